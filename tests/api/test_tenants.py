"""Tenants at the API: a request's tenant is its key; its models, its queue limit and its
band are enforced before anything is queued (no worker runs here: jobs wait)."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from litestar.testing import AsyncTestClient
from redis.asyncio import Redis

from api.app import create_app
from dispatcher import keys
from iop.redis_server import RedisServer
from tests.api.app_config import make_config

pytestmark = pytest.mark.anyio

WEB, EVAL, LEGACY = "web-key-1", "eval-key-2", "legacy-key-3"


def auth(key: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **extra}


@pytest.fixture
async def client(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[AsyncTestClient[Any], Redis]]:
    monkeypatch.setenv("IOP_TEST_WEB", WEB)
    monkeypatch.setenv("IOP_TEST_LEGACY", LEGACY)
    config = make_config(
        redis_server.url,
        api={
            "api_keys_env": "IOP_TEST_LEGACY",
            "priorities": ["interactive", "standard", "batch"],
            "keys": [
                {"name": "web", "key_env": "IOP_TEST_WEB", "priority": "interactive", "weight": 3,
                 "models": ["m"]},
                {"name": "eval", "key_sha256": hashlib.sha256(EVAL.encode()).hexdigest(), "priority": "batch",
                 "max_queued": 2},
            ],
        },
        queue={"max_queue": 100, "queue_timeout_ms": 200},
    )
    redis = Redis.from_url(redis_server.url)
    await redis.flushall()
    async with AsyncTestClient(create_app(config)) as c:
        yield c, redis
    await redis.aclose()


async def post(c: AsyncTestClient[Any], key: str, model: str = "m", **headers: str) -> Any:
    return await c.post("/v1/chat/completions", json={"model": model, "messages": []},
                        headers=auth(key, **headers))


async def test_unknown_keys_are_refused(client: Any) -> None:
    c, _ = client
    resp = await post(c, "nope")
    assert resp.status_code == 401
    assert resp.json()["error"]["code"] == "invalid_api_key"


async def test_models_outside_the_allow_list_are_forbidden_and_unlisted(client: Any) -> None:
    c, redis = client
    resp = await post(c, WEB, model="org/model:tag")
    assert resp.status_code == 403
    assert resp.json()["error"]["code"] == "model_not_allowed"
    assert await redis.hgetall(keys.JOBS) == {}
    listed = (await c.get("/v1/models", headers=auth(WEB))).json()
    assert [m["id"] for m in listed["data"]] == ["m"]
    assert (await c.get("/v1/models/org/model:tag", headers=auth(WEB))).status_code == 403
    # A tenant without an allow-list sees every model.
    listed = (await c.get("/v1/models", headers=auth(EVAL))).json()
    assert [m["id"] for m in listed["data"]] == ["m", "org/model:tag"]


async def test_max_queued_answers_429_with_retry_after(client: Any) -> None:
    c, redis = client
    # Two of eval's requests wait already (the scripts keep this count: test_flow_control.py).
    await redis.hset(keys.TENANTS, mapping={"q:eval": 2, "q:eval:m": 2})
    resp = await post(c, EVAL)
    assert resp.status_code == 429
    assert resp.json()["error"]["code"] == "tenant_queue_full"
    assert "Retry-After" in resp.headers
    assert await redis.hlen(keys.JOBS) == 0


async def test_a_request_may_only_lower_its_band(client: Any) -> None:
    c, _ = client
    assert (await post(c, "nope", **{"x-iop-priority": "batch"})).status_code == 401
    bad = await post(c, WEB, **{"x-iop-priority": "urgent"})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "x-iop-priority"


async def test_limits_are_published_for_dispatch(client: Any) -> None:
    _, redis = client
    assert await redis.hgetall(keys.TENANT_LIMITS) == {}  # nobody has max_in_flight here
