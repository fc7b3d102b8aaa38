"""The runtime control endpoints (api/control.py): drain, resume and read a provider's drain
state, behind the admin keys; the catalog and /metrics show it."""

from __future__ import annotations

from typing import Any

import pytest
from litestar.testing import AsyncTestClient
from redis.asyncio import Redis

from api.app import create_app
from dispatcher import keys
from iop.redis_server import RedisServer
from tests.api.test_app import make_config
from tests.api.test_operator import samples

pytestmark = pytest.mark.anyio

ADMIN = {"authorization": "Bearer admin"}


@pytest.fixture
def keyed(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("IOP_TEST_KEYS", "caller")
    monkeypatch.setenv("IOP_TEST_ADMIN", "admin")
    return make_config(redis_server.url, api={"api_keys_env": "IOP_TEST_KEYS", "admin_keys_env": "IOP_TEST_ADMIN"})


async def test_drain_and_resume_need_an_admin_key(keyed: Any, redis: Redis) -> None:
    async with AsyncTestClient(create_app(keyed)) as c:
        for method, path in (("POST", "/admin/providers/p/drain"), ("POST", "/admin/providers/p/resume"),
                             ("GET", "/admin/providers/p")):
            assert (await c.request(method, path)).status_code == 401
            resp = await c.request(method, path, headers={"authorization": "Bearer caller"})
            assert resp.status_code == 401
            assert resp.json()["error"]["code"] == "invalid_api_key"
        # Nothing was changed by the refused calls.
        assert not await redis.hexists(keys.provider("p"), "drain")
        resp = await c.post("/admin/providers/p/drain", headers=ADMIN)
        assert resp.status_code == 200
        assert resp.json() == {"provider": "p", "drain": "drained", "in_flight": 0}
        assert await redis.hexists(keys.provider("p"), "drain")


async def test_caller_keys_never_drain_without_admin_keys(
    redis_server: RedisServer, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without admin keys the read-only surfaces take the caller keys; runtime control refuses.
    monkeypatch.setenv("IOP_TEST_KEYS", "caller")
    config = make_config(redis_server.url, api={"api_keys_env": "IOP_TEST_KEYS"})
    async with AsyncTestClient(create_app(config)) as c:
        assert (await c.post("/admin/providers/p/drain")).status_code == 401
        resp = await c.post("/admin/providers/p/drain", headers={"authorization": "Bearer caller"})
        assert resp.status_code == 403
        assert resp.json()["error"]["code"] == "admin_key_required"
        assert (await c.get("/catalog", headers={"authorization": "Bearer caller"})).status_code == 200
    assert not await redis.hexists(keys.provider("p"), "drain")


async def test_states_catalog_and_metrics(keyed: Any, redis: Redis) -> None:
    await redis.hset(keys.provider("p"), mapping={"health": "available", "hb_ms": 1, "hb_exp": 10**15,
                                                  "capacity": 2, "in_flight": 1})
    async with AsyncTestClient(create_app(keyed)) as c:
        assert (await c.get("/admin/providers/p", headers=ADMIN)).json() == {
            "provider": "p", "drain": None, "in_flight": 1}
        drained = (await c.post("/admin/providers/p/drain", headers=ADMIN)).json()
        assert drained == {"provider": "p", "drain": "draining", "in_flight": 1}
        (provider,) = (await c.get("/catalog", headers=ADMIN)).json()["providers"]
        assert (provider["health"], provider["drain"]) == ("available", "draining")
        values = samples((await c.get("/metrics", headers=ADMIN)).text)
        labels = (("category", "local_inference"), ("node", "n"), ("provider", "p"), ("type", "vllm"))
        assert values[("iop_provider_draining", labels)] == 1
        # Its running job ends (finish.lua releases the slot): drained.
        await redis.hset(keys.provider("p"), "in_flight", 0)
        assert (await c.get("/admin/providers/p", headers=ADMIN)).json()["drain"] == "drained"
        assert (await c.get("/catalog", headers=ADMIN)).json()["providers"][0]["drain"] == "drained"
        resumed = (await c.post("/admin/providers/p/resume", headers=ADMIN)).json()
        assert resumed == {"provider": "p", "drain": None, "in_flight": 0}
        values = samples((await c.get("/metrics", headers=ADMIN)).text)
        assert values[("iop_provider_draining", labels)] == 0
        assert (await c.get("/catalog", headers=ADMIN)).json()["providers"][0]["drain"] is None


async def test_unknown_provider_is_404(keyed: Any, redis: Redis) -> None:
    async with AsyncTestClient(create_app(keyed)) as c:
        for method, path in (("POST", "/admin/providers/nope/drain"), ("POST", "/admin/providers/nope/resume"),
                             ("GET", "/admin/providers/nope")):
            resp = await c.request(method, path, headers=ADMIN)
            assert resp.status_code == 404
            assert resp.json()["error"]["code"] == "provider_not_found"
    assert not await redis.exists(keys.provider("nope"))


async def test_redis_down_is_503() -> None:
    # An address nothing listens on: the control call fails like any Redis call of the API.
    config = make_config("redis://127.0.0.1:9", dispatch={"heartbeat_interval_ms": 200})
    async with AsyncTestClient(create_app(config)) as c:
        resp = await c.post("/admin/providers/p/drain")
        assert resp.status_code == 503
        assert resp.json()["error"]["code"] == "redis_unavailable"
