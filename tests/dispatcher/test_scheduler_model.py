"""A model-based test of the scheduler: Hypothesis drives the real Lua scripts, through
``dispatcher.script_calls.ScriptCalls``, against real redis-servers (every available version),
and a small Python model of the jobs checks the scheduler's invariants after every step.

The world: providers ``a`` (chat and responses; models m1, m2; capacity 1), ``b`` (rerank
too; m1, m2; capacity 2) and ``c`` (rerank too; m1 only; capacity 1, on a second node);
``b`` is always configured, ``a`` and ``c`` come and go with reloads. Under flow control
there are three tenants (``t1`` weight 2 with max_in_flight 1, ``t2`` interactive with
max_queued 3, ``t3`` in the lowest band, which a reload may rename) and three bands; a
second machine runs the same world without flow control (plain FIFO).

Steps: requests (a model, an endpoint or a pin to the provider holding a stored Response,
a band at or below the tenant's), one at a time or in bursts; a worker ending a run
(answered; ``retry``: its provider failed it before any output; ``requeue``: its worker
shut down); a first output; a client leaving; a queue deadline passing (rewritten into
the past, since the scripts read Redis ``TIME``), with or without the API's timer firing
at once; heartbeats up and down; a worker dying (its heartbeat expiry rewritten); a lease
running out (its score rewritten) and the reaper's ``reap_lease``; a reaper round
(``Reaper.run_once``: refusals, jobs moved out of lanes a reload renamed); a stale run's
late writes; drains and resumes; and reloads (a provider added or removed, a band
renamed), after which every process uses only the new plans, as after ``SIGHUP``: the
workers mark the providers it removes as removed with their old plans, heartbeat the
others with the new ones, and the reaper's next round follows. What the workers are handed
is read from the node streams through their consumer group (``XREADGROUP``), what the API
is told from its reply stream.

Issues 29 and 30 added: a provider's 5xx answers as evidence (``provider_answers_5xx``, and
``another_provider_answers_what_one_failed``, which ejects it), an ejection running out (a
trial), and a worker publishing a learned limit (that may fall under what runs), load other
clients put on a provider and a rate limit's hold (``capacity_changes``); the machines must
meet each of those cases (``test_the_machines_met_every_case_they_check``).

The invariants are the ``inv*`` functions (each docstring says what it demands). The
machine checks them all after every step, invariant 6 (no idle capacity) only after steps
that pump. A violation that a known defect of issue 19 explains (``KNOWN_DEFECTS``) is let
through and counted; anything else fails. Each known defect also has a deterministic
regression test at the end of this module, marked xfail(strict) while its flag is in
``KNOWN_DEFECTS`` (``known_defect``): when the fix lands the test XPASSes, which fails the
run until the flag comes out, and from then on the machine checks that case too.
Invariant 7 (weighted shares across lanes) is one of those tests only.

``IOP_SCHEDULER_EXAMPLES=500 pytest tests/dispatcher/test_scheduler_model.py`` explores
further than the default run (minutes instead of seconds).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import os
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.internal.conjecture import engine as hypothesis_engine
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule, run_state_machine_as_test
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from dispatcher import config as cfg
from dispatcher import events, keys, wire
from dispatcher.events import Assignment, Done, Failed, Meta, Requeued, Start
from dispatcher.exceptions import ProviderUnreachable, WorkerLost
from dispatcher.plans import Lane, Plans
from dispatcher.reaper import Reaper
from dispatcher.script_calls import CancelReason, FinishMode, ScriptCalls, Submitted
from dispatcher.scripts import Scripts
from dispatcher.tenants import Tenant, Tenants
from iop.redis_server import RedisServer

T = TypeVar("T")

# --- known defects ------------------------------------------------------------------------------------
#
# Issue 19's defects that the scripts in this tree still have. The machine lets a violation
# through only when one of these explains it (each check says which defect would); the
# regression test named in the comment reproduces it deterministically and is xfail(strict)
# while its flag is here. When a fix lands, that test XPASSes: take the flag out, and both the
# test and the machine check the case from then on. Defects of issue 19 already fixed here
# keep their regression tests, unmarked.
KNOWN_DEFECTS: frozenset[str] = frozenset()  # none left
# Fixed in this tree; their flags would relax the same checks, and their regression tests run
# unmarked (a flag put back here marks its test xfail again):
#  1a. "stranded_after_reload": a reload that took a lane's queue key away (a band renamed,
#     a provider removed from the providers of an endpoint only some serve) left the jobs
#     waiting there, and jobs that came back to it later (requeued by their worker, unparked
#     by their tenant's release), in a queue no plan pumps; and jobs pinned to a provider it
#     removed waited out their deadline. Now reaper rounds move them (lua/rehome.lua) or
#     answer the pinned ones (lua/abandon.lua), and a job coming back to such a key is moved
#     at once (dispatcher/reaper.py rehome_queue).
#     test_defect1_jobs_waiting_in_a_lane_a_reload_renamed_are_still_served[provider removed,
#     band renamed], test_defect1_a_job_pinned_to_a_provider_a_reload_removes_is_answered,
#     test_defect1_a_job_coming_back_after_a_reload_goes_to_a_lane_that_is_pumped
#  1b. "misplaced_after_reload": a reload that added a provider to the providers of an
#     endpoint only some serve renamed that endpoint's lane ("b" -> "b,c"), and the old key
#     stayed in use as the lane of jobs pinned to b: the jobs waiting there since waited for b
#     alone while c idled. Now reaper rounds look in pinned-only lanes too (Plans.pinned_only).
#     test_defect1_jobs_waiting_in_a_lane_a_reload_renamed_are_still_served[provider added]
#  8. "parked_while_under_cap" (found by this machine in the parking of capped tenants' jobs,
#     the fix of defect 5): a release brings back the earliest parked job of each lane; when
#     that one left without running (its client gone), the jobs parked behind it stayed
#     parked while their tenant ran nothing. Now the job that leaves hands its place to the
#     next (lua/cancel.lua). test_defect8_a_parked_job_comes_back_when_the_job_brought_back_instead_leaves
#  2. "wrong_endpoint_after_reload": after a reload adds a provider that does not serve an
#     endpoint all the others served, that endpoint's waiting jobs went to it (inv5).
#     test_defect2_a_reload_adding_a_provider_never_sends_it_an_endpoint_it_does_not_serve
#  3. "retry_blocks_lane": a retried job at the head of its lane whose only free provider was
#     the one it excludes held up the jobs behind it while that provider idled (inv6).
#     test_defect3_a_retried_job_does_not_hold_up_its_lane_while_a_provider_idles
#  4. "weights_strict_across_lanes": heads of different lanes compared by their lag behind
#     their own lane's virtual time: weights became strict priority across lanes (inv7).
#     test_defect4_weights_hold_across_lanes
#  5. "tenant_cap_lookahead": a tenant at its max_in_flight with more than 64 jobs at the front
#     of a lane hid other tenants' jobs behind them while capacity idled (inv6).
#     test_defect5_a_capped_tenant_does_not_idle_capacity_beyond_the_look_ahead
#  6. "cap_release_not_pumped": a release that took a tenant back under its max_in_flight
#     pumped only the lanes of the provider that freed (inv6) -- now the lanes its parked jobs
#     went back to are pumped too (lua/wake.lua).
#     test_defect6_a_tenant_back_under_its_cap_gets_idle_capacity_at_once
#  7. "blocked_head_cancel_not_pumped": cancelling a blocked head pumped nothing: the jobs
#     behind it kept waiting while the provider it blocked idled (inv6).
#     test_defect7_cancelling_a_blocked_head_lets_the_next_job_take_the_idle_provider
#  8. (its first case) "parked_while_under_cap": a release that took a tenant back under its
#     max_in_flight brought back only its earliest parked jobs, whether or not they could run
#     (inv6) -- now the earliest of each lane it has parked jobs in comes back.
#     test_defect8_a_tenant_under_its_cap_has_no_runnable_job_left_parked
#  9. "parked_submit_says_dispatched" (found by this machine in the work in progress on defect
#     5): a submit whose job was parked at once (its tenant at its max_in_flight) answered
#     'dispatched' instead of 'queued' (the model's check of submit's answer).
#     test_defect9_a_submit_parked_at_once_answers_queued
#  10. "rehomed_cancel_leaves_entry" (found by this machine in the fix of defect 1a): a job a
#     reaper round moved to another lane, then given up by its API (which names the queue it
#     submitted to), kept its entry in the queue it was moved to (inv8b, inv3).
#     test_defect10_a_job_moved_by_the_reaper_leaves_nothing_behind_when_cancelled


def known_defect(flag: str, reason: str) -> pytest.MarkDecorator:
    """The mark of a defect's regression test: xfail(strict) while its flag is known."""
    return pytest.mark.xfail(flag in KNOWN_DEFECTS, strict=True, reason=f"issue 19 {reason}")


# Violations let through, per defect, over the session (printed by the machine's test, -s).
SEEN_DEFECTS: Counter[str] = Counter()
# How often the runs met the cases issues 29 and 30 added (printed the same way): a test that
# checks them must have met them.
SEEN_CASES: Counter[str] = Counter()

# --- the world ----------------------------------------------------------------------------------------

CHAT, RESPONSES, RERANK = "chat/completions", "responses", "rerank"
LONG_MS = 3_600_000  # leases, heartbeats and queue deadlines never run out by themselves here
MAX_ATTEMPTS = 3
REPLICA = "rep1"
WORKER = "w1"
REFUSAL_CODES = ("no_provider_available", "response_provider_unavailable")


@dataclass(frozen=True, slots=True)
class Spec:
    node: str
    capacity: int
    endpoints: tuple[str, ...]
    models: tuple[str, ...]


UNIVERSE: dict[str, Spec] = {
    "a": Spec("n1", 1, (CHAT, RESPONSES), ("m1", "m2")),
    "b": Spec("n1", 2, (CHAT, RESPONSES, RERANK), ("m1", "m2")),
    "c": Spec("n2", 1, (CHAT, RESPONSES, RERANK), ("m1",)),
}
PROVIDERS = tuple(sorted(UNIVERSE))
NODES = ("n1", "n2")


def make_config(
    providers: Mapping[str, Spec], *, tenants: Mapping[str, Mapping[str, Any]] | None = None,
    bands: Sequence[str] = (), max_queue: int = 1000,
) -> cfg.Config:
    """Providers (vllm, serving '<model>@<provider>') on their nodes; named tenant keys; priority
    bands (``standard`` is the default one)."""
    api: dict[str, Any] = {}
    if tenants:
        api["keys"] = [{"name": name, "key_sha256": f"{i + 1:064x}", **opts}
                       for i, (name, opts) in enumerate(tenants.items())]
    if bands:
        api["priorities"] = list(bands)
    models = sorted({m for s in providers.values() for m in s.models})
    return cfg.parse({
        "api": api,
        "queue": {"max_queue": max_queue, "queue_timeout_ms": LONG_MS},
        "dispatch": {"lease_ms": LONG_MS, "heartbeat_ttl_ms": LONG_MS, "max_attempts": MAX_ATTEMPTS},
        # One 5xx another provider answered instead ejects, for an hour (the machine ends one
        # itself: ejection_ends); at most half of a lane's providers.
        "ejection": {"consecutive_5xx": 1, "base_s": LONG_MS // 1000, "max_s": LONG_MS // 1000},
        "nodes": [{"id": n, "providers": [
            {"id": p, "type": "vllm", "base_url": "http://127.0.0.1:1", "capacity": s.capacity,
             "models": [f"{m}@{p}" for m in s.models], "endpoints": list(s.endpoints)}
            for p, s in sorted(providers.items()) if s.node == n]} for n in NODES],
        "models": [{"id": m, "providers": {p: f"{m}@{p}" for p, s in sorted(providers.items()) if m in s.models}}
                   for m in models],
    }).config


@dataclass(frozen=True)
class Setup:
    """A config and what every process derives from it."""

    config: cfg.Config
    plans: Plans
    tenants: Tenants

    @classmethod
    def of(cls, config: cfg.Config) -> Setup:
        return cls(config, Plans(config), Tenants(config))


@functools.cache
def world_setup(present: frozenset[str], fair: bool, batch: str = "batch") -> Setup:
    """The machine's config: the ``present`` providers of UNIVERSE; under flow control, its
    tenants and bands (``batch`` names the lowest band)."""
    providers = {p: UNIVERSE[p] for p in present}
    if not fair:
        return Setup.of(make_config(providers, max_queue=3))
    return Setup.of(make_config(
        providers, max_queue=3, bands=("interactive", "standard", batch),
        tenants={"t1": {"weight": 2, "max_in_flight": 1}, "t2": {"priority": "interactive", "max_queued": 3},
                 "t3": {"priority": batch}},
    ))


def lane_queues(plans: Plans, provider: str | None = None) -> set[str]:
    """The queues the plans pump: all of them, or those of ``provider``'s plan."""
    return {ln.queue for lanes in plans.lanes_by_model.values() for ln in lanes
            if provider is None or provider in ln.providers}


@dataclass(frozen=True, slots=True)
class Run:
    """One dispatch as the worker holds it: the node stream entry, and its node."""

    a: Assignment
    node: str

    def meta(self) -> Meta:
        return Meta(self.a.provider, self.node, self.a.target, self.a.queue_ms, self.a.attempt)


# --- what Redis holds ---------------------------------------------------------------------------------

# Everything the invariants look at, in one script: KEYS jobs, bodies, leases, deadlines, tenants;
# ARGV provider hashes. Returns those, then each lane queue with its jobs (first first), then each
# parked set (lib/pump.lua parks the jobs of a tenant at its max_in_flight) with its jobs.
SNAPSHOT_LUA = """
local out = {redis.call('HGETALL', KEYS[1]), redis.call('HKEYS', KEYS[2]),
             redis.call('ZRANGE', KEYS[3], 0, -1, 'WITHSCORES'), redis.call('ZRANGE', KEYS[4], 0, -1, 'WITHSCORES'),
             redis.call('HGETALL', KEYS[5])}
for _, p in ipairs(ARGV) do out[#out + 1] = redis.call('HGETALL', p) end
for _, pattern in ipairs({'{iop}:q:*', '{iop}:park:*'}) do
  local sets = {}
  for _, key in ipairs(redis.call('KEYS', pattern)) do
    -- {iop}:park:<tenant> is the set of its lanes; {iop}:park:<tenant>|<lane queue> its jobs.
    if redis.call('TYPE', key).ok == 'zset' then
      sets[#sets + 1] = key
      sets[#sets + 1] = redis.call('ZRANGE', key, 0, -1)
    end
  end
  out[#out + 1] = sets
end
return out
"""


def _pairs(flat: Sequence[Any]) -> Iterator[tuple[str, Any]]:
    for i in range(0, len(flat), 2):
        yield flat[i].decode(), flat[i + 1]


@dataclass
class Snapshot:
    records: dict[str, dict[str, Any]]
    bodies: set[str]
    leases: dict[str, float]
    deadlines: dict[str, float]
    providers: dict[str, dict[str, str]]
    counters: dict[str, int]
    queues: dict[str, list[str]]  # lane queue -> its jobs, first first
    parked: dict[str, str]  # job -> the parked set it is in
    where: dict[str, str] = field(init=False)  # job -> the lane queue it is in

    def __post_init__(self) -> None:
        self.where = {job: q for q, jobs in self.queues.items() for job in jobs}

    @classmethod
    def parse(cls, res: Sequence[Any], providers: Sequence[str]) -> Snapshot:
        jobs, bodies, leases, deadlines, counters = res[:5]
        n = len(providers)
        return cls(
            records={k: json.loads(v) for k, v in _pairs(jobs)},
            bodies={b.decode() for b in bodies},
            leases={k: float(v) for k, v in _pairs(leases)},
            deadlines={k: float(v) for k, v in _pairs(deadlines)},
            providers={p: {k: v.decode() for k, v in _pairs(h)} for p, h in zip(providers, res[5:5 + n], strict=True)},
            counters={k: int(v) for k, v in _pairs(counters)},
            queues={q: [j.decode() for j in js] for q, js in sorted(_pairs(res[5 + n]))},
            parked={j.decode(): q for q, js in _pairs(res[6 + n]) for j in js},
        )

    def in_flight(self, provider: str) -> int:
        return int(self.providers.get(provider, {}).get("in_flight", "0") or 0)

    def field(self, provider: str, name: str) -> int:
        try:
            return int(float(self.providers.get(provider, {}).get(name, "0") or 0))
        except ValueError:
            return 0

    def ejected(self, provider: str) -> bool:
        """Out of rotation for its 5xx (lib/eject.lua): the machine's ejections last an hour
        unless it ends one (ej_until rewritten to 0)."""
        return self.providers.get(provider, {}).get("ej_trial") == "1" and self.field(provider, "ej_until") > 0

    def on_trial(self, provider: str) -> bool:
        return self.providers.get(provider, {}).get("ej_trial") == "1" and self.field(provider, "ej_until") == 0

    def held(self, provider: str) -> bool:
        """A rate limit keeps new jobs off it (lua/capacity.lua hold_until): an hour, here."""
        return self.field(provider, "hold_until") > 0

    def slots(self, provider: str) -> int:
        """The slots dispatch may fill on it now: its capacity in force (one on trial), less the
        load iop does not send; none while held."""
        if self.held(provider):
            return 0
        cap = self.field(provider, "capacity")
        if self.on_trial(provider):
            cap = min(cap, 1)
        return cap - self.field(provider, "ext")

    def lane_of(self, job: str) -> str | None:
        """The lane queue a waiting job is in, or goes back to from its parked set."""
        if job in self.parked:
            return self.parked[job].partition("|")[2]  # {iop}:park:<tenant>|<lane queue>
        return self.where.get(job)

    def running(self, tenant: str) -> int:
        return self.counters.get(f"r:{tenant}", 0)


@dataclass(frozen=True, slots=True)
class Observed:
    replies: list[tuple[str, events.Event]]
    runs: list[Run]
    snap: Snapshot


class Fleet:
    """Every process of a deployment as Redis sees them: one API replica, the node workers (one
    consumer each of their node stream's group) and a reaper, all calling the scripts with the
    ScriptCalls of the config they all run (``use``: a reload, as SIGHUP does in each)."""

    def __init__(self, redis: Redis, setup: Setup) -> None:
        self.redis = redis
        self.scripts = Scripts(redis)  # loaded on first use (EVALSHA, then the source once)
        self._reply_last = b"0-0"
        self.use(setup)
        self.reaper = Reaper(self.calls, redis, "reaper-1")

    def use(self, setup: Setup) -> ScriptCalls:
        """Switch to ``setup``; returns the calls of the config before."""
        old: ScriptCalls | None = getattr(self, "calls", None)
        self.config, self.plans, self.tenants = setup.config, setup.plans, setup.tenants
        self.calls = ScriptCalls(self.scripts, setup.config, setup.plans)
        if hasattr(self, "reaper"):
            self.reaper.use(self.calls)
        return old or self.calls

    async def start(self) -> None:
        limits = self.tenants.limits()
        if limits:
            await self.redis.hset(keys.TENANT_LIMITS, mapping=limits)  # type: ignore[arg-type]
        for node in NODES:
            try:
                await self.redis.xgroup_create(keys.node(node), keys.NODE_GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def observe(self, providers: Sequence[str]) -> Observed:
        """In one round trip: what the API replica reads from its reply stream and what the node
        workers are handed (XREADGROUP '>') since the last call, then a snapshot."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xread({keys.reply(REPLICA): self._reply_last})
            pipe.xreadgroup(keys.NODE_GROUP, WORKER, {keys.node(n): ">" for n in NODES}, count=10_000)
            pipe.eval(SNAPSHOT_LUA, 5, keys.JOBS, keys.BODIES, keys.LEASES, keys.DEADLINES, keys.TENANTS,
                      *(keys.provider(p) for p in providers))
            got_replies, got_runs, snap = await pipe.execute()
        replies: list[tuple[str, events.Event]] = []
        for _stream, entries in got_replies or []:
            for entry_id, fields in entries:
                self._reply_last = entry_id
                replies.append((fields[b"job"].decode(), events.decode(fields[b"event"])))
        runs = []
        for stream, entries in got_runs or []:
            node = stream.decode().removeprefix(keys.node(""))
            runs += [Run(Assignment.from_entry(eid, f), node) for eid, f in entries if f]
        return Observed(replies, runs, Snapshot.parse(snap, providers))

    # --- the API side

    def lane(self, model: str, endpoint: str, pin: str | None = None, band: int | None = None) -> Lane | None:
        """The lane a request goes to, as api/intake.py picks it; None: answered 404 there."""
        lane = self.plans.pinned_lane(model, pin) if pin else self.plans.lane_for(model, endpoint)
        if lane is None or band is None or band == lane.band:
            return lane
        return self.plans.banded(lane, band)

    async def submit(self, job: str, lane: Lane, endpoint: str, pinned: bool = False,
                     tenant: Tenant | None = None) -> Submitted:
        return await self.calls.submit(job, lane, REPLICA, b"{}", endpoint, False, pinned, tenant)

    async def cancel(self, job: str, queue: str, reason: CancelReason) -> str:
        return str((await self.calls.cancel(job, queue, REPLICA, reason)).outcome)

    # --- the worker side

    async def heartbeat(self, provider: str, up: bool, calls: ScriptCalls | None = None) -> int:
        calls = calls or self.calls
        node, prov = next((n, p) for n, p in calls.config.providers() if p.id == provider)
        fields: list[tuple[str, str | int]] = [("capacity", prov.capacity), ("node", node.id),
                                               ("reason", "" if up else "probe failed")]
        return await calls.heartbeat(provider, "available" if up else "unavailable", fields)

    async def removed(self, provider: str, old: ScriptCalls) -> None:
        """A reload removed the provider: its worker marks it so with the old plans
        (workers/worker.py reload)."""
        await old.heartbeat(provider, "unavailable", [("reason", "removed from the config"), ("removed", 1)])

    async def finish(self, run: Run, mode: FinishMode, verdict: str = "") -> str:
        event: events.Event
        if mode == "done":
            event = Done(run.meta(), 200, b"{}")
        elif mode == "retry":
            event = Failed.from_error(ProviderUnreachable("provider answered 500"), run.meta())
        else:
            event = Failed.from_error(WorkerLost("the worker shut down before the job ended"))
        return str(await self.calls.finish(run.a, run.node, events.encode(event), mode=mode, verdict=verdict))

    async def publish_capacity(self, provider: str, capacity: int, external: int, hold: bool) -> int:
        """A worker publishes what it learned of a provider's load (lua/capacity.lua)."""
        report = wire.CapacityReport(capacity=capacity, mode="auto", external=external,
                                     hold_ms=LONG_MS if hold else 0, moved=True)
        return await self.calls.capacity(provider, report)

    async def end_ejection(self, provider: str) -> None:
        """An ejection's time is up: the provider is on trial (ej_until in the past)."""
        await self.redis.hset(keys.provider(provider), "ej_until", 0)

    async def emit(self, run: Run) -> str:
        return str(await self.calls.emit(run.a, events.encode(Start(run.meta(), 200, [b"data: {}\n\n"]))))

    async def drain(self, provider: str, drain: bool) -> None:
        await self.calls.drain(provider, "drain" if drain else "resume")

    # --- maintenance, and the clock where the scripts let a test move it

    async def expire_lease_and_reap(self, job: str) -> dict[str, int]:
        """The job's lease runs out (its score rewritten); the reaper's lease step, in a round whose
        marker is fresh (as if rounds had been running)."""
        await self.redis.zadd(keys.LEASES, {job: 1}, xx=True)
        sec, usec = await self.redis.time()
        now = int(sec) * 1000 + int(usec) // 1000
        await self.redis.hset(keys.REAPER_SEEN, mapping={"ms": now})
        return await self.reaper.reap_leases(now)

    async def pass_deadline(self, job: str) -> None:
        """The job's queue deadline passes, just now (in its record and in the deadlines zset; not
        long ago, which would make it an orphan of a dead API for the reaper)."""
        await self.redis.eval(
            "local t = redis.call('TIME') local d = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) - 1 "
            "local raw = redis.call('HGET', KEYS[1], ARGV[1]) if raw then local r = cjson.decode(raw) "
            "r.deadline_ms = d redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(r)) end "
            "if redis.call('ZSCORE', KEYS[2], ARGV[1]) then redis.call('ZADD', KEYS[2], d, ARGV[1]) end return 1",
            2, keys.JOBS, keys.DEADLINES, job,
        )

    async def reaper_round(self) -> None:
        """One reaper round (``Reaper.run_once``), as every reap_interval_ms: its lock free and
        its marker fresh (rounds have been running on this server), and not a reconciling one,
        which would mend what the invariants are here to catch."""
        await self.redis.delete(keys.REAPER_LOCK)
        info = await self.redis.info("server")
        sec, usec = await self.redis.time()
        await self.redis.hset(keys.REAPER_SEEN, mapping={"ms": int(sec) * 1000 + int(usec) // 1000,
                                                         "run": str(info.get("run_id", ""))})
        self.reaper.rounds = 1
        assert await self.reaper.run_once() is not None

    async def kill_worker(self, provider: str) -> None:
        """The provider's worker dies: its heartbeat expires (nobody refuses anything yet)."""
        await self.redis.hset(keys.provider(provider), "hb_exp", 1)


# --- the model ----------------------------------------------------------------------------------------


@dataclass
class Job:
    id: str
    tenant: str
    model: str
    endpoint: str
    pin: str | None
    band: int
    queue: str  # the lane queue it waits in (or was dispatched from: a requeue puts it back there)
    gen: int  # the config generation it was submitted under
    api_queue: str = ""  # the queue its API names when it gives up: the one it submitted to
    state: str = "waiting"  # waiting | running | cancelling (client left, slot still held) | gone
    run: Run | None = None
    excluded: set[str] = field(default_factory=set)  # providers that failed it ('retry')
    attempts: int = 1
    output: bool = False  # some of its output reached the client
    overdue: bool = False  # its queue deadline passed (the next pump that sees it expires it)
    outcomes: list[str] = field(default_factory=list)


@dataclass
class Prov:
    up: bool = False  # its last heartbeat said available (never seen: not up)
    live: bool = True  # its heartbeat has not expired
    drained: bool = False  # the drain mark, which outlives heartbeats and reloads

    def ok(self) -> bool:
        return self.up and self.live and not self.drained


class World:
    """The model: the jobs and providers as the API, the workers and the operator know them, the
    config in force, and when each lane was last pumped (to tell which defect explains what)."""

    def __init__(self, fleet: Fleet, fair: bool, present: frozenset[str]) -> None:
        self.fleet = fleet
        self.fair = fair
        self.present = present
        self.batch = "batch"
        self.gen = 0
        self.step = 0
        self.jobs: dict[str, Job] = {}
        self.provs = {p: Prov() for p in UNIVERSE}
        self.stale: list[Run] = []  # runs taken over or ended: a late write must change nothing
        self.last_pumped: dict[str, int] = {}  # queue -> step
        self.uncapped_at: dict[str, int] = {}  # tenant -> step it went back under max_in_flight
        self.unblocked_at: dict[str, int] = {}  # queue -> step a job that excluded providers left it
        self.snap: Snapshot | None = None
        # Providers handed a job in the step being checked, and each one's in_flight before it.
        self.dispatched_now: set[str] = set()
        self.prev_in_flight: dict[str, int] = {}
        # Providers whose ejection ran out since their lanes were last pumped: nothing pumps at
        # that moment, so they take waiting jobs at the next pump (their heartbeat, at the latest).
        self.back_unpumped: set[str] = set()

    @property
    def plans(self) -> Plans:
        return self.fleet.plans

    @property
    def config(self) -> cfg.Config:
        return self.fleet.config

    def limit(self, tenant: str) -> int | None:
        t = self.fleet.tenants.by_name.get(tenant)
        return t.max_in_flight if (self.fair and t is not None) else None

    def capacity(self, provider: str) -> int:
        return next((p.capacity for _, p in self.config.providers() if p.id == provider), 0)

    def available(self, provider: str) -> bool:
        """In the config in force, up, heard from and not drained."""
        return provider in self.present and self.provs[provider].ok()

    def serves(self, provider: str, job: Job) -> bool:
        """Could ``provider`` run ``job`` under the config in force: it serves the job's model and
        endpoint, and is its pin if it has one."""
        prov = next((p for _, p in self.config.providers() if p.id == provider), None)
        model = self.config.model(job.model)
        return (prov is not None and model is not None and provider in model.providers
                and job.endpoint in prov.served_endpoints and job.pin in (None, provider))

    def lane(self, queue: str) -> Lane | None:
        """The lane of the config in force whose queue ``queue`` is."""
        return next((ln for lanes in self.plans.lanes_by_model.values() for ln in lanes if ln.queue == queue), None)

    def home(self, job: Job, queue: str) -> Lane | None:
        """The lane of ``queue`` if it is one the config in force would put ``job`` in, in any band
        (where a reaper round moves a job whose lane a reload renamed)."""
        lane, base = self.lane(queue), self.fleet.lane(job.model, job.endpoint, job.pin)
        ok = lane is not None and base is not None and (lane.model, lane.providers) == (base.model, base.providers)
        return lane if ok else None

    def misplaced(self, job: Job) -> bool:
        """Is the job queued where the plans in force would not put a new request like it (it was
        submitted before a reload that renamed its lane)?"""
        lane = self.fleet.lane(job.model, job.endpoint, job.pin, job.band if self.fair else None)
        return lane is None or lane.queue != job.queue

    def reload_defect(self, job: Job) -> str | None:
        """The known defect a job queued before a reload is subject to, if any: its queue is one no
        plan pumps now, or one the plans would not put it in."""
        if job.gen == self.gen:
            return None
        if job.queue not in lane_queues(self.plans):
            return "stranded_after_reload"
        return "misplaced_after_reload" if self.misplaced(job) else None

    def live_jobs(self, *states: str) -> list[Job]:
        return [j for j in self.jobs.values() if j.state in states]

    def in_rotation(self, provider: str, s: Snapshot | None) -> bool:
        """Available and not ejected for its 5xx answers (as ``s`` has it)."""
        return self.available(provider) and not (s is not None and s.ejected(provider))

    def stand_ins(self, j: Job, provider: str, s: Snapshot | None) -> list[str]:
        """The other providers of ``j``'s lane that serve it and are in rotation: while there is
        one, an ejected ``provider`` gets nothing (lib/usable.lua)."""
        lane = self.lane(j.queue)
        members = lane.providers if lane is not None else tuple(sorted(self.present))
        return [p for p in members if p != provider and p in self.present and self.serves(p, j)
                and self.in_rotation(p, s)]


# --- the invariants -----------------------------------------------------------------------------------

# A check's finding: what is wrong, and the known defect that would explain it (None: none).
Problem = tuple[str, str | None]


class Violation(AssertionError):
    pass


def enforce(check: Callable[..., Iterable[Problem]], *args: Any) -> None:
    """Run one check; fail with its name and docstring on any finding no known defect explains."""
    unexplained = []
    for msg, defect in check(*args):
        if defect is not None and defect in KNOWN_DEFECTS:
            SEEN_DEFECTS[defect] += 1
        else:
            unexplained.append(msg if defect is None else f"{msg}  [issue 19: {defect}]")
    if unexplained:
        doc = " ".join((check.__doc__ or "").split())
        raise Violation(f"{check.__name__}: {doc}\n  " + "\n  ".join(unexplained))


def inv1_in_flight_matches_leases(w: World, s: Snapshot) -> Iterator[Problem]:
    """Invariant 1: every provider's in_flight equals the live leases whose record names it, and is
    never negative, never above its capacity."""
    held: Counter[str] = Counter()
    for job in s.leases:
        rec = s.records.get(job)
        if rec is None or not rec.get("provider"):
            yield f"lease of {job} without a dispatched record ({rec})", None
        else:
            held[str(rec["provider"])] += 1
    for pid in PROVIDERS:
        inf = s.in_flight(pid)
        cap = int(s.providers.get(pid, {}).get("capacity", "0") or 0)
        if inf != held[pid]:
            yield f"{pid}: in_flight {inf}, live leases {held[pid]}", None
        if inf < 0:
            yield f"{pid}: in_flight {inf} < 0", None
        if inf > cap and (inf > w.prev_in_flight.get(pid, 0) or pid in w.dispatched_now):
            # Only a limit that fell under running jobs leaves it above (lua/capacity.lua): then
            # they finish and nothing is dispatched there until it is under it.
            yield f"{pid}: in_flight {inf} > capacity {cap}, and it grew or got a job", None


def inv1b_dispatch_within_the_limit_in_force(w: World, s: Snapshot) -> Iterator[Problem]:
    """A provider handed a job runs at most the slots in force when it was dispatched: its
    capacity (the config's or a learned one), one while on trial after an ejection, less the load
    its engine reports for other clients; none while a rate limit holds it."""
    for pid in PROVIDERS:
        if s.in_flight(pid) > s.field(pid, "capacity") > 0:
            SEEN_CASES["in_flight above a limit that fell"] += 1
        if s.ejected(pid):
            SEEN_CASES["provider ejected"] += 1
        if s.on_trial(pid):
            SEEN_CASES["provider on trial"] += 1
    for pid in sorted(w.dispatched_now):
        if s.ejected(pid):
            SEEN_CASES["an ejected provider as its lane's last"] += 1
        if s.on_trial(pid):
            SEEN_CASES["a trial job"] += 1
        if s.in_flight(pid) > s.slots(pid):
            yield (f"{pid} got a job: in_flight {s.in_flight(pid)} > its slots {s.slots(pid)} (capacity "
                   f"{s.field(pid, 'capacity')}, external {s.field(pid, 'ext')}, trial {s.on_trial(pid)}, "
                   f"held {s.held(pid)})"), None


def inv2_tenant_counters_match_jobs(w: World, s: Snapshot) -> Iterator[Problem]:
    """Invariant 2: the tenants hash (q:<t>[:<model>] waiting, r:<t>[:<model>] running) counts
    exactly the jobs there are, and no counter is negative."""
    want: Counter[str] = Counter()
    if w.fair:
        for job, rec in s.records.items():
            kind = {"q": "q", "d": "r", "c": "r"}.get(str(rec["state"]))
            if kind is not None:
                tenant = job.partition("~")[0]
                want[f"{kind}:{tenant}"] += 1
                want[f"{kind}:{tenant}:{rec['model']}"] += 1
    for name in sorted(set(want) | set(s.counters)):
        have = s.counters.get(name, 0)
        if have < 0:
            yield f"{name} = {have} < 0", None
        if have != want[name]:
            yield f"{name} = {have}, the jobs say {want[name]}", None


def inv2b_tenants_within_max_in_flight(w: World, s: Snapshot) -> Iterator[Problem]:
    """A tenant never runs more jobs than its max_in_flight."""
    for tenant in ("t1", "t2", "t3") if w.fair else ():
        lim = w.limit(tenant)
        if lim is not None and s.running(tenant) > lim:
            yield f"{tenant} runs {s.running(tenant)} > max_in_flight {lim}", None


def inv3_idle_leaves_nothing_behind(w: World, s: Snapshot) -> Iterator[Problem]:
    """Invariant 3: when no job waits or runs, every in_flight and tenant counter is 0, and no
    lease and no queued job is left."""
    if any(rec["state"] in ("q", "d", "c") for rec in s.records.values()):
        return
    for pid in PROVIDERS:
        if s.in_flight(pid):
            yield f"idle, yet {pid} has in_flight {s.in_flight(pid)}", None
    for name, value in s.counters.items():
        if value:
            yield f"idle, yet {name} = {value}", None
    if s.leases:
        yield f"idle, yet leases {sorted(s.leases)} are left", None
    for q, jobs in s.queues.items():
        for job in jobs:
            j = w.jobs.get(job)
            moved = "rehomed_cancel_leaves_entry" if j is not None and j.state == "gone" and q != j.api_queue else None
            yield f"idle, yet {q} holds {job}", moved


def inv4_waiting_jobs_are_pumped(w: World, s: Snapshot) -> Iterator[Problem]:
    """Invariant 4: every waiting job is in a lane queue that the plan of some provider of the
    config in force pumps: none is stranded after a reload. A parked job may go back to a lane
    a reload took away: whatever brings it back moves it to its lane at once
    (dispatcher/reaper.py rehome_queue; inv6 checks that it then runs)."""
    pumped = lane_queues(w.plans)
    for job, rec in s.records.items():
        if rec["state"] != "q":
            continue
        q = s.lane_of(job)
        j = w.jobs.get(job)
        if q is None:
            yield f"{job} waits in no lane queue ({rec})", None
        elif q not in pumped and job not in s.parked:
            if j is not None and j.pin is not None and j.pin not in w.present and not w.provs[j.pin].live:
                continue  # pinned to a provider a reload removed whose worker died: answered once
                #           its heartbeat runs out (a reaper round: lua/abandon.lua)
            defect = "stranded_after_reload" if j is not None and j.gen != w.gen else None
            yield f"{job} waits in {q}, which no plan of the config in force pumps", defect


def inv5_dispatches_go_where_allowed(w: World, run: Run) -> Iterator[Problem]:
    """Invariant 5: a job is dispatched only to a provider of the config in force that can take
    work, serves its model and endpoint, is its pin if it has one, and did not fail it ('retry')
    unless none of the others that serve it can take work."""
    a = run.a
    j = w.jobs.get(a.job)
    if j is None:
        yield f"{a.job}, which nobody submitted, dispatched to {a.provider}", None
        return
    what = f"{j.id} ({j.model} {j.endpoint}{' pinned to ' + j.pin if j.pin else ''}, queued in {j.queue})"
    if a.provider not in w.present:
        yield f"{what} dispatched to {a.provider}, which the config in force does not have", None
    elif not w.serves(a.provider, j):
        reload = "wrong_endpoint_after_reload" if j.gen != w.gen and w.misplaced(j) else None
        yield f"{what} dispatched to {a.provider}, which does not serve it", reload
    if not w.provs[a.provider].ok():
        yield f"{what} dispatched to {a.provider}, which cannot take work ({w.provs[a.provider]})", None
    if a.provider in j.excluded:
        others = [p for p in sorted(w.present) if p not in j.excluded and w.available(p) and w.serves(p, j)]
        if others:
            yield f"{what} dispatched again to {a.provider}, which failed it, while {others} could take it", None
    if a.model != j.model:
        yield f"{what} dispatched as model {a.model}", None


def inv5b_ejected_and_held_providers_get_nothing(w: World, run: Run, s: Snapshot) -> Iterator[Problem]:
    """A job goes to a provider ejected for its 5xx answers only when no other provider of its
    lane that serves it is in rotation (a 5xx alone never leaves a request without a provider),
    and never to one a rate limit holds."""
    j = w.jobs.get(run.a.job)
    pid = run.a.provider
    if j is None:
        return
    if s.ejected(pid) and (others := w.stand_ins(j, pid, s)):
        yield f"{j.id} dispatched to ejected {pid} while {others} could take it", None
    if s.held(pid):
        yield f"{j.id} dispatched to {pid}, which a rate limit holds", None


def inv6_no_idle_capacity_while_a_job_waits(w: World, s: Snapshot) -> Iterator[Problem]:
    """Invariant 6 (after a step that pumps): no job waits while a provider that could take it --
    up, heard from, not drained, below its capacity, serving the job's model, endpoint and pin,
    not one that failed it -- idles, and its tenant is under its max_in_flight."""
    for job, rec in s.records.items():
        j = w.jobs.get(job)
        if j is None or j.overdue or rec["state"] != "q":
            continue
        lim = w.limit(j.tenant)
        if lim is not None and s.running(j.tenant) >= lim:
            continue
        for pid in sorted(w.present):
            if not w.available(pid) or s.in_flight(pid) >= s.slots(pid):
                continue
            if not w.serves(pid, j) or pid in j.excluded:
                continue
            if s.ejected(pid) and w.stand_ins(j, pid, s):
                continue  # out of rotation: its lane has others
            if pid in w.back_unpumped:
                continue  # its ejection ran out; nothing has pumped its lanes since
            place = f"parked for {s.lane_of(job)}" if job in s.parked else f"in {s.lane_of(job)}"
            yield (f"{job} ({j.model} {j.endpoint}, tenant {j.tenant}) waits {place} while {pid} idles "
                   f"(in_flight {s.in_flight(pid)} of {s.slots(pid)} slots)", why_idle(w, s, j, pid))


def why_idle(w: World, s: Snapshot, j: Job, pid: str) -> str | None:
    """The known defect that would leave ``pid`` idle while ``j`` waits, if one would."""
    if (reload := w.reload_defect(j)) is not None:
        return reload
    if j.id in s.parked:
        return "parked_while_under_cap"
    queue = s.queues.get(j.queue, [])
    ahead = queue[:queue.index(j.id)] if j.id in queue else []
    if any(pid in w.jobs[h].excluded for h in ahead if h in w.jobs):
        return "retry_blocks_lane"
    capped = [h for h in ahead if (lim := w.limit(h.partition("~")[0])) is not None
              and s.running(h.partition("~")[0]) >= lim]
    if len(capped) >= 63:
        return "tenant_cap_lookahead"
    pumped = w.last_pumped.get(j.queue, -1)
    if w.limit(j.tenant) is not None and pumped < w.uncapped_at.get(j.tenant, -1):
        return "cap_release_not_pumped"
    if pumped < w.unblocked_at.get(j.queue, -1):
        return "blocked_head_cancel_not_pumped"
    return None


def inv8_one_outcome_per_job(w: World, s: Snapshot) -> Iterator[Problem]:
    """Invariant 8: every submitted job gets exactly one outcome (answered, refused, cancelled,
    expired or failed): none is lost (gone from Redis unanswered), none answered twice."""
    for j in w.jobs.values():
        if len(j.outcomes) > 1:
            yield f"{j.id} answered more than once: {j.outcomes}", None
        alive = j.id in s.records
        if not alive and len(j.outcomes) != 1:
            yield f"{j.id} is gone from Redis with outcomes {j.outcomes} (the model has it {j.state})", None
        if alive and j.outcomes and j.state != "cancelling":
            yield f"{j.id} has outcome {j.outcomes}, yet its record is still there: {s.records[j.id]}", None
    for job in s.records:
        if job not in w.jobs:
            yield f"Redis has a record of {job}, which nobody submitted", None


def inv8b_model_matches_redis(w: World, s: Snapshot) -> Iterator[Problem]:
    """Redis holds each job as the model has it: a waiting job in its lane's queue (or parked, to go
    back there) with a deadline, a running one with a lease and its latest dispatch, an ended one
    nowhere (a parked set may keep it until it is unparked)."""
    for j in w.jobs.values():
        rec = s.records.get(j.id)
        st_ = None if rec is None else rec["state"]
        queued, parked = j.id in s.where, j.id in s.parked
        if j.state == "gone":
            left = [name for name, held in (("record", rec), ("lease", j.id in s.leases), ("body", j.id in s.bodies),
                                            ("deadline", j.id in s.deadlines)) if held]
            if left:
                yield f"{j.id} ended ({j.outcomes}), yet Redis keeps its {', '.join(left)}", None
            if queued:
                moved = "rehomed_cancel_leaves_entry" if s.where[j.id] != j.api_queue else None
                yield f"{j.id} ended ({j.outcomes}), yet it is still in {s.where[j.id]}", moved
        elif j.state == "waiting":
            if (st_ == "q" and s.lane_of(j.id) == j.queue and queued != parked and j.id in s.deadlines
                    and j.id not in s.leases):
                continue
            if st_ == "x" and j.overdue and not queued and j.id not in s.leases:
                continue  # expired in its queue: its API collects it
            yield f"{j.id} should wait in {j.queue}; Redis has {rec}, in {s.where.get(j.id)}", None
        else:
            run = j.run
            want = "c" if j.state == "cancelling" else "d"
            if (st_ != want or run is None or rec is None or rec.get("provider") != run.a.provider
                    or rec.get("fence") != run.a.fence or j.id not in s.leases or queued or parked):
                yield f"{j.id} should be {j.state} on {run.a.provider if run else None}; Redis has {rec}", None


INVARIANTS = (inv1_in_flight_matches_leases, inv1b_dispatch_within_the_limit_in_force,
              inv2_tenant_counters_match_jobs, inv2b_tenants_within_max_in_flight,
              inv3_idle_leaves_nothing_behind, inv4_waiting_jobs_are_pumped, inv8_one_outcome_per_job,
              inv8b_model_matches_redis)


# --- the machine --------------------------------------------------------------------------------------

# A request: tenant, model, what it asks (chat, responses, rerank, or a stored Response's
# follow-up pinned to the provider that made it), which provider (pinned), bands below its own.
Request = tuple[str, str, str, int, int]
REQUESTS = st.tuples(st.sampled_from(["t1", "t2", "t3"]), st.sampled_from(["m1", "m2"]),
                     st.sampled_from(["chat", "chat", "responses", "rerank", "pinned"]), st.integers(0, 3),
                     st.integers(0, 2))
PICK = st.integers(0, 20)  # which of the jobs (or providers) a step concerns


class SchedulerMachine(RuleBasedStateMachine):
    """The scheduler's scripts under random traffic, operations and reloads (see the module doc).
    ``loop`` and ``redis`` are set per run by the test (one connection for every example)."""

    fair = True
    loop: asyncio.AbstractEventLoop
    redis: Redis

    def __init__(self) -> None:
        super().__init__()
        self.ids = itertools.count(1)
        self.w: World

    def run(self, coro: Awaitable[T]) -> T:
        return self.loop.run_until_complete(coro)

    # --- stepping

    def settle(self, pumped: set[str] | None) -> None:
        """After a step: follow what the API and the workers read, then check every invariant
        (``pumped``: the queues the step pumped; None: it pumped nothing, so inv6 is not due)."""
        self.begin(pumped)
        self.check(self.observe(), pumped)

    def begin(self, pumped: set[str] | None) -> None:
        self.w.step += 1
        self.w.dispatched_now = set()
        for p in list(self.w.back_unpumped):
            if pumped and self.lanes_of(p) and self.lanes_of(p) <= pumped:
                self.w.back_unpumped.discard(p)
        for q in pumped or ():
            self.w.last_pumped[q] = self.w.step

    def observe(self) -> Snapshot:
        """Follow what the API replica and the workers read now; the snapshot read with it."""
        w = self.w
        seen = self.run(w.fleet.observe(PROVIDERS))
        for job, event in seen.replies:
            self.on_reply(job, event)
        for run in seen.runs:
            enforce(inv5_dispatches_go_where_allowed, w, run)
            enforce(inv5b_ejected_and_held_providers_get_nothing, w, run, seen.snap)
            w.dispatched_now.add(run.a.provider)
            self.on_dispatch(run)
        s = seen.snap
        for j in w.live_jobs("waiting"):
            # Moved by a reaper round from a lane a reload renamed to the one it belongs in now.
            q = s.lane_of(j.id)
            if q is not None and q != j.queue and j.gen != w.gen and (home := w.home(j, q)) is not None:
                j.queue, j.band = q, home.band
        return s

    def check(self, s: Snapshot, pumped: set[str] | None) -> None:
        w = self.w
        for tenant in ("t1", "t2", "t3") if w.fair and w.snap is not None else ():
            lim = w.limit(tenant)
            if lim is not None and w.snap is not None and w.snap.running(tenant) >= lim > s.running(tenant):
                w.uncapped_at[tenant] = w.step
        w.snap = s
        for check in INVARIANTS:
            enforce(check, w, s)
        if pumped is not None:
            enforce(inv6_no_idle_capacity_while_a_job_waits, w, s)
        w.prev_in_flight = {p: s.in_flight(p) for p in PROVIDERS}

    def expect(self, what: str, got: object, want: object, defect: str | None = None) -> None:
        """A script answered as the model says, or as the known ``defect`` explains."""
        if got == want:
            return
        if defect is not None and defect in KNOWN_DEFECTS:
            SEEN_DEFECTS[defect] += 1
            return
        raise Violation(f"scripts_answer_as_modelled: {what}: {got}, the model says {want}"
                        + (f"  [issue 19: {defect}]" if defect else ""))

    def on_reply(self, job: str, event: events.Event) -> None:
        w = self.w
        j = w.jobs.get(job)
        if j is None:
            raise Violation(f"the API got {event} for {job}, which nobody submitted")
        if isinstance(event, Start):
            j.output = True
            return
        if isinstance(event, Requeued):
            if j.state != "running" or j.run is None:
                raise Violation(f"{job} requeued while {j.state}")
            w.stale.append(j.run)
            j.state, j.run, j.attempts, j.output = "waiting", None, j.attempts + 1, False
            return
        if isinstance(event, Failed) and event.code in REFUSAL_CODES:
            if j.state != "waiting":
                raise Violation(f"{job} refused ({event.code}) while {j.state}")
            lane = w.lane(j.queue)
            up = [p for p in (lane.providers if lane else ()) if w.available(p)]
            if up:
                raise Violation(f"{job} refused ({event.message}) while {up} of its lane can take work")
            if j.excluded:
                w.unblocked_at[j.queue] = w.step
            kind = "refused"
        else:
            kind = "failed" if isinstance(event, Failed) else "answered"
        j.outcomes.append(kind)
        if j.run is not None:
            w.stale.append(j.run)
        j.state, j.run = "gone", None

    def on_dispatch(self, run: Run) -> None:
        j = self.w.jobs.get(run.a.job)
        if j is None:
            return
        if j.state != "waiting":
            raise Violation(f"{j.id} dispatched to {run.a.provider} while {j.state}")
        if run.a.attempt != j.attempts:
            raise Violation(f"{j.id} dispatched as attempt {run.a.attempt}, the model says {j.attempts}")
        if run.a.provider in j.excluded:
            j.excluded.clear()  # back to a provider that failed it, the only one up: exclusions forgotten
        j.state, j.run, j.queue = "running", run, keys.queue(run.a.model, run.a.lane)

    def pick(self, jobs: Sequence[Job], i: int) -> Job:
        return sorted(jobs, key=lambda j: j.id)[i % len(jobs)]

    def lanes_of(self, provider: str) -> set[str]:
        """The queues a heartbeat (or a release) of ``provider`` pumps: its plan's."""
        return lane_queues(self.w.plans, provider) if provider in self.w.present else set()

    # --- requests

    def request(self, req: Request) -> None:
        """One request arrives and is submitted, as api/intake.py and api/relay.py do."""
        w = self.w
        tenant, model, kind, pin, lower = req
        endpoint = {"chat": CHAT, "responses": RESPONSES, "rerank": RERANK, "pinned": RESPONSES}[kind]
        pinned = None
        if kind == "pinned":
            pins = sorted(p for p in w.present if model in UNIVERSE[p].models)
            pinned = pins[pin % len(pins)]
        t = w.fleet.tenants.by_name[tenant] if self.fair else None
        band = min(t.band + lower, len(w.plans.bands) - 1) if t is not None else None
        lane = w.fleet.lane(model, endpoint, pinned, band)
        if lane is None:
            return  # answered 404 by the API: nothing reaches Redis
        n = next(self.ids)
        job_id = t.job_id(f"j{n}") if t is not None else f"j{n}"
        status = str(self.run(w.fleet.submit(job_id, lane, endpoint, pinned is not None, t)).status)
        j = Job(job_id, t.name if t else "default", model, endpoint, pinned, lane.band, lane.queue, w.gen, lane.queue)
        w.jobs[job_id] = j
        # A refusal for want of a provider only when none of the lane's can take work (when one
        # that is silent or unheard of may, is the scripts' choice).
        can = [p for p in lane.providers if w.available(p)]
        if status in ("unavailable", "no_provider") and can:
            self.expect(f"submit of {job_id} to {lane.queue} while {can} can take work", status, "queued")
        self.expect(f"submit of {job_id} (pinned to {pinned}): 'unavailable' is for pinned jobs",
                    status == "unavailable" and pinned is None, False)
        if status not in ("dispatched", "queued"):
            j.state = "gone"
            j.outcomes.append(f"refused {status}")
        self.settle({lane.queue} if status not in ("unavailable", "tenant_full") else None)
        if status == "dispatched":
            parked = self.w.snap is not None and job_id in self.w.snap.parked
            self.expect(f"submit of {job_id} said dispatched; is it running", j.state, "running",
                        "parked_submit_says_dispatched" if parked else None)

    @initialize(present=st.sampled_from(["abc", "ab", "bc", "b"]), backlog=st.lists(REQUESTS, max_size=6))
    def start(self, present: str, backlog: list[Request]) -> None:
        """A fleet of the ``present`` providers, all up, and its first requests."""
        self.run(self.redis.flushall())
        fleet = Fleet(self.redis, world_setup(frozenset(present), self.fair))
        self.run(fleet.start())
        self.w = World(fleet, self.fair, frozenset(present))
        for pid in sorted(present):
            self.w.provs[pid].up = True
            self.run(fleet.heartbeat(pid, True))
        self.settle(set())
        for req in backlog:
            self.request(req)

    @rule(req=REQUESTS)
    def submit(self, req: Request) -> None:
        self.request(req)

    @rule(reqs=st.lists(REQUESTS, min_size=2, max_size=5))
    def burst(self, reqs: list[Request]) -> None:
        for req in reqs:
            self.request(req)

    # --- the workers

    def settling(self, j: Job, mode: str) -> str:
        """What finish (or an expired lease: 'requeue') does with a running job, as the model sees
        it: one given up before any output goes back to its queue while attempts are left, one its
        provider failed ('retry') only if another provider that serves it can take work."""
        w = self.w
        if mode == "done":
            return "released"
        if j.state == "cancelling":
            return "dropped"
        if j.output or j.attempts >= MAX_ATTEMPTS:
            return "failed"
        if mode == "retry" and not any(p not in j.excluded and w.in_rotation(p, w.snap) and w.serves(p, j)
                                       for p in w.present):
            return "failed"
        return "requeued"

    def ending(self, i: int, mode: FinishMode, verdict: str = "") -> None:
        w = self.w
        j = self.pick(w.live_jobs("running", "cancelling"), i)
        run = j.run
        assert run is not None
        pid = run.a.provider
        if mode == "retry":
            j.excluded.add(pid)
        expect = self.settling(j, mode)
        outcome = self.run(w.fleet.finish(run, mode, verdict))
        self.expect(f"finish {mode} of {j.id} ({j.state} on {pid})", outcome, expect,
                    w.reload_defect(j))
        if outcome in ("dropped", "released") and j.state == "cancelling":
            w.stale.append(run)
            j.state, j.run = "gone", None
        self.settle(self.released(pid, j))

    def released(self, provider: str, j: Job) -> set[str]:
        """The queues a release of ``provider``'s run of ``j`` pumps: the provider's plan, or when a
        reload removed the provider, the job's own lane's."""
        return self.lanes_of(provider) if provider in self.w.present else {j.queue}

    @precondition(lambda self: self.w.live_jobs("running", "cancelling"))
    @rule(i=PICK)
    def answer(self, i: int) -> None:
        """A run ends with its answer (which ends its provider's streak of 5xx, or its trial)."""
        self.ending(i, "done", "ok")

    @precondition(lambda self: self.w.live_jobs("running", "cancelling"))
    @rule(i=PICK)
    def provider_answers_5xx(self, i: int) -> None:
        """A run's provider answers it 5xx before any output: 'retry', and evidence that may
        eject it, or excuse it (lib/evidence.lua)."""
        self.ending(i, "retry", "500")

    @precondition(lambda self: self.w.live_jobs("running"))
    @rule(i=PICK, expires=st.booleans())
    def another_provider_answers_what_one_failed(self, i: int, expires: bool) -> None:
        """A run's provider answers it 5xx, and the provider it is retried on answers it: the
        first is blamed (and, here, ejected: lib/evidence.lua) -- what it takes two steps of
        the rules above to meet by chance; ``expires``: its ejection then runs out (trial)."""
        w = self.w
        j = self.pick(w.live_jobs("running"), i)
        assert j.run is not None
        failed = j.run.a.provider
        self.ending(sorted(w.live_jobs("running", "cancelling"), key=lambda x: x.id).index(j), "retry", "500")
        if j.state == "running" and j.run is not None:
            self.ending(sorted(w.live_jobs("running", "cancelling"), key=lambda x: x.id).index(j), "done", "ok")
        if expires and w.snap is not None and w.snap.ejected(failed):
            self.begin(None)
            self.run(w.fleet.end_ejection(failed))
            w.back_unpumped.add(failed)
            self.check(self.observe(), None)
            # And a request for it, which it may take on trial.
            self.request(("t1", UNIVERSE[failed].models[0], "chat", 0, 0))

    @precondition(lambda self: self.w.live_jobs("running", "cancelling"))
    @rule(i=PICK)
    def provider_fails(self, i: int) -> None:
        """A run's provider fails it before any output (unreachable, 5xx): 'retry'."""
        self.ending(i, "retry")

    @precondition(lambda self: self.w.live_jobs("running", "cancelling"))
    @rule(i=PICK)
    def worker_shuts_down(self, i: int) -> None:
        """A run's worker shuts down and gives it back: 'requeue'."""
        self.ending(i, "requeue")

    @precondition(lambda self: self.w.live_jobs("running", "cancelling"))
    @rule(i=PICK)
    def first_output(self, i: int) -> None:
        j = self.pick(self.w.live_jobs("running", "cancelling"), i)
        assert j.run is not None
        outcome = self.run(self.w.fleet.emit(j.run))
        self.expect(f"emit of {j.id} ({j.state})", outcome, "cancelled" if j.state == "cancelling" else "ok")
        self.settle(None)

    @precondition(lambda self: self.w.live_jobs("running", "cancelling"))
    @rule(i=PICK)
    def lease_expires(self, i: int) -> None:
        """A running job's lease runs out (its worker died or hung) and the reaper reaps it."""
        w = self.w
        j = self.pick(w.live_jobs("running", "cancelling"), i)
        run = j.run
        assert run is not None
        expect = self.settling(j, "requeue")
        outcomes = self.run(w.fleet.expire_lease_and_reap(j.id))
        self.expect(f"reap of {j.id} ({j.state} on {run.a.provider})", outcomes, {expect: 1})
        if expect == "dropped":
            w.stale.append(run)
            j.state, j.run = "gone", None
        self.settle(self.released(run.a.provider, j))

    @precondition(lambda self: self.w.stale)
    @rule(i=PICK, mode=st.sampled_from(["done", "retry", "requeue", "emit"]))
    def late_worker(self, i: int, mode: str) -> None:
        """A run that was taken over or already ended writes late: nothing changes."""
        run = self.w.stale[i % len(self.w.stale)]
        finish: FinishMode | None = None if mode == "emit" else mode  # type: ignore[assignment]
        outcome = self.run(self.w.fleet.emit(run) if finish is None else self.w.fleet.finish(run, finish))
        self.expect(f"late {mode} of {run.a.job} (fence {run.a.fence})", outcome, "stale")
        self.settle(None)

    # --- the API gives up

    def gave_up(self, j: Job, outcome: str) -> None:
        """A waiting job the API gave up on: removed, or collected after it expired in its queue."""
        self.expect(f"cancel of waiting {j.id}", outcome in (("removed", "expired") if j.overdue else ("removed",)),
                    True)
        j.outcomes.append("cancelled" if outcome == "removed" else "expired")
        j.state = "gone"
        if j.excluded:
            self.w.unblocked_at[j.queue] = self.w.step + 1

    @precondition(lambda self: self.w.live_jobs("waiting", "running", "cancelling"))
    @rule(i=PICK)
    def client_leaves(self, i: int) -> None:
        w = self.w
        j = self.pick(w.live_jobs("waiting", "running", "cancelling"), i)
        outcome = self.run(w.fleet.cancel(j.id, j.api_queue, CancelReason.CLIENT))
        if j.state == "waiting":
            self.gave_up(j, outcome)
        else:
            self.expect(f"cancel of {j.state} {j.id}", outcome, "cancelling")
            if j.state == "running":
                j.outcomes.append("cancelled")
            j.state = "cancelling"
        self.settle(None)

    @precondition(lambda self: self.w.live_jobs("waiting"))
    @rule(i=PICK, now=st.booleans())
    def deadline_passes(self, i: int, now: bool) -> None:
        """A waiting job's queue deadline passes; ``now``: the API's timer fires at once (cancel
        'timeout'), else the next pump that sees the job expires it first."""
        w = self.w
        j = self.pick(w.live_jobs("waiting"), i)
        self.run(w.fleet.pass_deadline(j.id))
        j.overdue = True
        if now:
            self.gave_up(j, self.run(w.fleet.cancel(j.id, j.api_queue, CancelReason.TIMEOUT)))
        self.settle(None)

    # --- providers, operators, the reaper

    def provider(self, i: int) -> str:
        return sorted(self.w.present)[i % len(self.w.present)]

    @rule(i=PICK, up=st.booleans())
    def heartbeat(self, i: int, up: bool) -> None:
        """A provider's worker publishes it: up (which pumps its lanes), or down (which answers the
        jobs of lanes it leaves with no provider that can take work)."""
        w = self.w
        p = self.provider(i)
        w.provs[p].up, w.provs[p].live = up, True
        self.run(w.fleet.heartbeat(p, up))
        self.settle(self.lanes_of(p) if up else None)

    @precondition(lambda self: any(self.w.provs[p].live for p in self.w.present))
    @rule(i=PICK)
    def worker_dies(self, i: int) -> None:
        """A provider's heartbeat expires: nothing is refused until a reaper round."""
        w = self.w
        live = sorted(p for p in w.present if w.provs[p].live)
        p = live[i % len(live)]
        w.provs[p].live = False
        self.run(w.fleet.kill_worker(p))
        self.settle(None)

    @rule()
    def reaper_round(self) -> None:
        """A reaper round: among others, it answers the jobs of lanes none of whose providers can
        take work, and moves jobs out of lanes a reload renamed."""
        self.run(self.w.fleet.reaper_round())
        self.settle(set())

    @precondition(lambda self: self.w.snap is not None and any(self.w.snap.ejected(p) for p in self.w.present))
    @rule(i=PICK)
    def ejection_ends(self, i: int) -> None:
        """An ejection's time runs out: the provider is on trial, one job at a time."""
        w = self.w
        assert w.snap is not None
        out = sorted(p for p in w.present if w.snap.ejected(p))
        p = out[i % len(out)]
        self.run(w.fleet.end_ejection(p))
        w.back_unpumped.add(p)
        self.settle(None)

    @rule(i=PICK, capacity=st.integers(0, 2), external=st.integers(0, 1), hold=st.booleans())
    def capacity_changes(self, i: int, capacity: int, external: int, hold: bool) -> None:
        """A worker publishes what it learned of a provider's load (capacity: auto): a limit of 1
        or 2, or (``capacity`` 0) one under what runs there now; load other clients put on it;
        a rate limit's hold. It pumps the provider's lanes."""
        w = self.w
        p = self.provider(i)
        if capacity == 0:
            running = w.snap.in_flight(p) if w.snap is not None else 0
            capacity = max(running - 1, 1)
        self.run(w.fleet.publish_capacity(p, capacity, external, hold))
        self.settle(self.lanes_of(p))

    @rule(i=PICK, drain=st.booleans())
    def operator(self, i: int, drain: bool) -> None:
        """An operator drains a provider (answering the jobs of lanes it was the last provider of)
        or resumes it (which pumps its lanes)."""
        w = self.w
        p = self.provider(i)
        w.provs[p].drained = drain
        self.run(w.fleet.drain(p, drain))
        self.settle(None if drain else self.lanes_of(p))

    # --- reloads

    def reload(self, present: frozenset[str], batch: str) -> None:
        """Every process applies a new config, as after SIGHUP: the workers first mark the providers
        it removes unavailable (with their old plans), then heartbeat the others with the new ones,
        which pumps their lanes; then the reaper's next round."""
        w = self.w
        before = w.present
        self.begin(None)
        old = w.fleet.use(world_setup(present, self.fair, batch))
        for p in sorted(before - present):
            if w.provs[p].live:
                w.provs[p].up = False
                self.run(w.fleet.removed(p, old))
                self.observe()
        w.present, w.batch = present, batch
        w.gen += 1
        pumped: set[str] = set()
        for p in sorted(present):
            if p not in before:
                w.provs[p].up, w.provs[p].live = True, True
            elif not w.provs[p].live:
                continue
            self.run(w.fleet.heartbeat(p, w.provs[p].up))
            if w.provs[p].up:
                pumped |= self.lanes_of(p)
                for q in self.lanes_of(p):
                    w.last_pumped[q] = w.step
            self.observe()
        # The reaper's next round (every process runs one within reap_interval_ms).
        self.run(w.fleet.reaper_round())
        self.check(self.observe(), pumped)

    @rule(p=st.sampled_from(["a", "c"]))
    def reload_toggles_provider(self, p: str) -> None:
        """A reload adds provider ``p`` (a serves no rerank; c serves m1 only), or removes it."""
        self.reload(self.w.present ^ {p}, self.w.batch)

    @precondition(lambda self: self.fair)
    @rule()
    def reload_renames_band(self) -> None:
        """A reload renames the lowest priority band (batch <-> bulk)."""
        self.reload(self.w.present, "bulk" if self.w.batch == "batch" else "batch")


class FifoSchedulerMachine(SchedulerMachine):
    """The same world without flow control: one tenant, one band, plain FIFO by submit order."""

    fair = False


# Modest by default (the whole module runs in seconds); IOP_SCHEDULER_EXAMPLES explores further.
EXAMPLES = int(os.environ.get("IOP_SCHEDULER_EXAMPLES", "0"))
STEPS = 30


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("machine", "examples"), [(SchedulerMachine, 40), (FifoSchedulerMachine, 30)],
                         ids=["flow-control", "fifo"])
def test_scheduler_model(any_redis_server: RedisServer, machine: type[SchedulerMachine], examples: int,
                         monkeypatch: pytest.MonkeyPatch) -> None:
    # A failure is shrunk to a short sequence of steps; every try replays Redis calls, so give up
    # shrinking after two minutes rather than Hypothesis's five (what is found by then is printed).
    monkeypatch.setattr(hypothesis_engine, "MAX_SHRINKING_SECONDS", 120, raising=False)
    loop = asyncio.new_event_loop()
    redis = Redis.from_url(any_redis_server.url)
    runner = type(machine.__name__, (machine,), {"loop": loop, "redis": redis})
    try:
        run_state_machine_as_test(runner, settings=settings(
            max_examples=EXAMPLES or examples, stateful_step_count=STEPS, deadline=None, derandomize=True,
            database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
            report_multiple_bugs=False, phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
        ))
    finally:
        loop.run_until_complete(redis.aclose())
        loop.close()
        print(f"known defects met ({machine.__name__}, so far):", dict(SEEN_DEFECTS))
        print(f"cases met ({machine.__name__}, so far):", dict(SEEN_CASES))
        MACHINES_RUN.add(machine.__name__)


MACHINES_RUN: set[str] = set()


def test_the_machines_met_every_case_they_check() -> None:
    # After both machines (definition order): a check that never met its case proves nothing.
    if {"SchedulerMachine", "FifoSchedulerMachine"} != MACHINES_RUN:
        pytest.skip("the scheduler machines did not both run in this session")
    for case in ("in_flight above a limit that fell", "provider ejected", "provider on trial", "a trial job"):
        assert SEEN_CASES[case], f"the machines never met: {case} ({dict(SEEN_CASES)})"


# --- the known defects, one deterministic scenario each -------------------------------------------------


class Scene:
    """A scenario written out step by step on the machine's Fleet: what each job was handed is read
    from the node streams, as the machine reads it."""

    def __init__(self, redis: Redis, config: cfg.Config, providers: Mapping[str, Spec]) -> None:
        self.fleet = Fleet(redis, Setup.of(config))
        self.specs = dict(providers)
        self.runs: dict[str, Run] = {}
        self.replies: list[tuple[str, events.Event]] = []

    async def start(self) -> None:
        await self.fleet.start()
        for pid in sorted(self.specs):
            await self.fleet.heartbeat(pid, True)
        await self.sync()

    async def sync(self) -> Snapshot:
        seen = await self.fleet.observe(sorted(self.specs))
        self.runs.update((r.a.job, r) for r in seen.runs)
        self.replies += seen.replies
        return seen.snap

    async def submit(self, job: str, model: str = "m1", endpoint: str = CHAT, tenant: str | None = None,
                     pin: str | None = None) -> str:
        """``pin``: a follow-up of a stored Response (endpoint responses) that provider made."""
        t = self.fleet.tenants.by_name[tenant] if tenant else None
        endpoint = RESPONSES if pin else endpoint
        lane = self.fleet.lane(model, endpoint, pin, t.band if t else None)
        assert lane is not None
        result = await self.fleet.submit(t.job_id(job) if t else job, lane, endpoint, pin is not None, t)
        await self.sync()
        return str(result.status)

    def on(self, job: str) -> str | None:
        """The provider the job was last handed to (None: never dispatched)."""
        run = self.runs.get(job)
        return None if run is None else run.a.provider

    async def finish(self, job: str, mode: FinishMode = "done") -> str:
        outcome = await self.fleet.finish(self.runs[job], mode)
        await self.sync()
        return outcome

    async def reload(self, config: cfg.Config, providers: Mapping[str, Spec]) -> None:
        """Every process switches to ``config``, as the machine's reload does: removed providers
        are marked so with the old plans, the others heartbeated with the new ones, then the
        reaper's next round."""
        old = self.fleet.use(Setup.of(config))
        for pid in sorted(set(self.specs) - set(providers)):
            await self.fleet.removed(pid, old)
        self.specs = {**self.specs, **providers}
        for pid in sorted(providers):
            await self.fleet.heartbeat(pid, True)
        await self.fleet.reaper_round()
        await self.sync()


SceneMaker = Callable[[cfg.Config, Mapping[str, Spec]], Scene]


@pytest.fixture
def scene(any_redis: Redis) -> SceneMaker:
    return lambda config, providers: Scene(any_redis, config, providers)


CHAT_ONLY = Spec("n1", 1, (CHAT,), ("m1",))
RERANKING = Spec("n1", 1, (CHAT, RERANK), ("m1",))


@pytest.mark.anyio
@pytest.mark.parametrize("change", [
    "provider removed",
    "provider added",
    "band renamed",
])
async def test_defect1_jobs_waiting_in_a_lane_a_reload_renamed_are_still_served(scene: SceneMaker, change: str) -> None:
    if change != "band renamed":
        # a serves chat only: rerank has its own lane. Removing c renames it from "b,c" to "b"
        # (a key no plan pumps any more); adding c renames it from "b" to "b,c" (and "b" is now
        # only the lane of jobs pinned to b, so the rerank jobs there wait for b alone).
        with_c = {"a": CHAT_ONLY, "b": RERANKING, "c": RERANKING}
        without_c = {"a": CHAT_ONLY, "b": RERANKING}
        before, after = (with_c, without_c) if change == "provider removed" else (without_c, with_c)
        s = scene(make_config(before), before)
        await s.start()
        jobs = ("r1", "r2", "r3") if change == "provider removed" else ("r1", "r3")
        for job in jobs:
            await s.submit(job, endpoint=RERANK)
        assert s.on("r3") is None
        busy, waiting = next(j for j in jobs if s.on(j) == "b"), "r3"
        await s.reload(make_config(after), after)
    else:
        bands, tenants = ("interactive", "standard", "batch"), {"t": {"priority": "batch"}, "u": {}}
        one = {"b": RERANKING}
        s = scene(make_config(one, tenants=tenants, bands=bands), one)
        await s.start()
        for job in ("r1", "r3"):
            await s.submit(job, tenant="t")
        busy, waiting = "t~r1", "t~r3"
        assert s.on(waiting) is None
        renamed = {**tenants, "t": {"priority": "bulk"}}
        await s.reload(make_config(one, tenants=renamed, bands=("interactive", "standard", "bulk")), one)
    if change == "provider added":
        # c is idle and serves rerank: the job that has waited since before the reload takes it.
        assert s.on(waiting) == "c"
        return
    assert await s.finish(busy) == "released"
    # b is free: the job that has waited since before the reload takes it.
    assert s.on(waiting) == "b"


@pytest.mark.anyio
async def test_defect1_a_job_pinned_to_a_provider_a_reload_removes_is_answered(scene: SceneMaker) -> None:
    both = {"b": RERANKING, "c": Spec("n1", 1, (CHAT, RESPONSES), ("m1",))}
    s = scene(make_config(both), both)
    await s.start()
    await s.submit("busy", pin="c")
    await s.submit("pinned", pin="c")  # a follow-up of a Response stored on c, which is busy
    assert (s.on("busy"), s.on("pinned")) == ("c", None)
    await s.reload(make_config({"b": RERANKING}), {"b": RERANKING})
    # Its Response lives on a provider that is gone: it cannot run anywhere, so it is answered
    # (503) rather than left waiting in a lane nothing pumps any more.
    snap = await s.sync()
    assert "pinned" not in snap.records, f"waits in {snap.where.get('pinned')}"
    assert any(job == "pinned" and isinstance(event, Failed) for job, event in s.replies)


@pytest.mark.anyio
@pytest.mark.parametrize("back", ["requeued", "unparked"])
async def test_defect1_a_job_coming_back_after_a_reload_goes_to_a_lane_that_is_pumped(
    scene: SceneMaker, back: str,
) -> None:
    # Tenant t is in the batch band; a reload renames the band (its lanes' keys go away).
    bands, tenants = ("interactive", "standard", "batch"), {"t": {"priority": "batch", "max_in_flight": 1}, "u": {}}
    one = {"b": Spec("n1", 2, (CHAT,), ("m1",))}
    s = scene(make_config(one, tenants=tenants, bands=bands), one)
    await s.start()
    await s.submit("x", tenant="t")  # running: t is at its max_in_flight
    await s.submit("y", tenant="t")  # parked (with the key of the lane it goes back to)
    assert (s.on("t~x"), s.on("t~y")) == ("b", None)
    renamed = {**tenants, "t": {"priority": "bulk", "max_in_flight": 1}}
    await s.reload(make_config(one, tenants=renamed, bands=("interactive", "standard", "bulk")), one)
    handed = dict(s.runs)
    if back == "requeued":
        # x's worker shuts down before any output: x goes back to its lane, and b is free.
        assert await s.finish("t~x", "requeue") == "requeued"
        coming_back = "t~x"
    else:
        # x ends: t is under its cap again, y comes back to its lane, and b is free.
        assert await s.finish("t~x") == "released"
        coming_back = "t~y"
    snap = await s.sync()
    run = s.runs.get(coming_back)
    assert run is not handed.get(coming_back), f"waits in {snap.lane_of(coming_back)}"
    assert run is not None
    assert run.a.provider == "b"


@pytest.mark.anyio
@known_defect("wrong_endpoint_after_reload", "defect 2: a provider a reload adds gets an endpoint it does not serve")
async def test_defect2_a_reload_adding_a_provider_never_sends_it_an_endpoint_it_does_not_serve(
    scene: SceneMaker,
) -> None:
    # b and c both serve rerank: rerank jobs wait in the lane of all providers, {iop}:q:m1.
    before = {"b": RERANKING, "c": RERANKING}
    s = scene(make_config(before), before)
    await s.start()
    for job in ("r1", "r2", "r3"):
        await s.submit(job, endpoint=RERANK)
    assert s.on("r3") is None
    # A reload adds a, which serves chat only; its first heartbeat pumps that lane.
    after = {**before, "a": CHAT_ONLY}
    await s.reload(make_config(after), after)
    assert s.on("r3") is None, "a rerank job went to a, which serves chat only"
    assert await s.finish("r1") == "released"
    assert s.on("r3") == s.on("r1")


@pytest.mark.anyio
@known_defect("retry_blocks_lane", "defect 3: a retried head blocks its lane while a provider idles")
async def test_defect3_a_retried_job_does_not_hold_up_its_lane_while_a_provider_idles(scene: SceneMaker) -> None:
    both = {"a": CHAT_ONLY, "b": CHAT_ONLY}
    s = scene(make_config(both), both)
    await s.start()
    for job in ("j", "k", "l"):
        await s.submit(job)
    failing = s.on("j")
    assert await s.finish("j", "retry") == "requeued"
    # j waits for the other provider (busy with k); l, behind it, may take the one j excludes.
    assert s.on("l") == failing


@pytest.mark.anyio
@known_defect("weights_strict_across_lanes", "defect 4: weights become strict priority across lanes")
async def test_defect4_weights_hold_across_lanes(scene: SceneMaker) -> None:
    """Invariant 7: one provider serves m1 and m2; tenant A (weight 2) floods m1, B (weight 1)
    floods m2: of the next 30 slots A gets about 20, B about 10."""
    one = {"p": Spec("n1", 1, (CHAT,), ("m1", "m2"))}
    s = scene(make_config(one, tenants={"A": {"weight": 2}, "B": {"weight": 1}}), one)
    await s.start()
    for i in range(40):
        await s.submit(f"a{i}", "m1", tenant="A")
        await s.submit(f"b{i}", "m2", tenant="B")
    (running,) = s.runs
    order = []
    for _ in range(30):
        before = set(s.runs)
        await s.finish(running)
        (running,) = set(s.runs) - before
        order.append(running.partition("~")[0])
    assert 18 <= order.count("A") <= 22, order


@pytest.mark.anyio
@known_defect("tenant_cap_lookahead", "defect 5: a capped tenant idles capacity beyond the look-ahead of 64")
async def test_defect5_a_capped_tenant_does_not_idle_capacity_beyond_the_look_ahead(scene: SceneMaker) -> None:
    one = {"p": Spec("n1", 3, (CHAT,), ("m1",))}
    s = scene(make_config(one, tenants={"A": {"weight": 100, "max_in_flight": 1}, "B": {"weight": 1}}), one)
    await s.start()
    for job, tenant in [("a0", "A"), ("b0", "B"), *((f"a{i}", "A") for i in range(1, 100)), ("b1", "B")]:
        await s.submit(job, tenant=tenant)
    # A runs a0 and is at its max_in_flight; B runs b0. B's second job's tag (1) is behind A's 99
    # waiting jobs (0.01 .. 0.99), which may not run: the third slot is free, and b1 may use it.
    assert sorted(s.runs) == ["A~a0", "B~b0", "B~b1"]


@pytest.mark.anyio
@known_defect("cap_release_not_pumped", "defect 6: a release taking a tenant under its cap pumps no other lane")
async def test_defect6_a_tenant_back_under_its_cap_gets_idle_capacity_at_once(scene: SceneMaker) -> None:
    two = {"p1": Spec("n1", 1, (CHAT,), ("m1",)), "p2": Spec("n1", 1, (CHAT,), ("m2",))}
    s = scene(make_config(two, tenants={"A": {"max_in_flight": 1}, "B": {}}), two)
    await s.start()
    await s.submit("x", "m1", tenant="A")
    await s.submit("y", "m2", tenant="A")
    assert (s.on("A~x"), s.on("A~y")) == ("p1", None)  # A is at its cap; p2 idles
    assert await s.finish("A~x") == "released"
    # A is under its cap again: its m2 job takes the idle p2 now, not at p2's next heartbeat.
    assert s.on("A~y") == "p2"


@pytest.mark.anyio
@known_defect("blocked_head_cancel_not_pumped", "defect 7: cancelling a blocked head pumps nothing")
async def test_defect7_cancelling_a_blocked_head_lets_the_next_job_take_the_idle_provider(scene: SceneMaker) -> None:
    both = {"a": CHAT_ONLY, "b": CHAT_ONLY}
    s = scene(make_config(both), both)
    await s.start()
    for job in ("j", "k", "l"):
        await s.submit(job)
    failing = s.on("j")
    assert await s.finish("j", "retry") == "requeued"
    # j's client leaves: whatever j held up, l takes the provider j excluded.
    assert await s.fleet.cancel("j", keys.queue("m1"), CancelReason.CLIENT) == "removed"
    await s.sync()
    assert s.on("l") == failing


@pytest.mark.anyio
async def test_defect8_a_tenant_under_its_cap_has_no_runnable_job_left_parked(scene: SceneMaker) -> None:
    two = {"b": Spec("n1", 2, (CHAT, RESPONSES), ("m1", "m2")), "c": Spec("n1", 1, (CHAT, RESPONSES), ("m1",))}
    s = scene(make_config(two, tenants={"A": {"max_in_flight": 1}, "B": {}}), two)
    await s.start()
    await s.submit("y", "m1", tenant="B", pin="c")  # c is full
    await s.submit("x", "m2", tenant="A")  # on b: A is at its cap
    await s.submit("p", "m1", tenant="A", pin="c")  # for c, which is busy
    await s.submit("q", "m2", tenant="A")  # for b, which has a free slot
    assert (s.on("B~y"), s.on("A~x"), s.on("A~p"), s.on("A~q")) == ("c", "b", None, None)
    assert await s.finish("A~x") == "released"
    # A may run one job again: p cannot (c is busy), q can, on b.
    assert s.on("A~q") == "b"


@pytest.mark.anyio
@known_defect("parked_submit_says_dispatched", "defect 9: a submit parked at once answers 'dispatched'")
async def test_defect9_a_submit_parked_at_once_answers_queued(scene: SceneMaker) -> None:
    one = {"p": Spec("n1", 2, (CHAT,), ("m1",))}
    s = scene(make_config(one, tenants={"A": {"max_in_flight": 1}, "B": {}}), one)
    await s.start()
    assert await s.submit("x", tenant="A") == "dispatched"
    # A is at its max_in_flight: its next job waits (its API arms the queue deadline).
    assert await s.submit("y", tenant="A") == "queued"
    assert s.on("A~y") is None


@pytest.mark.anyio
@known_defect("rehomed_cancel_leaves_entry", "defect 10: a job moved by the reaper, then cancelled, stays queued")
async def test_defect10_a_job_moved_by_the_reaper_leaves_nothing_behind_when_cancelled(scene: SceneMaker) -> None:
    bands, tenants = ("interactive", "standard", "batch"), {"t": {"priority": "batch"}, "u": {}}
    one = {"b": RERANKING}
    s = scene(make_config(one, tenants=tenants, bands=bands), one)
    await s.start()
    for job in ("r1", "r3"):
        await s.submit(job, tenant="t")
    submitted_to = keys.queue("m1", "#batch")
    assert await s.fleet.redis.zscore(submitted_to, "t~r3") is not None
    renamed = {**tenants, "t": {"priority": "bulk"}}
    await s.reload(make_config(one, tenants=renamed, bands=("interactive", "standard", "bulk")), one)
    # The reaper moved t~r3 out of the band's old key; its client leaves, and its API names the
    # queue it submitted to, as it does.
    assert await s.fleet.cancel("t~r3", submitted_to, CancelReason.CLIENT) == "removed"
    snap = await s.sync()
    assert "t~r3" not in snap.records
    assert "t~r3" not in snap.where, f"still in {snap.where.get('t~r3')}"


@pytest.mark.anyio
@known_defect("parked_while_under_cap", "defect 8: a job stays parked while its tenant runs nothing")
async def test_defect8_a_parked_job_comes_back_when_the_job_brought_back_instead_leaves(scene: SceneMaker) -> None:
    two = {"p1": Spec("n1", 1, (CHAT,), ("m1",)), "p2": Spec("n1", 1, (CHAT,), ("m2",))}
    s = scene(make_config(two, tenants={"A": {"max_in_flight": 1}, "B": {}}), two)
    await s.start()
    await s.submit("b", "m2", tenant="B")  # p2 is busy
    await s.submit("x", "m1", tenant="A")  # on p1: A is at its cap
    await s.submit("y", "m2", tenant="A")
    await s.submit("z", "m2", tenant="A")
    assert (s.on("B~b"), s.on("A~x"), s.on("A~y"), s.on("A~z")) == ("p2", "p1", None, None)
    assert await s.finish("A~x") == "released"  # A may run one again; p2 is still busy
    assert await s.fleet.cancel("A~y", keys.queue("m2"), CancelReason.CLIENT) == "removed"
    assert await s.finish("B~b") == "released"
    # A runs nothing, p2 is free: z takes it.
    assert s.on("A~z") == "p2"
