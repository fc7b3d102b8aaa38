"""A model-based test of models that load and unload under dispatch: Hypothesis drives the real
Lua scripts (submit, finish, heartbeat, lua/models.lua, lua/load_done.lua) through
``ScriptCalls`` against real redis-servers (every available version), and a small model of the
runtimes (what each holds, obeying iop's orders) checks the invariants after every step.

The world: managed providers ``a`` (capacity 2, one model at a time, unload_idle_s 0) and
``b`` (capacity 1, two at a time, unload_idle_s one hour), and a static ``c`` (capacity 1,
model m1 only); models m1, m2, m3. Steps: requests; runs answered; a worker carrying out the
load ordered on its provider (done, or failed by the runtime); a worker's reading of its
runtime (``lua/models.lua``); a runtime unloading an idle model by itself (Ollama's
keep_alive), read at once; a worker dying mid-load (its order's time runs out); service
times measured (which let a second copy be placed); every provider's heartbeat (which pumps
all lanes).

Invariants (each ``inv_*`` says what it demands), after every step: a job runs on a managed
provider only where its runtime holds its model; each model's running count equals its live
leases; no runtime holds more than its max_loaded models; an order's evicted model runs
nothing there; at most one order per provider. After every provider's heartbeat: a job whose
model is loaded nowhere and being loaded nowhere waits only while no provider could take the
load (``inv_no_placement_left_undone``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from redis.asyncio import Redis

from dispatcher import config as cfg
from dispatcher import events, keys, wire
from dispatcher.events import Assignment, Done, Meta
from dispatcher.plans import Plans
from dispatcher.script_calls import ScriptCalls
from dispatcher.scripts import Scripts
from iop.redis_server import RedisServer
from workers.adapters.model_runtime import RuntimeModels
from workers.model_lifecycle import report_of

T = TypeVar("T")

LONG_MS = 3_600_000
MODELS = ("m1", "m2", "m3")
MANAGED = {"a": {"capacity": 2, "max_loaded": 1, "unload_idle_s": 0},
           "b": {"capacity": 1, "max_loaded": 2, "unload_idle_s": 3600}}
REPLICA = "rep1"
SEEN: Counter[str] = Counter()


def world() -> cfg.Config:
    providers = [
        {"id": pid, "type": "ollama", "lifecycle": "managed", "base_url": "http://127.0.0.1:1", "models": list(MODELS),
         "load_s": 5,
         **opts} for pid, opts in MANAGED.items()
    ] + [{"id": "c", "type": "vllm", "base_url": "http://127.0.0.1:1", "capacity": 1, "models": ["m1"]}]
    return cfg.parse({
        "queue": {"max_queue": 1000, "queue_timeout_ms": LONG_MS},
        "dispatch": {"lease_ms": LONG_MS, "heartbeat_ttl_ms": LONG_MS},
        "nodes": [{"id": "n1", "providers": providers}],
        "models": [{"id": m, "providers": {p["id"]: m for p in providers if m in p["models"]}} for m in MODELS],
    }).config


CONFIG = world()
PROVIDERS = tuple(p.id for _, p in CONFIG.providers())


@dataclass
class Runtime:
    """What a managed provider's runtime holds: it obeys iop's orders, and may unload an idle
    model by itself."""

    loaded: set[str] = field(default_factory=set)


class PlacementMachine(RuleBasedStateMachine):
    loop: asyncio.AbstractEventLoop
    redis: Redis

    def __init__(self) -> None:
        super().__init__()
        self.ids = itertools.count(1)
        self.runtimes = {pid: Runtime() for pid in MANAGED}
        self.running: dict[str, Assignment] = {}  # job -> its node stream entry
        self.last_stream_id = "0-0"

    def run(self, coro: Awaitable[T]) -> T:
        return self.loop.run_until_complete(coro)

    # --- set-up and observation

    @initialize(held=st.fixed_dictionaries({pid: st.sets(st.sampled_from(MODELS), max_size=opts["max_loaded"])
                                            for pid, opts in MANAGED.items()}))
    def start(self, held: dict[str, set[str]]) -> None:
        self.run(self.redis.flushall())
        self.calls = ScriptCalls(Scripts(self.redis), CONFIG, Plans(CONFIG))
        for pid, models in held.items():
            self.runtimes[pid].loaded = set(models)
        for pid in PROVIDERS:
            self.run(self.heartbeat(pid))
        for pid in MANAGED:
            self.run(self.read(pid))
        self.observe()

    async def heartbeat(self, pid: str) -> int:
        prov = next(p for _, p in CONFIG.providers() if p.id == pid)
        return await self.calls.heartbeat(pid, "available", [("capacity", prov.capacity), ("node", "n1")])

    async def read(self, pid: str) -> int:
        """The worker's reading of the runtime (lua/models.lua)."""
        prov = next(p for _, p in CONFIG.providers() if p.id == pid)
        states = {m: "loaded" if m in self.runtimes[pid].loaded else "unloaded" for m in MODELS}
        return await self.calls.models(pid, report_of(CONFIG, prov, RuntimeModels(states=states)))

    def observe(self) -> None:
        """The runs the node's worker was handed since the last look."""
        entries = self.run(self.redis.xrange(keys.node("n1"), min=f"({self.last_stream_id}"
                                             if self.last_stream_id != "0-0" else "-"))
        for entry_id, fields in entries:
            self.last_stream_id = entry_id.decode()
            a = Assignment.from_entry(entry_id, fields)
            self.running[a.job] = a
            SEEN["dispatch to a managed provider" if a.provider in MANAGED else "dispatch to the static one"] += 1

    def fields(self, pid: str) -> dict[str, str]:
        raw = self.run(self.redis.hgetall(keys.provider(pid)))
        return {k.decode(): v.decode() for k, v in raw.items()}

    def order(self, pid: str) -> tuple[str, str]:
        f = self.fields(pid)
        return f.get("load", ""), f.get("load_evict", "")

    # --- steps

    @rule(model=st.sampled_from(MODELS), n=st.integers(1, 3))
    def requests(self, model: str, n: int) -> None:
        lane = self.calls.plans.main_lane(model)
        for _ in range(n):
            self.run(self.calls.submit(f"j{next(self.ids)}", lane, REPLICA, b"{}", "chat/completions", False))
        self.observe()

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def answered(self, data: st.DataObject) -> None:
        job = data.draw(st.sampled_from(sorted(self.running)))
        a = self.running.pop(job)
        event = events.encode(Done(Meta(a.provider, "n1", a.target, a.queue_ms, a.attempt), 200, b"{}"))
        self.run(self.calls.finish(a, "n1", event, mode="done"))
        self.observe()

    def ordered(self) -> list[str]:
        return [pid for pid in sorted(MANAGED) if hasattr(self, "calls") and self.order(pid)[0]]

    @precondition(lambda self: self.ordered())
    @rule(data=st.data(), fails=st.integers(0, 3))
    def carry_out(self, data: st.DataObject, fails: int) -> None:
        """A worker carries out the order on its provider: done, or (one time in four) failed."""
        pid = data.draw(st.sampled_from(self.ordered()))
        ok = fails > 0
        served, evict = self.order(pid)
        rt = self.runtimes[pid]
        rt.loaded.discard(evict)
        if ok:
            rt.loaded.add(served)
            SEEN["load done"] += 1
        else:
            SEEN["load failed"] += 1
        outcome = wire.LoadOutcome(provider=pid, served=served, ok=ok, load_ms=800 if ok else 0,
                                   reason="" if ok else "out of memory", evict=evict, evicted=bool(evict))
        self.run(self.calls.load_done(pid, outcome))
        self.observe()

    @rule(pid=st.sampled_from(sorted(MANAGED)))
    def reading(self, pid: str) -> None:
        self.run(self.read(pid))
        self.observe()

    @rule(pid=st.sampled_from(sorted(MANAGED)), data=st.data())
    def runtime_unloads_an_idle_model(self, pid: str, data: st.DataObject) -> None:
        """keep_alive ran out for a model nothing runs on: the runtime unloads it, and the
        worker's next reading (this step) says so."""
        busy = {a.target for a in self.running.values() if a.provider == pid}
        served, _ = self.order(pid)
        idle = sorted(self.runtimes[pid].loaded - busy - {served})
        if not idle:
            return
        self.runtimes[pid].loaded.discard(data.draw(st.sampled_from(idle)))
        SEEN["runtime unloaded by itself"] += 1
        self.run(self.read(pid))
        self.observe()

    @rule(pid=st.sampled_from(sorted(MANAGED)))
    def worker_dies_mid_load(self, pid: str) -> None:
        """The order's worker died: its time runs out, and another worker reads the runtime."""
        if not self.order(pid)[0]:
            return
        SEEN["order lapsed"] += 1
        self.run(self.redis.hset(keys.provider(pid), "load_until", 1))
        self.run(self.read(pid))
        self.observe()

    @rule(pid=st.sampled_from(PROVIDERS), ms=st.sampled_from([500, 4000, 20000]))
    def service_time(self, pid: str, ms: int) -> None:
        """The capacity loop publishes its calls' median time (lua/capacity.lua svc_ms)."""
        self.run(self.redis.hset(keys.provider(pid), "svc_ms", ms))

    @rule()
    def heartbeats(self) -> None:
        for pid in PROVIDERS:
            self.run(self.heartbeat(pid))
        self.observe()
        self.check_placement()

    # --- invariants

    def leases(self) -> dict[str, dict[str, Any]]:
        jobs = [j.decode() for j in self.run(self.redis.zrange(keys.LEASES, 0, -1))]
        recs = self.run(self.redis.hmget(keys.JOBS, jobs)) if jobs else []
        return {j: json.loads(r) for j, r in zip(jobs, recs, strict=True) if r}

    @invariant()
    def inv_runs_only_where_the_model_is_loaded(self) -> None:
        """A job runs on a managed provider only where its runtime holds its model."""
        if not hasattr(self, "calls"):
            return
        for job, a in self.running.items():
            if a.provider in MANAGED:
                assert a.target in self.runtimes[a.provider].loaded, (job, a.provider, a.target, self.runtimes)

    @invariant()
    def inv_running_counts_equal_leases(self) -> None:
        """Each managed model's running count (mr:) equals its live leases there."""
        if not hasattr(self, "calls"):
            return
        want: Counter[tuple[str, str]] = Counter()
        for rec in self.leases().values():
            if rec.get("managed"):
                want[(rec["provider"], rec["target"])] += 1
        for pid in MANAGED:
            f = self.fields(pid)
            for m in MODELS:
                assert int(f.get(f"mr:{m}", "0")) == want[(pid, m)], (pid, m, f.get(f"mr:{m}"), want)

    @invariant()
    def inv_within_max_loaded_and_one_order(self) -> None:
        """No runtime holds more than its max_loaded models, counting one being loaded; an
        order's evicted model runs nothing there and takes no request."""
        if not hasattr(self, "calls"):
            return
        for pid, opts in MANAGED.items():
            served, evict = self.order(pid)
            held = self.runtimes[pid].loaded | ({served} if served else set())
            assert len(held - ({evict} if evict else set())) <= opts["max_loaded"], (pid, held, evict)
            if evict:
                SEEN["eviction ordered"] += 1
                assert not any(a.provider == pid and a.target == evict for a in self.running.values())
                assert self.fields(pid).get(f"ms:{evict}") == "unloading"

    def check_placement(self) -> None:
        """After every provider's heartbeat (which pumps every lane): a job whose model no
        provider holds nor loads waits only while no managed provider could take its load --
        each has an order in force, or is backing off that model, or has no room (every model
        it holds runs a job or has one waiting, or, on b, was used or loaded within its hour)."""
        waiting: set[str] = set()
        for m in MODELS:
            if self.run(self.redis.zcard(keys.queue(m))):
                waiting.add(m)
        now = int(self.run(self.redis.time())[0]) * 1000
        for m in sorted(waiting):
            # c, static, always holds m1: a copy, whose wait the law weighs (test_model_placement.py).
            copies = ["c"] if m == "m1" else []
            copies += [p for p in MANAGED if self.fields(p).get(f"ms:{m}") in ("loaded", "loading")]
            if copies:
                continue
            SEEN["model loaded nowhere waits"] += 1
            for pid, opts in MANAGED.items():
                f = self.fields(pid)
                if f.get("load") or int(f.get(f"mf:{m}", "0")) > now:
                    continue
                held = [x for x in MODELS if f.get(f"ms:{x}") in ("loaded", "loading", "unloading")]
                if len(held) < opts["max_loaded"]:
                    raise AssertionError(f"{m} waits, loaded nowhere, and {pid} has a free model slot: {f}")
                for x in held:
                    if f.get(f"ms:{x}") != "loaded" or int(f.get(f"mr:{x}", "0")) > 0 or x in waiting:
                        continue
                    if opts["unload_idle_s"] == 0:
                        raise AssertionError(f"{m} waits, loaded nowhere, and {pid} could unload idle {x}: {f}")


EXAMPLES = int(os.environ.get("IOP_SCHEDULER_EXAMPLES", "0"))


@pytest.mark.timeout(600)
def test_placement_model(any_redis_server: RedisServer) -> None:
    SEEN.clear()
    loop = asyncio.new_event_loop()
    redis = Redis.from_url(any_redis_server.url)
    runner = type("PlacementMachine", (PlacementMachine,), {"loop": loop, "redis": redis})
    try:
        run_state_machine_as_test(runner, settings=settings(
            max_examples=EXAMPLES or 60, stateful_step_count=40, deadline=None, derandomize=True, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], report_multiple_bugs=False))
    finally:
        loop.run_until_complete(redis.aclose())
        loop.close()
        print("cases met:", dict(SEEN))
    for case in ("dispatch to a managed provider", "load done", "load failed", "eviction ordered",
                 "model loaded nowhere waits", "runtime unloaded by itself", "order lapsed"):
        assert SEEN[case], f"the machine never met: {case} ({dict(SEEN)})"
