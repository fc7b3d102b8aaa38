"""The read-only provider catalog: what every provider of every pool looks
like right now, read from Redis, so every API replica shows the same thing.

Health uses exactly the dispatcher's rule (``lua/lib/pump.lua``): a provider is
*available* when its worker reported it healthy, its heartbeat is fresh and its
capacity is above zero. Otherwise it is *unavailable* (it answered, badly: the probe's
reason) or *unknown* (no fresh word from its worker: never seen, or a stale heartbeat).

With flow control (``dispatcher/tenants.py``) it also shows who waits and runs: each
configured tenant's band, weight, limits and totals, and per model group the tenants with
jobs waiting or running there, from the counters the dispatch scripts keep in
``{iop}:tenants`` (read in the same pipeline as the rest). Only configured tenant names are
read, so a stale counter of a tenant no longer in the config never shows.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any, cast

import msgspec
from redis.asyncio import Redis

from dispatcher import keys, wire
from dispatcher.capability_flags import LifecycleFlags, flags_for
from dispatcher.config import DEFAULT_TENANT, Config, ModelConfig, ProviderConfig
from dispatcher.control import drain_state
from dispatcher.live import LiveView, read_live
from dispatcher.plans import Plans
from dispatcher.telemetry import HeldModel, Telemetry, read_nodes
from dispatcher.tenants import Tenant, Tenants, bands, flow_control


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
    # Endpoint names it serves (dispatcher/endpoints.py): its worker's word, else its config.
    endpoints: list[str]
    # Parallel slots the runtime itself reports (llama.cpp): a hint beside ``capacity``,
    # which alone decides dispatch. None when the runtime does not say.
    slots: int | None
    # An operator's drain (dispatcher/control.py): "draining" while jobs still run on it,
    # "drained" once none does; None when open. Health stays the probe's word.
    drain: str | None = None
    # Completion tokens per second over about the last 10 s, fleet-wide (tokens_per_s()).
    tokens_per_s: float = 0.0
    # Prompt tokens of its finished jobs (as its answers' usage said them), and of them those
    # it served from its prefix cache, since its hash began (lua/finish.lua); the ratio, None
    # while it has reported no cached token at all (a provider that does not say, or cold).
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cache_hit_rate: float | None = None
    # Out of rotation, or on trial, for its 5xx answers (None: in rotation).
    ejection: EjectionView | None = None
    evidence: EvidenceView | None = None
    # How ``capacity`` (the limit in force) is set: "fixed" (the config's) or "auto"
    # (learned: workers/capacity.py), within ``capacity_bounds``, and why it last moved.
    capacity_mode: str = "fixed"
    capacity_bounds: list[int] | None = None
    capacity_reason: str = ""
    # When the learned limit moved, and to what: [server ms, limit], oldest first.
    capacity_history: list[list[int]] = []
    engine: EngineView | None = None
    # What its engine runs and queues beyond iop's in_flight there: load iop does not send,
    # counted against it in routing (``load_ratio`` includes it).
    external_load: int = 0
    rate_limited: RateLimitView | None = None
    # The median time of its recent calls, ms (what deadlines are predicted from).
    service_ms: float | None = None
    # Live figures from traffic (dispatcher/live.py), per window ('5m', '1h', '24h'): over
    # every model it serves, and per model.
    live: dict[str, LiveView] = {}
    live_by_model: dict[str, dict[str, LiveView]] = {}


class EjectionView(msgspec.Struct):
    """A provider's ejection for its 5xx answers (``ejection`` in the config; README
    "Health"): ``state`` "ejected" until ``until_ms`` (UTC ms), then "on_trial" (one request
    at a time) until one is answered; None once it is fully back."""

    state: str  # ejected | on_trial
    reason: str
    until_ms: int


class EvidenceView(msgspec.Struct):
    """What iop holds against a provider's 5xx answers: its streak (5xx counted against it
    since it last answered), the 5xx excused (another provider answered the same request
    5xx too: the request's fault), and its ejections so far by kind."""

    streak_5xx: int
    excused_5xx: int
    ejections: dict[str, int]


class EngineView(msgspec.Struct):
    """What the provider's engine last said of its own load (workers/engine_metrics.py); None
    where it does not say. ``age_ms``: how old that reading is now."""

    running: int | None
    waiting: int | None
    kv_usage: float | None
    age_ms: int


class RateLimitView(msgspec.Struct):
    """Nothing new goes to the provider until ``until_ms`` (UTC ms): its upstream said so."""

    until_ms: int
    reason: str


class CandidateView(msgspec.Struct):
    provider: str
    served_name: str
    node_id: str
    health: str
    capacity: int
    in_flight: int
    load_ratio: float | None


class TenantUse(msgspec.Struct):
    """A tenant's jobs in one model group."""

    tenant: str
    queued: int
    in_flight: int


class AffinityView(msgspec.Struct):
    """A model group's cache-aware dispatch (``models[].affinity``)."""

    mode: str
    load_bound: float
    index_blocks: int  # prompt blocks its prefix index remembers now
    index_max_blocks: int
    # Decisions since Redis started: 'hit' (a provider holding the head, within the bound),
    # 'miss' (nobody holds it), 'spill' (its holders were over the bound).
    decisions: dict[str, int]


class ModelView(msgspec.Struct):
    id: str
    display_name: str
    candidates: list[CandidateView]
    queued: int
    oldest_wait_ms: int | None
    available_slots: int
    # Tenants with jobs waiting or running in the group (flow control only), config order.
    tenants: list[TenantUse]
    affinity: AffinityView | None = None


class TenantLimitsView(msgspec.Struct):
    """A tenant's rate limits and budget (``api.keys[].limits``), and what it used of them:
    in the sliding minute (``lua/lib/limits.lua``), and today (UTC). None: no such limit."""

    requests_per_minute: int | None
    requests_used: int
    tokens_per_minute: int | None
    tokens_used: int
    tokens_per_day: int | None
    tokens_used_today: int
    refused: dict[str, int]  # requests | tokens | budget -> refusals so far


class TenantView(msgspec.Struct):
    """A configured tenant (named caller key, or ``default``) and its jobs, all groups."""

    name: str
    band: str  # its priority band (api.priorities)
    weight: float
    models: list[str] | None  # the model groups it may call; None: every one
    max_queued: int | None
    max_in_flight: int | None
    queued: int
    in_flight: int
    limits: TenantLimitsView | None = None


class NodeView(msgspec.Struct):
    id: str
    providers: list[str]
    # Its live workers' ids, and the freshest report of its host and devices (None: no worker
    # reports; dispatcher/telemetry.py), with the models its runtimes hold.
    workers: list[str] = []
    telemetry: Telemetry | None = None


class Catalog(msgspec.Struct):
    server_time_ms: int
    providers: list[ProviderView]
    models: list[ModelView]
    nodes: list[NodeView]
    # Flow control only (empty without it: every job is one tenant's, plain FIFO).
    tenants: list[TenantView]


def classify(fields: dict[str, str], now_ms: int) -> tuple[str, str]:
    """(health, reason) of a provider's Redis hash, by the dispatcher's own rule. An
    ejected provider is unavailable, saying why and until when (a lane with no other
    provider that can take work still uses it: lua/lib/pump.lua)."""
    if "hb_ms" not in fields:
        return "unknown", "never seen: no heartbeat from its worker yet"
    if int(fields.get("hb_exp", 0)) < now_ms:
        age_s = (now_ms - int(fields["hb_ms"])) / 1000
        return "unknown", f"stale heartbeat: last one {age_s:.1f}s ago"
    if fields.get("health") != "available":
        return "unavailable", fields.get("reason") or "reported unavailable"
    if int(fields.get("capacity", 0)) <= 0:
        return "unavailable", "capacity 0"
    ej = wire.ejection_state(fields)
    if ej.ejected(now_ms):
        return "unavailable", f"ejected: {ej.reason}; on trial again at {clock(ej.until_ms or 0)}"
    if ej.on_trial(now_ms):
        return "available", f"on trial after an ejection ({ej.reason}): one request at a time until one is answered"
    return "available", ""


def clock(ms: int) -> str:
    """A server time as an operator reads it in a reason: ``12:03:10 UTC``."""
    return time.strftime("%H:%M:%S UTC", time.gmtime(ms / 1000))


def _ejection(fields: dict[str, str], now_ms: int) -> tuple[EjectionView | None, EvidenceView | None]:
    ej = wire.ejection_state(fields)
    view = None
    if ej.ejected(now_ms) or ej.on_trial(now_ms):
        view = EjectionView("ejected" if ej.ejected(now_ms) else "on_trial", ej.reason, ej.until_ms or 0)
    evidence = None
    if ej.streak or ej.excused or any(ej.ejections.values()):
        evidence = EvidenceView(ej.streak, ej.excused, ej.ejections)
    return view, evidence


TOKEN_BUCKET_MS = 10_000  # lua/finish.lua's bucket


def tokens_per_s(fields: dict[str, str], now_ms: int) -> float:
    """Completion tokens per second the provider generated over the last bucket's length,
    from ``lua/finish.lua``'s two buckets: the current one whole, the one before weighted by
    how much of it the window still covers. Buckets the scripts have not rolled over yet
    (no job finished since) are rolled here, so an idle provider falls to 0 within two
    buckets. A job's tokens count when it finishes, so a long stream lands all at once."""
    try:
        t0 = int(fields["tok_t0"])
        cur = float(fields.get("tok_cur") or 0)
        prev = float(fields.get("tok_prev") or 0)
    except (KeyError, ValueError):
        return 0.0
    elapsed = max(now_ms - t0, 0)
    if elapsed >= 2 * TOKEN_BUCKET_MS:
        return 0.0
    if elapsed >= TOKEN_BUCKET_MS:
        prev, cur, elapsed = cur, 0.0, elapsed - TOKEN_BUCKET_MS
    covered = 1 - elapsed / TOKEN_BUCKET_MS
    return round((prev * covered + cur) / (TOKEN_BUCKET_MS / 1000), 3)


def _json_list(raw: str | None) -> list[str] | None:
    if not raw:
        return None
    value = json.loads(raw)
    return [str(v) for v in value] if isinstance(value, list) else None


def _slots(raw: str | None) -> int | None:
    try:
        value = int(raw) if raw else None
    except ValueError:
        return None
    return value if value is not None and value > 0 else None


def _tenants(config: Config) -> tuple[list[Tenant], bool]:
    """The tenants whose counters the catalog reads, in config order -- none without flow
    control; else the named keys and ``default`` -- and whether ``default`` is one requests
    can be (``api_keys_env``, an open API); if not, it is shown only while it has jobs."""
    if not flow_control(config) and not any(k.limits for k in config.api.keys):
        return [], False
    tenants = Tenants(config)
    named = [tenants.by_name[k.name] for k in config.api.keys]
    if all(t.name != DEFAULT_TENANT for t in named):
        named.append(tenants.default)
    return named, bool(config.api.api_keys_env or not config.api.keys)


def _counter_fields(tenants: list[Tenant], model_ids: list[str]) -> list[str]:
    """The ``{iop}:tenants`` fields read, per tenant: its totals, then each model group's."""
    return [f"{kind}:{t.name}{suffix}" for t in tenants for suffix in ["", *(f":{m}" for m in model_ids)]
            for kind in ("q", "r")]


def _affinity_views(models: list[ModelConfig], replies: list[Any]) -> dict[str, AffinityView]:
    """``replies``: each model's index size (ZCARD), then the decision counters (HGETALL)."""
    if not models:
        return {}
    stats = {k.decode(): int(v) for k, v in cast(dict[bytes, bytes], replies[-1]).items()}
    views = {}
    for model, blocks in zip(models, replies[:-1], strict=True):
        decisions = {r: stats.get(f"{model.id}\t{r}", 0) for r in ("hit", "miss", "spill")}
        views[model.id] = AffinityView(model.affinity.mode, model.affinity.load_bound, int(blocks),
                                       model.affinity.index_max_blocks, decisions)
    return views


async def read_catalog(redis: Redis, config: Config) -> Catalog:
    providers = [(node.id, prov) for node, prov in config.providers()]
    # A model group waits in several lanes (dispatcher/plans.py): its queue is all of them.
    lanes = [(model.id, lane.queue) for model in config.models for lane in Plans(config).lanes_by_model[model.id]]
    tenants, default_configured = _tenants(config)
    band_names = bands(config)
    model_ids = [m.id for m in config.models]
    counter_fields = _counter_fields(tenants, model_ids)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.time()
        for _, prov in providers:
            pipe.hgetall(keys.provider(prov.id))
        learning = [prov for _, prov in providers if prov.auto]
        for prov in learning:
            pipe.lrange(keys.capacity_history(prov.id), 0, -1)
        for _, queue in lanes:
            pipe.zcard(queue)
            pipe.zrange(queue, 0, 0, withscores=True)
        affine = [m for m in config.models if m.affinity.mode != "off"]
        for model in affine:
            pipe.zcard(keys.affinity_recency(model.id))
        if affine:
            pipe.hgetall(keys.AFFINITY_STATS)
        if counter_fields:
            pipe.hmget(keys.TENANTS, counter_fields)
        limited = any(t.limits for t in tenants)
        if limited:
            pipe.hgetall(keys.LIMITS)
        replies: list[Any] = await pipe.execute()
    limit_state = ({k.decode(): v.decode() for k, v in cast(dict[bytes, bytes], replies.pop()).items()}
                   if limited else {})
    counters = _counters(counter_fields, replies.pop() if counter_fields else [])
    affinity_views = _affinity_views(affine, replies[len(replies) - len(affine) - 1:] if affine else [])
    if affine:
        del replies[len(replies) - len(affine) - 1:]
    sec, usec = replies[0]
    now = int(sec) * 1000 + int(usec) // 1000
    hashes = [
        {k.decode(): v.decode() for k, v in cast(dict[bytes, bytes], h).items()}
        for h in replies[1 : 1 + len(providers)]
    ]
    histories = {prov.id: _history(raw) for prov, raw in
                 zip(learning, replies[1 + len(providers):1 + len(providers) + len(learning)], strict=True)}
    del replies[1 + len(providers):1 + len(providers) + len(learning)]
    queue_replies = replies[1 + len(providers) : 1 + len(providers) + 2 * len(lanes)]
    queued = {m.id: 0 for m in config.models}
    head_seq: dict[str, tuple[float, str]] = {}
    for i, (model_id, _) in enumerate(lanes):
        queued[model_id] += int(queue_replies[2 * i])
        if queue_replies[2 * i + 1]:
            job, seq = queue_replies[2 * i + 1][0]
            if model_id not in head_seq or seq < head_seq[model_id][0]:
                head_seq[model_id] = (seq, job.decode())
    if counter_fields and flow_control(config):
        # A tenant at its max_in_flight has its waiting jobs parked outside the lanes
        # (lib/pump.lua park_job): the tenants' counters count every waiting job.
        queued = {m: sum(counters.get(f"q:{t.name}:{m}", 0) for t in tenants) for m in queued}
    heads = {model_id: job for model_id, (_, job) in head_seq.items()}
    head_records = await redis.hmget(keys.JOBS, list(heads.values())) if heads else []
    oldest: dict[str, int] = {}
    for model_id, raw in zip(heads, head_records, strict=True):
        if raw is not None:
            oldest[model_id] = max(now - int(json.loads(raw).get("submitted_ms", now)), 0)

    groups_of: dict[str, list[str]] = {}
    for model in config.models:
        for pid in model.providers:
            groups_of.setdefault(pid, []).append(model.id)

    views: dict[str, ProviderView] = {}
    for (node_id, prov), fields in zip(providers, hashes, strict=True):
        views[prov.id] = _provider_view(node_id, prov, fields, now, groups_of.get(prov.id, []), queued,
                                        histories.get(prov.id, []))

    figures = await read_live(redis, [(pid, m.id) for m in config.models for pid in m.providers if pid in views],
                              {prov.id: h for (_, prov), h in zip(providers, hashes, strict=True)}, now)
    for pid, live in figures.items():
        views[pid].live, views[pid].live_by_model = live.total, live.by_model

    models = []
    for model in config.models:
        cands = [
            CandidateView(pid, served, v.node_id, v.health, v.capacity, v.in_flight, v.load_ratio)
            for pid, served in model.providers.items()
            if (v := views.get(pid)) is not None
        ]
        # A drained provider's slots are not the group's: nothing new goes there; one on
        # trial after an ejection takes one request at a time.
        free = sum(max(_slots_now(c.capacity, views[c.provider]) - c.in_flight - views[c.provider].external_load, 0)
                   for c in cands if c.health == "available" and views[c.provider].drain is None
                   and views[c.provider].rate_limited is None)
        uses = [TenantUse(t.name, counters.get(f"q:{t.name}:{model.id}", 0), counters.get(f"r:{t.name}:{model.id}", 0))
                for t in tenants]
        uses = [u for u in uses if u.queued or u.in_flight]
        models.append(ModelView(model.id, model.display_name or model.id, cands, queued[model.id],
                                oldest.get(model.id), free, uses, affinity_views.get(model.id)))
    nodes = [NodeView(n.id, [p.id for p in n.providers]) for n in config.nodes]
    reports = await read_nodes(redis, [n.id for n in nodes])
    for node in nodes:
        found = reports.get(node.id, [])
        node.workers = [w.worker for w in found]
        node.telemetry = with_engines(found[0].telemetry, [views[p] for p in node.providers if p in views]) \
            if found else None
    tenant_views = [
        TenantView(
            name=t.name,
            band=band_names[t.band],
            weight=t.weight,
            models=None if t.models is None else [m for m in model_ids if t.allows(m)],
            max_queued=t.max_queued,
            max_in_flight=t.max_in_flight,
            queued=counters.get(f"q:{t.name}", 0),
            in_flight=counters.get(f"r:{t.name}", 0),
            limits=_limits_view(t, limit_state, now),
        )
        for t in tenants
    ]
    tenant_views = [v for v in tenant_views
                    if v.name != DEFAULT_TENANT or default_configured or v.queued or v.in_flight]
    return Catalog(now, list(views.values()), models, nodes, tenant_views)


def with_engines(t: Telemetry, providers: list[ProviderView]) -> Telemetry:
    """A node's report with each provider's KV cache use, from its engine's last reading."""
    held = list(t.models)
    for p in providers:
        if p.engine is not None and p.engine.kv_usage is not None:
            held.append(HeldModel(p.id, ", ".join(p.models), None, p.engine.kv_usage))
    return msgspec.structs.replace(t, models=held)


def _slots_now(capacity: int, view: ProviderView) -> int:
    """The slots dispatch fills on a provider now: its capacity, one while it is on trial."""
    return min(capacity, 1) if view.ejection is not None and view.ejection.state == "on_trial" else capacity


def _limits_view(t: Tenant, state: dict[str, str], now: int) -> TenantLimitsView | None:
    lim = t.limits
    if lim is None:
        return None

    def used(field: str, per_minute: int | None) -> int:
        # '<arrival time ms>|<the limit it was computed under>' (lua/lib/limits.lua).
        tat, _, under = state.get(f"{field}:{t.name}", "").partition("|")
        if not per_minute or not tat:
            return 0
        return math.ceil(max(float(tat) - now, 0) * int(under or per_minute) / 60_000 - 1e-9)

    day, _, today = state.get(f"d:{t.name}", "").partition(":")
    return TenantLimitsView(
        requests_per_minute=lim.requests_per_minute, requests_used=used("r", lim.requests_per_minute),
        tokens_per_minute=lim.tokens_per_minute, tokens_used=used("t", lim.tokens_per_minute),
        tokens_per_day=lim.tokens_per_day,
        tokens_used_today=max(int(today), 0) if day and int(day) == now // 86_400_000 else 0,
        refused={kind: int(state.get(f"x:{t.name}:{kind}", 0)) for kind in ("requests", "tokens", "budget")})


def _counters(fields: list[str], values: list[bytes | None]) -> dict[str, int]:
    """Field -> count, for the counters that are set (never below zero)."""
    out: dict[str, int] = {}
    for field, raw in zip(fields, values, strict=True):
        if raw is not None:
            try:
                out[field] = max(int(raw), 0)
            except ValueError:
                continue
    return out


def _history(raw: list[bytes]) -> list[list[int]]:
    """``lua/capacity.lua``'s '<ms>:<limit>' entries."""
    out = []
    for entry in raw:
        at, _, limit = entry.decode().partition(":")
        if at.isdigit() and limit.isdigit():
            out.append([int(at), int(limit)])
    return out


def _engine_view(fields: dict[str, str], now: int) -> EngineView | None:
    raw = fields.get("engine")
    if not raw:
        return None
    try:
        reading = msgspec.json.decode(raw, type=wire.EngineReading)
    except msgspec.DecodeError:
        return None
    published = int(fields.get("engine_ms") or now)
    return EngineView(reading.running, reading.waiting, reading.kv_usage,
                      reading.age_ms + max(now - published, 0))


def _provider_view(
    node_id: str, prov: ProviderConfig, fields: dict[str, str], now: int, groups: list[str], queued: dict[str, int],
    history: list[list[int]] | None = None,
) -> ProviderView:
    health, reason = classify(fields, now)
    default = prov.capacity_bounds[0] if prov.auto else prov.fixed_capacity
    capacity = int(fields["capacity"]) if "capacity" in fields else default
    in_flight = int(fields.get("in_flight", 0))
    external = int(fields.get("ext") or 0)
    hold_until = int(fields.get("hold_until") or 0)
    svc = float(fields.get("svc_ms") or 0)
    reported = _json_list(fields.get("reported_models"))
    endpoints = _json_list(fields.get("endpoints"))
    missing = [m for m in prov.models if reported is not None and m not in reported]
    hb_ms = fields.get("hb_ms")
    prompt_tokens, cached_tokens = int(fields.get("prompt_tokens", 0)), int(fields.get("cached_tokens", 0))
    ejection, evidence = _ejection(fields, now)
    return ProviderView(
        id=prov.id,
        node_id=node_id,
        type=prov.type,
        category=prov.effective_category,
        health=health,
        reason=reason,
        capacity=capacity,
        in_flight=in_flight,
        load_ratio=round((in_flight + external) / capacity, 4) if capacity > 0 else None,
        models=list(prov.models),
        reported_models=reported,
        missing_models=missing,
        loaded_models=_json_list(fields.get("loaded_models")),
        queued=sum(queued[g] for g in groups),
        lifecycle_capabilities=flags_for(prov.type),
        heartbeat_age_ms=max(now - int(hb_ms), 0) if hb_ms else None,
        model_groups=groups,
        endpoints=endpoints if endpoints is not None else list(prov.served_endpoints),
        slots=_slots(fields.get("slots")),
        drain=drain_state(fields.get("drain"), in_flight),
        tokens_per_s=tokens_per_s(fields, now),
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        cache_hit_rate=round(cached_tokens / prompt_tokens, 4) if cached_tokens and prompt_tokens else None,
        ejection=ejection,
        evidence=evidence,
        capacity_mode="auto" if prov.auto else "fixed",
        capacity_bounds=list(prov.capacity_bounds) if prov.auto else None,
        capacity_reason=fields.get("cap_reason", "") if prov.auto else "",
        capacity_history=history or [],
        engine=_engine_view(fields, now),
        external_load=external,
        rate_limited=RateLimitView(hold_until, fields.get("hold_reason", "")) if hold_until > now else None,
        service_ms=svc or None,
    )
