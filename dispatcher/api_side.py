"""What an API replica asks of Redis: submit a job, give up on it, say it is alive, look
at job records. One instance per API process (its replica id)."""

from __future__ import annotations

from redis.asyncio import Redis

from dispatcher import keys
from dispatcher.config import ModelConfig
from dispatcher.protocol import Cancelled, CancelReason, ScriptCalls, Submitted


class ApiSide:
    def __init__(self, calls: ScriptCalls, redis: Redis, replica_id: str) -> None:
        self.calls = calls
        self.redis = redis
        self.replica_id = replica_id
        self.reply_key = keys.reply(replica_id)

    async def submit(self, job_id: str, model: ModelConfig, body: bytes, endpoint: str, stream: bool) -> Submitted:
        return await self.calls.submit(job_id, model, self.replica_id, body, endpoint, stream)

    async def cancel(self, job_id: str, model_id: str, reason: CancelReason) -> Cancelled:
        return await self.calls.cancel(job_id, model_id, self.replica_id, reason)

    async def heartbeat(self) -> int:
        """Say this replica is alive; returns the server time in ms."""
        return await self.calls.replica_alive(self.replica_id)

    async def states(self, job_ids: list[str]) -> list[bytes | None]:
        """The raw records of some jobs (None where a job has ended)."""
        if not job_ids:
            return []
        records: list[bytes | None] = await self.redis.hmget(keys.JOBS, job_ids)  # type: ignore[assignment]
        return records
