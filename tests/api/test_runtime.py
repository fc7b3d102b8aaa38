"""api/runtime.py: what one config means to an API process, built once. A reload builds a
new Runtime and the old one keeps meaning its own config (a request finishes with the one it
started with)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from api.runtime import Runtime
from dispatcher import config as cfg
from dispatcher.exceptions import Unauthorized
from dispatcher.scripts import Scripts
from iop.redis_server import RedisServer

pytestmark = pytest.mark.anyio


def config(models: dict[str, dict[str, Any]], **top: Any) -> cfg.Config:
    """Models (id -> their own settings) on one provider p of node n1."""
    return cfg.parse({
        **top,
        "nodes": [{"id": "n1", "providers": [
            {"id": "p", "type": "vllm", "base_url": "http://127.0.0.1:1", "models": [f"{m}@p" for m in models]}]}],
        "models": [{"id": m, "providers": {"p": f"{m}@p"}, **opts} for m, opts in models.items()],
    }).config


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


def build(redis: Redis, loaded: cfg.Config) -> Runtime:
    return Runtime.build(loaded, Scripts(redis), redis, "rep1")


async def test_the_models_are_the_configs_by_id_in_its_order(redis: Redis) -> None:
    loaded = config({"b": {}, "a": {"display_name": "A"}})
    rt = build(redis, loaded)
    assert list(rt.models) == ["b", "a"]
    assert rt.models["a"] is loaded.model("a")
    assert rt.config is loaded


async def test_its_script_calls_and_plans_are_its_jobs_own(redis: Redis) -> None:
    rt = build(redis, config({"m": {}}))
    assert rt.calls is rt.jobs.calls
    assert rt.plans is rt.jobs.calls.plans
    assert rt.plans.main_lane("m").model == "m"


async def test_the_wait_rules_come_from_its_config(redis: Redis) -> None:
    rt = build(redis, config({"m": {}, "slow": {"queue_timeout_ms": 90_000}},
                             queue={"queue_timeout_ms": 4_000}, dispatch={"lease_ms": 6_000},
                             redis={"failover_hold_ms": 2_500}))
    rules = rt.wait_rules
    assert rules.watch_s == 6.0  # a lease period
    assert rules.hold_s == 2.5
    assert rules.queue_timeout_ms("m") == 4_000  # the queue's
    assert rules.queue_timeout_ms("slow") == 90_000  # the model's own


async def test_a_model_a_reload_removed_still_has_a_queue_timeout(redis: Redis) -> None:
    rt = build(redis, config({"m": {}}, queue={"queue_timeout_ms": 4_000}))
    assert rt.wait_rules.queue_timeout_ms("gone") == 4_000


async def test_a_new_runtime_leaves_the_old_one_as_it_was(redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RT_KEYS", "k-old")
    old = build(redis, config({"m": {}}, api={"api_keys_env": "RT_KEYS"}, queue={"queue_timeout_ms": 4_000}))
    monkeypatch.setenv("RT_KEYS", "k-new")
    new = build(redis, config({"m": {}, "n": {}}, api={"api_keys_env": "RT_KEYS"},
                              queue={"queue_timeout_ms": 8_000}))
    assert list(old.models) == ["m"]
    assert list(new.models) == ["m", "n"]
    assert old.wait_rules.queue_timeout_ms("m") == 4_000
    assert new.wait_rules.queue_timeout_ms("m") == 8_000
    # Each checks the caller keys of its own config, read when it was built.
    assert old.callers.tenant_of({"authorization": "Bearer k-old"}).name == "default"
    assert new.callers.tenant_of({"authorization": "Bearer k-new"}).name == "default"
    with pytest.raises(Unauthorized):
        old.callers.tenant_of({"authorization": "Bearer k-new"})
