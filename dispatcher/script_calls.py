"""Typed calls of the Lua scripts: KEYS and ARGV built in one place, answers as enums.

Each ``lua/*.lua`` header documents its KEYS, ARGV and return value; this module is the
one Python rendering of those headers, so a script's signature changes in two files, the
script and here. The sides (``dispatcher.api_side``, ``dispatcher.worker_side``) and the
reaper call these and never build a key list themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

import msgspec
from redis.exceptions import ResponseError

from dispatcher import events, keys, wire
from dispatcher.config import Config
from dispatcher.events import Assignment, JobRecord
from dispatcher.exceptions import ModelNotFound
from dispatcher.fastredis import Arg
from dispatcher.plans import Lane, Plan, Plans
from dispatcher.scripts import Script, Scripts
from dispatcher.tenants import Tenant

log = logging.getLogger(__name__)

# The tenant of a job submitted without one (tests, benchmarks).
DEFAULT = Tenant("default", 0)

# A replica's reply stream and job set outlive its last heartbeat by this much, so a
# dead replica's keys expire even if no reaper ever runs again.
REPLY_KEEP_MS = 300_000
# Waiting jobs of one lane answered no_provider_available per script call: the rest at the
# next call (a reaper round), so that one call stays short.
REFUSE_LIMIT = 500
# A dispatch plan kept in Redis goes after a day (lua/plan.lua); one still in use is written
# again by the first call that misses it.
PLAN_TTL_MS = 86_400_000
# What lua/abandon.lua answers a job pinned to a provider a reload removed.
_PROVIDER_GONE = events.encode(events.Failed(
    503, "response_provider_unavailable",
    "The provider holding this response was removed from the configuration; start a new conversation"))


class SubmitStatus(StrEnum):
    DISPATCHED = "dispatched"
    QUEUED = "queued"
    FULL = "full"  # refused: max_queue jobs already wait
    DUPLICATE = "duplicate"  # a retried submit whose first try went through
    UNAVAILABLE = "unavailable"  # pinned to one provider, which cannot take work
    TENANT_FULL = "tenant_full"  # its tenant has max_queued jobs waiting
    RATE_LIMITED = "rate_limited"  # its tenant's requests or tokens per minute (lua/lib/limits.lua)
    BUDGET_EXHAUSTED = "budget_exhausted"  # its tenant's tokens per day
    DEADLINE_UNMEETABLE = "deadline_unmeetable"  # its predicted queue wait is over its deadline
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
    # A limited tenant's windows after this submit (lua/lib/limits.lua admit_limits, JSON).
    limits: bytes = b""


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
    judge_from_ms: int  # server ms from which silent workers may be taken for dead ones
    quiet_since_ms: int = 0  # > 0: no worker heard since the gap this round opened at


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
        self._shed = {m.id: config.refuse_predicted_over_ms(m) or 0 for m in config.models}
        self._refusal_options = wire.Refusal(keys.reply(""), keys.replica_jobs(""), REPLY_KEEP_MS, REFUSE_LIMIT)
        self._refusal = wire.encode(self._refusal_options)
        # (model, lane, endpoint, pin) -> the queue a requeued job of that lane goes back to.
        self._homes: dict[tuple[str, str, str, str | None], str] = {}

    # --- the API side -----------------------------------------------------------------------

    async def submit(
        self, job: str, lane: Lane, replica: str, body: bytes, endpoint: str, stream: bool, pinned: bool = False,
        tenant: Tenant | None = None, blocks: Sequence[str] = (), limits: wire.Limits | None = None,
        deadline_ms: int = 0, excluded: Sequence[str] = (), first: bool = False,
    ) -> Submitted:
        """``tenant``: under flow control, who asks (the job id must name it: ``Tenant.job_id``).
        ``excluded``, ``first``: a continuation's (api/continuation.py): never to these
        providers, and ahead of the lane's new work.
        ``blocks``: cache-aware dispatch's keys of the request (``api/intake.py``).
        ``limits``: its tenant's rate limits and budget, with the request's token estimate.
        ``deadline_ms``: the longest the caller will wait for it to start (0: the model's
        queue timeout); a wait predicted to be longer is refused at once."""
        plan = self.plans.by_lane.get((lane.model, lane.name))
        if plan is None or lane.model not in self._queue_limits:
            # A reload took the model (or this lane of it) away while the request was read.
            raise ModelNotFound(lane.model)
        ks, head = plan.args((*keys.PUMP_KEYS, keys.SEQ, lane.queue, keys.replica_jobs(replica), keys.LIMITS),
                             self._lease_ms)
        timeout_ms, max_queue = self._queue_limits[lane.model]
        predict_ms = self._shed[lane.model]
        if deadline_ms > 0:
            timeout_ms = min(timeout_ms, deadline_ms)
            predict_ms = min(predict_ms or deadline_ms, deadline_ms)
        t = (tenant or DEFAULT) if self.plans.fair else None
        opts = wire.SubmitOptions(
            job=job, model=lane.model, replica=replica, endpoint=endpoint, stream=int(stream), lane=lane.name,
            timeout_ms=timeout_ms, max_queue=max_queue, pinned=pinned,
            tenant=t.name if t else "", weight=t.weight if t else 1.0, max_queued=(t.max_queued or 0) if t else 0,
            blocks=list(blocks), limits=limits, predict_ms=predict_ms, excluded=list(excluded), first=first,
        )
        status, queued, deadline, now, *rest = await self._pump(
            self.scripts.submit, plan, ks, [*head, wire.encode(opts), body])
        return Submitted(SubmitStatus(status.decode()), int(queued), int(deadline) - int(now),
                         rest[0].decode() if rest else "", rest[1] if len(rest) > 1 else b"")

    async def cancel(self, job: str, queue_key: str, replica: str, reason: CancelReason) -> Cancelled:
        """``queue_key``: the queue of the job's lane."""
        outcome, wait_ms, *woken = await self.scripts.cancel(
            [*keys.JOB_KEYS, queue_key, keys.replica_jobs(replica), keys.TENANTS, keys.TENANT_LIMITS,
             keys.WAITING_LANES],
            [job, reason, keys.CANCEL_CHANNEL_PREFIX, keys.parked("")],
        )
        # A parked job of its tenant took its place: pumped now, like a release's (_wake).
        await self._wake("", woken)
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
        self, job: Assignment, node: str, event: bytes | None, *, mode: FinishMode = "done", tokens: int = 0,
        prompt: int = 0, cached: int = 0, verdict: str = "",
    ) -> FinishOutcome:
        """``tokens``: the completion tokens the job generated, for its provider's throughput;
        ``prompt``, ``cached``: its prompt tokens and those the provider served from its cache;
        ``verdict``: 'ok' the provider answered, '<status>' a 5xx, '' nothing to count
        (lua/lib/blame.lua). An ejection it decided is logged."""
        queue = self._queue_now(job.model, job.lane, job.endpoint, job.provider if job.pinned else None)
        plan, ks, head = self._settle_args(job.provider, node, job.replica, queue, keys.LIMITS)
        outcome, _, ejected, *woken = await self._pump(
            self.scripts.finish, plan, ks,
            [*head, job.job, job.fence, job.entry_id, keys.NODE_GROUP, event or b"", REPLY_KEEP_MS,
             mode, self.config.dispatch.max_attempts, events.REQUEUED, tokens, prompt, cached, verdict],
        )
        result = FinishOutcome(outcome.decode())
        if ejected:
            log.warning("provider %s", ejected.decode())
        await self._wake(job.provider, [*woken, *([queue.encode()] if result == FinishOutcome.REQUEUED else [])])
        return result

    async def add_live(self, tallies: dict[tuple[str, str], wire.LiveTally]) -> int:
        """A worker's tallies of (provider, model) pairs added to their live figures
        (lua/live.lua); the number of pairs written."""
        pairs = list(tallies.items())
        return int(await self.scripts.live([keys.live(p, m) for (p, m), _ in pairs],
                                           [msgspec.msgpack.encode(t) for _, t in pairs]))

    def _queue_now(self, model: str, lane: str, endpoint: str, pin: str | None) -> str:
        """The queue a dispatched job of ``lane`` goes back to if it is requeued: the lane it
        belongs in under the config in force (``Plans.home_of``: its lane's own, unless a
        reload renamed it -- its old key may even be another lane's now, a provider's own
        lane for pinned jobs), so that a retry finds its lane's other providers and a
        requeued job waits where it is pumped. When none is known, its old one
        (``dispatcher/reaper.py`` rehome_queue then settles it)."""
        found = self._homes.get((model, lane, endpoint, pin))
        if found is None:
            home = self.plans.home_of(model, lane, endpoint, pin)
            found = home.queue if home is not None else keys.queue(model, lane)
            self._homes[(model, lane, endpoint, pin)] = found
        return found

    async def _wake(self, provider: str, woken: Sequence[bytes]) -> None:
        """Pump the lanes a release brought parked jobs back to that ``provider``'s plan, which
        the releasing script pumped, does not hold (``lua/wake.lua``). Rare: only a tenant at
        its max_in_flight whose jobs wait in other providers' lanes. A queue this config does
        not pump (a job parked, or dispatched, before a reload renamed its lane, came back to
        it) has its jobs moved where they belong now."""
        pumped = self.plans.provider_queues.get(provider, frozenset())
        for raw in dict.fromkeys(woken):
            queue = raw.decode()
            plan = self.plans.by_queue.get(queue)
            if plan is None:
                # Moved where it belongs now (which pumps it there), not left for a reaper
                # round. The reaper owns that rule and calls these script calls: imported here,
                # where it is needed, not at the top, which would make the two a cycle.
                from dispatcher.reaper import rehome_queue

                await rehome_queue(self, queue)
            elif queue not in pumped:
                ks, head = plan.args(keys.PUMP_KEYS, self._lease_ms)
                await self._pump(self.scripts.wake, plan, ks, head)

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
        plan = self.plans.by_provider[provider]
        ks, head = plan.args((*keys.PUMP_KEYS, keys.provider(provider)), self._lease_ms)
        flat: list[Arg] = []
        for name, value in fields:
            flat += [name, value]
        ttl_ms = self.config.dispatch.heartbeat_ttl_ms
        return int(await self._pump(self.scripts.heartbeat, plan, ks, [*head, health, ttl_ms, self._refusal, *flat]))

    async def capacity(self, provider: str, report: wire.CapacityReport) -> int:
        """Publish what a worker knows of a provider's load (lua/capacity.lua), then pump its
        lanes (a limit that rose takes waiting jobs at once); how many it dispatched."""
        plan = self.plans.by_provider[provider]
        ks, head = plan.args((*keys.PUMP_KEYS, keys.provider(provider), keys.capacity_history(provider)),
                             self._lease_ms)
        return int(await self._pump(self.scripts.capacity, plan, ks, [*head, wire.encode(report)]))

    async def models(self, provider: str, report: wire.ModelsReport) -> int:
        """Publish which models a provider's runtime holds (lua/models.lua), then pump its lanes
        (a model that became loaded takes its waiting jobs); how many it dispatched."""
        plan = self.plans.by_provider[provider]
        ks, head = plan.args((*keys.PUMP_KEYS, keys.provider(provider)), self._lease_ms)
        return int(await self._pump(self.scripts.models, plan, ks, [*head, wire.encode(report)]))

    async def load_done(self, provider: str, outcome: wire.LoadOutcome) -> int:
        """Report the end of a load iop ordered there (lua/load_done.lua), then pump its lanes;
        how many jobs it dispatched."""
        plan = self.plans.by_provider[provider]
        ks, head = plan.args((*keys.PUMP_KEYS, keys.provider(provider)), self._lease_ms)
        return int(await self._pump(self.scripts.load_done, plan, ks, [*head, wire.encode(outcome)]))

    async def remember_response(self, response_id: str, provider: str, model: str) -> None:
        r = self.config.responses
        await self.scripts.remember_response(
            [keys.RESPONSES, keys.RESPONSES_BY_EXPIRY], [response_id, provider, model, r.id_ttl_s * 1000, r.max_ids]
        )

    # --- runtime control (dispatcher/control.py) ----------------------------------------------

    async def drain(self, provider: str, mode: Literal["drain", "resume"], by: str = "iop",
                    via: str = "http") -> Drained:
        """Set (``drain``) or clear (``resume``, which pumps) a provider's drain mark, audited
        as ``by`` through ``via`` when it changed."""
        plan = self.plans.by_provider[provider]
        ks, head = plan.args((*keys.PUMP_KEYS, keys.provider(provider), keys.AUDIT, keys.AUDIT_COUNTS),
                             self._lease_ms)
        mark, in_flight, dispatched = await self._pump(
            self.scripts.drain, plan, ks,
            [*head, mode, self._refusal, by, via, keys.AUDIT_KEEP, f"provider/{provider}"])
        return Drained(mark.decode() or None, int(in_flight), int(dispatched))

    async def override(self, op: Literal["set", "clear", "lapse"], name: str, target_id: str, *,
                       value: bytes = b"null", config: bytes = b"null", by: str = "iop", via: str = "http",
                       for_ms: int = 0, action: str = "") -> tuple[bool, bytes]:
        """Set, clear or lapse one override (lua/override.lua): whether it changed anything,
        and the record now in force (b"" none). A provider's field pumps (or, disabled,
        refuses for) its lanes with this config's plan of it; a model's takes the empty plan."""
        fixed: tuple[str, ...] = (*keys.PUMP_KEYS, keys.OVERRIDES, keys.OVERRIDES_VERSION, keys.AUDIT,
                                  keys.AUDIT_COUNTS)
        is_provider = name in ("enabled", "capacity", "capacity_bounds")
        plan = self.plans.by_provider.get(target_id) if is_provider else None
        if is_provider:
            fixed = (*fixed, keys.provider(target_id))
        plan = plan or self.plans.empty
        ks, head = plan.args(fixed, self._lease_ms)
        target = f"{'provider' if is_provider else 'model'}/{target_id}"
        changed, record, _ = await self._pump(
            self.scripts.override, plan, ks,
            [*head, op, f"{name}|{target_id}", value, config, by, via, for_ms, action, target, keys.AUDIT_KEEP,
             self._refusal])
        return bool(changed), bytes(record)

    # --- maintenance ------------------------------------------------------------------------

    async def rehome(self, old_queue: str, lane: Lane, jobs: Sequence[str]) -> tuple[int, int]:
        """Move waiting ``jobs`` from ``old_queue`` (a lane this config has not) to ``lane``, then
        pump it; returns (moved, dispatched)."""
        plan = self.plans.by_lane[(lane.model, lane.name)]
        ks, head = plan.args((*keys.PUMP_KEYS, old_queue, lane.queue), self._lease_ms)
        moved, dispatched = await self._pump(self.scripts.rehome, plan, ks, [*head, lane.name, *jobs])
        return int(moved), int(dispatched)

    async def abandon(self, queue: str, replica: str, jobs: Sequence[str]) -> int:
        """Answer 503 the waiting ``jobs`` of ``queue`` (a lane this config has not), submitted by
        ``replica`` and pinned to a provider a reload removed: no lane may take them."""
        return int(await self.scripts.abandon(
            [*keys.JOB_KEYS, queue, keys.TENANTS, keys.reply(replica), keys.replica_jobs(replica)],
            [REPLY_KEEP_MS, _PROVIDER_GONE, *jobs]))

    async def refuse(self, opened_ms: int) -> int:
        """Answer no_provider_available the jobs waiting in lanes none of whose providers can
        take work now, counting a provider whose worker is silent as down: a reaper round's,
        which opened at server ms ``opened_ms`` with Redis reachable until then. Past an
        observation gap after that, silence proves nothing (``wire.Refusal``). Returns how
        many."""
        plan = self.plans.everything
        ks, head = plan.args(keys.PUMP_KEYS, self._lease_ms)
        sweep = msgspec.structs.replace(
            self._refusal_options, silent_down_until_ms=opened_ms + self.config.dispatch.observation_gap_ms)
        return int(await self._pump(self.scripts.refuse, plan, ks, [*head, wire.encode(sweep)]))

    async def reap_round(self, run_id: str) -> Round:
        d = self.config.dispatch
        providers = [keys.provider(p.id) for _, p in self.config.providers()]
        now, gap, changed, judge, quiet = await self.scripts.reap_round(
            [keys.LEASES, keys.REPLICAS, keys.REAPER_SEEN, *providers],
            [d.observation_gap_ms, d.lease_ms, d.replica_ttl_ms, run_id, d.heartbeat_ttl_ms],
        )
        return Round(int(now), int(gap), bool(changed), int(judge), int(quiet))

    async def reap_lease(self, job: str, rec: JobRecord, provider: str, node: str, lost_event: bytes) -> ReapOutcome:
        """``provider`` and ``node``: the record's, which a dispatched job always has."""
        queue = self._queue_now(rec.model, rec.lane, rec.endpoint, rec.pin)
        plan, ks, head = self._settle_args(provider, node, rec.replica, queue, keys.REAPER_SEEN)
        outcome, _, *woken = await self._pump(
            self.scripts.reap_lease, plan, ks,
            [*head, job, keys.NODE_GROUP, self.config.dispatch.max_attempts, lost_event, REPLY_KEEP_MS,
             self.config.dispatch.observation_gap_ms, events.REQUEUED],
        )
        result = ReapOutcome(outcome.decode())
        await self._wake(provider, [*woken, *([queue.encode()] if result == ReapOutcome.REQUEUED else [])])
        return result

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

    async def write_plans(self) -> int:
        """Write every plan of this config into Redis (each is written anyway by the first
        call that misses it); returns how many."""
        plans = self.plans.every_plan()
        for plan in plans:
            await self.scripts.plan(*plan.upload(PLAN_TTL_MS))
        return len(plans)

    async def _pump(self, script: Script, plan: Plan, ks: list[str], args: Sequence[Arg]) -> Any:
        """Call a script that pumps ``plan``'s lanes. One that finds the plan missing from Redis
        (a new server, a failover that lost it, its TTL) fails ``NOPLAN`` having changed
        nothing: the plan is written (``lua/plan.lua``) and the call made again."""
        try:
            return await script(ks, args)
        except ResponseError as exc:
            if not str(exc).startswith("NOPLAN"):
                raise
        await self.scripts.plan(*plan.upload(PLAN_TTL_MS))
        return await script(ks, args)

    def _settle_args(
        self, provider: str, node: str, replica: str, queue_key: str, *extra: str
    ) -> tuple[Plan, list[str], list[Arg]]:
        """The plan, KEYS and ARGV head of the scripts that end a dispatch (finish, reap_lease): the job's
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
        return plan, ks, list(head)
