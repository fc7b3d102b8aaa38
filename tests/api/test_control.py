"""The runtime control endpoints (api/control.py): drain, resume and read a provider's drain
state, behind the admin keys -- and, without any key, open to loopback clients only; the
catalog and /metrics show it.

The test client always says its peer is ``testclient``; :class:`FromPeer` sets the address a
request comes from, as the server's socket would (``tests/e2e/test_admin_exposure.py``
does the same through real sockets)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from litestar import Litestar
from litestar.enums import ScopeType
from litestar.testing import AsyncTestClient
from litestar.types import Receive, Scope, Send
from redis.asyncio import Redis

from api.app import create_app
from api.auth import exposure_notes, is_loopback, listens_on_loopback
from dispatcher import keys
from iop.redis_server import RedisServer
from tests.api.app_config import make_config
from tests.api.prometheus import samples

pytestmark = pytest.mark.anyio

ADMIN = {"authorization": "Bearer admin"}
WRITES = ("/admin/providers/p/drain", "/admin/providers/p/resume")
LOOPBACK = ("127.0.0.1", "127.8.9.10", "::1", "::ffff:127.0.0.1")
# Other machines, this machine's own non-loopback addresses, and peers the server could not name.
REMOTE = ("192.0.2.2", "10.0.0.7", "::ffff:10.0.0.7", "2001:db8::1", "fe80::1%eth0", "::127.0.0.1", "testclient",
          None)


class FromPeer:
    """The app, its requests coming from ``host`` (None: no address, as from a unix socket);
    a test may change ``host`` between requests."""

    def __init__(self, app: Litestar, host: str | None) -> None:
        self.app = app
        self.host = host

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == ScopeType.HTTP:
            scope["client"] = (self.host, 50000) if self.host is not None else None
        await self.app(scope, receive, send)


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


@pytest.mark.parametrize("peer", ["testclient", "127.0.0.1"])
async def test_caller_keys_never_drain_without_admin_keys(
    redis_server: RedisServer, redis: Redis, monkeypatch: pytest.MonkeyPatch, peer: str
) -> None:
    # Without admin keys the read-only surfaces take the caller keys; runtime control refuses,
    # from loopback too: with keys configured, keys decide, never the address.
    monkeypatch.setenv("IOP_TEST_KEYS", "caller")
    config = make_config(redis_server.url, api={"api_keys_env": "IOP_TEST_KEYS"})
    caller = {"authorization": "Bearer caller"}
    async with AsyncTestClient(FromPeer(create_app(config), peer)) as c:
        for path in WRITES:
            assert (await c.post(path)).status_code == 401
            resp = await c.post(path, headers=caller)
            assert resp.status_code == 403
            assert resp.json()["error"]["code"] == "admin_key_required"
            assert "api.admin_keys_env" in resp.json()["error"]["message"]
        assert (await c.get("/catalog", headers=caller)).status_code == 200
        # The read shows what /catalog shows, so it takes /catalog's keys.
        assert (await c.get("/admin/providers/p")).status_code == 401
        resp = await c.get("/admin/providers/p", headers=caller)
        assert resp.status_code == 200
        assert resp.json() == {"provider": "p", "drain": None, "in_flight": 0}
    assert not await redis.hexists(keys.provider("p"), "drain")


async def test_an_open_api_drains_for_loopback_clients_only(redis_server: RedisServer, redis: Redis) -> None:
    app = FromPeer(create_app(make_config(redis_server.url)), None)
    async with AsyncTestClient(app) as c:
        for peer in REMOTE:
            app.host = peer
            for path in WRITES:
                # A forwarding header is the client's word, not its address.
                resp = await c.post(path, headers={"x-forwarded-for": "127.0.0.1", "x-real-ip": "127.0.0.1"})
                assert resp.status_code == 403, (peer, path, resp.text)
                error = resp.json()["error"]
                assert (error["code"], error["type"]) == ("admin_key_required", "permission_error")
                assert "loopback" in error["message"]
                assert "api.admin_keys_env" in error["message"]
            # The read is open, like /catalog on an open API.
            assert (await c.get("/admin/providers/p")).json()["drain"] is None
        assert not await redis.hexists(keys.provider("p"), "drain")
        for peer in LOOPBACK:
            app.host = peer
            resp = await c.post("/admin/providers/p/drain")
            assert resp.status_code == 200, (peer, resp.text)
            assert resp.json()["drain"] == "drained"
            assert await redis.hexists(keys.provider("p"), "drain")
            assert (await c.post("/admin/providers/p/resume")).json()["drain"] is None
            assert not await redis.hexists(keys.provider("p"), "drain")


async def test_admin_keys_let_a_remote_client_drain(
    keyed: Any, redis_server: RedisServer, redis: Redis
) -> None:
    remote = "192.0.2.2"
    # The same remote client, on an API without keys, is refused...
    async with AsyncTestClient(FromPeer(create_app(make_config(redis_server.url)), remote)) as c:
        resp = await c.post("/admin/providers/p/drain", headers=ADMIN)
        assert resp.status_code == 403
        assert resp.json()["error"]["code"] == "admin_key_required"
    assert not await redis.hexists(keys.provider("p"), "drain")
    # ... and with admin keys the key decides, wherever the client is: loopback is no key.
    app = FromPeer(create_app(keyed), None)
    async with AsyncTestClient(app) as c:
        for peer in (remote, "127.0.0.1"):
            app.host = peer
            for path in WRITES:
                assert (await c.post(path)).status_code == 401
                assert (await c.post(path, headers={"authorization": "Bearer nope"})).status_code == 401
            resp = await c.post("/admin/providers/p/drain", headers=ADMIN)
            assert resp.status_code == 200
            assert resp.json()["drain"] == "drained"
            assert (await c.post("/admin/providers/p/resume", headers=ADMIN)).json()["drain"] is None


@pytest.mark.parametrize("peer", LOOPBACK)
def test_loopback_peers(peer: str) -> None:
    assert is_loopback(peer)


@pytest.mark.parametrize("peer", REMOTE)
def test_remote_peers(peer: str | None) -> None:
    assert not is_loopback(peer)


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("localhost", True), ("::1", True), ("127.0.1.1", True),
    ("0.0.0.0", False), ("::", False), ("", False), ("192.0.2.2", False), ("gateway.internal", False),
])
def test_listens_on_loopback(host: str, loopback: bool) -> None:
    assert listens_on_loopback(host) is loopback


def _notes(api: dict[str, Any], host: str) -> list[tuple[int, str]]:
    return exposure_notes(make_config("redis://127.0.0.1:6379/0", api=api).api, host)


def test_exposure_notes() -> None:
    # No keys, beyond loopback: a warning, and the note that control is loopback-only.
    warning, note = _notes({}, "0.0.0.0")
    assert warning[0] == logging.WARNING
    assert "listens on 0.0.0.0, beyond loopback, with no keys" in warning[1]
    assert note[0] == logging.INFO
    assert "loopback clients only" in note[1]
    # On loopback only the note; with caller keys, control answers no one; with admin keys, nothing to say.
    assert _notes({}, "127.0.0.1") == [note]
    (refused,) = _notes({"api_keys_env": "K"}, "0.0.0.0")
    assert refused[0] == logging.INFO
    assert "refused to everyone" in refused[1]
    assert _notes({"keys": [{"name": "t", "key_sha256": "0" * 64}]}, "::") == [refused]
    assert _notes({"admin_keys_env": "A"}, "0.0.0.0") == []
    assert _notes({"admin_keys_env": "A", "api_keys_env": "K"}, "::") == []


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
    async with AsyncTestClient(FromPeer(create_app(config), "127.0.0.1")) as c:
        resp = await c.post("/admin/providers/p/drain")
        assert resp.status_code == 503
        assert resp.json()["error"]["code"] == "redis_unavailable"
