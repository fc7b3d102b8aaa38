"""The read-only provider catalog: what every provider of every pool looks
like right now, read from Redis, so every API replica shows the same thing.

Health uses exactly the dispatcher's rule (``lua/lib/pump.lua``): a provider is
*available* when its worker reported it healthy, its heartbeat is fresh and its
capacity is above zero. Otherwise it is *unavailable* (it answered, badly: the probe's
reason) or *unknown* (no fresh word from its worker: never seen, or a stale heartbeat).
"""

from __future__ import annotations

import json
from typing import Any, cast

import msgspec
from redis.asyncio import Redis

from dispatcher import keys
from dispatcher.config import Config, ProviderConfig
from dispatcher.lifecycle import LifecycleFlags, flags_for


class ProviderView(msgspec.Struct):
    id: str
    node_id: str
    type: str
    category: str
    health: str  # available | unavailable | unknown
    reason: str
    capacity: int
    in_flight: int
    load_ratio: float | None
    models: list[str]
    reported_models: list[str] | None
    missing_models: list[str]  # configured served names the provider does not report
    loaded_models: list[str] | None
    queued: int
    lifecycle_capabilities: LifecycleFlags
    heartbeat_age_ms: int | None
    model_groups: list[str]


class CandidateView(msgspec.Struct):
    provider: str
    served_name: str
    node_id: str
    health: str
    capacity: int
    in_flight: int
    load_ratio: float | None


class ModelView(msgspec.Struct):
    id: str
    display_name: str
    candidates: list[CandidateView]
    queued: int
    oldest_wait_ms: int | None
    available_slots: int


class NodeView(msgspec.Struct):
    id: str
    providers: list[str]


class Catalog(msgspec.Struct):
    server_time_ms: int
    providers: list[ProviderView]
    models: list[ModelView]
    nodes: list[NodeView]


def classify(fields: dict[str, str], now_ms: int) -> tuple[str, str]:
    """(health, reason) of a provider's Redis hash, by the dispatcher's own rule."""
    if "hb_ms" not in fields:
        return "unknown", "never seen: no heartbeat from its worker yet"
    if int(fields.get("hb_exp", 0)) < now_ms:
        age_s = (now_ms - int(fields["hb_ms"])) / 1000
        return "unknown", f"stale heartbeat: last one {age_s:.1f}s ago"
    if fields.get("health") != "available":
        return "unavailable", fields.get("reason") or "reported unavailable"
    if int(fields.get("capacity", 0)) <= 0:
        return "unavailable", "capacity 0"
    return "available", ""


def _json_list(raw: str | None) -> list[str] | None:
    if not raw:
        return None
    value = json.loads(raw)
    return [str(v) for v in value] if isinstance(value, list) else None


async def read_catalog(redis: Redis, config: Config) -> Catalog:
    providers = [(node.id, prov) for node, prov in config.providers()]
    async with redis.pipeline(transaction=False) as pipe:
        pipe.time()
        for _, prov in providers:
            pipe.hgetall(keys.provider(prov.id))
        for model in config.models:
            pipe.zcard(keys.queue(model.id))
            pipe.zrange(keys.queue(model.id), 0, 0)
        replies: list[Any] = await pipe.execute()
    sec, usec = replies[0]
    now = int(sec) * 1000 + int(usec) // 1000
    hashes = [
        {k.decode(): v.decode() for k, v in cast(dict[bytes, bytes], h).items()}
        for h in replies[1 : 1 + len(providers)]
    ]
    queue_replies = replies[1 + len(providers):]
    queued = {m.id: int(queue_replies[2 * i]) for i, m in enumerate(config.models)}
    heads = {m.id: queue_replies[2 * i + 1][0].decode() for i, m in enumerate(config.models)
             if queue_replies[2 * i + 1]}
    head_records = await redis.hmget(keys.JOBS, list(heads.values())) if heads else []
    oldest: dict[str, int] = {}
    for model_id, raw in zip(heads, head_records, strict=True):
        if raw is not None:
            oldest[model_id] = max(now - int(json.loads(raw).get("t0", now)), 0)

    groups_of: dict[str, list[str]] = {}
    for model in config.models:
        for pid in model.providers:
            groups_of.setdefault(pid, []).append(model.id)

    views: dict[str, ProviderView] = {}
    for (node_id, prov), fields in zip(providers, hashes, strict=True):
        views[prov.id] = _provider_view(node_id, prov, fields, now, groups_of.get(prov.id, []), queued)

    models = []
    for model in config.models:
        cands = [
            CandidateView(pid, served, v.node_id, v.health, v.capacity, v.in_flight, v.load_ratio)
            for pid, served in model.providers.items()
            if (v := views.get(pid)) is not None
        ]
        free = sum(max(c.capacity - c.in_flight, 0) for c in cands if c.health == "available")
        models.append(ModelView(model.id, model.display_name or model.id, cands, queued[model.id],
                                oldest.get(model.id), free))
    nodes = [NodeView(n.id, [p.id for p in n.providers]) for n in config.nodes]
    return Catalog(now, list(views.values()), models, nodes)


def _provider_view(
    node_id: str, prov: ProviderConfig, fields: dict[str, str], now: int, groups: list[str], queued: dict[str, int]
) -> ProviderView:
    health, reason = classify(fields, now)
    capacity = int(fields["capacity"]) if "capacity" in fields else prov.capacity
    in_flight = int(fields.get("in_flight", 0))
    reported = _json_list(fields.get("reported_models"))
    missing = [m for m in prov.models if reported is not None and m not in reported]
    hb_ms = fields.get("hb_ms")
    return ProviderView(
        id=prov.id,
        node_id=node_id,
        type=prov.type,
        category=prov.effective_category,
        health=health,
        reason=reason,
        capacity=capacity,
        in_flight=in_flight,
        load_ratio=round(in_flight / capacity, 4) if capacity > 0 else None,
        models=list(prov.models),
        reported_models=reported,
        missing_models=missing,
        loaded_models=_json_list(fields.get("loaded_models")),
        queued=sum(queued[g] for g in groups),
        lifecycle_capabilities=flags_for(prov.type),
        heartbeat_age_ms=max(now - int(hb_ms), 0) if hb_ms else None,
        model_groups=groups,
    )
