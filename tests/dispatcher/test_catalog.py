"""The catalog read from real Redis: every field, every health case, and the same
health rule as the dispatcher."""

from __future__ import annotations

import json
import uuid
from typing import Any

import msgspec
import pytest
from redis.asyncio import Redis

from dispatcher import catalog, keys
from dispatcher import config as cfg
from dispatcher.capability_flags import LifecycleFlags, flags_for
from dispatcher.catalog import Catalog, ProviderView, read_catalog
from dispatcher.endpoints import DEFAULT_ENDPOINTS
from dispatcher.plans import Plans
from tests.dispatcher.harness import FairHarness, Harness

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
            {"id": "local", "providers": {"llama": "gguf", "picky": "picky-m"}},
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
            {"id": "n3", "providers": [
                http("llama", "llamacpp", 4, ["gguf"]),
                http("picky", "vllm", 2, ["picky-m"], endpoints=["chat/completions", "rerank"]),
            ]},
        ],
    }).config


@pytest.fixture
async def h(redis: Redis) -> Harness:
    harness = Harness(redis, catalog_config())
    harness.node.node_id = "n1"
    return harness


async def beat(h: Harness, pid: str, health: str = "available", reason: str = "",
               reported: list[str] | None = None, loaded: list[str] | None = None,
               slots: int | None = None, endpoints: list[str] | None = None) -> None:
    """A heartbeat with the fields a worker writes (workers/provider_state.py ``_heartbeat``)."""
    prov = next(p for _, p in h.config.providers() if p.id == pid)
    fields: list[tuple[str, str | int]] = [
        ("capacity", prov.capacity), ("reason", reason),
        ("reported_models", json.dumps(reported) if reported is not None else ""),
        ("loaded_models", json.dumps(loaded) if loaded is not None else ""),
        ("endpoints", json.dumps(endpoints if endpoints is not None else prov.served_endpoints)),
        ("slots", slots if slots is not None else ""),
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
    # vLLM loads and unloads only in sleep mode, which its config declares (lifecycle: managed).
    assert up.lifecycle_capabilities == LifecycleFlags(list_models=True)
    assert up.heartbeat_age_ms is not None
    assert 0 <= up.heartbeat_age_ms < 10_000
    assert up.model_groups == ["qwen", "tiny"]
    assert up.endpoints == list(DEFAULT_ENDPOINTS["vllm"])
    assert up.slots is None


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


async def test_a_provider_a_reload_removed_says_so_even_once_its_heartbeat_is_stale(h: Harness) -> None:
    # What a worker's reload writes of a provider it no longer has (workers/worker.py), then
    # nothing more: its heartbeat runs out.
    await beat(h, "stale", "unavailable", "removed from the config")
    await h.redis.hset(keys.provider("stale"), "removed", 1)
    _, providers = await read(h)
    assert (providers["stale"].health, providers["stale"].reason) == ("unavailable",
                                                                      "removed from the config by a reload")
    await h.redis.hset(keys.provider("stale"), mapping={"hb_exp": 1, "hb_ms": 1})
    _, providers = await read(h)
    assert (providers["stale"].health, providers["stale"].reason) == ("unavailable",
                                                                      "removed from the config by a reload")
    # Back in the config: its worker's heartbeat clears the mark (workers/provider_state.py).
    await beat(h, "stale")
    await h.redis.hset(keys.provider("stale"), "removed", "")
    _, providers = await read(h)
    assert (providers["stale"].health, providers["stale"].reason) == ("available", "")


async def test_a_drain_leaves_health_to_the_probe(h: Harness) -> None:
    await beat(h, "zero")
    await h.redis.hset(keys.provider("zero"), "drain", 1)
    _, providers = await read(h)
    assert (providers["zero"].health, providers["zero"].reason, providers["zero"].drain) == (
        "unavailable", "capacity 0", "drained")


async def test_categories_of_every_kind(h: Harness) -> None:
    _, providers = await read(h)
    assert {p.category for p in providers.values()} == {"api", "cli", "local_inference"}
    assert providers["tool"].category == "cli"
    assert providers["tool"].lifecycle_capabilities == LifecycleFlags()
    assert providers["zero"].lifecycle_capabilities == LifecycleFlags(list_models=True)  # sglang


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
                                                         ("n2", ["ghost", "zero", "stale"]),
                                                         ("n3", ["llama", "picky"])]


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


# --- endpoints and the slots hint ------------------------------------------------------------


async def test_slots_hint_is_shown_beside_the_capacity(h: Harness) -> None:
    await beat(h, "llama", slots=8)
    doc, providers = await read(h)
    llama = providers["llama"]
    assert (llama.type, llama.category) == ("llamacpp", "local_inference")
    assert (llama.capacity, llama.slots) == (4, 8)
    # llama-server loads and unloads only in router mode, which its config declares.
    assert llama.lifecycle_capabilities == LifecycleFlags(list_models=True)
    assert llama.endpoints == list(DEFAULT_ENDPOINTS["llamacpp"])
    # A hint only: the free slots of its group follow the capacity.
    local = next(m for m in doc.models if m.id == "local")
    assert local.available_slots == 4
    # The JSON /catalog serves carries both fields.
    wire = json.loads(msgspec.json.encode(doc))
    entry = next(p for p in wire["providers"] if p["id"] == "llama")
    assert (entry["slots"], entry["capacity"]) == (8, 4)
    assert entry["endpoints"] == list(DEFAULT_ENDPOINTS["llamacpp"])


async def test_slots_unknown_is_none(h: Harness) -> None:
    await beat(h, "llama")  # the runtime did not say: the worker writes ""
    _, providers = await read(h)
    assert providers["llama"].slots is None
    for raw in ("0", "-3", "many"):
        await h.redis.hset(keys.provider("llama"), "slots", raw)
        _, providers = await read(h)
        assert providers["llama"].slots is None, raw


async def test_slots_follow_the_latest_heartbeat(h: Harness) -> None:
    await beat(h, "llama", slots=8)
    await beat(h, "llama", slots=2)
    _, providers = await read(h)
    assert providers["llama"].slots == 2
    await beat(h, "llama", "unavailable", "loading model")
    _, providers = await read(h)
    assert (providers["llama"].health, providers["llama"].reason, providers["llama"].slots) == (
        "unavailable", "loading model", None)


async def test_endpoints_come_from_the_heartbeat(h: Harness) -> None:
    # The worker's word wins (its config may be newer than this API's).
    await beat(h, "up", endpoints=["chat/completions", "embeddings"])
    _, providers = await read(h)
    assert providers["up"].endpoints == ["chat/completions", "embeddings"]
    await beat(h, "up", endpoints=[])
    _, providers = await read(h)
    assert providers["up"].endpoints == []


async def test_endpoints_fall_back_to_the_config(h: Harness) -> None:
    # Never seen: nothing in Redis, so the config's (explicit list, or the type's default).
    _, providers = await read(h)
    assert providers["picky"].endpoints == ["chat/completions", "rerank"]
    assert providers["ghost"].endpoints == list(DEFAULT_ENDPOINTS["lemonade"])
    assert providers["tool"].endpoints == list(DEFAULT_ENDPOINTS["cli"])
    # A heartbeat of a worker that predates the field: no 'endpoints' in the hash.
    await beat(h, "picky")
    await h.redis.hdel(keys.provider("picky"), "endpoints", "slots")
    _, providers = await read(h)
    assert providers["picky"].health == "available"
    assert providers["picky"].endpoints == ["chat/completions", "rerank"]
    assert providers["picky"].slots is None


async def test_every_provider_has_endpoints_and_slots(h: Harness) -> None:
    for pid in ("up", "sick", "tool", "stale", "llama", "picky"):
        await beat(h, pid)
    _, providers = await read(h)
    for pid, view in providers.items():
        prov = next(p for _, p in h.config.providers() if p.id == pid)
        assert view.endpoints == list(prov.served_endpoints), pid
        assert view.slots is None, pid


# --- tenants (flow control) ------------------------------------------------------------------


def tenants_config(api: dict[str, Any] | None = None) -> cfg.Config:
    """Two model groups on one provider each (one slot), and three tenants in three bands."""
    return cfg.parse({
        "queue": {"max_queue": 1000},
        "api": api if api is not None else {
            "priorities": ["interactive", "standard", "batch"],
            "keys": [
                {"name": "web", "key_sha256": "1" * 64, "priority": "interactive", "weight": 3, "max_in_flight": 2},
                {"name": "eval", "key_sha256": "2" * 64, "priority": "batch", "max_queued": 50, "models": ["big*"]},
                {"name": "ops", "key_sha256": "3" * 64},
            ],
        },
        "nodes": [{"id": "n1", "providers": [
            {"id": p, "type": "vllm", "base_url": "http://127.0.0.1:1", "capacity": 1, "models": [f"{p}-m"]}
            for p in ("pa", "pb")]}],
        "models": [{"id": "big", "providers": {"pa": "pa-m"}}, {"id": "small", "providers": {"pb": "pb-m"}}],
    }).config


async def tenant_harness(redis: Redis, config: cfg.Config) -> FairHarness:
    h = FairHarness(redis, config)
    await h.start()
    return h


async def send(h: FairHarness, tenant: str, model: str) -> str:
    """Submit one job of ``tenant`` to ``model`` in the tenant's band; its id."""
    t = h.tenants.by_name[tenant]
    plans = h.calls.plans
    lane = plans.banded(plans.main_lane(model), t.band)
    job = t.job_id(uuid.uuid4().hex[:12])
    await h.api.submit(job, lane, b'{"model":"%s"}' % model.encode(), "chat/completions", False, tenant=t)
    return job


def uses(doc: Catalog, model: str) -> list[tuple[str, int, int]]:
    return [(u.tenant, u.queued, u.in_flight) for u in next(m for m in doc.models if m.id == model).tenants]


async def test_tenants_queued_and_in_flight_per_model_group(redis: Redis) -> None:
    h = await tenant_harness(redis, tenants_config())
    first = await send(h, "eval", "big")  # dispatched: big's one slot
    for _ in range(3):
        await send(h, "eval", "big")
    await send(h, "web", "big")
    await send(h, "ops", "small")  # dispatched: small's one slot
    await send(h, "web", "small")
    doc = await read_catalog(h.redis, h.config)
    # The jobs of a model group wait in a lane per band: its queued is all of them.
    big = next(m for m in doc.models if m.id == "big")
    assert big.queued == 4
    assert big.oldest_wait_ms is not None
    assert uses(doc, "big") == [("web", 1, 0), ("eval", 3, 1)]
    assert uses(doc, "small") == [("web", 1, 0), ("ops", 0, 1)]
    views = {t.name: t for t in doc.tenants}
    assert list(views) == ["web", "eval", "ops"]  # config order; no 'default': nobody can be it
    web, ev, ops = views["web"], views["eval"], views["ops"]
    assert (web.band, web.weight, web.models, web.max_queued, web.max_in_flight) == ("interactive", 3.0, None,
                                                                                     None, 2)
    assert (ev.band, ev.weight, ev.models, ev.max_queued, ev.max_in_flight) == ("batch", 1.0, ["big"], 50, None)
    assert ops.band == "standard"
    assert [(t.queued, t.in_flight) for t in (web, ev, ops)] == [(2, 0), (3, 1), (0, 1)]
    # The freed slot goes to the interactive band: the counters follow.
    await h.node.finish(await h.assignment(first), b"", mode="done")
    doc = await read_catalog(h.redis, h.config)
    assert uses(doc, "big") == [("web", 0, 1), ("eval", 3, 0)]
    assert [(t.name, t.queued, t.in_flight) for t in doc.tenants] == [("web", 1, 1), ("eval", 3, 0), ("ops", 0, 1)]
    # The JSON /catalog serves.
    wire = json.loads(msgspec.json.encode(doc))
    assert wire["tenants"][1] == {"name": "eval", "band": "batch", "weight": 1.0, "models": ["big"],
                                  "max_queued": 50, "max_in_flight": None, "queued": 3, "in_flight": 0,
                                  "limits": None}
    assert next(m for m in wire["models"] if m["id"] == "small")["tenants"] == [
        {"tenant": "web", "queued": 1, "in_flight": 0}, {"tenant": "ops", "queued": 0, "in_flight": 1}]


async def test_tenant_counters_of_names_outside_the_config_are_not_read(redis: Redis) -> None:
    h = await tenant_harness(redis, tenants_config())
    await redis.hset(keys.TENANTS, mapping={"q:gone": 5, "q:gone:big": 5, "r:web": -1, "r:web:big": -1,
                                            "q:ops": 2, "q:ops:small": 2})
    doc = await read_catalog(h.redis, h.config)
    assert [t.name for t in doc.tenants] == ["web", "eval", "ops"]
    assert [(t.queued, t.in_flight) for t in doc.tenants] == [(0, 0), (0, 0), (2, 0)]
    assert uses(doc, "big") == []
    assert uses(doc, "small") == [("ops", 2, 0)]
    # 'default' is no configured tenant here: shown only while it has jobs (a tenant header naming it).
    await redis.hset(keys.TENANTS, mapping={"r:default": 1, "r:default:big": 1})
    doc = await read_catalog(h.redis, h.config)
    assert [t.name for t in doc.tenants] == ["web", "eval", "ops", "default"]
    assert uses(doc, "big") == [("default", 0, 1)]


async def test_default_tenant_is_listed_beside_named_keys(redis: Redis) -> None:
    config = tenants_config({"api_keys_env": "IOP_TEST_KEYS", "keys": [{"name": "web", "key_sha256": "1" * 64}]})
    h = await tenant_harness(redis, config)
    await send(h, "default", "big")
    await send(h, "default", "big")
    doc = await read_catalog(h.redis, h.config)
    assert [(t.name, t.band, t.queued, t.in_flight) for t in doc.tenants] == [
        ("web", "standard", 0, 0), ("default", "standard", 1, 1)]
    assert uses(doc, "big") == [("default", 1, 1)]


async def test_without_flow_control_there_are_no_tenants(h: Harness) -> None:
    await beat(h, "up")
    await h.redis.hset(keys.provider("up"), "capacity", 1)
    await h.submit("qwen")
    await h.submit("qwen")
    doc, _ = await read(h)
    assert doc.tenants == []
    assert all(m.tenants == [] for m in doc.models)
    assert next(m for m in doc.models if m.id == "qwen").queued == 1
    assert json.loads(msgspec.json.encode(doc))["tenants"] == []


async def test_what_a_config_implies_is_built_once_per_config(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[cfg.Config] = []
    real = catalog.Plans

    def counting(config: cfg.Config) -> Plans:
        built.append(config)
        return real(config)

    monkeypatch.setattr(catalog, "Plans", counting)
    first, _ = await read(h)
    again, _ = await read(h)
    assert built == [h.config]
    assert [p.id for p in again.providers] == [p.id for p in first.providers]
    other = catalog_config()  # an equal config, but another one (a reload): built anew
    await read_catalog(h.redis, other)
    assert len(built) == 2
    assert built[1] is other


def test_a_managed_router_or_sleeping_vllm_says_it_loads_and_unloads() -> None:
    loads = LifecycleFlags(list_models=True, load_model=True, unload_model=True)
    assert flags_for("llamacpp", managed=True) == flags_for("vllm", managed=True) == loads
    assert flags_for("sglang", managed=True) == LifecycleFlags(list_models=True)
    assert flags_for("ollama") == flags_for("ollama", managed=True)
