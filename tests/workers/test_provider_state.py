"""What a worker publishes of its providers (workers/provider_state.py), against a private
redis-server: the heartbeat scripts write each provider's hash, read back here.

Probes go to the project's fake provider (iop.fake_provider) where what is tested is what
a real probe finds, and to counting stand-in adapters where it is whether (and which)
probe was made: a provider is busy the way another worker's dispatch makes it, through
its ``in_flight`` in Redis, or through a run of this worker.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError

from dispatcher import keys
from dispatcher.config import Config, ProviderConfig, parse
from dispatcher.events import Assignment
from dispatcher.exceptions import ProviderRejected
from dispatcher.scripts import Scripts
from dispatcher.worker_side import WorkerSide
from iop.fake_provider import FakeOptions, start
from iop.redis_server import RedisServer, free_port
from tests.waiting import EVENTUALLY_S, eventually
from workers.adapters import probes
from workers.adapters.base import Adapter, ProbeResult, ProviderCall, Sink
from workers.leases import Runs
from workers.provider_state import ProviderState
from workers.runtime import NodeRuntime, ProviderAdapters

pytestmark = pytest.mark.anyio

HOST = "127.0.0.1"
NODE = "n1"
WORKER = "worker-a"
HEARTBEAT_MS = 30
PROBE_MS = 60


@pytest.fixture(autouse=True)
def _nothing_remembered() -> None:
    """Which path answers for health is remembered per server root; ports are reused."""
    probes._no_health.clear()
    probes._slots_source.clear()
    probes._health_seen.clear()


def make_config(redis_url: str, *providers: dict[str, Any], **dispatch: Any) -> Config:
    return parse({
        "redis": {"url": redis_url},
        "models": [{"id": "m", "providers": {p["id"]: "t" for p in providers}}],
        "nodes": [{"id": NODE, "providers": list(providers)}],
        "dispatch": {"heartbeat_interval_ms": HEARTBEAT_MS, "heartbeat_ttl_ms": 2000, "probe_interval_ms": PROBE_MS,
                     "probe_timeout_ms": 1000, **dispatch},
    }).config


def provider(pid: str, url: str = "http://127.0.0.1:9", provider_type: str = "openai_api") -> dict[str, Any]:
    return {"id": pid, "type": provider_type, "base_url": url, "models": ["t"], "capacity": 2}


class Counting(Adapter):
    """Answers its probes with ``result`` (and ``busy_result`` while busy), counting them; a
    whole probe takes ``delay_s``."""

    def __init__(self, provider: ProviderConfig, result: ProbeResult, busy_result: ProbeResult | None = None,
                 delay_s: float = 0.0) -> None:
        super().__init__(provider)
        self.result = result
        self.delay_s = delay_s
        self.busy_result = busy_result
        self.probes = 0
        self.busy_probes = 0

    async def call(self, call: ProviderCall, sink: Sink) -> None:
        raise NotImplementedError

    async def probe(self, timeout_s: float) -> ProbeResult:
        self.probes += 1
        await anyio.sleep(self.delay_s)
        return self.result

    async def probe_while_busy(self, timeout_s: float) -> ProbeResult | None:
        self.busy_probes += 1
        return self.busy_result


@dataclass
class Published:
    """The part under test, what it runs with, and Redis to read what it wrote."""

    state: ProviderState
    adapters: ProviderAdapters
    runs: Runs
    redis: Redis
    runtime: list[NodeRuntime]  # [the current one]: a test may swap it, as a reload does
    side: WorkerSide
    scripts: Scripts

    async def hash(self, pid: str) -> dict[str, str]:
        raw: dict[bytes, bytes] = await self.redis.hgetall(keys.provider(pid))  # type: ignore[assignment]
        return {k.decode(): v.decode() for k, v in raw.items()}

    async def until(self, pid: str, check: Callable[[dict[str, str]], bool]) -> dict[str, str]:
        return await eventually(lambda: self.hash(pid), check, what=f"{pid}'s hash")

    async def health_is(self, pid: str, health: str, reason: str = "") -> dict[str, str]:
        return await self.until(pid, lambda h: h.get("health") == health and h.get("reason", "").startswith(reason))

    async def heartbeats(self, pid: str, count: int) -> None:
        """Until ``count`` more heartbeats of ``pid`` were written."""
        for _ in range(count):
            before = (await self.hash(pid)).get("hb_ms")
            await self.until(pid, lambda h, before=before: h.get("hb_ms") != before)  # type: ignore[misc]


Publishing = Callable[..., Awaitable[Any]]


@pytest.fixture
async def publish(redis_server: RedisServer, redis: Redis) -> AsyncIterator[Publishing]:
    """``publish(config, stand_ins)``: a running ProviderState for the node of ``config``,
    its adapters real ones unless ``stand_ins`` gives some."""
    control = Redis.from_url(redis_server.url)
    scripts = Scripts(control)
    await scripts.load()
    made: list[ProviderAdapters] = []

    async with anyio.create_task_group() as tg:

        async def publishing(config: Config, stand_ins: dict[str, Adapter] | None = None,
                             on_back: Callable[[str, int | None], None] | None = None) -> Published:
            runtime = NodeRuntime.build(config, NODE, scripts)
            assert runtime is not None
            current = [runtime]
            adapters = ProviderAdapters()
            made.append(adapters)
            adapters.open(runtime.node)
            adapters.current.update(stand_ins or {})
            runs = Runs(keep_s=60)
            side = WorkerSide(lambda: current[0].calls, control, NODE)
            state = ProviderState(lambda: current[0], adapters, runs, side, control, config.dispatch, WORKER,
                                  on_back=on_back)
            tg.start_soon(state.run)
            return Published(state, adapters, runs, redis, current, side, scripts)

        try:
            yield publishing
        finally:
            tg.cancel_scope.cancel()
    for adapters in made:
        await adapters.aclose()
    await control.aclose()


@pytest.fixture
async def fake() -> AsyncIterator[tuple[str, FakeOptions]]:
    options = FakeOptions(models=["t"])
    port = free_port()
    runner = await start(HOST, port, options)
    try:
        yield f"http://{HOST}:{port}", options
    finally:
        await runner.cleanup()


def job_on(pid: str) -> Assignment:
    return Assignment(entry_id="1-0", job="j1", fence=1, provider=pid, target="t", model="m", lane="", replica="r1",
                      endpoint="chat/completions", stream=False, attempt=1, submitted_ms=0, dispatched_ms=0,
                      body=b"")


# --------------------------------------------------------------------------- probes and heartbeats


async def test_a_provider_is_published_with_what_its_probe_found(
    publish: Publishing, redis_server: RedisServer, fake: tuple[str, FakeOptions]
) -> None:
    url, _ = fake
    p = await publish(make_config(redis_server.url, provider("p", url)))
    found = await p.health_is("p", "available")
    assert found["node"] == NODE
    assert found["type"] == "openai_api"
    assert found["capacity"] == "2"
    assert json.loads(found["models"]) == ["t"]
    assert json.loads(found["reported_models"]) == ["t"]  # from the fake's model list
    assert found["worker"] == WORKER
    assert found["reason"] == ""
    assert p.state.health["p"].healthy


async def test_a_provider_failing_its_probe_is_unavailable_until_it_passes_again(
    publish: Publishing, redis_server: RedisServer, fake: tuple[str, FakeOptions]
) -> None:
    url, options = fake
    options.healthy = False
    p = await publish(make_config(redis_server.url, provider("p", url)))
    found = await p.health_is("p", "unavailable")
    assert "503" in found["reason"]
    options.healthy = True
    await p.health_is("p", "available")


async def test_a_provider_back_after_being_down_is_told_once_with_slots_that_changed(
    publish: Publishing, redis_server: RedisServer
) -> None:
    # A learned capacity starts over then (workers/capacity_control.py provider_back).
    cfg = make_config(redis_server.url, provider("p"))
    stand_in = Counting(cfg.nodes[0].providers[0], ProbeResult(True, slots=4))
    told: list[tuple[str, int | None]] = []
    p = await publish(cfg, {"p": stand_in}, on_back=lambda pid, slots: told.append((pid, slots)))
    await p.health_is("p", "available")
    assert told == []  # its first verdict is no return
    for slots in (4, 8):
        stand_in.result = ProbeResult(False, "down")
        await p.health_is("p", "unavailable", "down")
        stand_in.result = ProbeResult(True, slots=slots)
        await p.health_is("p", "available")
        await p.heartbeats("p", 3)
    # Back with the slots it had: none to tell; then with others: those.
    assert told == [("p", None), ("p", 8)]


async def test_heartbeats_that_fail_are_logged_until_one_lands_again(
    publish: Publishing, redis_server: RedisServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = make_config(redis_server.url, provider("p"))
    p = await publish(cfg, {"p": Counting(cfg.nodes[0].providers[0], ProbeResult(True))})
    await p.heartbeats("p", 1)
    real = p.side.heartbeat
    away = True

    async def heartbeat(*args: Any) -> int:
        if away:
            raise ConnectionError("Redis away")
        landed: int = await real(*args)
        return landed

    caplog.set_level(logging.INFO, "iop.worker")
    monkeypatch.setattr(p.side, "heartbeat", heartbeat)
    await eventually(lambda: caplog.text.count("heartbeat of p failed: Redis away") >= 2, what="failures logged")
    assert "land again" not in caplog.text
    away = False
    await p.heartbeats("p", 1)
    await eventually(lambda: re.search(r"heartbeats of p land again, [0-9.]+ s after the first that failed",
                                       caplog.text), what="the recovery logged")


async def test_a_turn_that_outlasts_half_the_heartbeat_ttl_is_logged(
    publish: Publishing, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "iop.worker")
    cfg = make_config(redis_server.url, provider("p"))
    slow = Counting(cfg.nodes[0].providers[0], ProbeResult(True), delay_s=1.2)  # the heartbeat TTL here is 2 s
    p = await publish(cfg, {"p": slow})
    await p.heartbeats("p", 1)
    await eventually(lambda: re.search(r"probe and heartbeat of p took 1\.[2-9] s \(heartbeat TTL 2\.0 s\)",
                                       caplog.text), what="the slow turn logged")


async def test_a_busy_provider_gets_only_its_harmless_probe(publish: Publishing, redis_server: RedisServer,
                                                           redis: Redis) -> None:
    cfg = make_config(redis_server.url, provider("p"), busy_probe_interval_ms=PROBE_MS)
    stand_in = Counting(cfg.nodes[0].providers[0], ProbeResult(True, models=["t"]), ProbeResult(True))
    await redis.hset(keys.provider("p"), "in_flight", 1)  # another worker's job runs on it
    p = await publish(cfg, {"p": stand_in})
    await p.health_is("p", "available")
    await p.heartbeats("p", 8)
    assert stand_in.probes == 0
    assert stand_in.busy_probes >= 1

    await redis.hset(keys.provider("p"), "in_flight", 0)
    # Idle again: the whole probe, and what it found in the heartbeat after it (the count
    # moves as the probe begins, before the heartbeat writes).
    found = await p.until("p", lambda h: stand_in.probes >= 1 and h.get("reported_models") == json.dumps(["t"]))
    assert found["health"] == "available"


async def test_a_run_of_this_worker_makes_its_provider_busy(publish: Publishing, redis_server: RedisServer) -> None:
    cfg = make_config(redis_server.url, provider("p"))
    stand_in = Counting(cfg.nodes[0].providers[0], ProbeResult(True))  # no harmless probe: none while busy
    p = await publish(cfg, {"p": stand_in})
    await p.health_is("p", "available")
    running = p.runs.start(job_on("p"))
    probes_before = stand_in.probes
    await p.heartbeats("p", 8)  # several probe intervals
    assert stand_in.probes <= probes_before + 1  # at most the one begun before the run
    p.runs.end(running)
    await p.until("p", lambda _: stand_in.probes > probes_before + 1)


# --------------------------------------------------------------------------- calls as the signal


async def test_a_failed_call_takes_the_provider_out_and_an_answered_one_brings_it_back(
    publish: Publishing, redis_server: RedisServer, redis: Redis
) -> None:
    cfg = make_config(redis_server.url, provider("p"))
    stand_in = Counting(cfg.nodes[0].providers[0], ProbeResult(True, models=["t"]))
    p = await publish(cfg, {"p": stand_in})
    await p.health_is("p", "available")
    await redis.hset(keys.provider("p"), "in_flight", 1)  # busy, and no harmless probe: calls alone tell
    await p.heartbeats("p", 2)

    error = ProviderRejected(502, b"boom", provider="p")
    p.state.call_failed("p", error)
    found = await p.health_is("p", "unavailable", str(error))
    assert found["reported_models"] == json.dumps(["t"])  # what the whole probe found stays
    p.state.answered("p")
    await p.health_is("p", "available")


async def test_an_answered_call_does_not_overrule_a_failed_probe(
    publish: Publishing, redis_server: RedisServer, redis: Redis
) -> None:
    cfg = make_config(redis_server.url, provider("p"))
    stand_in = Counting(cfg.nodes[0].providers[0], ProbeResult(False, "probe says no"))
    p = await publish(cfg, {"p": stand_in})
    await p.health_is("p", "unavailable", "probe says no")
    p.state.answered("p")
    assert not p.state.health["p"].healthy
    await p.heartbeats("p", 2)
    assert (await p.hash("p"))["health"] == "unavailable"


async def test_a_failed_call_asks_for_a_probe_once_the_provider_is_idle(
    publish: Publishing, redis_server: RedisServer
) -> None:
    # Probes so seldom that only probe_now explains a second one within the test.
    cfg = make_config(redis_server.url, provider("p"), probe_interval_ms=600_000, heartbeat_ttl_ms=700_000)
    stand_in = Counting(cfg.nodes[0].providers[0], ProbeResult(True))
    p = await publish(cfg, {"p": stand_in})
    await p.health_is("p", "available")
    assert stand_in.probes == 1
    p.state.call_failed("p", ProviderRejected(503, b"down", provider="p"))
    await p.health_is("p", "unavailable")
    p.state.probe_now("p")  # what a job does once released
    await p.health_is("p", "available")
    assert stand_in.probes == 2


async def test_a_call_failure_of_a_provider_not_served_is_ignored(publish: Publishing,
                                                                 redis_server: RedisServer) -> None:
    cfg = make_config(redis_server.url, provider("p"))
    p = await publish(cfg, {"p": Counting(cfg.nodes[0].providers[0], ProbeResult(True))})
    await p.health_is("p", "available")
    p.state.call_failed("gone", ProviderRejected(502, b"boom", provider="gone"))
    assert "gone" not in p.state.health


# --------------------------------------------------------------------------- reloads and stop


async def test_providers_come_and_go_with_reloads(publish: Publishing, redis_server: RedisServer) -> None:
    cfg = make_config(redis_server.url, provider("a"), provider("b"))
    a = Counting(cfg.nodes[0].providers[0], ProbeResult(True))
    b = Counting(cfg.nodes[0].providers[1], ProbeResult(True))
    p = await publish(cfg, {"a": a, "b": b})
    await p.health_is("a", "available")
    await p.health_is("b", "available")

    # Removed: its loop ends, nothing of it is kept.
    p.state.forget("a")
    p.adapters.retire("a")
    assert "a" not in p.state.health
    last = (await p.hash("a")).get("hb_ms")
    probes_of_a = a.probes
    await p.heartbeats("b", 6)
    assert (await p.hash("a")).get("hb_ms") == last
    assert a.probes == probes_of_a

    # Added: published at once, with the new config's description.
    new = make_config(redis_server.url, provider("b"), provider("c"))
    runtime = NodeRuntime.build(new, NODE, p.scripts)
    assert runtime is not None
    p.runtime[0] = runtime
    p.adapters.current["c"] = Counting(new.nodes[0].providers[1], ProbeResult(True))
    p.state.start("c")
    found = await p.health_is("c", "available")
    assert found["node"] == NODE


async def test_stop_ends_every_loop(publish: Publishing, redis_server: RedisServer) -> None:
    cfg = make_config(redis_server.url, provider("p"))
    stand_in = Counting(cfg.nodes[0].providers[0], ProbeResult(True))
    p = await publish(cfg, {"p": stand_in})
    await p.health_is("p", "available")
    p.state.stop()
    last = (await p.hash("p")).get("hb_ms")
    probes = stand_in.probes
    # Another provider's loop would have heartbeat several times meanwhile.
    other_cfg = make_config(redis_server.url, provider("q"))
    q = await publish(other_cfg, {"q": Counting(other_cfg.nodes[0].providers[0], ProbeResult(True))})
    await q.heartbeats("q", 6)
    assert (await p.hash("p")).get("hb_ms") == last
    assert stand_in.probes == probes


async def test_a_state_stopped_before_it_runs_publishes_nothing(redis_server: RedisServer, redis: Redis) -> None:
    cfg = make_config(redis_server.url, provider("p"))
    scripts = Scripts(redis)
    runtime = NodeRuntime.build(cfg, NODE, scripts)
    assert runtime is not None
    adapters = ProviderAdapters()
    adapters.current["p"] = Counting(cfg.nodes[0].providers[0], ProbeResult(True))
    state = ProviderState(lambda: runtime, adapters, Runs(keep_s=60), WorkerSide(lambda: runtime.calls, redis, NODE),
                          redis, cfg.dispatch, WORKER)
    state.stop()
    with anyio.fail_after(EVENTUALLY_S):
        await state.run()
    assert await redis.exists(keys.provider("p")) == 0
