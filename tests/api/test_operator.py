"""The operator surfaces of the API: /catalog, /metrics, /ui, and their keys."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from litestar.testing import AsyncTestClient
from redis.asyncio import Redis

from api.app import create_app
from dispatcher import keys
from iop.redis_server import RedisServer
from tests.api.app_config import make_config
from tests.api.prometheus import samples

pytestmark = pytest.mark.anyio


@pytest.fixture
async def client(redis_server: RedisServer, redis: Redis) -> AsyncIterator[AsyncTestClient[Any]]:
    async with AsyncTestClient(create_app(make_config(redis_server.url))) as c:
        yield c


async def test_catalog_json(client: AsyncTestClient[Any], redis: Redis) -> None:
    await redis.hset(keys.provider("p"), mapping={"health": "available", "hb_ms": 1, "hb_exp": 10**15,
                                                  "capacity": 1, "in_flight": 1})
    doc = (await client.get("/catalog")).json()
    (provider,) = doc["providers"]
    assert provider["id"] == "p"
    assert provider["health"] == "available"
    assert provider["load_ratio"] == 1.0
    assert provider["category"] == "local_inference"
    assert [m["id"] for m in doc["models"]] == ["m", "org/model:tag"]


async def test_metrics_parse_and_count_requests(client: AsyncTestClient[Any], redis: Redis) -> None:
    # Outcomes without a worker: 404, 429 and a queue timeout (503).
    await client.post("/v1/chat/completions", json={"model": "nope", "messages": []})
    await client.post("/v1/chat/completions", json={"model": "org/model:tag", "messages": []})
    await client.post("/v1/chat/completions", json={"model": "m", "messages": []})
    resp = await client.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    values = samples(resp.text)

    def count(model: str, status: str) -> float:
        return values[("iop_requests_total",
                       (("model", model), ("provider", ""), ("status", status), ("tenant", "default")))]

    # A model id outside the config is never a label value of its own.
    assert count("_unknown", "404") == 1
    assert count("org/model:tag", "429") == 1
    assert count("m", "503") == 1
    assert values[("iop_request_duration_seconds_count", (("model", "m"), ("provider", ""), ("status", "503")))] == 1
    names = {name for name, _ in values}
    for family in ("iop_provider_in_flight", "iop_provider_capacity", "iop_provider_available",
                   "iop_provider_health", "iop_model_queued", "iop_model_oldest_wait_seconds"):
        assert family in names, family
    health = {labels: v for (name, labels), v in values.items() if name == "iop_provider_health"}
    assert health[(("category", "local_inference"), ("health", "unknown"), ("node", "n"), ("provider", "p"),
                   ("type", "vllm"))] == 1
    # No flow control (one tenant, one band, no limits): no tenant gauges.
    assert not {n for n in names if n.startswith("iop_tenant_")}


async def test_tenants_in_the_catalog_and_metrics(
    redis_server: RedisServer, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IOP_TEST_WEB", "web-key")
    monkeypatch.setenv("IOP_TEST_EVAL", "eval-key")
    config = make_config(redis_server.url, api={
        "priorities": ["interactive", "batch"], "default_priority": "batch",
        "keys": [{"name": "web", "key_env": "IOP_TEST_WEB", "priority": "interactive", "weight": 4,
                  "models": ["m"], "max_in_flight": 2},
                 {"name": "eval", "key_env": "IOP_TEST_EVAL", "max_queued": 10}]})
    auth = {"authorization": "Bearer web-key"}
    async with AsyncTestClient(create_app(config)) as c:
        # What the dispatch scripts count (lua/lib/jobs.lua), and a counter of a tenant no longer configured.
        await redis.hset(keys.TENANTS, mapping={"q:web": 3, "q:web:m": 3, "r:web": 1, "r:web:m": 1,
                                                "q:eval": 2, "q:eval:org/model:tag": 2, "q:old": 9, "q:old:m": 9})
        doc = (await c.get("/catalog", headers=auth)).json()
        assert doc["tenants"] == [
            {"name": "web", "band": "interactive", "weight": 4.0, "models": ["m"], "max_queued": None,
             "max_in_flight": 2, "queued": 3, "in_flight": 1, "limits": None},
            {"name": "eval", "band": "batch", "weight": 1.0, "models": None, "max_queued": 10,
             "max_in_flight": None, "queued": 2, "in_flight": 0, "limits": None}]
        assert {m["id"]: m["tenants"] for m in doc["models"]} == {
            "m": [{"tenant": "web", "queued": 3, "in_flight": 1}],
            "org/model:tag": [{"tenant": "eval", "queued": 2, "in_flight": 0}]}
        values = samples((await c.get("/metrics", headers=auth)).text)
    queued = {dict(labels)["tenant"] + " " + dict(labels)["model"]: v
              for (name, labels), v in values.items() if name == "iop_tenant_queued"}
    # Configured tenants only, each for the model groups it may call.
    assert queued == {"web m": 3, "eval m": 0, "eval org/model:tag": 2}
    in_flight = {dict(labels)["tenant"]: v for (name, labels), v in values.items() if name == "iop_tenant_in_flight"}
    assert in_flight == {"web": 1, "eval": 0}


async def test_ui_page_is_served(client: AsyncTestClient[Any]) -> None:
    resp = await client.get("/ui")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/html")
    assert "iop catalog" in resp.text
    assert 'fetch("catalog"' in resp.text


async def test_admin_keys_guard_the_operator_surfaces(
    redis_server: RedisServer, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IOP_TEST_KEYS", "caller")
    monkeypatch.setenv("IOP_TEST_ADMIN", "admin")
    config = make_config(redis_server.url, api={"api_keys_env": "IOP_TEST_KEYS", "admin_keys_env": "IOP_TEST_ADMIN"})
    async with AsyncTestClient(create_app(config)) as c:
        for path in ("/catalog", "/metrics"):
            assert (await c.get(path)).status_code == 401
            assert (await c.get(path, headers={"authorization": "Bearer caller"})).status_code == 401
            assert (await c.get(path, headers={"authorization": "Bearer admin"})).status_code == 200
        # Admin keys are not caller keys either.
        assert (await c.get("/v1/models", headers={"authorization": "Bearer admin"})).status_code == 401
        # The page holds no data: it is open, and asks for a key when /catalog wants one.
        assert (await c.get("/ui")).status_code == 200


async def test_without_admin_keys_the_caller_keys_guard_them(
    redis_server: RedisServer, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IOP_TEST_KEYS", "caller")
    async with AsyncTestClient(create_app(make_config(redis_server.url, api={"api_keys_env": "IOP_TEST_KEYS"}))) as c:
        assert (await c.get("/catalog")).status_code == 401
        assert (await c.get("/catalog", headers={"authorization": "Bearer caller"})).status_code == 200
