"""A worker's reading of its providers' load, and what it publishes (workers/capacity_control.py):
a real ``Worker`` in the test's event loop against a private redis-server, in front of an
upstream served by the test (aiohttp) that reports its engine's load as vLLM does. iop's own
load on the provider is played the way dispatch makes it: its ``in_flight`` in Redis, and a
job waiting in its lane."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest
from aiohttp import web
from redis.asyncio import Redis

from dispatcher import keys, qualifications
from dispatcher.catalog import read_catalog
from dispatcher.config import parse
from dispatcher.qualifications import CapacitySeed
from iop.redis_server import RedisServer, free_port
from tests.waiting import eventually
from workers.adapters import probes
from workers.capacity import Change, LimitController
from workers.worker import Worker

pytestmark = pytest.mark.anyio

HOST = "127.0.0.1"
PROVIDER = "p"
SERVED = "served-model"


@dataclass
class Engine:
    """A vLLM-shaped server whose engine load the test sets; ``metrics`` off: /metrics is 404."""

    running: int = 0
    waiting: int = 0
    kv: float = 0.1
    metrics: bool = True
    has_health: bool = True
    healthy: bool = True
    slots: int | None = None  # llama-server's /props total_slots, when set
    seen: list[str] = field(default_factory=list)
    url: str = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.seen.append(request.path)
        if request.path == "/health" and self.has_health:
            return web.json_response({}, status=200 if self.healthy else 503)
        if request.path == "/props" and self.slots is not None:
            return web.json_response({"total_slots": self.slots})
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": SERVED, "object": "model"}]})
        if request.path == "/metrics" and self.metrics:
            text = (f'vllm:num_requests_running{{model_name="{SERVED}"}} {self.running}\n'
                    f'vllm:num_requests_waiting{{model_name="{SERVED}"}} {self.waiting}\n'
                    f'vllm:kv_cache_usage_perc{{model_name="{SERVED}"}} {self.kv}\n')
            return web.Response(text=text, content_type="text/plain")
        return web.json_response({"detail": "Not Found"}, status=404)


@pytest.fixture(autouse=True)
def _nothing_remembered() -> None:
    probes._no_health.clear()
    probes._slots_source.clear()
    probes._health_seen.clear()


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    up = Engine()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", up.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, HOST, port).start()
    up.url = f"http://{HOST}:{port}"
    try:
        yield up
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def serving(redis_server: RedisServer, engine: Engine, provider_type: str = "vllm",
                  **provider: Any) -> AsyncIterator[Worker]:
    config = parse({
        "redis": {"url": redis_server.url},
        "models": [{"id": "m", "providers": {PROVIDER: SERVED}}],
        "nodes": [{"id": "n1", "providers": [{"id": PROVIDER, "type": provider_type, "base_url": engine.url,
                                              "models": [SERVED], "timeout_s": 10, **provider}]}],
        "dispatch": {"heartbeat_interval_ms": 100, "heartbeat_ttl_ms": 2000, "probe_interval_ms": 200,
                     "probe_timeout_ms": 1000, "drain_grace_s": 0},
    }).config
    worker = Worker(config, "n1")
    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.run)
        try:
            yield worker
        finally:
            worker.stop()


async def fields(redis: Redis) -> dict[str, str]:
    raw: dict[bytes, bytes] = await redis.hgetall(keys.provider(PROVIDER))  # type: ignore[assignment]
    return {k.decode(): v.decode() for k, v in raw.items()}


async def until(redis: Redis, what: str, predicate: Any) -> dict[str, str]:
    return await eventually(lambda: fields(redis), predicate, what=what, every=0.05)


async def busy(redis: Redis, in_flight: int, backlog: bool = True) -> None:
    """iop runs ``in_flight`` requests there (another worker's dispatches: a record and a
    lease each, which the reaper's reconcile counts), and more wait."""
    async with redis.pipeline(transaction=True) as pipe:
        pipe.delete(keys.LEASES)
        for i in range(in_flight):
            job = f"running-{i}"
            pipe.hset(keys.JOBS, job, json.dumps({"model": "m", "replica": "r", "state": "d", "provider": PROVIDER}))
            pipe.zadd(keys.LEASES, {job: 2**50})
        pipe.hset(keys.provider(PROVIDER), "in_flight", in_flight)
        await pipe.execute()
    if backlog:
        await redis.zadd(keys.queue("m"), {"waiting-job": 1})
    else:
        await redis.delete(keys.queue("m"))


async def test_a_learned_capacity_falls_to_what_the_engine_runs_when_it_queues(
        redis: Redis, redis_server: RedisServer, engine: Engine) -> None:
    async with serving(redis_server, engine, capacity="auto", min_capacity=1, max_capacity=16):
        first = await until(redis, "published", lambda f: f.get("capacity_mode") == "auto")
        assert first["capacity"] == "2"  # the safe start
        # iop fills its two slots and more wait; the engine keeps up: the limit rises.
        engine.running, engine.waiting = 2, 0
        await busy(redis, 2)
        risen = await until(redis, "risen", lambda f: int(f["capacity"]) > 2)
        assert "engine queue 0" in risen["cap_reason"]
        # The engine queues at 1 running (its batch shrank, or its KV filled): the limit falls to it.
        limit = int(risen["capacity"])
        engine.running, engine.waiting = 1, 3
        await busy(redis, limit)
        fallen = await until(redis, "fallen", lambda f: f["capacity"] == "1")
        assert fallen["cap_reason"].startswith("engine queue 3 at 1 running")
        assert fallen["cap_reason"].endswith(f": {limit} → 1")
        config = parse({"models": [{"id": "m", "providers": {PROVIDER: SERVED}}],
                        "nodes": [{"id": "n1", "providers": [{"id": PROVIDER, "type": "vllm", "base_url": engine.url,
                                                              "models": [SERVED], "capacity": "auto"}]}]}).config
        view = (await read_catalog(redis, config)).providers[0]
        assert view.capacity_mode == "auto"
        assert view.capacity == 1
        assert view.capacity_bounds == [1, 64]
        assert view.capacity_reason.startswith("engine queue 3 at 1 running")
        assert view.engine is not None
        assert view.engine.waiting == 3
        assert [x[1] for x in view.capacity_history][-1] == 1


async def test_a_full_share_the_engine_runs_unqueued_rises_with_nothing_waiting_in_iop(
        redis: Redis, redis_server: RedisServer, engine: Engine) -> None:
    """Routing sends the next job to a provider with a slot free, so a full provider shows no
    backlog: the engine running the whole limit with nothing queued is the proof a rise needs."""
    async with serving(redis_server, engine, capacity="auto", min_capacity=1, max_capacity=16):
        await until(redis, "published", lambda f: f.get("capacity_mode") == "auto")
        engine.running, engine.waiting = 2, 0
        await busy(redis, 2, backlog=False)
        risen = await until(redis, "risen", lambda f: int(f["capacity"]) > 2)
        assert risen["cap_reason"] == f"engine queue 0, every slot busy: 2 → {risen['capacity']}"


async def test_an_engine_busy_with_other_clients_is_read_as_busy_and_its_limit_rises(
        redis: Redis, redis_server: RedisServer, engine: Engine) -> None:
    """Another client runs three there, none of them iop's: routing counts them against the
    provider, so at a limit of 2 iop sends it nothing. The engine is read at the busy pace
    all the same, and what it runs unqueued is proof enough for the limit to rise."""
    async with serving(redis_server, engine, capacity="auto", min_capacity=1, max_capacity=16):
        await until(redis, "published", lambda f: f.get("capacity_mode") == "auto")
        engine.seen.clear()
        await anyio.sleep(2.0)
        idle = engine.seen.count("/metrics")
        engine.running, engine.waiting = 3, 0
        await until(redis, "busy", lambda f: '"running":3' in f.get("engine", ""))
        engine.seen.clear()
        await anyio.sleep(2.0)
        busy = engine.seen.count("/metrics")
        assert idle <= 3, idle  # once a second
        assert busy >= 5, busy  # four times a second
        risen = await until(redis, "risen", lambda f: int(f["capacity"]) > 2)
        assert risen["cap_reason"].startswith("engine queue 0, every slot busy")


async def test_requests_refused_for_want_of_time_count_as_demand(
        redis: Redis, redis_server: RedisServer, engine: Engine,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Load shedding keeps the queue empty: the refusals lua/submit.lua counts per queue
    (keys.shed_field) are demand past the limit, which a rise on latency alone needs. One is
    enough, whenever it lands between two ticks (the worker reads twice per tick: one seen at
    a reading that was not a tick once went uncounted). What the worker tells its controller
    is read off its ticks."""
    demand: list[bool] = []
    tick = LimitController.tick

    def recording(ctl: LimitController, now: float, backlog: bool, external: int) -> Change | None:
        demand.append(backlog)
        return tick(ctl, now, backlog, external)

    monkeypatch.setattr(LimitController, "tick", recording)
    async with serving(redis_server, engine, capacity="auto", min_capacity=1, max_capacity=16):
        await until(redis, "published", lambda f: f.get("capacity_mode") == "auto")
        await busy(redis, 2, backlog=False)
        for _ in range(3):
            await anyio.sleep(1.0)
            assert demand  # the worker ticked
            assert not any(demand), demand  # nothing waits, nothing refused
            await redis.hincrby(keys.QUEUE_RATES, keys.shed_field(keys.queue("m")), 1)
            await eventually(lambda: list(demand), any, what="a tick with demand", every=0.05)
            await anyio.sleep(0.6)  # past the next tick: a refusal counts once
            demand.clear()


async def test_an_engine_back_after_being_down_with_other_slots_starts_from_them(
        redis: Redis, redis_server: RedisServer, engine: Engine) -> None:
    # A new engine process: what was learned of the old one (its holds, a batch cap) goes,
    # and a new --parallel is where the limit starts again (workers/capacity.py restarted).
    engine.slots = 4
    async with serving(redis_server, engine, "llamacpp", capacity="auto", max_capacity=16):
        await until(redis, "published", lambda f: f.get("capacity_mode") == "auto" and f.get("slots") == "4")
        engine.healthy = False
        await until(redis, "down", lambda f: f.get("health") == "unavailable")
        engine.slots, engine.healthy = 8, True
        back = await until(redis, "back", lambda f: f.get("cap_reason", "").startswith("back after being down"))
        assert back["cap_reason"].startswith("back after being down, its slots 8: ")
        assert back["capacity"] == "8"


async def test_a_provider_resumed_after_a_drain_is_learned_afresh(
        redis: Redis, redis_server: RedisServer, engine: Engine) -> None:
    # Drain, restart the engine, resume (docs/OPERATIONS.md): a restart quicker than a probe
    # shows nowhere else, so the resume is taken as one (workers/capacity.py restarted).
    async with serving(redis_server, engine, capacity="auto", min_capacity=1, max_capacity=16) as worker:
        await until(redis, "published", lambda f: f.get("capacity_mode") == "auto")
        engine.running, engine.waiting = 1, 3
        await busy(redis, 2)
        await until(redis, "fallen", lambda f: f["capacity"] == "1")
        controller = worker.capacity.loads[PROVIDER].controller
        assert controller is not None
        assert not controller.slow_start  # it queued: rises are one slot at a time now
        await redis.hset(keys.provider(PROVIDER), "drain", 1)
        await eventually(lambda: worker.capacity.loads[PROVIDER].drained, what="the drain read")
        assert not controller.slow_start  # a drain alone changes nothing
        await redis.hdel(keys.provider(PROVIDER), "drain")
        await eventually(lambda: controller.slow_start, what="learned afresh after the resume")


async def test_load_iop_does_not_send_is_published_for_a_fixed_capacity_too(
        redis: Redis, redis_server: RedisServer, engine: Engine) -> None:
    async with serving(redis_server, engine, capacity=8):
        engine.running, engine.waiting = 6, 1
        await busy(redis, 2, backlog=False)
        found = await until(redis, "external load", lambda f: f.get("ext") == "5")
        assert found["capacity"] == "8"  # the config's
        assert found["capacity_mode"] == "fixed"
        engine.running, engine.waiting = 2, 0
        await until(redis, "gone", lambda f: f.get("ext") == "0")


async def test_a_server_without_health_is_never_asked_for_metrics(
        redis: Redis, redis_server: RedisServer, engine: Engine) -> None:
    # llama-cpp-python behind the llamacpp type: no /health, and its routes take its model lock.
    engine.has_health = False
    async with serving(redis_server, engine, "llamacpp", capacity="auto"):
        await until(redis, "published", lambda f: f.get("capacity_mode") == "auto" and f.get("health") == "available")
        await busy(redis, 1)
        await anyio.sleep(1.0)
        assert "/metrics" not in engine.seen


async def test_without_metrics_the_capacity_is_learned_from_latency_alone(
        redis: Redis, redis_server: RedisServer, engine: Engine) -> None:
    engine.metrics = False
    async with serving(redis_server, engine, capacity="auto", max_capacity=8):
        first = await until(redis, "published", lambda f: f.get("capacity_mode") == "auto")
        assert first["capacity"] == "2"
        await busy(redis, 2)
        await anyio.sleep(1.5)
        # Saturated, but no call finished: no evidence that more would keep up.
        assert (await fields(redis))["capacity"] == "2"
        assert "engine" not in (await fields(redis)) or (await fields(redis))["engine"] == ""


async def test_an_auto_limit_with_nothing_learned_starts_at_its_qualification_s_knee(
        redis: Redis, redis_server: RedisServer, engine: Engine) -> None:
    seed = CapacitySeed(capacity=6, model="m", run="run-1", started="2026-12-02T00:00:00Z")
    await redis.hset(keys.CAPACITY_SEEDS, PROVIDER, qualifications.encode(seed))
    async with serving(redis_server, engine, capacity="auto", max_capacity=16):
        first = await until(redis, "published", lambda f: f.get("capacity_mode") == "auto")
        assert first["capacity"] == "6"
        assert first["cap_reason"] == "starting at 6"


async def test_a_seed_above_the_ceiling_starts_at_the_ceiling(
        redis: Redis, redis_server: RedisServer, engine: Engine) -> None:
    seed = CapacitySeed(capacity=40, model="m", run="run-1", started="2026-12-02T00:00:00Z")
    await redis.hset(keys.CAPACITY_SEEDS, PROVIDER, qualifications.encode(seed))
    async with serving(redis_server, engine, capacity="auto", max_capacity=8):
        first = await until(redis, "published", lambda f: f.get("capacity_mode") == "auto")
        assert first["capacity"] == "8"
