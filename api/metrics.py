"""Prometheus metrics (``GET /metrics``).

Two kinds:

* **Global gauges** -- provider in_flight, capacity, health and completion tokens per
  second, queued jobs and the oldest wait per model group, and with flow control each configured tenant's queued jobs
  per model group and running jobs -- are read from Redis at scrape time, so every replica
  reports the same values (aggregate them with ``max``, not ``sum``).
* **Per-process counters and histograms** -- requests by model, provider, status and
  tenant, tokens (prompt and completion, as providers report them in ``usage``) by the
  same labels, request latency, queue wait (by model and tenant), streams' time to first
  byte. Tenant labels are configured key names (and ``default``) only: bounded. When ``iop api --workers N``
  runs several processes on one port, each writes to ``PROMETHEUS_MULTIPROC_DIR``
  (prometheus_client's multiprocess mode, set up by ``iop api``) and a scrape of any of
  them returns the sum over all, so no process's counts are lost to the load balancer.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from dispatcher.catalog import Catalog
from dispatcher.events import Usage
from dispatcher.tracing import RequestTrace
from dispatcher.wire import EJECTION_KINDS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
UNKNOWN = "_unknown"  # label for model ids outside the config: callers must not mint label values


class _Children:
    """A labelled metric's children by their label values, each looked up once: prometheus_client's
    ``labels()`` checks and locks on every call, and every request makes several. The label
    values are bounded by the config (model and tenant ids, providers, HTTP statuses)."""

    __slots__ = ("_found", "_metric")

    def __init__(self, metric: Counter | Histogram) -> None:
        self._metric = metric
        self._found: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        child = self._found.get(values)
        if child is None:
            child = self._found[values] = self._metric.labels(*values)
        return child


class RequestMetrics:
    def __init__(self) -> None:
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "iop_requests", "Requests answered, by model, provider, HTTP status and tenant",
            ["model", "provider", "status", "tenant"], registry=self.registry,
        )
        self.latency = Histogram(
            "iop_request_duration_seconds", "Time from request to the end of its answer",
            ["model", "provider", "status"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.queue_wait = Histogram(
            "iop_queue_wait_seconds", "Time a request waited in its model queue before dispatch",
            ["model", "tenant"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.ttfb = Histogram(
            "iop_stream_first_byte_seconds", "Time from request to the first streamed chunk",
            ["model", "provider"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.tokens = Counter(
            "iop_tokens", "Tokens of the answers, as their providers reported them: kind prompt or completion",
            ["model", "provider", "kind", "tenant"], registry=self.registry,
        )
        self.fallbacks = Counter(
            "iop_fallbacks", "Requests a model's fallback took (models[].fallbacks), by the model asked for "
            "and the one that took it", ["model", "fallback"], registry=self.registry,
        )
        self.cached_tokens = Counter(
            "iop_cached_tokens", "Prompt tokens the provider served from its prefix cache, where it reports them "
            "(over iop_tokens_total{kind=\"prompt\"}: its cache hit rate)",
            ["model", "provider"], registry=self.registry,
        )
        self.continuations = Counter(
            "iop_continuations", "Streams cut after output began (reason: provider_error, worker_lost), by "
            "what iop did: continued on another provider, or refused (why)",
            ["model", "reason", "outcome"], registry=self.registry,
        )
        self.requests_of = _Children(self.requests)
        self.latency_of = _Children(self.latency)
        self.queue_wait_of = _Children(self.queue_wait)
        self.ttfb_of = _Children(self.ttfb)
        self.tokens_of = _Children(self.tokens)
        self.cached_tokens_of = _Children(self.cached_tokens)

    def continuation(self, model: str, reason: str, outcome: str) -> None:
        """A cut stream continued (``outcome`` ``continued``) or not (``refused: <why>``)."""
        self.continuations.labels(model, reason, outcome).inc()

    def fell_back(self, model: str, fallback: str) -> None:
        """A fallback of ``model`` took a request (both ids come from the config)."""
        self.fallbacks.labels(model, fallback).inc()

    def render(self, catalog: Catalog | None) -> bytes:
        if self.multiprocess:
            registry = CollectorRegistry()
            MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
            text = generate_latest(registry)
        else:
            text = generate_latest(self.registry)
        if catalog is not None:
            gauges = CollectorRegistry()
            gauges.register(_CatalogCollector(catalog))
            text += generate_latest(gauges)
        return text


class RequestClock:
    """Times one request and records it exactly once."""

    __slots__ = ("_done", "metrics", "model", "provider", "started", "tenant", "trace")

    def __init__(self, metrics: RequestMetrics) -> None:
        self.metrics = metrics
        self.started = time.perf_counter()
        self.model = UNKNOWN
        self.provider = ""
        self.tenant = UNKNOWN
        self._done = False
        # The request's span, while tracing is on (dispatcher/tracing.py): ended with the count.
        self.trace: RequestTrace | None = None

    def queued(self, queue_ms: int) -> None:
        self.metrics.queue_wait_of(self.model, self.tenant).observe(queue_ms / 1000)

    def continuation(self, reason: str, outcome: str, job_id: str = "") -> None:
        """A cut stream: counted, and noted on the request's trace."""
        self.metrics.continuation(self.model, reason, outcome)
        if self.trace is not None:
            self.trace.continued(reason, outcome, job_id)

    def first_byte(self) -> None:
        self.metrics.ttfb_of(self.model, self.provider).observe(time.perf_counter() - self.started)

    def done(self, status: int, usage: Usage | None = None) -> None:
        """``usage``: the answer's tokens, when its provider reported them."""
        if self._done:
            return
        self._done = True
        m = self.metrics
        code = str(status)
        m.requests_of(self.model, self.provider, code, self.tenant).inc()
        if usage is not None:
            m.tokens_of(self.model, self.provider, "prompt", self.tenant).inc(usage.prompt)
            m.tokens_of(self.model, self.provider, "completion", self.tenant).inc(usage.completion)
            if usage.cached:
                m.cached_tokens_of(self.model, self.provider).inc(usage.cached)
        m.latency_of(self.model, self.provider, code).observe(time.perf_counter() - self.started)
        if self.trace is not None:
            self.trace.end(status, self.model, self.tenant, usage)


class _CatalogCollector(Collector):
    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    def collect(self) -> Iterator[Metric]:
        labels = ["provider", "node", "type", "category"]
        in_flight = GaugeMetricFamily("iop_provider_in_flight", "Requests running on the provider", labels=labels)
        capacity = GaugeMetricFamily("iop_provider_capacity", "Concurrent slots of the provider", labels=labels)
        up = GaugeMetricFamily("iop_provider_available", "1 when the dispatcher may choose the provider",
                               labels=labels)
        health = GaugeMetricFamily("iop_provider_health", "1 for the provider's current health state",
                                   labels=[*labels, "health"])
        queued_p = GaugeMetricFamily("iop_provider_queued", "Jobs waiting in the groups the provider serves",
                                     labels=labels)
        draining = GaugeMetricFamily("iop_provider_draining",
                                     "1 while an operator's drain keeps new jobs off the provider", labels=labels)
        disabled = GaugeMetricFamily("iop_provider_disabled",
                                     "1 while an operator's override disables the provider", labels=labels)
        overridden = GaugeMetricFamily("iop_provider_overridden",
                                       "1 for each of the provider's config values an operator overrides now",
                                       labels=[*labels, "field"])
        tokens_rate = GaugeMetricFamily("iop_provider_tokens_per_second",
                                        "Completion tokens per second over about the last 10 s, all workers",
                                        labels=labels)
        ejected = GaugeMetricFamily("iop_provider_ejected",
                                    "1 while the provider is out of rotation for its 5xx answers, 0.5 on trial",
                                    labels=labels)
        ejections = CounterMetricFamily("iop_provider_ejections",
                                        "Ejections of the provider for its 5xx answers, by reason",
                                        labels=[*labels, "reason"])
        learned = GaugeMetricFamily("iop_provider_capacity_learned",
                                    "1 when the provider's capacity is learned (capacity: auto)", labels=labels)
        external = GaugeMetricFamily("iop_provider_external_load",
                                     "What its engine runs and queues beyond iop's in_flight there", labels=labels)
        engine_running = GaugeMetricFamily("iop_provider_engine_running", "Requests its engine reports running",
                                           labels=labels)
        engine_waiting = GaugeMetricFamily("iop_provider_engine_waiting", "Requests its engine reports queued",
                                           labels=labels)
        kv_usage = GaugeMetricFamily("iop_provider_engine_kv_usage", "Its engine's KV cache use, 0-1", labels=labels)
        paused = GaugeMetricFamily("iop_provider_rate_limited",
                                   "1 while its upstream's rate limit keeps new requests off it", labels=labels)
        excused = CounterMetricFamily("iop_provider_excused_5xx",
                                      "5xx answers not held against the provider: another provider answered the "
                                      "same request 5xx too", labels=labels)
        for p in self.catalog.providers:
            values = [p.id, p.node_id, p.type, p.category]
            in_flight.add_metric(values, p.in_flight)
            capacity.add_metric(values, p.capacity)
            up.add_metric(values, 1 if p.health == "available" else 0)
            queued_p.add_metric(values, p.queued)
            draining.add_metric(values, 1 if p.drain else 0)
            disabled.add_metric(values, 0 if p.enabled else 1)
            for name in p.override:
                overridden.add_metric([*values, name], 1)
            tokens_rate.add_metric(values, p.tokens_per_s)
            for state in ("available", "unavailable", "unknown"):
                health.add_metric([*values, state], 1 if p.health == state else 0)
            ej = p.ejection
            ejected.add_metric(values, 0 if ej is None else 1 if ej.state == "ejected" else 0.5)
            evidence = p.evidence
            for kind in EJECTION_KINDS:
                ejections.add_metric([*values, kind], evidence.ejections.get(kind, 0) if evidence else 0)
            excused.add_metric(values, evidence.excused_5xx if evidence else 0)
            learned.add_metric(values, 1 if p.capacity_mode == "auto" else 0)
            external.add_metric(values, p.external_load)
            paused.add_metric(values, 1 if p.rate_limited else 0)
            e = p.engine
            if e is not None:  # absent, not 0, where the engine says nothing
                if e.running is not None:
                    engine_running.add_metric(values, e.running)
                if e.waiting is not None:
                    engine_waiting.add_metric(values, e.waiting)
                if e.kv_usage is not None:
                    kv_usage.add_metric(values, e.kv_usage)
        queued = GaugeMetricFamily("iop_model_queued", "Jobs waiting in the model group's queue", labels=["model"])
        oldest = GaugeMetricFamily("iop_model_oldest_wait_seconds", "Age of the oldest waiting job",
                                   labels=["model"])
        for m in self.catalog.models:
            queued.add_metric([m.id], m.queued)
            oldest.add_metric([m.id], (m.oldest_wait_ms or 0) / 1000)
        actions = CounterMetricFamily("iop_control_actions", "Control actions audited (drain, disable, capacity, "
                                      "fallbacks, load, reload, ...), fleet-wide: every replica reports the same",
                                      labels=["action"])
        for action, n in self.catalog.control_actions.items():
            actions.add_metric([action], n)
        yield from (in_flight, capacity, up, health, queued_p, draining, disabled, overridden, tokens_rate, ejected,
                    ejections, excused, learned, external, engine_running, engine_waiting, kv_usage, paused, queued,
                    oldest, actions)
        yield from self._affinity()
        yield from self._tenants()
        yield from self._live()
        yield from self._lifecycle()

    def _lifecycle(self) -> Iterator[Metric]:
        """Models that load and unload, per managed provider and served name: what its runtime
        holds, and the loads, unloads and failed loads counted in Redis (every replica reports
        the fleet's)."""
        pair = ["provider", "model"]
        loaded = GaugeMetricFamily("iop_model_loaded", "1 while the provider's runtime holds the model loaded",
                                   labels=pair)
        loads = CounterMetricFamily("iop_model_loads", "Loads of the model on the provider: placed by iop "
                                    "(demand), or seen done by the runtime itself (runtime)", labels=[*pair, "reason"])
        unloads = CounterMetricFamily("iop_model_unloads", "Unloads of the model on the provider: to make room "
                                      "for another (evict), or by the runtime itself (runtime)",
                                      labels=[*pair, "reason"])
        failed = CounterMetricFamily("iop_model_load_failures", "Loads iop placed that failed", labels=pair)
        for p in self.catalog.providers:
            for served, state in p.models_state.items():
                loaded.add_metric([p.id, served], 1 if state.state == "loaded" else 0)
                for reason, n in state.loads.items():
                    loads.add_metric([p.id, served, reason], n)
                for reason, n in state.unloads.items():
                    unloads.add_metric([p.id, served, reason], n)
                if state.load_failures:
                    failed.add_metric([p.id, served], state.load_failures)
        yield from (loaded, loads, unloads, failed)

    def _live(self) -> Iterator[Metric]:
        """The live figures from traffic (dispatcher/live.py), per provider x model and window;
        a figure with nothing to say (no answered request in the window) is left out, not 0."""
        pair = ["provider", "model", "window"]
        requests = GaugeMetricFamily("iop_live_requests", "Callers' requests that ended in the window", labels=pair)
        errors = GaugeMetricFamily("iop_live_errors", "Of them, those that failed, by kind", labels=[*pair, "kind"])
        ttft = GaugeMetricFamily("iop_live_ttft_seconds", "Time to first output of the answered streams, "
                                 "as the worker measured it", labels=[*pair, "quantile"])
        e2e = GaugeMetricFamily("iop_live_e2e_seconds", "Time from the worker's call to its answer's end",
                                labels=[*pair, "quantile"])
        rate = GaugeMetricFamily("iop_live_tokens_per_second", "The median output tokens per second of a request",
                                 labels=pair)
        uptime = GaugeMetricFamily("iop_provider_uptime", "The share of the window the provider was healthy",
                                   labels=["provider", "window"])
        for p in self.catalog.providers:
            for window, view in p.live.items():
                if view.uptime is not None:
                    uptime.add_metric([p.id, window], view.uptime)
            for model, windows in p.live_by_model.items():
                for window, view in windows.items():
                    labels = [p.id, model, window]
                    requests.add_metric(labels, view.requests)
                    for kind, n in view.errors.items():
                        errors.add_metric([*labels, kind], n)
                    for family, pct in ((ttft, view.ttft_ms), (e2e, view.e2e_ms)):
                        if pct is not None:
                            family.add_metric([*labels, "0.5"], pct.p50 / 1000)
                            family.add_metric([*labels, "0.9"], pct.p90 / 1000)
                    if view.tokens_per_s is not None:
                        rate.add_metric(labels, view.tokens_per_s)
        yield from (requests, errors, ttft, e2e, rate, uptime)

    def _affinity(self) -> Iterator[Metric]:
        """Cache-aware dispatch, per model group that has it (counters kept in Redis: every
        replica reports the fleet's)."""
        affine = [m for m in self.catalog.models if m.affinity is not None]
        if not affine:
            return
        decisions = CounterMetricFamily(
            "iop_affinity_decisions", "Cache-aware dispatch decisions: hit (a provider holding the prompt's head, "
            "within the load bound), miss (none holds it), spill (its holders were over the bound)",
            labels=["model", "result"])
        blocks = GaugeMetricFamily("iop_affinity_index_blocks", "Prompt blocks the model's prefix index remembers",
                                   labels=["model"])
        home_queued = CounterMetricFamily(
            "iop_affinity_home_queued", "Hits sent past their home's capacity, to wait in its engine's queue "
            "(affinity.home_queue; counted among the hits too)", labels=["model"])
        for m in affine:
            assert m.affinity is not None
            for result, n in m.affinity.decisions.items():
                decisions.add_metric([m.id, result], n)
            blocks.add_metric([m.id], m.affinity.index_blocks)
            home_queued.add_metric([m.id], m.affinity.home_queued)
        yield from (decisions, blocks, home_queued)

    def _tenants(self) -> Iterator[Metric]:
        """Per tenant (flow control only): configured names, and each of them only for the
        model groups it may call, so the series are bounded by the config."""
        if not self.catalog.tenants:
            return
        queued = GaugeMetricFamily("iop_tenant_queued", "Jobs of the tenant waiting in the model group's queues",
                                   labels=["tenant", "model"])
        in_flight = GaugeMetricFamily("iop_tenant_in_flight", "Jobs of the tenant running, all model groups",
                                      labels=["tenant"])
        waiting = {(u.tenant, m.id): u.queued for m in self.catalog.models for u in m.tenants}
        for t in self.catalog.tenants:
            in_flight.add_metric([t.name], t.in_flight)
            for m in self.catalog.models:
                if t.models is None or m.id in t.models or (t.name, m.id) in waiting:
                    queued.add_metric([t.name, m.id], waiting.get((t.name, m.id), 0))
        yield from (queued, in_flight)
        limited = [t for t in self.catalog.tenants if t.limits is not None]
        if not limited:
            return
        used = GaugeMetricFamily("iop_tenant_tokens_used", "Tokens a limited tenant used: in the sliding minute "
                                 "of its tokens_per_minute, and today (UTC) against its tokens_per_day",
                                 labels=["tenant", "window"])
        refused = CounterMetricFamily("iop_rate_limited", "Requests its limits refused, by limit "
                                      "(requests, tokens, budget), across the fleet", labels=["tenant", "limit"])
        for t in limited:
            lim = t.limits
            assert lim is not None
            if lim.tokens_per_minute:
                used.add_metric([t.name, "minute"], lim.tokens_used)
            if lim.tokens_per_day:
                used.add_metric([t.name, "day"], lim.tokens_used_today)
            for kind, n in lim.refused.items():
                refused.add_metric([t.name, kind], n)
        yield from (used, refused)
