"""The read-only provider catalog: what every provider of every pool looks
like right now, read from Redis, so every API replica shows the same thing.

Health uses exactly the dispatcher's rule (``lua/lib/unavailable_reason.lua``, read in
Python by ``dispatcher/wire.py`` ProviderHealth): a provider is *available* when its worker
reported it healthy, its heartbeat is fresh and its capacity is above zero. Otherwise it is
*unavailable* (it answered, badly: the probe's reason; or a reload removed it) or *unknown*
(no fresh word from its worker: never seen, or a stale heartbeat).

With flow control (``dispatcher/tenants.py``) it also shows who waits and runs: each
configured tenant's band, weight, limits and totals, and per model group the tenants with
jobs waiting or running there, from the counters the dispatch scripts keep in
``{iop}:tenants`` (read in the same pipeline as the rest). Only configured tenant names are
read, so a stale counter of a tenant no longer in the config never shows.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
from redis.asyncio import Redis

from dispatcher import keys, overrides, wire
from dispatcher.capability_flags import CapabilityFlags, LifecycleFlags, capability_flags, flags_for
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
    # False while an operator's override disables it (dispatcher/control.py): nothing new
    # goes there, what runs finishes. Health stays the probe's word, as with a drain.
    enabled: bool = True
    # Operators' overrides in force (dispatcher/overrides.py), by field: enabled, capacity,
    # capacity_bounds. The usual fields show the value in force.
    override: dict[str, OverrideView] = {}
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
    # Models that load and unload (``lifecycle``: "managed" or "static"): for a managed
    # provider, what its runtime holds of each served name (as its worker last read it, or
    # as a load iop ordered there made it: lua/models.lua, lua/lib/place.lua), how many it
    # holds at once, and the load under way.
    lifecycle: str = "static"
    models_state: dict[str, wire.ModelState] = {}
    max_loaded: int | None = None
    loading: str | None = None
    # What its type can do with a request beyond answering it: ``continue`` a cut answer of
    # another provider (api/continuation.py).
    capability_flags: CapabilityFlags = CapabilityFlags()


class OverrideView(msgspec.Struct):
    """An operator's override of one config value: the value in force, the config's, who set
    it (an admin key's name), when, and when it lapses (UTC ms; None: never)."""

    value: Any
    config: Any
    by: str
    at: int
    until: int | None


class EjectionView(msgspec.Struct):
    """A provider's ejection for its 5xx answers (``ejection`` in the config; docs/PROVIDERS.md
    "Leaving rotation and coming back"): ``state`` "ejected" until ``until_ms`` (UTC ms), then "on_trial" (one request
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
    # A home takes its own prompts up to capacity x (1 + home_queue); the hits it took past
    # its capacity, to wait in its engine's queue (a part of decisions['hit']).
    home_queue: float = 0.0
    home_queued: int = 0


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
    # In force: the config's, or an operator's override of it (``override``).
    fallbacks: list[str] = []
    preference: list[str] = []
    override: dict[str, OverrideView] = {}


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
    # Control actions audited so far (lua/lib/audit.lua), by action, fleet-wide.
    control_actions: dict[str, int] = {}


def classify(fields: dict[str, str], now_ms: int) -> tuple[str, str]:
    """(health, reason) of a provider's Redis hash, by the dispatcher's own rule
    (``wire.ProviderHealth``, which is ``lua/lib/unavailable_reason.lua``'s): *unknown* while
    its worker is silent, *unavailable* for any other reason -- a drain aside, which the
    view shows apart (health stays the probe's word). An ejected provider is unavailable,
    saying why and until when (a lane with no other provider that can take work still uses
    it: lua/lib/usable.lua)."""
    reasons = [(kind, words) for kind, words in wire.provider_health(fields).reasons(now_ms)
               if kind not in ("drained", "disabled")]
    if reasons:
        kind, words = reasons[0]
        return ("unknown" if kind in ("never_seen", "stale") else "unavailable"), words
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


@dataclass(frozen=True)
class _Layout:
    """What the catalog reads for one config, and how it groups it: built once per config
    (a frozen one: a reload brings a new object), not at every read."""

    providers: list[tuple[str, ProviderConfig]]  # (node id, provider), config order
    learning: list[ProviderConfig]  # capacity: auto (their limit's history is read)
    # A model group waits in several lanes (dispatcher/plans.py): its queue is all of them.
    lanes: list[tuple[str, str]]  # (model id, queue key)
    affine: list[ModelConfig]  # models with cache-aware dispatch
    tenants: list[Tenant]
    default_configured: bool
    band_names: list[str]
    model_ids: list[str]
    counter_fields: list[str]  # of {iop}:tenants
    limited: list[Tenant]  # tenants with rate limits or a budget
    groups_of: dict[str, list[str]]  # provider id -> its model groups

    @classmethod
    def of(cls, config: Config) -> _Layout:
        tenants, default_configured = _tenants(config)
        model_ids = [m.id for m in config.models]
        providers = [(node.id, prov) for node, prov in config.providers()]
        groups_of: dict[str, list[str]] = {}
        for model in config.models:
            for pid in model.providers:
                groups_of.setdefault(pid, []).append(model.id)
        plans = Plans(config)
        return cls(
            providers=providers, learning=[prov for _, prov in providers if prov.auto],
            lanes=[(model.id, lane.queue) for model in config.models for lane in plans.lanes_by_model[model.id]],
            affine=[m for m in config.models if m.affinity.mode != "off"],
            tenants=tenants, default_configured=default_configured, band_names=bands(config), model_ids=model_ids,
            counter_fields=_counter_fields(tenants, model_ids), limited=[t for t in tenants if t.limits],
            groups_of=groups_of)


_LAYOUTS: dict[int, tuple[Config, _Layout]] = {}  # id(config) -> the config (which keeps the id its own), layout
_LAYOUTS_KEPT = 4


def _layout(config: Config) -> _Layout:
    found = _LAYOUTS.get(id(config))
    if found is not None and found[0] is config:
        return found[1]
    layout = _Layout.of(config)
    if len(_LAYOUTS) >= _LAYOUTS_KEPT:
        _LAYOUTS.pop(next(iter(_LAYOUTS)))
    _LAYOUTS[id(config)] = (config, layout)
    return layout


def _counter_fields(tenants: list[Tenant], model_ids: list[str]) -> list[str]:
    """The ``{iop}:tenants`` fields read, per tenant: its totals, then each model group's."""
    return [f"{kind}:{t.name}{suffix}" for t in tenants for suffix in ["", *(f":{m}" for m in model_ids)]
            for kind in ("q", "r")]


def _affinity_views(models: list[ModelConfig], blocks: list[int], stats: dict[str, int]) -> dict[str, AffinityView]:
    """``blocks``: each model's index size; ``stats``: the decision counters."""
    views = {}
    for model, size in zip(models, blocks, strict=True):
        decisions = {r: stats.get(f"{model.id}\t{r}", 0) for r in ("hit", "miss", "spill")}
        views[model.id] = AffinityView(model.affinity.mode, model.affinity.load_bound, size,
                                       model.affinity.index_max_blocks, decisions, model.affinity.home_queue,
                                       stats.get(f"{model.id}\thome_queued", 0))
    return views


def _overrides(raw: dict[bytes, bytes]) -> dict[str, dict[str, OverrideView]]:
    """The overrides hash, by target: a provider's id, or ``\\0model\\0`` and a model's id."""
    out: dict[str, dict[str, OverrideView]] = {}
    for (name, target_id), rec in overrides.parse(raw).items():
        where = target_id if overrides.target_of(name) == "provider" else "\0model\0" + target_id
        out.setdefault(where, {})[name] = OverrideView(rec.value, rec.config, rec.by, rec.at, rec.until)
    return out


def _in_force(overridden: dict[str, OverrideView], name: str, configured: list[str]) -> list[str]:
    found = overridden.get(name)
    return [str(v) for v in found.value] if found is not None and isinstance(found.value, list) else configured


def _text(raw: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in raw.items()}


async def read_catalog(redis: Redis, config: Config) -> Catalog:
    lay = _layout(config)
    limit_fields = [wire.TenantLimitState.fields(t.name) for t in lay.limited]
    async with redis.pipeline(transaction=False) as pipe:
        # Read back below in this order, each group as it was asked.
        pipe.time()
        for _, prov in lay.providers:
            pipe.hgetall(keys.provider(prov.id))
        for prov in lay.learning:
            pipe.lrange(keys.capacity_history(prov.id), 0, -1)
        for _, queue in lay.lanes:
            pipe.zcard(queue)
            pipe.zrange(queue, 0, 0, withscores=True)
        for model in lay.affine:
            pipe.zcard(keys.affinity_recency(model.id))
        if lay.affine:
            pipe.hgetall(keys.AFFINITY_STATS)
        if lay.counter_fields:
            pipe.hmget(keys.TENANTS, lay.counter_fields)
        for names in limit_fields:
            pipe.hmget(keys.LIMITS, names)
        pipe.hgetall(keys.OVERRIDES)
        pipe.hgetall(keys.AUDIT_COUNTS)
        replies: Iterator[Any] = iter(await pipe.execute())

    def take(n: int) -> list[Any]:
        return [next(replies) for _ in range(n)]

    sec, usec = next(replies)
    now = int(sec) * 1000 + int(usec) // 1000
    hashes = [_text(h) for h in take(len(lay.providers))]
    histories = {prov.id: wire.capacity_history(raw)
                 for prov, raw in zip(lay.learning, take(len(lay.learning)), strict=True)}
    queue_replies = take(2 * len(lay.lanes))
    affinity_views = _affinity_views(
        lay.affine, [int(n) for n in take(len(lay.affine))],
        {k: int(v) for k, v in _text(next(replies)).items()} if lay.affine else {})
    counters = _counters(lay.counter_fields, next(replies) if lay.counter_fields else [])
    limit_states = {t.name: wire.tenant_limit_state([None if v is None else v.decode() for v in raw])
                    for t, raw in zip(lay.limited, take(len(lay.limited)), strict=True)}
    in_force = _overrides(next(replies))
    actions = {k: int(v) for k, v in sorted(_text(next(replies)).items())}

    queued = {m: 0 for m in lay.model_ids}
    head_seq: dict[str, tuple[float, str]] = {}
    for (model_id, _), count, head in zip(lay.lanes, queue_replies[::2], queue_replies[1::2], strict=True):
        queued[model_id] += int(count)
        if head:
            job, seq = head[0]
            if model_id not in head_seq or seq < head_seq[model_id][0]:
                head_seq[model_id] = (seq, job.decode())
    if lay.counter_fields and flow_control(config):
        # A tenant at its max_in_flight has its waiting jobs parked outside the lanes
        # (lib/park_job.lua): the tenants' counters count every waiting job.
        queued = {m: sum(counters.get(f"q:{t.name}:{m}", 0) for t in lay.tenants) for m in queued}
    heads = {model_id: job for model_id, (_, job) in head_seq.items()}
    head_records = await redis.hmget(keys.JOBS, list(heads.values())) if heads else []
    oldest: dict[str, int] = {}
    for model_id, raw in zip(heads, head_records, strict=True):
        if raw is not None:
            oldest[model_id] = max(now - int(json.loads(raw).get("submitted_ms", now)), 0)

    views: dict[str, ProviderView] = {}
    for (node_id, prov), fields in zip(lay.providers, hashes, strict=True):
        views[prov.id] = _provider_view(node_id, prov, fields, now, lay.groups_of.get(prov.id, []), queued,
                                        histories.get(prov.id, []))
        views[prov.id].override = in_force.get(prov.id, {})

    figures = await read_live(redis, [(pid, m.id) for m in config.models for pid in m.providers if pid in views],
                              {prov.id: h for (_, prov), h in zip(lay.providers, hashes, strict=True)}, now)
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
                   and views[c.provider].enabled and views[c.provider].rate_limited is None)
        uses = [TenantUse(t.name, counters.get(f"q:{t.name}:{model.id}", 0), counters.get(f"r:{t.name}:{model.id}", 0))
                for t in lay.tenants]
        uses = [u for u in uses if u.queued or u.in_flight]
        # The values in force as the overrides read with the rest say them, not as this
        # process's config has them yet (it follows within a watch tick).
        overridden = in_force.get("\0model\0" + model.id, {})
        models.append(ModelView(model.id, model.display_name or model.id, cands, queued[model.id],
                                oldest.get(model.id), free, uses, affinity_views.get(model.id),
                                fallbacks=list(_in_force(overridden, "fallbacks", model.fallbacks)),
                                preference=list(_in_force(overridden, "preference", model.preference)),
                                override=overridden))
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
            band=lay.band_names[t.band],
            weight=t.weight,
            models=None if t.models is None else [m for m in lay.model_ids if t.allows(m)],
            max_queued=t.max_queued,
            max_in_flight=t.max_in_flight,
            queued=counters.get(f"q:{t.name}", 0),
            in_flight=counters.get(f"r:{t.name}", 0),
            limits=_limits_view(t, limit_states.get(t.name), now),
        )
        for t in lay.tenants
    ]
    tenant_views = [v for v in tenant_views
                    if v.name != DEFAULT_TENANT or lay.default_configured or v.queued or v.in_flight]
    return Catalog(now, list(views.values()), models, nodes, tenant_views, actions)


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


def _limits_view(t: Tenant, state: wire.TenantLimitState | None, now: int) -> TenantLimitsView | None:
    lim = t.limits
    if lim is None or state is None:
        return None

    def used(window: wire.LimitWindow | None, per_minute: int | None) -> int:
        return window.used(now, per_minute) if per_minute and window is not None else 0

    return TenantLimitsView(
        requests_per_minute=lim.requests_per_minute, requests_used=used(state.requests, lim.requests_per_minute),
        tokens_per_minute=lim.tokens_per_minute, tokens_used=used(state.tokens, lim.tokens_per_minute),
        tokens_per_day=lim.tokens_per_day,
        tokens_used_today=state.budget.used_on(now // 86_400_000) if state.budget is not None else 0,
        refused=state.refused)


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


def _engine_view(load: wire.ProviderLoad, now: int) -> EngineView | None:
    reading, age = load.engine, load.engine_age_ms(now)
    if reading is None or age is None:
        return None
    return EngineView(reading.running, reading.waiting, reading.kv_usage, age)


def _provider_view(
    node_id: str, prov: ProviderConfig, fields: dict[str, str], now: int, groups: list[str], queued: dict[str, int],
    history: list[list[int]] | None = None,
) -> ProviderView:
    health, reason = classify(fields, now)
    load = wire.provider_load(fields)
    default = prov.capacity_bounds[0] if prov.auto else prov.fixed_capacity
    capacity = load.capacity if load.capacity is not None else default
    in_flight, external, hold_until = load.in_flight, load.external, load.hold_until_ms
    reported = _json_list(fields.get("reported_models"))
    endpoints = _json_list(fields.get("endpoints"))
    missing = [m for m in prov.models if reported is not None and m not in reported]
    hb_ms = fields.get("hb_ms")
    prompt_tokens, cached_tokens = load.prompt_tokens, load.cached_tokens
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
        lifecycle_capabilities=flags_for(prov.type, prov.manages_models),
        capability_flags=capability_flags(prov.type),
        heartbeat_age_ms=max(now - int(hb_ms), 0) if hb_ms else None,
        model_groups=groups,
        endpoints=endpoints if endpoints is not None else list(prov.served_endpoints),
        slots=_slots(fields.get("slots")),
        drain=drain_state(fields.get("drain"), in_flight),
        enabled=not fields.get("off"),
        tokens_per_s=window.per_s(now) if (window := wire.token_window(fields)) is not None else 0.0,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        cache_hit_rate=round(cached_tokens / prompt_tokens, 4) if cached_tokens and prompt_tokens else None,
        ejection=ejection,
        evidence=evidence,
        capacity_mode="auto" if prov.auto else "fixed",
        capacity_bounds=list(prov.capacity_bounds) if prov.auto else None,
        capacity_reason=load.capacity_reason if prov.auto else "",
        capacity_history=history or [],
        engine=_engine_view(load, now),
        external_load=external,
        rate_limited=RateLimitView(hold_until, load.hold_reason) if hold_until > now else None,
        service_ms=load.service_ms or None,
        **_lifecycle_view(prov, fields),
    )


def _lifecycle_view(prov: ProviderConfig, fields: dict[str, str]) -> dict[str, Any]:
    if not prov.manages_models:
        return {}
    models = wire.models_state(fields)
    for served in prov.models:
        models.setdefault(served, wire.ModelState(state="unknown", since=None, last_used=None, load_s=None))
    raw_max = fields.get("max_loaded")
    return {"lifecycle": "managed", "models_state": dict(sorted(models.items())),
            "max_loaded": int(raw_max) if raw_max and raw_max.isdigit() else prov.max_loaded,
            "loading": fields.get("load") or None}
