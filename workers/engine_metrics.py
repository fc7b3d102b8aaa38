"""What a provider's engine says of its own load, read by its node's worker (``capacity:
auto``, and load iop does not send: workers/capacity.py).

| type     | running                          | waiting                       | KV use (0-1)                 |
|----------|----------------------------------|-------------------------------|------------------------------|
| vllm     | ``vllm:num_requests_running``    | ``vllm:num_requests_waiting`` | ``vllm:kv_cache_usage_perc`` |
| sglang   | ``sglang:num_running_reqs``      | ``sglang:num_queue_reqs``     | ``sglang:token_usage``       |
| llamacpp | ``llamacpp:requests_processing`` | ``llamacpp:requests_deferred`` | (none)                      |

All from ``GET /metrics``. vLLM before 0.10 names its KV use ``vllm:gpu_cache_usage_perc``;
SGLang publishes metrics with ``--enable-metrics``, llama-server with ``--metrics``. vLLM sets
its gauges at every step and llama-server counts at every scrape; SGLang sets them only when
it logs its stats (``EngineLoad.at_events``), which the controller reads otherwise.

Every one of these is answered outside the engine's request path (a Prometheus exposition
the server renders from counters it keeps), so it never disturbs generation. Other types
have no engine metrics: llama-cpp-python's server has no ``/metrics`` (and takes its model
lock for most of its routes: it is never asked anything while busy), Ollama, Lemonade and
hosted APIs report no queue; for them latency and rate-limit headers are the signals.

A server that answers ``/metrics`` with 404 (metrics off, or a llama-cpp-python behind the
``llamacpp`` type) is not asked again for ``NO_METRICS_RECHECK_S``.

The exposition is scanned for the few names wanted, not parsed whole: vLLM's is tens of
kilobytes of histograms, read several times a second. Values of one name are summed over
its label sets (a data-parallel server reports one per engine).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import msgspec

NO_METRICS_RECHECK_S = 60.0
MAX_METRICS_BYTES = 8 * 1024 * 1024


class EngineLoad(msgspec.Struct, frozen=True):
    """One reading of an engine's own counters; None where the engine does not say."""

    running: int | None
    waiting: int | None
    kv_usage: float | None
    at: float  # time.monotonic() when read
    # The engine sets these only at events it logs (SGLang: as a prefill batch forms, and every
    # 40th decoding step), not at every step: a reading may repeat one for a second or more.
    at_events: bool = False

    def age_s(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.at


@dataclass(frozen=True)
class MetricNames:
    """Where a runtime type publishes its load; each field lists names in order of preference."""

    path: str
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    kv_usage: tuple[str, ...]
    at_events: bool = False  # gauges set at logged events only (EngineLoad.at_events)


SOURCES: dict[str, MetricNames] = {
    "vllm": MetricNames("/metrics", ("vllm:num_requests_running",), ("vllm:num_requests_waiting",),
                        ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")),
    "sglang": MetricNames("/metrics", ("sglang:num_running_reqs",), ("sglang:num_queue_reqs",),
                          ("sglang:token_usage",), at_events=True),
    "llamacpp": MetricNames("/metrics", ("llamacpp:requests_processing",), ("llamacpp:requests_deferred",),
                            ("llamacpp:kv_cache_usage_ratio",)),
}


def sample_sum(text: bytes, name: str) -> float | None:
    """The sum of the samples of metric ``name`` in a Prometheus text exposition (None if it
    has none). Only lines ``name value`` and ``name{labels} value`` count: not comments, nor
    other metrics whose name merely starts with this one (``name_total``)."""
    key = name.encode()
    total: float | None = None
    start = 0
    while True:
        at = text.find(key, start)
        if at < 0:
            return total
        start = at + len(key)
        if at > 0 and text[at - 1] not in b"\n":
            continue  # inside another line (a comment's text, a label value)
        rest_at = at + len(key)
        if rest_at >= len(text) or text[rest_at] not in b"{ ":
            continue  # a longer name
        end = text.find(b"\n", rest_at)
        line = text[rest_at:end if end >= 0 else len(text)]
        if line.startswith(b"{"):
            close = line.rfind(b"}")
            if close < 0:
                continue
            line = line[close + 1:]
        fields = line.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if value != value:  # NaN: the engine has nothing to say
            continue
        total = value if total is None else total + value


def first_of(text: bytes, names: tuple[str, ...]) -> float | None:
    for name in names:
        value = sample_sum(text, name)
        if value is not None:
            return value
    return None


def parse(text: bytes, names: MetricNames, at: float) -> EngineLoad | None:
    """The engine's load from its exposition; None when it has none of the running and waiting counts."""
    running, waiting = first_of(text, names.running), first_of(text, names.waiting)
    if running is None and waiting is None:
        return None
    kv = first_of(text, names.kv_usage)
    return EngineLoad(running=None if running is None else round(running),
                      waiting=None if waiting is None else round(waiting),
                      kv_usage=None if kv is None else min(max(kv, 0.0), 1.0), at=at, at_events=names.at_events)


class EngineMetrics:
    """Reads one provider's engine load, when its type publishes one (``SOURCES``)."""

    def __init__(self, session: aiohttp.ClientSession, root: str, provider_type: str,
                 headers: dict[str, str] | None = None, silent: Callable[[], bool] | None = None) -> None:
        self._session = session
        # Never asked while this says so (a llamacpp-type server without /health: llama-cpp-python).
        self._silent = silent
        self._root = root.rstrip("/")
        self._names = SOURCES.get(provider_type)
        self._headers = headers or {}
        self._silent_until = 0.0  # answered 404: not asked again before then
        self.last: EngineLoad | None = None
        self.error = ""  # why the last reading failed, in words ('' when it did not)

    @property
    def available(self) -> bool:
        """Whether it is worth asking now (a type with metrics, not found missing lately)."""
        return (self._names is not None and time.monotonic() >= self._silent_until
                and not (self._silent is not None and self._silent()))

    async def read(self, timeout_s: float) -> EngineLoad | None:
        """A fresh reading, kept in ``last``; None when the engine gives none now."""
        if self._names is None or not self.available:
            return None
        names = self._names
        try:
            async with self._session.get(self._root + names.path, headers=self._headers,
                                         timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                if resp.status == 404:
                    self._silent_until = time.monotonic() + NO_METRICS_RECHECK_S
                    self.error = f"GET {names.path} answered 404: no engine metrics"
                    return None
                if resp.status != 200:
                    self.error = f"GET {names.path} answered {resp.status}"
                    return None
                text = await resp.content.read(MAX_METRICS_BYTES)
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.error = f"GET {names.path}: {exc.__class__.__name__}"
            return None
        load = parse(text, names, time.monotonic())
        if load is None:
            self.error = f"GET {names.path} has no {names.running[0]} nor {names.waiting[0]}"
            return None
        self.error = ""
        self.last = load
        return load
