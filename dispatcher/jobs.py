"""The API side of dispatch: submit a job, give up on it, say the replica is alive."""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from dispatcher import keys
from dispatcher.config import Config, ModelConfig
from dispatcher.plans import Plans
from dispatcher.scripts import Scripts

# A replica's reply stream and job set outlive its last heartbeat by this much, so a
# dead replica's keys expire even if no reaper ever runs again.
REPLY_KEEP_MS = 300_000


@dataclass(frozen=True, slots=True)
class Submitted:
    status: str  # 'dispatched' | 'queued' | 'full'
    queued: int
    wait_ms: int  # until the queue deadline, on the server's clock


@dataclass(frozen=True, slots=True)
class Cancelled:
    outcome: str  # see lua/cancel.lua
    wait_ms: int


class JobClient:
    def __init__(self, redis: Redis, scripts: Scripts, config: Config, plans: Plans, replica_id: str) -> None:
        self.redis = redis
        self.scripts = scripts
        self.config = config
        self.plans = plans
        self.replica_id = replica_id
        self.reply_key = keys.reply(replica_id)
        self.jobs_key = keys.replica_jobs(replica_id)
        self._submit_keys = {
            m.id: plans.by_model[m.id].args((*keys.PUMP_KEYS, keys.SEQ, keys.queue(m.id), self.jobs_key),
                                            config.dispatch.lease_ms)
            for m in config.models
        }
        self._queue_limits = {m.id: (config.queue_timeout_ms(m), config.max_queue(m)) for m in config.models}

    async def submit(self, job_id: str, model: ModelConfig, body: bytes, endpoint: str, stream: bool) -> Submitted:
        ks, head = self._submit_keys[model.id]
        timeout_ms, max_queue = self._queue_limits[model.id]
        status, queued, deadline, now = await self.scripts.submit(
            ks,
            [*head, job_id, body, model.id, self.replica_id, endpoint, int(stream), timeout_ms, max_queue],
        )
        return Submitted(status.decode(), int(queued), int(deadline) - int(now))

    async def cancel(self, job_id: str, model_id: str, reason: str, replica_id: str | None = None) -> Cancelled:
        replica = replica_id or self.replica_id
        outcome, wait_ms = await self.scripts.cancel(
            [*keys.JOB_KEYS, keys.queue(model_id), keys.replica_jobs(replica)],
            [job_id, reason, keys.CANCEL_CHANNEL_PREFIX],
        )
        return Cancelled(outcome.decode(), int(wait_ms))

    async def heartbeat(self) -> int:
        """Say this replica is alive; returns the server time in ms."""
        return int(
            await self.scripts.replica(
                [keys.REPLICAS, self.reply_key, self.jobs_key],
                [self.replica_id, self.config.dispatch.replica_ttl_ms, REPLY_KEEP_MS],
            )
        )

    async def states(self, job_ids: list[str]) -> list[bytes | None]:
        """The raw records of some jobs (None where a job has ended)."""
        if not job_ids:
            return []
        records: list[bytes | None] = await self.redis.hmget(keys.JOBS, job_ids)  # type: ignore[assignment]
        return records
