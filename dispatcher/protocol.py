"""Typed calls of the Lua scripts: KEYS and ARGV built in one place, answers as enums.

Each ``lua/*.lua`` header documents its KEYS, ARGV and return value; this module is the
one Python rendering of those headers, so a script's signature changes in two files, the
script and here. The sides (``dispatcher.api_side``, ``dispatcher.worker_side``) and the
reaper call these and never build a key list themselves.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

import msgspec

from dispatcher import events, keys, wire
from dispatcher.config import Config
from dispatcher.events import Assignment, JobRecord
from dispatcher.exceptions import ModelNotFound
from dispatcher.fastredis import Arg
from dispatcher.plans import Lane, Plans
from dispatcher.scripts import Scripts
from dispatcher.tenants import Tenant

# The tenant of a job submitted without one (tests, benchmarks).
DEFAULT = Tenant("default", 0)

# A replica's reply stream and job set outlive its last heartbeat by this much, so a
# dead replica's keys expire even if no reaper ever runs again.
REPLY_KEEP_MS = 300_000
# Waiting jobs of one lane answered no_provider_available per script call: the rest at the
# next call (a reaper round), so that one call stays short.
REFUSE_LIMIT = 500


class SubmitStatus(StrEnum):
    DISPATCHED = "dispatched"
    QUEUED = "queued"
    FULL = "full"  # refused: max_queue jobs already wait
    DUPLICATE = "duplicate"  # a retried submit whose first try went through
    UNAVAILABLE = "unavailable"  # pinned to one provider, which cannot take work
    TENANT_FULL = "tenant_full"  # its tenant has max_queued jobs waiting
    NO_PROVIDER = "no_provider"  # none of its providers can take work, and the model holds nothing


class CancelReason(StrEnum):
    TIMEOUT = "timeout"  # the queue deadline: a dispatched job keeps running
    CLIENT = "client"  # the caller left: a running job is aborted too


class CancelOutcome(StrEnum):
    REMOVED = "removed"  # it was waiting; gone
    EXPIRED = "expired"  # it expired in its queue; gone
    WAIT = "wait"  # a timeout asked before the deadline
    RUNNING = "running"  # it holds a slot: keep waiting for its worker
    CANCELLING = "cancelling"  # its worker was told to abort
    GONE = "gone"  # it already ended


class EmitOutcome(StrEnum):
    OK = "ok"
    CANCELLED = "cancelled"  # abort, then finish
    STALE = "stale"  # taken over: not this worker's job any more


class FinishOutcome(StrEnum):
    RELEASED = "released"
    REQUEUED = "requeued"  # given up unfinished before any output: dispatched again
    FAILED = "failed"  # given up after output started: its client got the event
    DROPPED = "dropped"  # given up, and its client had left
    STALE = "stale"  # taken over: nothing changed


# How a worker ends a dispatch (lua/finish.lua): answered; given up unfinished (shutdown);
# or failed by its provider before any output, to be tried on another provider of its lane.
FinishMode = Literal["done", "requeue", "retry"]


class ReapOutcome(StrEnum):
    REQUEUED = "requeued"
    FAILED = "failed"
    DROPPED = "dropped"
    SKIP = "skip"  # the lease is live, or the round lost sight of Redis


class AbortReason(StrEnum):
    CANCELLED = "cancelled"
    STALE = "stale"


@dataclass(frozen=True, slots=True)
class Submitted:
    status: SubmitStatus
    queued: int
    wait_ms: int  # until the queue deadline, on the server's clock
    # UNAVAILABLE, NO_PROVIDER: each provider's reason ("a: stale heartbeat ...; b: ...").
    why: str = ""


@dataclass(frozen=True, slots=True)
class Cancelled:
    outcome: CancelOutcome
    wait_ms: int


@dataclass(frozen=True, slots=True)
class Abort:
    job: str
    fence: int
    reason: AbortReason


@dataclass(frozen=True, slots=True)
class Round:
    now_ms: int
    gap_ms: int  # > 0: time since the last round; -1: no round was ever recorded
    new_server: bool


@dataclass(frozen=True, slots=True)
class Drained:
    mark: str | None  # server ms the drain mark was set; None: open
    in_flight: int
    dispatched: int  # waiting jobs a resume handed out at once


@dataclass(frozen=True, slots=True)
class Correction:
    provider: str
    old: int
    new: int


class ScriptCalls:
    """Every script, called with its KEYS and ARGV built from the config and the call."""

    def __init__(self, scripts: Scripts, config: Config, plans: Plans) -> None:
        self.scripts = scripts
        self.config = config
        self.plans = plans
        d = config.dispatch
        self._lease_ms = d.lease_ms
        self._queue_limits = {m.id: (config.queue_timeout_ms(m), config.max_queue(m)) for m in config.models}
        refusal = wire.Refusal(keys.reply(""), keys.replica_jobs(""), REPLY_KEEP_MS, REFUSE_LIMIT)
        self._refusal = wire.encode(refusal)
        self._sweep = wire.encode(msgspec.structs.replace(refusal, silent_is_down=True))

    # --- the API side -----------------------------------------------------------------------

    async def submit(
        self, job: str, lane: Lane, replica: str, body: bytes, endpoint: str, stream: bool, pinned: bool = False,
        tenant: Tenant | None = None,
    ) -> Submitted:
        """``tenant``: under flow control, who asks (the job id must name it: ``Tenant.job_id``)."""
        plan = self.plans.by_lane.get((lane.model, lane.name))
        if plan is None or lane.model not in self._queue_limits:
            # A reload took the model (or this lane of it) away while the request was read.
            raise ModelNotFound(lane.model)
        ks, head = plan.args((*keys.PUMP_KEYS, keys.SEQ, lane.queue, keys.replica_jobs(replica)), self._lease_ms)
        timeout_ms, max_queue = self._queue_limits[lane.model]
        t = (tenant or DEFAULT) if self.plans.fair else None
        opts = wire.SubmitOptions(
            job=job, model=lane.model, replica=replica, endpoint=endpoint, stream=int(stream), lane=lane.name,
            timeout_ms=timeout_ms, max_queue=max_queue, pinned=pinned,
            tenant=t.name if t else "", weight=t.weight if t else 1.0, max_queued=(t.max_queued or 0) if t else 0,
        )
        status, queued, deadline, now, *why = await self.scripts.submit(ks, [*head, wire.encode(opts), body])
        return Submitted(SubmitStatus(status.decode()), int(queued), int(deadline) - int(now),
                         why[0].decode() if why else "")

    async def cancel(self, job: str, queue_key: str, replica: str, reason: CancelReason) -> Cancelled:
        """``queue_key``: the queue of the job's lane."""
        outcome, wait_ms = await self.scripts.cancel(
            [*keys.JOB_KEYS, queue_key, keys.replica_jobs(replica), keys.TENANTS],
            [job, reason, keys.CANCEL_CHANNEL_PREFIX],
        )
        return Cancelled(CancelOutcome(outcome.decode()), int(wait_ms))

    async def replica_alive(self, replica: str) -> int:
        """Say an API replica is alive; returns the server time in ms."""
        return int(
            await self.scripts.replica(
                [keys.REPLICAS, keys.reply(replica), keys.replica_jobs(replica)],
                [replica, self.config.dispatch.replica_ttl_ms, REPLY_KEEP_MS],
            )
        )

    # --- the worker side --------------------------------------------------------------------

    async def emit(self, job: Assignment, event: bytes) -> EmitOutcome:
        result = await self.scripts.emit(
            [*keys.JOB_KEYS, keys.reply(job.replica)], [job.job, job.fence, self._lease_ms, event, REPLY_KEEP_MS]
        )
        return EmitOutcome(result.decode())

    async def finish(
        self, job: Assignment, node: str, event: bytes | None, *, mode: FinishMode = "done", tokens: int = 0
    ) -> FinishOutcome:
        """``tokens``: the completion tokens the job generated, for its provider's throughput."""
        ks, head = self._settle_args(job.provider, node, job.replica, keys.queue(job.model, job.lane))
        outcome, _, *woken = await self.scripts.finish(
            ks,
            [*head, job.job, job.fence, job.entry_id, keys.NODE_GROUP, event or b"", REPLY_KEEP_MS,
             mode, self.config.dispatch.max_attempts, events.REQUEUED, tokens],
        )
        await self._wake(job.provider, woken)
        return FinishOutcome(outcome.decode())

    async def _wake(self, provider: str, woken: Sequence[bytes]) -> None:
        """Pump the lanes a release brought parked jobs back to that ``provider``'s plan, which
        the releasing script pumped, does not hold (``lua/wake.lua``). Rare: only a tenant at
        its max_in_flight whose jobs wait in other providers' lanes."""
        pumped = self.plans.provider_queues.get(provider, frozenset())
        for raw in dict.fromkeys(woken):
            queue = raw.decode()
            plan = self.plans.by_queue.get(queue)
            if queue not in pumped and plan is not None:
                ks, head = plan.args(keys.PUMP_KEYS, self._lease_ms)
                await self.scripts.wake(ks, head)

    async def renew(self, runs: Iterable[tuple[str, int]], reply_within: float | None = None) -> list[Abort]:
        args: list[Arg] = [self._lease_ms]
        for job, fence in runs:
            args += [job, fence]
        if len(args) == 1:
            return []
        flat = await self.scripts.renew(list(keys.JOB_KEYS), args, reply_within=reply_within)
        return [Abort(flat[i].decode(), int(flat[i + 1]), AbortReason(flat[i + 2].decode()))
                for i in range(0, len(flat), 3)]

    async def heartbeat(self, provider: str, health: str, fields: Sequence[tuple[str, str | int]]) -> int:
        """Publish a provider; returns how many waiting jobs it took (available), or how many
        it answered no_provider_available (not: it was the last provider of their lanes)."""
        ks, head = self.plans.by_provider[provider].args((*keys.PUMP_KEYS, keys.provider(provider)), self._lease_ms)
        flat: list[Arg] = []
        for name, value in fields:
            flat += [name, value]
        ttl_ms = self.config.dispatch.heartbeat_ttl_ms
        return int(await self.scripts.heartbeat(ks, [*head, health, ttl_ms, self._refusal, *flat]))

    async def remember_response(self, response_id: str, provider: str, model: str) -> None:
        r = self.config.responses
        await self.scripts.remember_response(
            [keys.RESPONSES, keys.RESPONSES_BY_EXPIRY], [response_id, provider, model, r.id_ttl_s * 1000, r.max_ids]
        )

    # --- runtime control (dispatcher/control.py) ----------------------------------------------

    async def drain(self, provider: str, mode: Literal["drain", "resume"]) -> Drained:
        """Set (``drain``) or clear (``resume``, which pumps) a provider's drain mark."""
        ks, head = self.plans.by_provider[provider].args((*keys.PUMP_KEYS, keys.provider(provider)), self._lease_ms)
        mark, in_flight, dispatched = await self.scripts.drain(ks, [*head, mode, self._refusal])
        return Drained(mark.decode() or None, int(in_flight), int(dispatched))

    # --- maintenance ------------------------------------------------------------------------

    async def rehome(self, old_queue: str, lane: Lane, jobs: Sequence[str]) -> tuple[int, int]:
        """Move waiting ``jobs`` from ``old_queue`` (a lane this config has not) to ``lane``, then
        pump it; returns (moved, dispatched)."""
        ks, head = self.plans.by_lane[(lane.model, lane.name)].args(
            (*keys.PUMP_KEYS, old_queue, lane.queue), self._lease_ms)
        moved, dispatched = await self.scripts.rehome(ks, [*head, lane.name, *jobs])
        return int(moved), int(dispatched)

    async def refuse(self) -> int:
        """Answer no_provider_available the jobs waiting in lanes none of whose providers can
        take work now, counting a provider whose worker is silent as down (a reaper round:
        Redis was reachable); returns how many."""
        ks, head = self.plans.everything.args(keys.PUMP_KEYS, self._lease_ms)
        return int(await self.scripts.refuse(ks, [*head, self._sweep]))

    async def reap_round(self, run_id: str) -> Round:
        d = self.config.dispatch
        now, gap, changed = await self.scripts.reap_round(
            [keys.LEASES, keys.REPLICAS, keys.REAPER_SEEN],
            [d.observation_gap_ms, d.lease_ms, d.replica_ttl_ms, run_id],
        )
        return Round(int(now), int(gap), bool(changed))

    async def reap_lease(self, job: str, rec: JobRecord, provider: str, node: str, lost_event: bytes) -> ReapOutcome:
        """``provider`` and ``node``: the record's, which a dispatched job always has."""
        ks, head = self._settle_args(provider, node, rec.replica, keys.queue(rec.model, rec.lane), keys.REAPER_SEEN)
        outcome, _, *woken = await self.scripts.reap_lease(
            ks,
            [*head, job, keys.NODE_GROUP, self.config.dispatch.max_attempts, lost_event, REPLY_KEEP_MS,
             self.config.dispatch.observation_gap_ms, events.REQUEUED],
        )
        await self._wake(provider, woken)
        return ReapOutcome(outcome.decode())

    async def reconcile(self, provider_ids: list[str]) -> tuple[list[Correction], list[Correction]]:
        """In one script: each provider's in_flight set to its live leases, and the tenant
        counters to the job records. The corrections of each: of the counters, ``provider``
        names the field of ``keys.TENANTS`` (``q:<tenant>``, ``r:<tenant>:<model>`` ...)."""
        replies = await self.scripts.reconcile(
            [*keys.JOB_KEYS, keys.TENANTS, *(keys.provider(p) for p in provider_ids)], provider_ids
        )
        in_flight, counters = (
            [Correction(flat[i].decode(), int(flat[i + 1]), int(flat[i + 2])) for i in range(0, len(flat), 3)]
            for flat in replies
        )
        return in_flight, counters

    def _settle_args(
        self, provider: str, node: str, replica: str, queue_key: str, *extra: str
    ) -> tuple[list[str], list[Arg]]:
        """KEYS and ARGV head of the scripts that end a dispatch (finish, reap_lease): the job's
        node stream, reply stream, replica set, provider and lane queue, ``extra``, then the
        plan of every lane the provider is in, which they pump with the freed slot."""
        # A provider a reload removed has no plan: the job's lane's own then, so that a retry
        # finds its lane's other providers and the freed job goes to one of them at once.
        plan = self.plans.by_provider.get(provider) or self.plans.by_queue.get(queue_key, self.plans.empty)
        ks, head = plan.args(
            (*keys.PUMP_KEYS, keys.node(node), keys.reply(replica), keys.replica_jobs(replica),
             keys.provider(provider), queue_key, *extra),
            self._lease_ms,
        )
        return ks, list(head)
