"""Live figures from traffic, per provider x model (issue 32): requests, errors by kind, TTFT
and e2e percentiles, output tokens/s per request, and uptime, over three sliding windows.

Where they come from: the worker that ran a call knows its TTFT and e2e
(``workers/job_run.py``); once its ``finish`` has settled the job, the call goes into the
worker's :class:`Tallies`, binned there, and the worker flushes them about once a second
(``lua/live.lua``: per provider x model, the tally added to the current bucket of each window,
one ``HMGET`` and one ``HSET``). Uptime comes from heartbeats (``lua/lib/uptime.lua``, in the
provider hash). Nothing is added to the request path: no round trip, and no work in Redis per
request -- unpacking and repacking a bucket's histograms, as ``finish.lua`` once did per call,
cost Redis more than the rest of a call's scripts together (docs/BENCHMARKS.md). What a
worker had not flushed when it died is lost: at most a second of figures.

Why log-bucketed histograms: a percentile over a sliding window needs the window's samples or a
mergeable summary of them. Bins 5% wide (``RATIO``) are mergeable by addition across buckets,
windows and models, cost a fixed few hundred bytes per bucket whatever the traffic, and put a
percentile read from them (interpolated within its bin, geometrically) within 2.5% of the
samples' own -- inside the 5% the live TTFT p50 has to match a client's measure by
(``bench/live_figures.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec
from redis.asyncio import Redis

from dispatcher import keys, wire

# (name, bucket length ms, buckets): lua/lib/live_windows.lua's LIVE_WINDOWS, held to it by
# tests/dispatcher/test_live.py.
WINDOWS: tuple[tuple[str, int, int], ...] = (("5m", 30_000, 10), ("1h", 300_000, 12), ("24h", 3_600_000, 24))
RATIO = 1.05
# Bins are offset so that no histogram is ever a Lua sequence 1..n (cmsgpack would pack it as an
# array): values from 0.001 up all land at 859 and above.
BIN_BASE = 1000

# How often a worker writes the calls it tallied to the live figures (workers/worker.py): the
# figures lag the calls by at most this, and cost Redis one script call per worker this often.
FLUSH_S = 1.0

# The kinds of error a call can end in, as the live figures count them (``error_kind``).
ERROR_KINDS = ("5xx", "4xx", "429", "timeout", "unreachable", "other")


@dataclass(frozen=True, slots=True)
class LiveSample:
    """One call as the live figures count it: ``e2e_ms`` from the worker's call to its end,
    ``ttft_ms`` to its first output (None: a JSON answer), ``error`` '' answered, else its
    kind (``ERROR_KINDS``)."""

    e2e_ms: float
    ttft_ms: float | None = None
    error: str = ""


def error_kind(status: int, timeout: bool = False, unreachable: bool = False) -> str:
    """A failed call's kind: by its status when it answered, else how it failed."""
    if timeout:
        return "timeout"
    if unreachable:
        return "unreachable"
    if status == 429:
        return "429"
    if status >= 500:
        return "5xx"
    if status >= 400:
        return "4xx"
    return "other" if status >= 300 or status <= 0 else ""


class Percentiles(msgspec.Struct, frozen=True):
    p50: float
    p90: float


class LiveView(msgspec.Struct, frozen=True):
    """One window of a provider's (or a provider x model's) live figures. None: nothing to
    say (no answered request with that measure in the window); ``uptime`` None: no heartbeat
    seen in the window."""

    requests: int
    errors: dict[str, int]
    ttft_ms: Percentiles | None
    e2e_ms: Percentiles | None
    tokens_per_s: float | None  # the median of the answered requests' output tokens/s
    uptime: float | None


def value_of(bin_: float) -> float:
    """The value at a (fractional) bin position: bin b holds [RATIO**b, RATIO**(b+1))."""
    return float(RATIO ** (bin_ - BIN_BASE))


def bin_of(value: float) -> int:
    """The histogram bin of a value: ``RATIO``-wide bins, offset by ``BIN_BASE`` (see ``wire.LiveBucket``)."""
    return BIN_BASE + math.floor(math.log(max(value, 0.001)) / math.log(RATIO))


def _bump(into: dict[int, int], value: float) -> None:
    b = bin_of(value)
    into[b] = into.get(b, 0) + 1


@dataclass(slots=True)
class _Counts:
    """Calls and their histograms: one provider x model's since the last flush (a worker's
    ``Tallies``, ``wire.LiveTally`` once taken), or a window's buckets summed (the catalog)."""

    requests: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    ttft: dict[int, int] = field(default_factory=dict)
    e2e: dict[int, int] = field(default_factory=dict)
    tps: dict[int, int] = field(default_factory=dict)

    def add(self, sample: LiveSample, tokens: int) -> None:
        self.requests += 1
        if sample.error:
            self.errors[sample.error] = self.errors.get(sample.error, 0) + 1
            return
        ttft = sample.ttft_ms
        if ttft is not None and ttft >= 0:
            _bump(self.ttft, ttft)
        _bump(self.e2e, sample.e2e_ms)
        # Output tokens/s while generating: from the first output on, when there was one.
        generating = sample.e2e_ms - ttft if ttft is not None and 0 <= ttft < sample.e2e_ms else sample.e2e_ms
        if tokens > 0 and generating > 0:
            _bump(self.tps, tokens * 1000 / generating)

    def merge(self, other: wire.LiveTally | wire.LiveBucket | _Counts) -> None:
        self.requests += other.requests
        _merge(self.errors, other.errors)
        _merge(self.ttft, other.ttft)
        _merge(self.e2e, other.e2e)
        _merge(self.tps, other.tps)

    def tally(self) -> wire.LiveTally:
        return wire.LiveTally(self.requests, self.errors, self.ttft, self.e2e, self.tps)

    def view(self, uptime: float | None) -> LiveView:
        def pct(h: dict[int, int]) -> Percentiles | None:
            if not h:
                return None
            return Percentiles(cast(float, percentile(h, 0.5)), cast(float, percentile(h, 0.9)))

        return LiveView(self.requests, dict(sorted(self.errors.items())), pct(self.ttft), pct(self.e2e),
                        percentile(self.tps, 0.5) if self.tps else None, uptime)


class Tallies:
    """A worker's calls since its last flush, per (provider, model): what ``lua/live.lua``
    adds to the live figures. Bounded by the pairs and bins seen, not by the calls."""

    def __init__(self) -> None:
        self._pairs: dict[tuple[str, str], _Counts] = {}

    def _of(self, pair: tuple[str, str]) -> _Counts:
        counts = self._pairs.get(pair)
        if counts is None:
            counts = self._pairs[pair] = _Counts()
        return counts

    def add(self, provider: str, model: str, sample: LiveSample, tokens: int = 0) -> None:
        """One finished call; ``tokens``: the completion tokens it generated."""
        self._of((provider, model)).add(sample, tokens)

    def take(self) -> dict[tuple[str, str], wire.LiveTally]:
        """Everything tallied, to flush; the tallies start again empty."""
        taken, self._pairs = self._pairs, {}
        return {pair: counts.tally() for pair, counts in taken.items()}

    def put_back(self, taken: dict[tuple[str, str], wire.LiveTally]) -> None:
        """A flush that did not reach Redis: its tallies wait for the next one."""
        for pair, tally in taken.items():
            self._of(pair).merge(tally)

    def __len__(self) -> int:
        return len(self._pairs)


def percentile(hist: dict[int, int], q: float) -> float | None:
    """The ``q`` quantile (0..1) of a histogram: the bin that holds its rank, interpolated
    within the bin in log space (samples spread evenly in it)."""
    total = sum(hist.values())
    if total <= 0:
        return None
    rank = q * total
    seen = 0
    for b in sorted(hist):
        n = hist[b]
        if seen + n >= rank:
            return round(float(value_of(b + (rank - seen) / n)), 3)
        seen += n
    return round(float(value_of(max(hist) + 1)), 3)


def _merge(into: dict[Any, int], more: dict[Any, int]) -> None:
    for k, v in more.items():
        into[k] = into.get(k, 0) + v


def bucket_fields() -> list[str]:
    """Every field of a pair's hash (each window's buckets)."""
    return [f"{name}:{slot}" for name, _, count in WINDOWS for slot in range(count)]


def in_window(at: int, now_ms: int, length: int, count: int) -> bool:
    current = now_ms // length
    return current - count < at <= current


def windows_of(raw: Iterable[bytes | None], now_ms: int) -> dict[str, _Counts]:
    """A pair's buckets (``bucket_fields`` order) summed per window."""
    values = list(raw)
    out: dict[str, _Counts] = {}
    i = 0
    for name, length, count in WINDOWS:
        total = _Counts()
        for value in values[i:i + count]:
            bucket = wire.live_bucket(value) if value else None
            if bucket is not None and in_window(bucket.at, now_ms, length, count):
                total.merge(bucket)
        out[name] = total
        i += count
    return out


def uptime_of(fields: dict[str, str], now_ms: int) -> dict[str, float | None]:
    """Per window, the share of the time seen (since the first heartbeat in it) that the
    provider was reported available with a fresh heartbeat (``lua/lib/uptime.lua``); time since
    a stale heartbeat's expiry counts as seen, not up."""
    out: dict[str, float | None] = {}
    expiry = int(fields.get("hb_exp") or 0)
    for name, length, count in WINDOWS:
        up = seen = 0
        for slot in range(count):
            b = wire.uptime_bucket(fields.get(f"up:{name}:{slot}"))
            if b is not None and in_window(b.at, now_ms, length, count):
                up, seen = up + b.up_ms, seen + b.seen_ms
        if expiry and now_ms > expiry and seen:
            seen += min(now_ms - expiry, length * count)
        out[name] = round(up / seen, 4) if seen else None
    return out


@dataclass(frozen=True, slots=True)
class ProviderLive:
    """A provider's live figures: ``total`` over every model it serves, ``by_model`` each."""

    total: dict[str, LiveView]
    by_model: dict[str, dict[str, LiveView]]


async def read_live(redis: Redis, pairs: list[tuple[str, str]], hashes: dict[str, dict[str, str]],
                    now_ms: int) -> dict[str, ProviderLive]:
    """The live figures of each (provider, model) pair, in one pipeline; ``hashes``: each
    provider's hash (decoded), which holds its uptime buckets."""
    fields = bucket_fields()
    if not pairs:
        return {}
    async with redis.pipeline(transaction=False) as pipe:
        for provider, model in pairs:
            pipe.hmget(keys.live(provider, model), fields)
        replies: list[list[bytes | None]] = await pipe.execute()
    sums: dict[str, dict[str, dict[str, _Counts]]] = {}
    for (provider, model), raw in zip(pairs, replies, strict=True):
        sums.setdefault(provider, {})[model] = windows_of(raw, now_ms)
    out: dict[str, ProviderLive] = {}
    for provider, models in sums.items():
        uptime = uptime_of(hashes.get(provider, {}), now_ms)
        total: dict[str, LiveView] = {}
        for name, _, _ in WINDOWS:
            whole = _Counts()
            for per_window in models.values():
                whole.merge(per_window[name])
            total[name] = whole.view(uptime[name])
        out[provider] = ProviderLive(total, {m: {n: w[n].view(uptime[n]) for n, _, _ in WINDOWS}
                                             for m, w in models.items()})
    return out
