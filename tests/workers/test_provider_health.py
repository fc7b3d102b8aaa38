"""A worker's word on its providers' health (workers/provider_state.py): probes while they are idle,
nothing that could disturb them while they are busy, and their calls as the health signal.

A real ``Worker`` runs in the test's event loop against a private redis-server, in front of
an upstream served by the test itself (aiohttp), which records every request it gets. A
provider is made busy the way another worker's dispatch makes it: its ``in_flight`` in
Redis. A call is made through the worker's own ``jobs.call``, the path every job takes.
"""

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

from dispatcher import keys
from dispatcher.config import parse
from dispatcher.events import Assignment, Failed
from iop.redis_server import RedisServer, free_port
from tests.waiting import eventually
from workers.adapters import probes
from workers.adapters.openai_http import OpenAIHttpAdapter
from workers.leases import Running
from workers.sink import RedisSink
from workers.worker import Worker

pytestmark = pytest.mark.anyio

HOST = "127.0.0.1"
PROVIDER = "p"
SERVED = "served-model"
HEARTBEAT_MS = 50
PROBE_MS = 100
# While busy, this many heartbeats span several probe intervals: time enough for a probe
# that should not happen to show up.
QUIET_HEARTBEATS = 12


@dataclass
class Upstream:
    """An OpenAI-style runtime: ``/health`` (404 when ``has_health`` is off, as on
    llama-cpp-python), ``/v1/models``, and chat answering ``chat_status``."""

    has_health: bool = True
    chat_status: int = 200
    chat_garbage: bool = False  # chat answers 200 with a body that is not JSON
    seen: list[str] = field(default_factory=list)
    url: str = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.seen.append(request.path)
        if request.path == "/health" and self.has_health:
            return web.json_response({"status": "ok"})
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": SERVED, "object": "model"}]})
        if request.path == "/v1/chat/completions":
            if self.chat_garbage:
                return web.Response(body=b"{not json", content_type="application/json")
            if self.chat_status != 200:
                return web.json_response({"error": {"message": "boom", "type": "server_error"}},
                                         status=self.chat_status)
            return web.json_response({"id": "c1", "object": "chat.completion", "model": SERVED, "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]})
        return web.json_response({"detail": "Not Found"}, status=404)

    def since(self, mark: int) -> list[str]:
        return self.seen[mark:]


@pytest.fixture(autouse=True)
def _nothing_remembered() -> None:
    """Which path answers for health is remembered per server root; ports are reused."""
    probes._no_health.clear()
    probes._slots_source.clear()
    probes._health_seen.clear()


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream()
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
async def serving(redis_server: RedisServer, upstream: Upstream, provider_type: str,
                  **dispatch: Any) -> AsyncIterator[Worker]:
    config = parse({
        "redis": {"url": redis_server.url},
        "models": [{"id": "m", "providers": {PROVIDER: SERVED}}],
        "nodes": [{"id": "n1", "providers": [{"id": PROVIDER, "type": provider_type, "base_url": upstream.url,
                                              "models": [SERVED], "capacity": 2, "timeout_s": 10}]}],
        "dispatch": {"heartbeat_interval_ms": HEARTBEAT_MS, "heartbeat_ttl_ms": 2000, "probe_interval_ms": PROBE_MS,
                     "probe_timeout_ms": 1000, "drain_grace_s": 0, **dispatch},
    }).config
    worker = Worker(config, "n1")
    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.run)
        try:
            # The reaper's first round sets in_flight to the live leases: past it, an
            # in_flight a test writes for another worker's jobs stays (the next such check
            # is RECONCILE_EVERY rounds later).
            await eventually(lambda: worker.reaper.rounds >= 1, what="the first reaper round")
            yield worker
        finally:
            worker.stop()


async def state(redis: Redis) -> dict[str, str]:
    raw: dict[bytes, bytes] = await redis.hgetall(keys.provider(PROVIDER))  # type: ignore[assignment]
    return {k.decode(): v.decode() for k, v in raw.items()}


async def health_is(redis: Redis, health: str, reason: str) -> dict[str, str]:
    """Until the provider's hash says ``health``, its reason ``reason`` ("": none) or
    beginning with it."""
    def says(found: dict[str, str]) -> bool:
        got = found.get("reason", "")
        return found.get("health") == health and (got.startswith(reason) if reason else got == "")

    return await eventually(lambda: state(redis), says, what=f"{PROVIDER} {health} ({reason!r})")


async def heartbeats(redis: Redis, count: int) -> None:
    """Until the provider's heartbeat has been written ``count`` more times: every turn of
    its loop (probe, then heartbeat) started after the call has ended by then."""
    for _ in range(count):
        before = (await state(redis)).get("hb_ms")

        async def moved(before: str | None = before) -> bool:
            return (await state(redis)).get("hb_ms") != before

        await eventually(moved, what="a heartbeat")


async def set_in_flight(redis: Redis, count: int) -> None:
    """What another worker's dispatch (or its release) does to the provider's hash."""
    await redis.hset(keys.provider(PROVIDER), "in_flight", count)


async def until_busy_seen(redis: Redis, upstream: Upstream) -> int:
    """Busy from now on: the mark after which no probe begun while idle can still arrive."""
    await set_in_flight(redis, 1)
    await heartbeats(redis, 2)
    return len(upstream.seen)


def chat_job(n: int = 1) -> Assignment:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    return Assignment(entry_id=f"0-{n}", job=f"job-{n}", fence=n, provider=PROVIDER, target=SERVED, model="m",
                      lane="", replica="r1", endpoint="chat/completions", stream=False, attempt=1, submitted_ms=0,
                      dispatched_ms=0, body=body)


async def call(worker: Worker, n: int = 1) -> object:
    job = chat_job(n)
    return await worker.jobs.call(job, Running(job), RedisSink(worker.side, job, "n1"))


# --------------------------------------------------------------------------- busy: no probe


@pytest.mark.parametrize(("provider_type", "has_health", "model_list_asked"), [
    ("openai_api", True, ["/v1/models"]),
    # llama-cpp-python: no /health, its model list answers for it (and takes its model lock).
    ("llamacpp", False, ["/v1/models"]),
])
async def test_no_probe_reaches_a_busy_provider_and_an_idle_one_is_probed_again(
    provider_type: str, has_health: bool, model_list_asked: list[str], redis: Redis, redis_server: RedisServer,
    upstream: Upstream,
) -> None:
    upstream.has_health = has_health
    async with serving(redis_server, upstream, provider_type, busy_probe_interval_ms=PROBE_MS):
        await health_is(redis, "available", "")
        await heartbeats(redis, 3)  # llamacpp: the fallback to the model list is remembered by now
        mark = await until_busy_seen(redis, upstream)
        await heartbeats(redis, QUIET_HEARTBEATS)
        assert upstream.since(mark) == [], "a busy provider was probed"
        assert (await state(redis))["health"] == "available"

        await set_in_flight(redis, 0)

        async def probed() -> bool:
            return len(upstream.since(mark)) >= 2

        await eventually(probed, what="an idle provider probed again")
        assert set(upstream.since(mark)) == set(model_list_asked)


@pytest.mark.parametrize(("provider_type", "harmless"), [
    ("vllm", "/health"),
    ("sglang", "/health"),
    # llama-server: it has /health, answered outside its slots.
    ("llamacpp", "/health"),
])
async def test_a_busy_provider_is_asked_only_its_harmless_path(
    provider_type: str, harmless: str, redis: Redis, redis_server: RedisServer, upstream: Upstream
) -> None:
    async with serving(redis_server, upstream, provider_type, busy_probe_interval_ms=2 * PROBE_MS):
        await health_is(redis, "available", "")
        models = (await state(redis))["reported_models"]
        mark = await until_busy_seen(redis, upstream)

        async def asked_twice() -> bool:
            return upstream.since(mark).count(harmless) >= 2

        await eventually(asked_twice, what="the harmless path asked while busy")
        assert set(upstream.since(mark)) == {harmless}
        # What the whole probe found stays published; only health comes from the busy one.
        assert (await state(redis))["reported_models"] == models == json.dumps([SERVED])


# --------------------------------------------------------------------------- calls as the signal


async def test_a_call_that_fails_its_way_marks_the_provider_unavailable_with_its_error(
    redis: Redis, redis_server: RedisServer, upstream: Upstream
) -> None:
    async with serving(redis_server, upstream, "openai_api") as worker:
        await health_is(redis, "available", "")
        mark = await until_busy_seen(redis, upstream)

        upstream.chat_garbage = True
        assert isinstance(await call(worker), Failed)
        found = await health_is(redis, "unavailable", "the provider answered with invalid JSON")
        assert found["reported_models"] == json.dumps([SERVED])  # the whole probe's word on its models stays
        await heartbeats(redis, 3)
        assert (await state(redis))["health"] == "unavailable"  # no probe while busy overrules it
        assert upstream.since(mark) == ["/v1/chat/completions"]

        # A call it answers whole brings it back.
        upstream.chat_garbage = False
        assert not isinstance(await call(worker, 2), Failed)
        await health_is(redis, "available", "")

        # So does a probe, as soon as it runs nothing.
        upstream.chat_garbage = True
        await call(worker, 3)
        await health_is(redis, "unavailable", "the provider answered with invalid JSON")
        await set_in_flight(redis, 0)
        await health_is(redis, "available", "")
        assert "/v1/models" in upstream.since(mark)


@pytest.mark.parametrize("status", [500, 502, 503])
async def test_a_5xx_answer_alone_leaves_the_provider_in_rotation(
    status: int, redis: Redis, redis_server: RedisServer, upstream: Upstream
) -> None:
    # It may be the request's fault: only the evidence of several requests ejects it
    # (lua/lib/evidence.lua; tests/dispatcher/test_ejection.py, tests/e2e/test_ejection.py).
    async with serving(redis_server, upstream, "openai_api") as worker:
        await health_is(redis, "available", "")
        await until_busy_seen(redis, upstream)
        upstream.chat_status = status
        assert isinstance(await call(worker), Failed)
        await heartbeats(redis, 3)
        assert (await state(redis))["health"] == "available"
        assert worker.providers.health[PROVIDER].healthy


async def test_a_refused_connection_marks_the_provider_unavailable(
    redis: Redis, redis_server: RedisServer, upstream: Upstream
) -> None:
    async with serving(redis_server, upstream, "openai_api") as worker:
        await health_is(redis, "available", "")
        await until_busy_seen(redis, upstream)
        adapter = worker.adapters[PROVIDER]
        assert isinstance(adapter, OpenAIHttpAdapter)
        adapter.root = f"http://{HOST}:{free_port()}"  # the server went away
        assert isinstance(await call(worker), Failed)
        await health_is(redis, "unavailable", f"provider {PROVIDER} unreachable: connection refused")


async def test_the_provider_own_4xx_says_nothing_of_its_health(
    redis: Redis, redis_server: RedisServer, upstream: Upstream
) -> None:
    async with serving(redis_server, upstream, "openai_api") as worker:
        await health_is(redis, "available", "")
        await until_busy_seen(redis, upstream)
        upstream.chat_status = 400
        assert isinstance(await call(worker), Failed)
        await heartbeats(redis, 3)
        assert (await state(redis))["health"] == "available"
        assert worker.providers.health[PROVIDER].healthy
