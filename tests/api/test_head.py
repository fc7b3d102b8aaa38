"""``HEAD`` on the pages a ``GET`` reads (``api/head.py``): the ``GET``'s status, type and
length, and no body -- in-process, and through uvicorn in a real ``iop api``."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from litestar.testing import AsyncTestClient
from redis.asyncio import Redis

from api.app import create_app
from iop.processes import Child, wait_http
from iop.redis_server import RedisServer, free_port
from tests.api.app_config import make_config
from tests.dispatcher.config.one_model import ONE_MODEL

pytestmark = pytest.mark.anyio

PAGES = ["/ui", "/catalog", "/metrics", "/healthz", "/readyz"]
# Their GET answers the same bytes each time (/catalog and /metrics count and time things).
STABLE = {"/ui", "/healthz", "/readyz"}


@pytest.fixture
async def client(redis_server: RedisServer, redis: Redis) -> AsyncIterator[AsyncTestClient[Any]]:
    async with AsyncTestClient(create_app(make_config(redis_server.url))) as c:
        yield c


@pytest.mark.parametrize("path", PAGES)
async def test_head_answers_like_get_without_the_body(client: AsyncTestClient[Any], path: str) -> None:
    head = await client.head(path)
    got = await client.get(path)
    assert head.status_code == got.status_code == 200
    assert head.content == b""
    assert head.headers["content-type"] == got.headers["content-type"]
    assert int(head.headers["content-length"]) > 0
    if path in STABLE:
        assert head.headers["content-length"] == got.headers["content-length"] == str(len(got.content))


async def test_head_of_an_unready_api_is_503_like_get(redis_server: RedisServer) -> None:
    nobody = f"redis://127.0.0.1:{free_port()}/0"  # (a port nothing listens on)
    config = make_config(nobody, redis={"url": nobody, "failover_hold_ms": 0})
    async with AsyncTestClient(create_app(config)) as c:
        head, got = await c.head("/readyz"), await c.get("/readyz")
    assert head.status_code == got.status_code == 503
    assert head.content == b""
    assert head.headers["content-length"] == str(len(got.content))


async def test_head_of_a_guarded_page_needs_the_key_get_needs(redis_server: RedisServer, redis: Redis,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IOP_TEST_ADMIN", "admin")
    config = make_config(redis_server.url, api={"admin_keys_env": "IOP_TEST_ADMIN"})
    async with AsyncTestClient(create_app(config)) as c:
        for path in ("/catalog", "/metrics"):
            assert (await c.head(path)).status_code == 401
            assert (await c.head(path, headers={"authorization": "Bearer admin"})).status_code == 200


def test_head_through_a_real_server(tmp_path: Path, redis_server: RedisServer) -> None:
    path = tmp_path / "iop.yaml"
    path.write_text(yaml.safe_dump({**ONE_MODEL, "redis": {"url": redis_server.url}}))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "IOP_REDIS_URL"}
    api = Child("api", [sys.executable, "-m", "iop", "api", "--config", str(path), "--port", str(port)], env,
                log_path=tmp_path / "api.log").start()
    try:
        wait_http(api, f"http://127.0.0.1:{port}/readyz")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            for page in PAGES:
                head, got = client.head(page), client.get(page)
                assert (head.status_code, head.content) == (200, b""), page
                assert head.headers["content-type"] == got.headers["content-type"], page
                if page in STABLE:
                    assert head.headers["content-length"] == str(len(got.content)), page
            # The connection is still good for the next request: no body was left on it.
            assert client.get("/healthz").json() == {"status": "ok"}
    finally:
        api.stop()
