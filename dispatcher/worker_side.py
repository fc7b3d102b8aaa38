"""What a node's worker asks of Redis: report output, finish, renew leases, publish its
providers, read its node stream's group. One instance per worker process (its node); the
script calls it makes are those of the config in force, which it asks ``calls`` for at
each call (a reload swaps them: workers/worker.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from dispatcher import keys, wire
from dispatcher.events import Assignment
from dispatcher.fastredis import FastRedis
from dispatcher.live import LiveSample, Tallies
from dispatcher.script_calls import Abort, EmitOutcome, FinishMode, FinishOutcome, ScriptCalls


class WorkerSide:
    def __init__(self, calls: Callable[[], ScriptCalls], redis: Redis, node_id: str,
                 fast: FastRedis | None = None) -> None:
        self._calls = calls
        self.redis = redis
        self.fast = fast
        self.node_id = node_id
        self.node_key = keys.node(node_id)
        # The live figures of the calls finished since the last flush_live.
        self.tallies = Tallies()

    @property
    def calls(self) -> ScriptCalls:
        return self._calls()

    async def emit(self, job: Assignment, event: bytes) -> EmitOutcome:
        """First output of a streamed job (marks it as having reached its client)."""
        return await self.calls.emit(job, event)

    async def chunks(self, job: Assignment, event: bytes) -> None:
        """Later output of a streamed job: a plain append, ordered after ``emit``'s."""
        if self.fast is not None:
            await self.fast.execute("XADD", keys.reply(job.replica), "*", "job", job.job, "event", event)
        else:
            await self.redis.xadd(keys.reply(job.replica), {"job": job.job, "event": event})

    async def finish(
        self, job: Assignment, event: bytes | None, *, mode: FinishMode = "done", tokens: int = 0,
        prompt: int = 0, cached: int = 0, verdict: str = "", live: LiveSample | None = None,
    ) -> FinishOutcome:
        """Final event + release + ack. ``requeue`` (the worker gives the job up unfinished)
        and ``retry`` (its provider failed it before any output) dispatch it again if none
        of its output reached the client, else its client gets ``event``. ``tokens``: the
        completion tokens the job generated (its provider's tokens per second); ``prompt``,
        ``cached``: its prompt tokens, and those served from the provider's cache; ``verdict``:
        what the call says of its provider (``workers/job_run.py`` verdict_of); ``live``: the
        call in the live figures (None: not a caller's call to count), tallied once the job is
        settled -- a finish its lease's expiry made stale counts nothing -- and written by the
        next :meth:`flush_live`."""
        outcome = await self.calls.finish(job, self.node_id, event, mode=mode, tokens=tokens, prompt=prompt,
                                          cached=cached, verdict=verdict)
        if live is not None and outcome != FinishOutcome.STALE:
            self.tallies.add(job.provider, job.model, live, tokens)
        return outcome

    async def flush_live(self) -> int:
        """Write the calls tallied since the last flush to their live figures (lua/live.lua):
        the pairs written. Tallies Redis did not take wait for the next flush."""
        taken = self.tallies.take()
        if not taken:
            return 0
        try:
            return await self.calls.add_live(taken)
        except BaseException:
            # Not known to be written (an error that came after Redis ran it counts twice:
            # a second of figures, against losing them whenever Redis blinks).
            self.tallies.put_back(taken)
            raise

    async def publish_capacity(self, provider: str, report: wire.CapacityReport) -> int:
        """What this worker knows of a provider's load (workers/capacity_control.py)."""
        return await self.calls.capacity(provider, report)

    async def remember_response(self, response_id: str, job: Assignment) -> None:
        """A stored Response was made by the job's provider: later calls on it go there."""
        await self.calls.remember_response(response_id, job.provider, job.model)

    async def forget_response(self, response_id: str) -> None:
        """A stored Response was deleted by its provider: later calls on it are iop's 404."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hdel(keys.RESPONSES, response_id)
            pipe.zrem(keys.RESPONSES_BY_EXPIRY, response_id)
            await pipe.execute()

    async def renew(self, runs: Iterable[tuple[str, int]], reply_within: float | None = None) -> list[Abort]:
        """Extend the leases of (job, fence) runs; the runs to abort."""
        return await self.calls.renew(runs, reply_within)

    async def heartbeat(self, provider_id: str, health: str, fields: Sequence[tuple[str, str | int]]) -> int:
        return await self.calls.heartbeat(provider_id, health, fields)

    async def ensure_group(self) -> None:
        """Create the node stream's consumer group (from the start: jobs may predate it)."""
        try:
            await self.redis.xgroup_create(self.node_key, keys.NODE_GROUP, id="0", mkstream=True)
        except ResponseError as exc:  # BUSYGROUP: it exists already
            if "BUSYGROUP" not in str(exc):
                raise
