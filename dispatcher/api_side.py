"""What an API replica asks of Redis: submit a job, give up on it, say it is alive, look
at job records. One instance per API process (its replica id).

What a request asks before its job is submitted (``submit``, ``stored_response``) is held
through a short Redis outage (``dispatcher.holding``, ``redis.failover_hold_ms``): a caller
who arrives during a failover or a restart waits for Redis instead of getting a 503."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from redis.asyncio import Redis

from dispatcher import keys, wire
from dispatcher.holding import held
from dispatcher.plans import Lane
from dispatcher.script_calls import Cancelled, CancelReason, ScriptCalls, SubmitStatus, Submitted
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
        # How long a request waits for an unreachable Redis before it is answered 503 (the one
        # place it is derived: the API's job waits take it from here).
        self.hold_s = calls.config.redis.failover_hold_ms / 1000

    async def submit(
        self, job_id: str, lane: Lane, body: bytes, endpoint: str, stream: bool, pinned: bool = False,
        tenant: Tenant | None = None, blocks: Sequence[str] = (), limits: wire.Limits | None = None,
        deadline_ms: int = 0, excluded: Sequence[str] = (), first: bool = False,
    ) -> Submitted:
        tries = 0

        async def once() -> Submitted:
            nonlocal tries
            tries += 1
            return await self.calls.submit(job_id, lane, self.replica_id, body, endpoint, stream, pinned, tenant,
                                           blocks, limits, deadline_ms, excluded, first)

        submitted = await held(once, self.hold_s)
        if submitted.status == SubmitStatus.DUPLICATE and tries > 1:
            # An earlier try went through and its reply was lost with the connection. The
            # caller must wait for the job as if that reply had come: queued, with its deadline.
            return await held(lambda: self._submitted_before(job_id), self.hold_s)
        return submitted

    async def _submitted_before(self, job_id: str) -> Submitted:
        """What a submit whose reply was lost did: queued (with the time left until its
        deadline, on the server's clock) or dispatched (its events come as usual). A job has a
        queue deadline exactly while it waits (or expired waiting), not once dispatched."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zscore(keys.DEADLINES, job_id)
            pipe.time()
            deadline, (seconds, micros) = await pipe.execute()
        # The queue's length is not asked: only a refusal (full) reports it.
        if deadline is not None:
            # A deadline already past is checked at once: the cancel script answers queue_timeout.
            now_ms = int(seconds) * 1000 + int(micros) // 1000
            return Submitted(SubmitStatus.QUEUED, 0, int(deadline) - now_ms)
        # Dispatched, or even over: its events are in (or on their way to) the reply stream.
        return Submitted(SubmitStatus.DISPATCHED, 0, 0)

    async def cancel(self, job_id: str, queue_key: str, reason: CancelReason) -> Cancelled:
        return await self.calls.cancel(job_id, queue_key, self.replica_id, reason)

    async def stored_response(self, response_id: str) -> StoredResponse | None:
        """The provider and model of a remembered response id; None if unknown or forgotten."""
        raw = await held(lambda: self.redis.hget(keys.RESPONSES, response_id), self.hold_s)
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
