"""What an API replica asks of Redis: submit a job, give up on it, say it is alive, look
at job records. One instance per API process (its replica id)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from redis.asyncio import Redis

from dispatcher import keys
from dispatcher.plans import Lane
from dispatcher.protocol import Cancelled, CancelReason, ScriptCalls, Submitted
from dispatcher.tenants import Tenant


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """Where a stored Response lives (``lua/remember_response.lua``)."""

    provider: str
    model: str


class ApiSide:
    def __init__(self, calls: ScriptCalls, redis: Redis, replica_id: str) -> None:
        self.calls = calls
        self.redis = redis
        self.replica_id = replica_id
        self.reply_key = keys.reply(replica_id)

    async def submit(
        self, job_id: str, lane: Lane, body: bytes, endpoint: str, stream: bool, pinned: bool = False,
        tenant: Tenant | None = None,
    ) -> Submitted:
        return await self.calls.submit(job_id, lane, self.replica_id, body, endpoint, stream, pinned, tenant)

    async def cancel(self, job_id: str, queue_key: str, reason: CancelReason) -> Cancelled:
        return await self.calls.cancel(job_id, queue_key, self.replica_id, reason)

    async def stored_response(self, response_id: str) -> StoredResponse | None:
        """The provider and model of a remembered response id; None if unknown or forgotten."""
        raw = await self.redis.hget(keys.RESPONSES, response_id)
        if raw is None:
            return None
        provider, model, expiry = (raw.decode() if isinstance(raw, bytes) else raw).split("\t")
        # The wall clock against the server's: skew is seconds, a ttl is days.
        if int(expiry) < time.time() * 1000:
            return None
        return StoredResponse(provider, model)

    async def heartbeat(self) -> int:
        """Say this replica is alive; returns the server time in ms."""
        return await self.calls.replica_alive(self.replica_id)

    async def states(self, job_ids: list[str]) -> list[bytes | None]:
        """The raw records of some jobs (None where a job has ended)."""
        if not job_ids:
            return []
        records: list[bytes | None] = await self.redis.hmget(keys.JOBS, job_ids)  # type: ignore[assignment]
        return records
