"""``api/gateway.py`` on its own: what a reload swaps (one runtime, which requests already
running keep), what it refuses, and what it publishes, against a private Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from redis.asyncio import Redis

from api.gateway import Gateway
from dispatcher import config as cfg
from dispatcher import keys
from iop.redis_server import RedisServer

pytestmark = pytest.mark.anyio


def document(redis_url: str, capacity: int = 2, **api: Any) -> dict[str, Any]:
    return {
        "redis": {"url": redis_url},
        "api": {"max_streams": 10, **api},
        "models": [{"id": "m", "providers": {"p": "served"}}],
        "nodes": [{"id": "n", "providers": [
            {"id": "p", "type": "vllm", "base_url": "http://127.0.0.1:9", "models": ["served"],
             "capacity": capacity}]}],
    }


@pytest.fixture
async def setup(redis_server: RedisServer, tmp_path: Path) -> AsyncIterator[tuple[Gateway, Path, Redis]]:
    path = tmp_path / "iop.yaml"
    tenants = {"keys": [{"name": "a", "key_sha256": "0" * 64, "max_in_flight": 1},
                        {"name": "b", "key_sha256": "1" * 64}]}
    path.write_text(yaml.safe_dump(document(redis_server.url, **tenants)))
    gw = Gateway(cfg.load(path).config, str(path))
    redis = Redis.from_url(redis_server.url)
    await redis.flushall()
    yield gw, path, redis
    await gw.clients.aclose()
    await redis.aclose()


async def test_a_reload_swaps_one_runtime_and_a_running_request_keeps_its_own(
    setup: tuple[Gateway, Path, Redis],
) -> None:
    gw, path, redis = setup
    before = gw.runtime  # what a request that started now holds
    tenants = {"keys": [{"name": "a", "key_sha256": "0" * 64, "max_in_flight": 3},
                        {"name": "b", "key_sha256": "1" * 64}]}
    new = document(gw.config.redis.url or "", capacity=5, max_streams=20, **tenants)
    new["models"].append({"id": "m2", "providers": {"p": "served"}})
    path.write_text(yaml.safe_dump(new))
    assert await gw.reload()
    assert gw.runtime is not before
    assert set(gw.runtime.models) == {"m", "m2"}
    assert set(before.models) == {"m"}
    assert gw.runtime.jobs.calls.plans is gw.runtime.plans
    assert gw.reaper.calls is gw.runtime.calls  # the reaper works from the new config
    assert gw.streams.limit == 20
    # The tenants' max_in_flight, where dispatch reads them.
    assert await redis.hgetall(keys.TENANT_LIMITS) == {b"a": b"3"}


async def test_an_invalid_file_keeps_the_runtime(setup: tuple[Gateway, Path, Redis]) -> None:
    gw, path, _ = setup
    before = gw.runtime
    bad = document(gw.config.redis.url or "")
    bad["models"][0]["providers"] = {"nowhere": "x"}
    path.write_text(yaml.safe_dump(bad))
    assert not await gw.reload()
    assert gw.runtime is before


async def test_a_gateway_without_a_file_does_not_reload(redis_server: RedisServer) -> None:
    gw = Gateway(cfg.parse(document(redis_server.url)).config)
    try:
        before = gw.runtime
        assert not await gw.reload()
        assert gw.runtime is before
    finally:
        await gw.clients.aclose()


async def test_job_ids_are_unique_within_and_across_processes(redis_server: RedisServer) -> None:
    config = cfg.parse(document(redis_server.url)).config
    one, two = Gateway(config), Gateway(config)
    try:
        ids = [one.next_job_id() for _ in range(1000)] + [two.next_job_id() for _ in range(1000)]
        assert len(set(ids)) == 2000
    finally:
        await one.clients.aclose()
        await two.clients.aclose()
