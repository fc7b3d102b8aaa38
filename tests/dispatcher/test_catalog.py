"""The catalog read from real Redis: every field, every health case, and the same
health rule as the dispatcher."""

from __future__ import annotations

import json
from typing import Any

import pytest
from redis.asyncio import Redis

from dispatcher import config as cfg
from dispatcher import keys
from dispatcher.catalog import Catalog, ProviderView, read_catalog
from dispatcher.lifecycle import LifecycleFlags
from tests.dispatcher.test_scripts import Harness

pytestmark = pytest.mark.anyio


def catalog_config() -> cfg.Config:
    def http(pid: str, ptype: str, cap: int, models: list[str], **extra: Any) -> dict[str, Any]:
        return {"id": pid, "type": ptype, "base_url": "http://127.0.0.1:1", "capacity": cap, "models": models,
                **extra}

    return cfg.parse({
        "models": [
            {"id": "qwen", "display_name": "Qwen", "providers": {"up": "qwen-up", "sick": "qwen-sick",
                                                                 "ghost": "qwen-ghost"}},
            {"id": "tiny", "providers": {"up": "tiny-up", "tool": "tiny-tool", "zero": "tiny-zero"}},
            {"id": "cloud", "providers": {"stale": "cloud-stale"}},
        ],
        "nodes": [
            {"id": "n1", "providers": [
                http("up", "vllm", 4, ["qwen-up", "tiny-up"]),
                http("sick", "ollama", 2, ["qwen-sick"]),
                {"id": "tool", "type": "cli", "command": ["true"], "capacity": 1, "models": ["tiny-tool"]},
            ]},
            {"id": "n2", "providers": [
                http("ghost", "lemonade", 2, ["qwen-ghost"]),
                http("zero", "sglang", 0, ["tiny-zero"]),
                http("stale", "openai_api", 8, ["cloud-stale"]),
            ]},
        ],
    }).config


@pytest.fixture
async def h(redis: Redis) -> Harness:
    harness = Harness(redis, catalog_config())
    harness.node.node_id = "n1"
    return harness


async def beat(h: Harness, pid: str, health: str = "available", reason: str = "",
               reported: list[str] | None = None, loaded: list[str] | None = None) -> None:
    prov = next(p for _, p in h.config.providers() if p.id == pid)
    fields: list[tuple[str, str | int]] = [
        ("capacity", prov.capacity), ("reason", reason),
        ("reported_models", json.dumps(reported) if reported is not None else ""),
        ("loaded_models", json.dumps(loaded) if loaded is not None else ""),
    ]
    await h.node.heartbeat(pid, health, fields)


async def read(h: Harness) -> tuple[Catalog, dict[str, ProviderView]]:
    doc = await read_catalog(h.redis, h.config)
    return doc, {p.id: p for p in doc.providers}


async def test_available_provider_has_every_field(h: Harness) -> None:
    await beat(h, "up", reported=["qwen-up", "other"], loaded=None)
    await h.submit("qwen")
    _, providers = await read(h)
    up = providers["up"]
    assert (up.id, up.node_id, up.type, up.category) == ("up", "n1", "vllm", "local_inference")
    assert (up.health, up.reason) == ("available", "")
    assert (up.capacity, up.in_flight, up.load_ratio) == (4, 1, 0.25)
    assert up.models == ["qwen-up", "tiny-up"]
    assert up.reported_models == ["qwen-up", "other"]
    assert up.missing_models == ["tiny-up"]  # configured, but the provider does not offer it
    assert up.loaded_models is None
    assert up.queued == 0
    assert up.lifecycle_capabilities == LifecycleFlags(list_models=True)
    assert up.heartbeat_age_ms is not None
    assert 0 <= up.heartbeat_age_ms < 10_000
    assert up.model_groups == ["qwen", "tiny"]


async def test_unavailable_provider_carries_its_probe_reason(h: Harness) -> None:
    await beat(h, "sick", "unavailable", "GET /api/tags answered 503", loaded=["qwen-sick"])
    _, providers = await read(h)
    sick = providers["sick"]
    assert (sick.health, sick.reason) == ("unavailable", "GET /api/tags answered 503")
    assert sick.loaded_models == ["qwen-sick"]
    assert sick.lifecycle_capabilities == LifecycleFlags(True, True, True, True, True)


async def test_never_seen_provider_is_unknown(h: Harness) -> None:
    _, providers = await read(h)
    ghost = providers["ghost"]
    assert ghost.health == "unknown"
    assert "never seen" in ghost.reason
    assert ghost.heartbeat_age_ms is None
    assert ghost.reported_models is None
    assert ghost.missing_models == []
    # Its configured capacity is still shown.
    assert (ghost.capacity, ghost.in_flight, ghost.load_ratio) == (2, 0, 0.0)


async def test_stale_heartbeat_is_unknown(h: Harness) -> None:
    await beat(h, "stale")
    await h.redis.hset(keys.provider("stale"), mapping={"hb_exp": 1, "hb_ms": 1})
    _, providers = await read(h)
    stale = providers["stale"]
    assert stale.health == "unknown"
    assert "stale heartbeat" in stale.reason
    assert stale.category == "api"


async def test_capacity_zero_is_unavailable_without_a_ratio(h: Harness) -> None:
    await beat(h, "zero")
    _, providers = await read(h)
    zero = providers["zero"]
    assert (zero.health, zero.reason) == ("unavailable", "capacity 0")
    assert zero.load_ratio is None


async def test_categories_of_every_kind(h: Harness) -> None:
    _, providers = await read(h)
    assert {p.category for p in providers.values()} == {"api", "cli", "local_inference"}
    assert providers["tool"].category == "cli"
    assert providers["tool"].lifecycle_capabilities == LifecycleFlags()


async def test_queued_counts_while_a_group_is_saturated(h: Harness) -> None:
    await beat(h, "up")
    await h.redis.hset(keys.provider("up"), "capacity", 1)
    for _ in range(3):
        await h.submit("qwen")
    doc, providers = await read(h)
    qwen = next(m for m in doc.models if m.id == "qwen")
    assert qwen.queued == 2
    assert qwen.oldest_wait_ms is not None
    assert qwen.oldest_wait_ms >= 0
    assert qwen.available_slots == 0
    assert providers["up"].queued == 2  # the groups it serves: qwen (2) + tiny (0)
    assert providers["sick"].queued == 2
    assert providers["zero"].queued == 0
    tiny = next(m for m in doc.models if m.id == "tiny")
    assert (tiny.queued, tiny.oldest_wait_ms) == (0, None)


async def test_model_groups_list_their_candidates(h: Harness) -> None:
    await beat(h, "up")
    doc, _ = await read(h)
    qwen = next(m for m in doc.models if m.id == "qwen")
    assert qwen.display_name == "Qwen"
    assert [(c.provider, c.served_name, c.node_id, c.health) for c in qwen.candidates] == [
        ("up", "qwen-up", "n1", "available"), ("sick", "qwen-sick", "n1", "unknown"),
        ("ghost", "qwen-ghost", "n2", "unknown")]
    assert qwen.available_slots == 4
    assert [(n.id, n.providers) for n in doc.nodes] == [("n1", ["up", "sick", "tool"]),
                                                         ("n2", ["ghost", "zero", "stale"])]


@pytest.mark.parametrize(
    "state",
    [
        {"health": "available"},
        {"health": "unavailable"},
        {"health": "available", "stale": True},
        {"health": "available", "capacity": 0},
        {"never": True},
    ],
    ids=["available", "unavailable", "stale", "capacity-0", "never-seen"],
)
async def test_catalog_and_dispatcher_agree_on_availability(h: Harness, state: dict[str, Any]) -> None:
    # 'cloud' has one candidate, 'stale': the catalog calls it available exactly when a job is dispatched to it.
    if not state.get("never"):
        await beat(h, "stale", state["health"])
        if state.get("stale"):
            await h.redis.hset(keys.provider("stale"), "hb_exp", 1)
        if "capacity" in state:
            await h.redis.hset(keys.provider("stale"), "capacity", state["capacity"])
    _, providers = await read(h)
    _, status = await h.submit("cloud")
    assert (providers["stale"].health == "available") == (status == "dispatched")
