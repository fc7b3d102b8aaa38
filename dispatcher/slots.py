"""The worker side of dispatch: report output, finish, renew leases, heartbeat providers."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from dispatcher import events, keys
from dispatcher.config import Config
from dispatcher.events import Assignment
from dispatcher.fastredis import FastRedis
from dispatcher.jobs import REPLY_KEEP_MS
from dispatcher.plans import Plans
from dispatcher.scripts import Scripts


class NodeSlots:
    def __init__(
        self, redis: Redis, scripts: Scripts, config: Config, plans: Plans, node_id: str, fast: FastRedis | None = None
    ) -> None:
        self.redis = redis
        self.fast = fast
        self.scripts = scripts
        self.config = config
        self.plans = plans
        self.node_id = node_id
        self.node_key = keys.node(node_id)
        self.lease_ms = config.dispatch.lease_ms

    async def emit(self, job: Assignment, event: bytes) -> str:
        """First output of a streamed job; 'ok', 'cancelled' or 'stale'."""
        result = await self.scripts.emit(
            [*keys.JOB_KEYS, keys.reply(job.replica)],
            [job.job, job.fence, self.lease_ms, event, REPLY_KEEP_MS],
        )
        return str(result.decode())

    async def chunks(self, job: Assignment, event: bytes) -> None:
        """Later output of a streamed job: a plain append, ordered after ``emit``'s."""
        if self.fast is not None:
            await self.fast.execute("XADD", keys.reply(job.replica), "*", "j", job.job, "e", event)
        else:
            await self.redis.xadd(keys.reply(job.replica), {"j": job.job, "e": event})

    async def finish(self, job: Assignment, event: bytes | None, *, requeue: bool = False) -> str:
        """Final event + release + ack; 'released', or 'stale' when the job was taken over.

        With ``requeue`` (the worker gives the job up unfinished) the job is dispatched
        again if none of its output reached the client: 'requeued'; else the client
        gets ``event``: 'failed'.
        """
        plan = self.plans.by_provider.get(job.provider, self.plans.empty)
        ks, head = plan.args(
            (*keys.PUMP_KEYS, self.node_key, keys.reply(job.replica), keys.replica_jobs(job.replica),
             keys.provider(job.provider), keys.queue(job.model)),
            self.lease_ms,
        )
        outcome, _ = await self.scripts.finish(
            ks,
            [*head, job.job, job.fence, job.entry_id, keys.NODE_GROUP, event or b"", REPLY_KEEP_MS,
             "requeue" if requeue else "done", self.config.dispatch.max_attempts, events.REQUEUED],
        )
        return str(outcome.decode())

    async def renew(
        self, running: Iterable[tuple[str, int]], reply_within: float | None = None
    ) -> list[tuple[str, int, str]]:
        """Extend the leases of (job, fence) runs; returns (job, fence, 'cancelled' | 'stale')
        for the runs to abort."""
        args: list[str | int] = [self.lease_ms]
        for job, fence in running:
            args += [job, fence]
        if len(args) == 1:
            return []
        flat = await self.scripts.renew(list(keys.JOB_KEYS), args, reply_within=reply_within)
        return [(flat[i].decode(), int(flat[i + 1]), flat[i + 2].decode()) for i in range(0, len(flat), 3)]

    async def heartbeat(self, provider_id: str, health: str, fields: Sequence[tuple[str, str | int]]) -> int:
        ks, head = self.plans.by_provider[provider_id].args(
            (*keys.PUMP_KEYS, keys.provider(provider_id)), self.lease_ms
        )
        flat: list[str | int] = []
        for name, value in fields:
            flat += [name, value]
        return int(
            await self.scripts.heartbeat(
                ks, [*head, health, self.config.dispatch.heartbeat_ttl_ms, *flat]
            )
        )

    async def ensure_group(self) -> None:
        """Create the node stream's consumer group (from the start: jobs may predate it)."""
        try:
            await self.redis.xgroup_create(self.node_key, keys.NODE_GROUP, id="0", mkstream=True)
        except ResponseError as exc:  # BUSYGROUP: it exists already
            if "BUSYGROUP" not in str(exc):
                raise
