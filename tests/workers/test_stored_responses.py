"""Where a stored Response was made is noted before its answer or first event goes on; only
a create notes it, and a DELETE its provider carried out forgets it."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from api.app import create_app
from dispatcher import keys
from dispatcher.config import parse
from dispatcher.events import Usage
from iop.fake_provider import FakeOptions, start
from iop.redis_server import RedisServer, free_port
from workers.stored_responses import ForgettingSink, RememberingSink
from workers.worker import Worker

pytestmark = pytest.mark.anyio


class Log:
    def __init__(self, fail: bool = False) -> None:
        self.steps: list[str] = []
        self.fail = fail

    async def remember(self, response_id: str) -> None:
        if self.fail:
            raise RedisConnectionError("down")
        self.steps.append(f"remember {response_id}")

    async def forget(self, response_id: str) -> None:
        if self.fail:
            raise RedisConnectionError("down")
        self.steps.append(f"forget {response_id}")

    async def start(self, status: int, content_type: str = "text/event-stream",
                    headers: Mapping[str, str] | None = None) -> None:
        self.steps.append("start")

    async def chunks(self, payloads: list[bytes]) -> None:
        self.steps.append(f"chunks {len(payloads)}")

    async def done(self, status: int, body: bytes, content_type: str,
                   headers: Mapping[str, str] | None = None) -> None:
        self.steps.append(f"done {status}")

    def ended(self, upstream_done: bool) -> None:
        self.steps.append("ended")

    def usage(self, usage: Usage) -> None:
        self.steps.append(f"usage {usage.prompt}/{usage.completion}")


async def test_a_json_answer_is_remembered_before_it_goes_on() -> None:
    log = Log()
    sink = RememberingSink(log, log.remember)
    await sink.done(200, b'{"id":"resp_1","object":"response","model":"x"}', "application/json")
    assert log.steps == ["remember resp_1", "done 200"]


async def test_an_error_or_an_answer_without_id_is_not() -> None:
    log = Log()
    sink = RememberingSink(log, log.remember)
    await sink.done(404, b'{"id":"resp_1"}', "application/json")
    await sink.done(200, b"not json", "application/json")
    await sink.done(200, b'{"object":"response"}', "application/json")
    assert log.steps == ["done 404", "done 200", "done 200"]


async def test_a_stream_is_remembered_at_response_created_once() -> None:
    log = Log()
    sink = RememberingSink(log, log.remember)
    await sink.start(200)
    created = b'response.created\n{"type":"response.created","response":{"id":"resp_9","model":"x"}}'
    await sink.chunks([created, b'response.in_progress\n{"type":"response.in_progress"}'])
    await sink.chunks([b'response.created\n{"type":"response.created","response":{"id":"resp_other"}}'])
    sink.ended(False)
    assert log.steps == ["start", "remember resp_9", "chunks 2", "chunks 1", "ended"]


async def test_redis_away_does_not_stop_the_answer() -> None:
    log = Log(fail=True)
    sink = RememberingSink(log, log.remember)
    await sink.done(200, b'{"id":"resp_1"}', "application/json")
    assert log.steps == ["done 200"]


async def test_a_delete_forgets_its_id_before_the_answer_goes_on_and_only_on_success() -> None:
    log = Log()
    await ForgettingSink(log, "resp_1", log.forget).done(200, b'{"id":"resp_1","deleted":true}', "application/json")
    await ForgettingSink(log, "resp_2", log.forget).done(404, b'{"error":{}}', "application/json")
    assert log.steps == ["forget resp_1", "done 200", "done 404"]
    away = Log(fail=True)
    await ForgettingSink(away, "resp_1", away.forget).done(200, b"{}", "application/json")
    assert away.steps == ["done 200"]


# --------------------------------------------------------------------------- through a whole pool

HOST = "127.0.0.1"
MODEL = "m"
SERVED = "fake-model"  # what the fake provider reports


@dataclass
class Pool:
    """An API app and a worker in this event loop, a fake provider that keeps its own store of
    responses, and a private Redis: a call takes the path every request takes."""

    client: httpx.AsyncClient
    redis: Redis

    async def remembered(self, response_id: str) -> tuple[bytes | None, float | None]:
        """The id's record in the responses hash and its score in the expiry zset."""
        return (await self.redis.hget(keys.RESPONSES, response_id),
                await self.redis.zscore(keys.RESPONSES_BY_EXPIRY, response_id))

    async def create(self, **body: Any) -> str:
        resp = await self.client.post("/v1/responses", json={"model": MODEL, "input": "hello", **body})
        assert resp.status_code == 200, resp.text
        response_id: str = resp.json()["id"]
        return response_id


@pytest.fixture
async def pool(redis_server: RedisServer, redis: Redis) -> AsyncIterator[Pool]:
    port = free_port()
    runner = await start(HOST, port, FakeOptions(tokens=2))
    config = parse({
        "redis": {"url": redis_server.url},
        "models": [{"id": MODEL, "providers": {"p": SERVED}}],
        "nodes": [{"id": "n1", "providers": [{"id": "p", "type": "openai_api", "base_url": f"http://{HOST}:{port}",
                                              "models": [SERVED], "capacity": 2, "timeout_s": 10}]}],
        # A short lease keeps the worker's blocking read of its node stream short: it stops at once.
        "dispatch": {"heartbeat_interval_ms": 50, "heartbeat_ttl_ms": 2000, "drain_grace_s": 0, "lease_ms": 900,
                     "reap_interval_ms": 100},
    }).config
    worker = Worker(config, "n1")
    app = create_app(config)
    # Litestar's test client would run the app on a thread of its own while it blocks this
    # loop, and so the worker: the app runs here, and its lifespan is the gateway's.
    gateway = app.state.gateway
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker.run)
            with anyio.fail_after(10):  # until the worker has published its provider
                while True:
                    if await redis.hget(keys.provider("p"), "health") == b"available":
                        break
                    await anyio.sleep(0.01)
            await gateway.start()
            try:
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://iop") as client:
                    yield Pool(client, redis)
            finally:
                await gateway.close()
                worker.stop()
    finally:
        await runner.cleanup()


async def test_a_create_is_remembered(pool: Pool) -> None:
    response_id = await pool.create()
    record, expiry = await pool.remembered(response_id)
    assert record is not None
    assert record.split(b"\t")[:2] == [b"p", MODEL.encode()]
    assert expiry is not None


async def test_reading_a_stored_response_changes_nothing(pool: Pool) -> None:
    """A GET (or input_items, or a cancel) answers with the id too: it must not be noted again,
    which would push its expiry on at every read."""
    response_id = await pool.create(background=True)
    # An hour from now, not the week a fresh note gives: any rewrite shows.
    soon = int(time.time() * 1000) + 3_600_000
    await pool.redis.hset(keys.RESPONSES, response_id, f"p\t{MODEL}\t{soon}")
    await pool.redis.zadd(keys.RESPONSES_BY_EXPIRY, {response_id: soon})
    before = await pool.remembered(response_id)
    for method, path in (("GET", ""), ("GET", "/input_items"), ("POST", "/cancel")):
        resp = await pool.client.request(method, f"/v1/responses/{response_id}{path}")
        assert resp.status_code == 200, (method, path, resp.text)
        assert resp.headers["x-iop-provider"] == "p"
    assert await pool.remembered(response_id) == before


async def test_a_deleted_response_is_forgotten(pool: Pool) -> None:
    response_id = await pool.create()
    kept = await pool.create()
    resp = await pool.client.delete(f"/v1/responses/{response_id}")
    assert resp.status_code == 200, resp.text
    assert resp.json()["deleted"] is True
    assert await pool.remembered(response_id) == (None, None)
    # From now on iop answers for it, without asking the provider, which no longer has it.
    again = await pool.client.get(f"/v1/responses/{response_id}")
    assert again.status_code == 404
    assert again.json()["error"]["code"] == "response_not_found"
    # Other ids stay.
    assert (await pool.remembered(kept))[0] is not None


async def test_a_delete_the_provider_refused_forgets_nothing(pool: Pool) -> None:
    """The provider may still hold it: calls on it keep going there."""
    response_id = await pool.create(store=False)  # remembered, but never stored by the provider
    before = await pool.remembered(response_id)
    resp = await pool.client.delete(f"/v1/responses/{response_id}")
    assert resp.status_code == 404  # the provider's own answer
    assert resp.headers["x-iop-provider"] == "p"
    assert await pool.remembered(response_id) == before
