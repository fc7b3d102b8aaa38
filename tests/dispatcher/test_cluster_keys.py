"""Cluster-safe keys (issue 6, item 3): every script touches only keys it was given in
KEYS, and every key iop uses carries the one hash tag ``{iop}``.

A scenario drives every script through the real callers (``ApiSide``, ``WorkerSide``,
``Reaper``) while a ``MONITOR`` connection of its own records every command the server
runs. The script calls are sequential, so in the monitor stream the commands a script
runs (client ``lua``) come right after its ``EVALSHA``. For each of those inner
commands the server itself says which of its arguments are keys (``COMMAND GETKEYS``);
each must be one of that ``EVALSHA``'s KEYS and start with ``{iop}:``. Afterwards every
key left in Redis must start with ``{iop}:`` too. Runs on every available Redis.

The MONITOR recorder is tests/dispatcher/monitor.py (``tests/e2e/test_scale.py`` uses it too).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import anyio
import pytest
from redis import Redis as SyncRedis
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from dispatcher import config as cfg
from dispatcher import events, keys, wire
from dispatcher.control import Actor, CapacityBody, Control, FallbacksBody, audit_once
from dispatcher.events import Assignment, Meta, Start
from dispatcher.live import LiveSample
from dispatcher.reaper import Reaper
from dispatcher.script_calls import Abort, AbortReason, CancelReason
from dispatcher.scripts import NAMES, Scripts
from dispatcher.worker_side import WorkerSide
from iop.redis_server import RedisServer
from tests.dispatcher.harness import Harness
from tests.dispatcher.monitor import Command, MonitorRecorder, parse_line
from workers.adapters.model_runtime import RuntimeModels
from workers.model_lifecycle import report_of

pytestmark = pytest.mark.anyio

TAG = f"{keys.PREFIX}:"


@dataclass
class ScriptCall:
    """A top-level EVALSHA/EVAL and the commands it ran."""

    sha: str
    keys: tuple[str, ...]
    inner: list[Command]


def script_calls(commands: list[Command]) -> Iterator[ScriptCall]:
    """Group the stream: each EVALSHA/EVAL of a client, then the ``lua`` commands after it."""
    current: ScriptCall | None = None
    for cmd in commands:
        if cmd.lua:
            assert current is not None, f"a script command with no script before it: {cmd}"
            current.inner.append(cmd)
            continue
        if current is not None:
            yield current
            current = None
        if cmd.name in ("EVALSHA", "EVAL"):
            sha = cmd.text(1)
            if cmd.name == "EVAL":
                sha = hashlib.sha1(cmd.args[1]).hexdigest()
            numkeys = int(cmd.args[2])
            current = ScriptCall(sha, tuple(a.decode() for a in cmd.args[3:3 + numkeys]), [])
    if current is not None:
        yield current


# Commands a script may run that take no keys (GETKEYS refuses them).
KEYLESS = {"TIME", "PUBLISH"}


async def command_keys(redis: Redis, cmd: Command) -> list[str] | None:
    """The keys of a command, as the server sees them; None for a command without keys."""
    try:
        found = await redis.command_getkeys(*cmd.args)
    except ResponseError as exc:
        if "no key arguments" in str(exc) or "wrong number of arguments" in str(exc):
            return None
        raise
    return [k.decode() if isinstance(k, bytes) else str(k) for k in found]


# --- the scenario ------------------------------------------------------------------------------

CONFIG = {
    "queue": {"queue_timeout_ms": 60_000},
    # One 5xx another provider answered instead ejects: the scenario's finish reaches lib/eject.lua.
    "ejection": {"consecutive_5xx": 1},
    "nodes": [
        {"id": "n1", "providers": [
            {"id": "a", "type": "vllm", "base_url": "http://127.0.0.1:1", "capacity": 1,
             "models": ["m1@a", "m3@a"]},
            {"id": "b", "type": "vllm", "base_url": "http://127.0.0.1:2", "capacity": 2,
             "models": ["m1@b", "m2@b"]},
        ]},
        {"id": "n2", "providers": [
            {"id": "c", "type": "ollama", "base_url": "http://127.0.0.1:3", "capacity": 1,
             "models": ["m1@c", "m2@c"], "lifecycle": "managed"},
        ]},
    ],
    "models": [
        {"id": "m1", "providers": {"a": "m1@a", "b": "m1@b", "c": "m1@c"}},
        {"id": "m2", "providers": {"b": "m2@b", "c": "m2@c"}},
        {"id": "m3", "providers": {"a": "m3@a"}, "queue_timeout_ms": 50},
    ],
}


class Scenario:
    def __init__(self, redis: Redis) -> None:
        self.config = cfg.parse(CONFIG).config
        self.h = Harness(redis, self.config)
        self.redis = redis
        self.n1 = self.h.node
        self.n2 = WorkerSide(lambda: self.h.calls, redis, "n2")
        self.reaper = Reaper(self.h.calls, redis, "reaper-1")
        self.outcomes: list[tuple[str, Any]] = []

    def note(self, what: str, outcome: Any) -> Any:
        self.outcomes.append((what, outcome))
        return outcome

    async def up(self, pid: str, health: str = "available") -> None:
        node, prov = next((n, p) for n, p in self.config.providers() if p.id == pid)
        slots = self.n1 if node.id == "n1" else self.n2
        self.note(f"heartbeat {pid} {health}",
                  await slots.heartbeat(pid, health, [("capacity", prov.capacity), ("node", node.id)]))

    async def running(self) -> dict[str, Assignment]:
        out: dict[str, Assignment] = {}
        for node in ("n1", "n2"):
            entries = cast(list[tuple[bytes, dict[bytes, bytes]]], await self.redis.xrange(keys.node(node)))
            for eid, fields in entries:
                a = Assignment.from_entry(eid, fields)
                out[a.job] = a
        return out

    def slots_of(self, a: Assignment) -> WorkerSide:
        return self.n1 if a.provider in ("a", "b") else self.n2

    async def submit(self, model: str) -> tuple[str, str]:
        job, status = await self.h.submit(model)
        self.note(f"submit {model}", status)
        return job, status

    async def finish(self, job: str, **kw: Any) -> str:
        a = (await self.running())[job]
        return str(self.note(f"finish {job[:6]} {kw}", await self.slots_of(a).finish(a, b"final", **kw)))

    async def expire_lease(self, job: str) -> None:
        await self.redis.zadd(keys.LEASES, {job: 1})

    async def reap(self) -> dict[str, int]:
        """A reaper round's lease step (the round opened by reap_round, as run_once does)."""
        round_ = self.note("reap round", await self.reaper.open_round())
        assert round_.gap_ms == 0, "the scenario's first round was opened at its start"
        return await self.reaper.reap_leases(round_.now_ms)

    async def run(self) -> None:
        h, api = self.h, self.h.api
        await Scripts(self.redis).load()
        self.note("replica", await api.heartbeat())
        await self.n1.ensure_group()
        await self.n2.ensure_group()
        for pid in ("a", "b", "c"):
            await self.up(pid)
        self.note("first round", await self.reaper.open_round())

        # submit: dispatched until every slot is taken, then queued.
        jobs = [await self.submit("m1") for _ in range(5)]
        assert [s for _, s in jobs] == ["dispatched"] * 4 + ["queued"]
        waiting_m1 = jobs[4][0]
        run = await self.running()
        by_provider: dict[str, list[str]] = {}
        for a in run.values():
            by_provider.setdefault(a.provider, []).append(a.job)
        assert sorted(len(v) for v in by_provider.values()) == [1, 1, 2]

        # emit + renew.
        on_a = by_provider["a"][0]
        assert await self.n1.emit(run[on_a], events.encode(Start(Meta("a", "n1", "m1@a", 0), 200, [b"{}"]))) == "ok"
        self.note("renew n1", await self.n1.renew([(j, run[j].fence) for j in by_provider["a"] + by_provider["b"]]))
        self.note("renew n2", await self.n2.renew([(j, run[j].fence) for j in by_provider["c"]]))

        # finish: release + pump hands the slot of b to the waiting m1 job.
        answered = LiveSample(e2e_ms=80.0, ttft_ms=20.0)
        assert await self.finish(by_provider["b"][0], live=answered, tokens=12) == "released"
        self.note("live figures", await self.n1.flush_live())
        assert waiting_m1 in await self.running()

        # cancel of a waiting job: timeout before its deadline waits, the client's removes.
        queued_m2, status = await self.submit("m2")
        assert status == "queued"
        cancelled = await api.cancel(queued_m2, keys.queue("m2"), CancelReason.TIMEOUT)
        assert self.note("cancel wait", cancelled.outcome) == "wait"
        cancelled = await api.cancel(queued_m2, keys.queue("m2"), CancelReason.CLIENT)
        assert self.note("cancel queued", cancelled.outcome) == "removed"
        cancelled = await api.cancel(queued_m2, keys.queue("m2"), CancelReason.CLIENT)
        assert self.note("cancel gone", cancelled.outcome) == "gone"

        # cancel of a running job: a timeout keeps it, the client's tells its node; then it
        # finishes and the slot goes to a waiting m2 job.
        waiting_m2, status = await self.submit("m2")
        assert status == "queued"
        on_c = by_provider["c"][0]
        cancelled = await api.cancel(on_c, keys.queue("m1"), CancelReason.TIMEOUT)
        assert self.note("cancel running", cancelled.outcome) == "running"
        cancelled = await api.cancel(on_c, keys.queue("m1"), CancelReason.CLIENT)
        assert self.note("cancel client", cancelled.outcome) == "cancelling"
        assert self.note("renew cancelled", await self.n2.renew([(on_c, run[on_c].fence)])) == [
            Abort(on_c, run[on_c].fence, AbortReason.CANCELLED)]
        assert await self.finish(on_c) == "released"
        assert waiting_m2 in await self.running()

        # A job that expires in its queue: dropped by the next pump, then collected.
        late, status = await self.submit("m3")
        assert status == "queued"
        await anyio.sleep(0.12)
        assert await self.finish(on_a) == "released"  # pumps m1 and m3: m3's head expired
        assert (await h.record(late)).state == "x"
        cancelled = await api.cancel(late, keys.queue("m3"), CancelReason.TIMEOUT)
        assert self.note("cancel expired", cancelled.outcome) == "expired"

        # reap_lease: a lease without output is requeued (and dispatched again) ...
        run = await self.running()
        victim = next(j for j, a in run.items() if a.provider == "b")
        await self.expire_lease(victim)
        assert self.note("reap requeue", await self.reap()) == {"requeued": 1}
        # ... and one whose output reached its client fails.
        run = await self.running()
        streamed = run[victim]
        assert streamed.attempt == 2
        assert await self.slots_of(streamed).emit(streamed, b"start") == "ok"
        await self.expire_lease(victim)
        assert self.note("reap failed", await self.reap()) == {"failed": 1}

        # finish with requeue: a worker gives a job back unfinished.
        run = await self.running()
        givenup = next(iter(run))
        assert await self.finish(givenup, mode="requeue") == "requeued"

        # finish with retry: m1's provider failed a job before any output; it waits for
        # another provider of its lane (m1 has three).
        for job, a in (await self.running()).items():
            if a.model == "m1":
                await self.finish(job)
        failed, status = await self.submit("m1")
        assert status == "dispatched"
        tried = (await self.running())[failed].provider
        assert await self.finish(failed, mode="retry") == "requeued"
        assert (await self.running())[failed].provider != tried

        # remember_response, then a job pinned to that provider (the lane of one).
        made = next(iter((await self.running()).values()))
        await self.slots_of(made).remember_response("resp_1", made)
        stored = await api.stored_response("resp_1")
        assert stored is not None
        assert stored.provider == made.provider
        lane = h.calls.plans.pinned_lane(made.model, made.provider)
        assert lane is not None
        pinned = await api.submit("pinned-job", lane, b'{"model":"x"}', "responses", False, pinned=True)
        self.note("submit pinned", pinned.status)

        # reconcile: an in_flight out of step with the leases is corrected.
        await h.set_in_flight("a", 1 - await h.in_flight("a"))
        self.note("reconcile", await self.reaper.reconcile())
        assert self.outcomes[-1][1].in_flight, "reconcile corrected nothing"

        # A provider that goes away, and comes back: its heartbeat pumps a waiting job.
        for job, a in (await self.running()).items():
            if a.provider == "c":
                await self.finish(job)
        await self.up("c", "unavailable")
        for _ in range(3):
            if (await self.submit("m2"))[1] == "queued":
                break
        await self.up("c")
        assert self.outcomes[-1][1] == 1, self.outcomes[-4:]

        # An operator drains c, then resumes it (which pumps its lanes).
        assert self.note("drain c", await h.calls.drain("c", "drain")).mark is not None
        assert self.note("resume c", await h.calls.drain("c", "resume")).mark is None

        # A reload renamed a lane: a job waiting in the old key moves to its lane now.
        for _ in range(8):
            moved, status = await self.submit("m2")
            if status == "queued":
                break
        assert status == "queued"
        score = await self.redis.zscore(keys.queue("m2"), moved)
        await self.redis.zrem(keys.queue("m2"), moved)
        await self.redis.zadd(keys.queue("m2", "gone"), {moved: score})
        assert self.note("rehome", await self.reaper.rehome()) == 1

        # A reload removed the provider a waiting job is pinned to: it is answered (lua/abandon.lua).
        for _ in range(8):
            pinned, status = await self.submit("m2")
            if status == "queued":
                break
        assert status == "queued"
        score = await self.redis.zscore(keys.queue("m2"), pinned)
        await self.redis.zrem(keys.queue("m2"), pinned)
        await self.redis.zadd(keys.queue("m2", "gone"), {pinned: score})
        rec = json.loads(await self.redis.hget(keys.JOBS, pinned))
        await self.redis.hset(keys.JOBS, pinned, json.dumps({**rec, "pin": "gone", "lane": "gone"}))
        await self.redis.hset(keys.provider("gone"), "removed", 1)
        self.note("abandon", await self.reaper.rehome())
        assert await h.record(pinned) is None

        # A lane a release brought parked jobs back to, pumped on its own (lua/wake.lua).
        plan = h.calls.plans.by_queue[keys.queue("m2")]
        ks, head = plan.args(keys.PUMP_KEYS, h.config.dispatch.lease_ms)
        self.note("wake", await h.calls.scripts.wake(ks, head))

        # A worker publishes what it learned of c's load (lua/capacity.lua).
        self.note("capacity c", await self.n2.publish_capacity(
            "c", wire.CapacityReport(capacity=2, mode="auto", external=1, reason="test", moved=True)))
        # c's worker reads what its runtime holds (lua/models.lua: c's models iop manages), then
        # reports a load's end (lua/load_done.lua); each pumps c's lanes.
        c = next(p for _, p in self.config.providers() if p.id == "c")
        held = RuntimeModels(states={"m1@c": "loaded", "m2@c": "unloaded"}, max_loaded=1)
        self.note("models c", await h.calls.models("c", report_of(self.config, c, held)))
        done = wire.LoadOutcome(provider="c", served="m2@c", ok=True, load_ms=5)
        self.note("loaded c", await h.calls.load_done("c", done))
        # An operator's overrides (lua/override.lua): a provider's capacity (its lanes pumped),
        # a model's fallbacks (the empty plan), one lapsed; a load ordered (lua/model_order.lua);
        # a reload audited (lua/audit.lua).
        control = Control(h.calls, self.redis)
        self.note("capacity override c", await control.set_capacity("c", CapacityBody(capacity=1), Actor("ops")))
        self.note("fallbacks override m1", await control.set_fallbacks("m1", FallbacksBody([]), Actor("ops")))
        self.note("capacity clear c", await control.clear_capacity("c", Actor("ops")))
        self.note("lapse m1", await control.lapse("fallbacks", "m1"))
        self.note("load c", await control.model_order("c", "m1@c", "unload", Actor("ops")))
        self.note("reload", await audit_once(h.calls, "reload", "config", "a", "b", "iop", "reload", once_digest="b"))
        # A 5xx, then the same request answered by another provider: the first is blamed, and
        # ejected (lib/evidence.lua, lib/eject.lua read the lane's other providers).
        for job in list(await self.running()):
            await self.finish(job)
        failing, status = await self.submit("m1")
        assert status == "dispatched"
        first = (await self.running())[failing].provider
        assert await self.finish(failing, mode="retry", verdict="500") == "requeued"
        assert await self.finish(failing, verdict="ok") == "released"
        assert await self.redis.hget(keys.provider(first), "ej_trial") == b"1"

        # A dead replica: the reaper cancels its jobs (waiting and running ones).
        extra, _ = await self.submit("m1")
        await self.redis.zadd(keys.REPLICAS, {"rep1": 1})
        self.note("reap replica", await self.reaper.reap_replicas(await self.reaper.now_ms()))
        assert await h.record(extra) is None or (await h.record(extra)).state == "c"
        # A full reaper round too (lock, leases, replicas, orphans, reconcile, consumers,
        # refusals: the heartbeat TTL after the first round moved into the past).
        await self.redis.hset(keys.REAPER_SEEN, "judge", 0)
        self.note("round", await self.reaper.run_once())

        # Drain: finish whatever still runs; nothing may be held afterwards.
        for job in list(await self.running()):
            await self.finish(job)
        for pid in ("a", "b", "c"):
            assert await h.in_flight(pid) == 0, pid
        assert await self.redis.zcard(keys.LEASES) == 0


@pytest.fixture
def monitored(any_redis_server: RedisServer, any_redis: Redis) -> Iterator[MonitorRecorder]:
    recorder = MonitorRecorder(any_redis_server.url)
    yield recorder
    if recorder.is_alive():  # the test failed before ending it
        SyncRedis.from_url(any_redis_server.url).echo(recorder.marker)
        recorder.join(10)


async def test_every_script_touches_only_its_keys_under_one_tag(any_redis: Redis, monitored: MonitorRecorder) -> None:
    scenario = Scenario(any_redis)
    shas = {getattr(Scripts(any_redis), name).sha: name for name in NAMES}
    monitored.begin()
    await scenario.run()
    await any_redis.echo(monitored.marker)
    commands = monitored.end()

    calls = list(script_calls(commands))
    seen: dict[str, int] = {}
    checked = 0
    for call in calls:
        assert call.sha in shas, f"an unknown script ran: {call.sha}"
        name = shas[call.sha]
        seen[name] = seen.get(name, 0) + 1
        for key in call.keys:
            assert key.startswith(TAG), (name, key)
        for inner in call.inner:
            if inner.name in KEYLESS:
                if inner.name == "PUBLISH":  # not a key, but under the tag all the same
                    assert inner.text(1).startswith(TAG), (name, inner)
                continue
            touched = await command_keys(any_redis, inner)
            assert touched, f"{name}: no keys for {inner}"
            for key in touched:
                assert key.startswith(TAG), (name, inner)
                assert key in call.keys, f"{name} touched {key!r}, not in its KEYS {call.keys}: {inner}"
                checked += 1
    # Every script ran, and ran commands.
    assert set(seen) == set(NAMES), (sorted(set(NAMES) - set(seen)), scenario.outcomes)
    assert checked > 100

    # The plain commands of the callers (reaper scans, test helpers) stay under the tag too.
    for cmd in commands:
        if cmd.lua or cmd.name in ("EVALSHA", "EVAL", "SCRIPT", "ECHO", "HELLO", "PING", "CLIENT", "FLUSHALL"):
            continue
        for key in await command_keys(any_redis, cmd) or []:
            assert key.startswith(TAG), cmd

    # Everything the scenario left behind is under the tag.
    leftover = [k.decode() async for k in any_redis.scan_iter(count=1000)]
    assert leftover, "the scenario created no keys?"
    assert [k for k in leftover if not k.startswith(TAG)] == []


def test_monitor_lines_parse_back_to_their_arguments() -> None:
    raw = rb'1700000000.123456 [0 lua] "XADD" "{iop}:n:n1" "*" "b" "{\"a\": \"x y\"}\n\\\x01\xc3\xa9"'
    cmd = parse_line(raw)
    assert cmd.lua
    assert cmd.args == (b"XADD", b"{iop}:n:n1", b"*", b"b", b'{"a": "x y"}\n\\\x01\xc3\xa9')
    top = parse_line(b'1.5 [0 127.0.0.1:5555] "EVALSHA" "abc" "2" "k1" "k2" "v"')
    assert not top.lua
    assert top.client == "127.0.0.1:5555"
    (call,) = script_calls([top, cmd])
    assert call.keys == ("k1", "k2")
    assert call.inner == [cmd]
