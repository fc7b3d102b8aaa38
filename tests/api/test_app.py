"""The API's own answers (no worker involved): bad input, unknown models, queue
policy, auth, health. The app runs in-process against a private Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from litestar.testing import AsyncTestClient, TestClient
from redis.asyncio import Redis

from api.app import create_app
from dispatcher import keys
from iop.redis_server import RedisServer
from tests.api.app_config import make_config

pytestmark = pytest.mark.anyio


@pytest.fixture
async def redis_client(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.url)
    await client.flushall()
    yield client
    await client.aclose()


@pytest.fixture
async def client(redis_server: RedisServer, redis_client: Redis) -> AsyncIterator[AsyncTestClient[Any]]:
    async with AsyncTestClient(create_app(make_config(redis_server.url))) as c:
        yield c


def error_of(resp: Any) -> dict[str, Any]:
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    err: dict[str, Any] = body["error"]
    return err


CHAT = "/v1/chat/completions"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b'"text"', None),
        (b"{}", "model"),
        (b'{"model": 7}', "model"),
        (b'{"model": ""}', "model"),
        (b'{"model": "m", "stream": "yes"}', "stream"),
    ],
)
async def test_bad_bodies_are_400(client: AsyncTestClient[Any], body: bytes, param: str | None) -> None:
    resp = await client.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400
    err = error_of(resp)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param


async def test_unknown_model_is_404_and_never_queued(client: AsyncTestClient[Any], redis_client: Redis) -> None:
    resp = await client.post(CHAT, json={"model": "nope", "messages": []})
    assert resp.status_code == 404
    assert error_of(resp)["code"] == "model_not_found"
    assert await redis_client.hlen(keys.JOBS) == 0


async def test_oversized_body_is_413_naming_its_size_and_the_limit(client: AsyncTestClient[Any],
                                                                   redis_client: Redis) -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 5000 + b'"}]}'
    resp = await client.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 413
    err = error_of(resp)
    assert err["code"] == "request_too_large"
    assert err["type"] == "invalid_request_error"
    assert err["message"] == (f"The request body is {len(body)} bytes; this server takes at most 4096 bytes "
                              "(api.max_body_bytes)")
    assert await redis_client.hlen(keys.JOBS) == 0


def test_oversized_body_of_unknown_length_is_413_naming_the_limit(redis_server: RedisServer) -> None:
    def chunks() -> Iterator[bytes]:  # no content-length: sent chunked
        yield b'{"model": "m", "input": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    # (httpx's AsyncClient takes only an async iterator, which Litestar's test transport refuses)
    with TestClient(create_app(make_config(redis_server.url))) as sync_client:
        resp = sync_client.post("/v1/embeddings", content=chunks(), headers={"content-type": "application/json"})
    assert resp.status_code == 413
    assert error_of(resp)["message"] == ("The request body is over 4096 bytes; this server takes at most 4096 bytes "
                                         "(api.max_body_bytes)")


async def test_oversized_body_is_413_in_anthropics_shape_on_messages(client: AsyncTestClient[Any]) -> None:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x" * 5000}]}
    resp = await client.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
    assert resp.status_code == 413
    doc = resp.json()
    assert doc["type"] == "error"
    assert doc["error"]["type"] == "request_too_large"
    assert doc["error"]["message"].endswith("this server takes at most 4096 bytes (api.max_body_bytes)")


async def test_no_provider_up_is_503_at_once_with_the_reason(redis_server: RedisServer, redis_client: Redis) -> None:
    # No worker runs; the provider's hash says what its worker last reported, and the queue
    # holds nothing.
    config = make_config(redis_server.url, queue={"max_queue": 1, "queue_timeout_ms": 60_000})
    await redis_client.hset(keys.provider("p"), mapping={
        "health": "unavailable", "reason": "GET /health answered 404", "hb_ms": 1, "hb_exp": 2**52, "capacity": 1})
    async with AsyncTestClient(create_app(config)) as bare:
        resp = await bare.post(CHAT, json={"model": "m", "messages": []})
    assert resp.status_code == 503
    err = error_of(resp)
    assert err["code"] == "no_provider_available"
    assert err["message"] == "No provider of 'm' is available (p: GET /health answered 404); retry later"
    assert resp.headers["retry-after"] == "5"
    assert await redis_client.hlen(keys.JOBS) == 0


async def test_queue_deadline_is_503_with_retry_after(client: AsyncTestClient[Any], redis_client: Redis) -> None:
    # No worker runs: the provider never heartbeats, so the (held) job waits until its deadline.
    resp = await client.post(CHAT, json={"model": "m", "messages": []})
    assert resp.status_code == 503
    assert error_of(resp)["code"] == "queue_timeout"
    assert int(resp.headers["retry-after"]) >= 1
    # The timed-out job left nothing behind.
    assert await redis_client.hlen(keys.JOBS) == 0
    assert await redis_client.zcard(keys.queue("m")) == 0
    assert await redis_client.zcard(keys.DEADLINES) == 0


async def test_queue_full_is_429(client: AsyncTestClient[Any]) -> None:
    resp = await client.post(CHAT, json={"model": "org/model:tag", "messages": []})
    assert resp.status_code == 429
    err = error_of(resp)
    assert err["code"] == "queue_full"
    assert err["type"] == "rate_limit_error"
    assert int(resp.headers["retry-after"]) >= 1


async def test_models_list_and_lookup(client: AsyncTestClient[Any]) -> None:
    listing = (await client.get("/v1/models")).json()
    assert listing["object"] == "list"
    assert [(m["id"], m["display_name"], m["object"]) for m in listing["data"]] == [
        ("m", "Model M", "model"), ("org/model:tag", "org/model:tag", "model")]
    one = await client.get("/v1/models/org/model:tag")
    assert one.status_code == 200
    assert one.json()["id"] == "org/model:tag"
    missing = await client.get("/v1/models/nope")
    assert missing.status_code == 404
    assert error_of(missing)["code"] == "model_not_found"


async def test_unknown_route_is_an_openai_error(client: AsyncTestClient[Any]) -> None:
    resp = await client.get("/v1/nothing-here")
    assert resp.status_code == 404
    assert error_of(resp)["code"] == "not_found"
    resp = await client.get(CHAT)
    assert resp.status_code == 405


async def test_health_and_readiness(client: AsyncTestClient[Any]) -> None:
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    ready = await client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["status"] == "ready"


async def test_api_keys(redis_server: RedisServer, redis_client: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IOP_TEST_KEYS", "k1, k2")
    app = create_app(make_config(redis_server.url, api={"api_keys_env": "IOP_TEST_KEYS"}))
    async with AsyncTestClient(app) as c:
        for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic k1"},
                        {"authorization": "Bearer "}):
            resp = await c.get("/v1/models", headers=headers)
            assert resp.status_code == 401, headers
            assert error_of(resp)["code"] == "invalid_api_key"
        for key in ("k1", "k2"):
            assert (await c.get("/v1/models", headers={"authorization": f"Bearer {key}"})).status_code == 200
        # Health stays open.
        assert (await c.get("/healthz")).status_code == 200


async def test_named_but_empty_key_variable_locks_the_api(
    redis_server: RedisServer, redis_client: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IOP_TEST_KEYS", "")
    app = create_app(make_config(redis_server.url, api={"api_keys_env": "IOP_TEST_KEYS"}))
    async with AsyncTestClient(app) as c:
        assert (await c.get("/v1/models", headers={"authorization": "Bearer "})).status_code == 401


async def test_redis_down_answers_503_quickly() -> None:
    from iop.redis_server import free_port

    app = create_app(make_config(f"redis://127.0.0.1:{free_port()}/0"))
    async with AsyncTestClient(app) as c:
        resp = await c.post(CHAT, json={"model": "m", "messages": []})
        assert resp.status_code == 503
        assert error_of(resp)["code"] == "redis_unavailable"
        ready = await c.get("/readyz")
        assert ready.status_code == 503
        assert (await c.get("/healthz")).status_code == 200
