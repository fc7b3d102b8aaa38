"""``capacity: auto``: the concurrency limit of one provider, learned by its node's worker from
what the provider does and what its engine reports (the worker's part that reads the signals
and publishes the limit is workers/capacity_control.py).

The controller is **queue-based**: a continuous-batching engine runs up to its batch (its
``max_num_seqs``, ``--parallel``, or what its KV memory holds) and queues the rest; past that
knee throughput stops growing and every request waits in the engine, where iop's fairness,
priorities, affinity, deadlines and cancellation cannot act. So the limit is the most the
engine runs without queueing:

* **Engine metrics** (vLLM, SGLang, llama.cpp's server: workers/engine_metrics.py), trusted
  first: an engine that queues (``waiting`` > 0) is full at what it runs, so the limit falls
  to its ``running`` (all clients' requests: load iop does not send counts against iop's
  share, ``external``); an engine that runs the whole limit and queues nothing while iop
  fills every slot of its share rises (with or without more waiting in iop: routing sends
  the next job to another provider rather than wait for a full one, so no backlog need
  form); a KV cache at least ``KV_FULL`` used holds it, and no
  rise goes more than a slot past what the KV holds at the use per request it reports.
* **Latency**, everywhere, and alone when the engine says nothing (or its reading is older
  than ``STALE_S``): a request that waits in the engine shows it in its time to first token
  against its per-token time, ``ttft / tpot`` -- dimensionless, so a provider that slows
  down as a whole (another model loaded, a GPU shared) does not read as queueing. When the
  median of the last calls' ratio is over ``QUEUE_FACTOR`` x its unqueued level (a low
  quantile of a long window), the limit falls by that gradient (Envoy's gradient
  controller, on a signal a batching engine gives); it rises only on calls that showed no
  queueing, and only with demand past the limit (jobs waiting in iop, or refused): calls
  that ended say that each ran unqueued, not that the whole limit ran at once. A JSON call
  has no first token: its time per output token stands in. (iop's own streams give the
  engine path a reading where the engine gives none: ``FirstTokens``.)

The limit rises multiplicatively (x ``SLOW_START``) until the provider first shows a queue
(one slot at a time while nothing more waits in iop), then by one slot per tick
(``TICK_S``), and after a fall it does not try above where it fell from for ``HOLD_S``:
it settles on the knee, or one above it, rather than sawing.
A try that fails again from the same level doubles that hold, up to ``HOLD_MAX_S``: each
try sends one request into the engine's queue, where it waits for a slot to free (on a
small batch, about a whole request's time), so a knee found twice is tried seldom; a fall
from any other level (the provider changed) starts the hold afresh. A knee where the engine
queued with its KV cache holding room for another request is its batch cap (``max_num_seqs``,
``--parallel``), which moves only when the engine restarts with another: found there a
second time, it is not tried again for ``HOLD_CAP_S``.
It never leaves ``[floor, ceiling]`` (the provider's ``min_capacity`` / ``max_capacity``).
Rate-limit headers and 429s of hosted APIs are another matter (``RateLimits``): they pause
or cap what iop sends for exactly as long as the upstream says.

Alternatives considered (docs/DESIGN.md "Capacity that iop learns", docs/BENCHMARKS.md):
Vegas on TTFT (an estimated queue from min and recent RTT) reads a uniform slowdown as a
queue; Envoy's gradient on raw latency needs periodic drops to concurrency 1 to re-learn its
minimum, which costs a busy provider its throughput; llm-d's saturation threshold
(``max(queue/5, kv/0.8)``) stops routing to a full endpoint but learns no limit.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from workers.engine_metrics import EngineLoad

TICK_S = 0.5  # how often the limit may move
STALE_S = 2.0  # an engine reading older than this says nothing
KV_FULL = 0.92  # KV cache use at which the limit stops rising (preemption is near)
SLOW_START = 1.5  # the multiplier of rises before the first queue
HOLD_S = 5.0  # after a fall, no rise above the level it fell from for this long
HOLD_MAX_S = 40.0  # ... doubled by each fall from the same level, up to this
HOLD_CAP_S = 300.0  # ... and this long after a batch cap (a queue with KV to spare) is found twice
QUEUE_FACTOR = 2.0  # ttft/tpot this many times its unqueued level: requests queue in the engine
EASED = 0.75  # after a fall, a gradient still this much of the one before: it was no queue
FIRST_TOKEN_MARGIN = 1.5  # a first token this many times the unqueued p90 late: the call waits
MIN_SAMPLES = 3  # calls a latency verdict needs
PENDING = 64  # calls kept for the next latency verdict at most
PERSIST_S = 1.0  # an engine queue counts when every reading this long shows one (SGLang: the latest)
WINDOW = 256  # calls the unqueued level is taken from
UNQUEUED_QUANTILE = 0.2


@dataclass(frozen=True)
class CallSample:
    """One call the provider answered (2xx), as its worker timed it."""

    e2e_s: float  # from the call's start to its end
    ttft_s: float | None  # to its first output (streams); None for a JSON answer
    tokens: int  # completion tokens (0: not reported)

    def queue_signal(self) -> float | None:
        """Time to first token over time per output token (streams), or the time per output
        token (JSON); None when the call says neither (one token, or none reported)."""
        if self.ttft_s is not None and self.tokens > 1:
            tpot = (self.e2e_s - self.ttft_s) / (self.tokens - 1)
            return self.ttft_s / tpot if tpot > 0 else None
        if self.ttft_s is None and self.tokens > 0:
            return self.e2e_s / self.tokens
        return None


@dataclass
class Change:
    """A move of the limit, and why (for the catalog: ``engine queue 3 at 9 running: 10 → 9``)."""

    old: int
    new: int
    reason: str


@dataclass
class LimitController:
    floor: int
    ceiling: int
    limit: int
    reason: str = ""
    # Set once the provider has shown a queue: rises are one slot at a time from then on.
    slow_start: bool = True
    _hold_until: float = 0.0
    _hold_s: float = HOLD_S  # the hold the next fall sets
    _quiet_until: float = 0.0
    _last_clear: int = 0  # the last limit whose calls showed no queue (latency)
    _fell_at_gradient: float = 0.0  # the latency gradient a fall was made on, until calls ease
    _fell_from: int = 0
    _cap_knee: int = 0  # where the engine last queued with KV room to spare: its batch cap
    _peak_in_flight: int = 0
    _last_tick: float = 0.0
    _window: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    _window_json: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    _pending: list[CallSample] = field(default_factory=list)  # calls since the limit last moved
    _readings: deque[EngineLoad] = field(default_factory=lambda: deque(maxlen=32))

    @classmethod
    def starting(cls, floor: int, ceiling: int, start: int | None = None, hint: int | None = None) -> LimitController:
        """A safe start: ``start`` (a limit it learned before) or the engine's own slots hint,
        else two, within the bounds."""
        first = start if start is not None else hint if hint is not None else 2
        first = min(max(first, floor), ceiling)
        return cls(floor=floor, ceiling=ceiling, limit=first, reason=f"starting at {first}",
                   slow_start=start is None)

    def restarted(self, slots: int | None = None) -> Change | None:
        """The provider is back after its worker saw it down: most likely a new engine
        process, perhaps with another batch, model or device. What was learned of the old
        one's knee no longer holds: the holds (a batch cap's among them), the unqueued
        latency levels and the engine readings go, and slow start resumes from the limit in
        force, or from ``slots``: the engine's slots where they changed (restarted with
        another ``--parallel``, say)."""
        # Everything but the limit, its reason and the tick under way as a new controller has
        # it: the defaults are the one statement of what a fresh start knows.
        fresh = LimitController(floor=self.floor, ceiling=self.ceiling, limit=self.limit, reason=self.reason,
                                _peak_in_flight=self._peak_in_flight, _last_tick=self._last_tick)
        self.__dict__.update(fresh.__dict__)
        if slots is None:
            return None
        target = min(max(slots, self.floor), self.ceiling)
        if target == self.limit:
            return None
        old, self.limit = self.limit, target
        self.reason = f"back after being down, its slots {slots}: {old} → {self.limit}"
        return Change(old, self.limit, self.reason)

    # --- what the worker tells it -----------------------------------------------------------

    def observe(self, sample: CallSample) -> None:
        """A call the provider answered."""
        self._pending.append(sample)
        del self._pending[:-PENDING]

    def note_in_flight(self, in_flight: int) -> None:
        """iop's requests on the provider now (every worker's): the tick's peak."""
        self._peak_in_flight = max(self._peak_in_flight, in_flight)

    def note_engine(self, reading: EngineLoad) -> None:
        """A fresh reading of the engine's own load (workers/engine_metrics.py)."""
        if reading.waiting is not None:
            self._readings.append(reading)

    # --- the decision --------------------------------------------------------------------------

    def due(self, now: float) -> bool:
        return now - self._last_tick >= TICK_S

    def tick(self, now: float, backlog: bool, external: int) -> Change | None:
        """Move the limit, or not. ``backlog``: demand past the limit (jobs wait in the
        provider's lanes, or were refused since the last tick); ``external``: load iop does
        not send, counted against iop's share of the limit."""
        self._last_tick = now
        peak, self._peak_in_flight = self._peak_in_flight, 0
        # iop's own requests there past the limit: dispatched before it fell, or hits sent to
        # wait in their home's queue (lua/lib/home_room.lua), which is demand beyond it too.
        excess = max(peak - self.limit, 0)
        # Every slot of iop's share was taken at some moment of the tick; more wanted it.
        full, demand = peak >= self.limit - external, backlog or excess > 0
        window = [r for r in self._readings if 0 <= now - r.at <= PERSIST_S]
        if len(window) >= 2 and now - window[-1].at <= STALE_S:
            self._remember(self._pending)
            self._pending = []
            return self._by_engine(now, window, full, demand, excess, peak + external)
        # Both: the provider is the bottleneck.
        return self._by_latency(now, full and demand)

    def _by_engine(self, now: float, window: list[EngineLoad], full: bool, demand: bool,
                   excess: int, holds: int) -> Change | None:
        """A queue only counts when every reading of the last ``PERSIST_S`` shows one: a
        request that arrived during a step waits for the next one; that is not a knee. An
        engine that sets its gauges only at events it logs (SGLang) is taken at its latest
        word instead: each of its values is what was left queued after it scheduled, and the
        one set as a prefill batch forms is taken just as the queue's head left the queue, so
        a limit one over its batch shows a queue only in the readings between those. Nor does
        the part of a queue that is iop's own ``excess`` over the limit count: those wait
        there by design, or until they are done."""
        waits = [r.waiting or 0 for r in window]
        queued = waits[-1] if window[-1].at_events else min(waits)
        beyond = queued - excess
        if beyond > 0:
            # What the engine runs while it queues: its own count (at most, over the window),
            # or, where that count is stale and low (SGLang's, set as a prefill batch forms,
            # leaves out the batch joining), what it ``holds`` less what it queues: iop's
            # requests there at most this tick and the load iop does not send. The limit falls
            # to the higher of the two, and at least by iop's share of the queue: a limit slow
            # start took past the knee (14 → 21 on a batch of 16) is seldom filled, and a fall
            # by the queue its demand made left it 3 over.
            running = max(r.running or 0 for r in window)
            ran = max(running, holds - queued)
            target = max(self.floor, running, min(ran, self.limit - beyond))
            if target < self.limit:
                # Its KV had room for another at the use per request it reports, and it did
                # not run one: what stopped it is its batch cap, not memory.
                free = _kv_free_for(window)
                capped = free is not None and free >= 1 and target == ran
                return self._fall(now, target, f"engine queue {queued} at {running} running"
                                  + (f" (its KV had room for {free} more: a batch cap)" if capped else ""), capped)
            return None
        if queued > 0:
            return None  # all of it iop's own excess
        if any(r.kv_usage is not None and r.kv_usage >= KV_FULL for r in window):
            return None
        # Proof that it runs the whole limit: a reading with all of it running and nothing
        # queued (a request that waits a step elsewhere in the window does not disprove it).
        # iop's share full is enough; demand waiting in iop is not needed. Routing sends each
        # job to the provider least loaded for its limit, so a provider whose small limit is
        # full loses the next job to one with a slot free: no backlog forms, and a limit that
        # waited for one would stay at its start while the load went to the others (a batch-4
        # server held at 2 for 22 s, docs/BENCHMARKS.md "A limit that waited for a backlog").
        # A slot nobody needs costs little: routing fills it only where it is the least loaded.
        if full and any((r.waiting or 0) == 0 and _ran(r) >= self.limit for r in window):
            why = "engine queue 0, every slot busy" + (" with more waiting" if demand else "")
            # Without demand past the limit, one slot at a time: nothing waits for a faster
            # climb, and slow start's x1.5 would put a batch-4 engine at 6, where a load
            # that seldom queues it leaves the limit (slow-small-kv at 50%: limits 3-6).
            return self._rise(now, why, _kv_room(window), slow=demand)
        return None

    def _by_latency(self, now: float, saturated: bool) -> Change | None:
        if now < self._quiet_until:
            # Calls dispatched before the limit last moved, finishing now: not its verdict.
            self._remember(self._pending)
            self._pending = []
            return None
        samples = self._pending
        streams = [s for s in (c.queue_signal() for c in samples if c.ttft_s is not None) if s is not None]
        jsons = [s for s in (c.queue_signal() for c in samples if c.ttft_s is None) if s is not None]
        verdict: tuple[float, str] | None = None
        for values, window, what in ((streams, self._window, "time to first token / time per token"),
                                     (jsons, self._window_json, "time per output token")):
            if len(values) >= MIN_SAMPLES and len(window) >= MIN_SAMPLES:
                level = _quantile(window, UNQUEUED_QUANTILE)
                if level > 0:
                    gradient = statistics.median(values) / level
                    if verdict is None or gradient > verdict[0]:
                        verdict = (gradient, what)
        if verdict is None:
            if len(streams) + len(jsons) >= MIN_SAMPLES and not (len(self._window) + len(self._window_json)):
                self._remember(samples)  # the first calls: the unqueued level to judge by
                self._pending = []
            return None  # too few calls yet to say
        self._pending = []
        e2e = statistics.median(c.e2e_s for c in samples)
        gradient, what = verdict
        if gradient > QUEUE_FACTOR:
            if self._fell_at_gradient and gradient >= EASED * self._fell_at_gradient:
                # The limit fell and the calls did not ease: not a queue but other calls (longer
                # prompts, say). Their level is the one to judge by from now on.
                self._window.clear()
                self._window_json.clear()
                self._remember(samples)
                self._fell_at_gradient = 0.0
                return None
            # A call that waits in the engine waits about as long whether one or five are
            # over its batch: the gradient says that requests queue, not by how many. Back
            # to the last level that showed none in slow start, else one slot down.
            target = self._last_clear if self.slow_start and 0 < self._last_clear < self.limit else self.limit - 1
            if target >= self.floor:
                self._quiet_until = now + e2e
                self._fell_at_gradient = gradient
                return self._fall(now, target, f"{what} {gradient:.1f}x its unqueued level")
            return None
        # Only calls that showed no queue make the unqueued level.
        self._remember(samples)
        self._fell_at_gradient = 0.0
        self._last_clear = self.limit
        if saturated:
            change = self._rise(now, "every slot busy with more waiting, latency flat")
            if change is not None:
                self._quiet_until = now + e2e
            return change
        return None

    def _remember(self, samples: list[CallSample]) -> None:
        for c in samples:
            signal = c.queue_signal()
            if signal is not None:
                (self._window if c.ttft_s is not None else self._window_json).append(signal)

    def _fall(self, now: float, target: int, why: str, capped: bool = False) -> Change:
        old = self.limit
        self.limit = max(self.floor, target)
        self.slow_start = False
        # The same try failed again: the knee is where it was.
        self._hold_s = min(2 * self._hold_s, HOLD_MAX_S) if old == self._fell_from else HOLD_S
        if capped and self.limit == self._cap_knee:
            # The batch cap found again: it moves only with a restart of the engine.
            self._hold_s = HOLD_CAP_S
        self._cap_knee = self.limit if capped else 0
        self._fell_from = old
        self._hold_until = now + self._hold_s
        self.reason = f"{why}: {old} → {self.limit}"
        return Change(old, self.limit, self.reason)

    def _rise(self, now: float, why: str, kv_room: int | None = None, slow: bool = True) -> Change | None:
        """Up a step: slow start's (``slow``, until the first queue), else one slot."""
        if self.limit >= self.ceiling:
            return None
        step = max(1, math.ceil(self.limit * (SLOW_START - 1))) if self.slow_start and slow else 1
        target = min(self.limit + step, self.ceiling)
        if kv_room is not None and target > max(kv_room, self.limit + 1):
            # Past what its KV holds the engine queues (or preempts): no more than a slot
            # beyond that is worth a try, however fast slow start would go.
            target = max(kv_room, self.limit + 1)
            why = f"{why} (its KV holds about {kv_room})"
        if now < self._hold_until and target >= self._fell_from:
            target = self._fell_from - 1
        if target <= self.limit:
            return None
        old = self.limit
        self.limit = target
        self.reason = f"{why}: {old} → {self.limit}"
        return Change(old, self.limit, self.reason)


def _ran(reading: EngineLoad) -> int:
    """The most the engine ran at a reading. SGLang sets its gauges as a prefill batch forms
    (``running``: the batch before the new requests joined it; the new ones are only in its
    log line) and every 40th decoding step (the batch then): a reading of the first kind with
    nothing left queued ran at least one more than it says. Taking every event reading for
    that kind overstates a decoding step's by one, at worst one slot tried too early; taking
    none for it left a batch-4 SGLang server at 3 for 18 s, a reading of 4 running being
    rare while every free slot is filled at once."""
    running = reading.running or 0
    return running + 1 if reading.at_events and not reading.waiting else running


def _kv_room(window: list[EngineLoad]) -> int | None:
    """How many requests the engine's KV holds under ``KV_FULL``, at the use per running
    request its readings show (the least of them); None when they report no KV use."""
    rooms = [math.floor(r.running * KV_FULL / r.kv_usage + 1e-9) for r in window
             if r.kv_usage and r.kv_usage > 0 and r.running]
    return min(rooms) if rooms else None


def _kv_free_for(window: list[EngineLoad]) -> int | None:
    """How many more requests the engine's KV held, at the use per running request its
    readings show (the least of them, at the fullest reading); None without KV use."""
    frees = [math.floor(r.running / r.kv_usage + 1e-9) - r.running for r in window
             if r.kv_usage and r.kv_usage > 0 and r.running]
    return min(frees) if frees else None


def _quantile(values: deque[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(len(ordered) * q), len(ordered) - 1)]


# --------------------------------------------------------------------------- hosted APIs


@dataclass
class RateLimits:
    """What an upstream's rate-limit answers say iop may send it: nothing until
    ``paused_until`` (a 429's ``retry-after``, or a window with no request left until its
    reset), and at most ``cap`` requests at once until ``cap_until`` (the requests left in
    the window). Times are ``time.time()`` seconds (the headers' resets are wall-clock)."""

    paused_until: float = 0.0
    cap: int | None = None
    cap_until: float = 0.0
    reason: str = ""
    _consecutive_429: int = 0

    def answered(self, status: int, headers: dict[str, str], now: float | None = None) -> bool:
        """Read an answer's headers; whether what iop may send changed."""
        now = time.time() if now is None else now
        lowered = {k.lower(): v for k, v in headers.items()}
        before = (self.paused_until, self.cap, self.cap_until)
        if status == 429:
            self._consecutive_429 += 1
            wait = retry_after_s(lowered, now)
            if wait is None:
                wait = min(2.0 ** (self._consecutive_429 - 1), 30.0)
            self.paused_until = max(self.paused_until, now + wait)
            self.reason = f"429: nothing sent for {wait:g}s"
        else:
            self._consecutive_429 = 0
            remaining = _int_header(lowered, "x-ratelimit-remaining-requests",
                                    "anthropic-ratelimit-requests-remaining")
            reset = reset_s(lowered, now, "x-ratelimit-reset-requests", "anthropic-ratelimit-requests-reset")
            if remaining is not None and reset is not None:
                if remaining <= 0:
                    self.paused_until = max(self.paused_until, now + reset)
                    self.reason = f"no request left in the upstream's window: nothing sent for {reset:g}s"
                else:
                    self.cap, self.cap_until = remaining, now + reset
            tokens_left = _int_header(lowered, "x-ratelimit-remaining-tokens", "anthropic-ratelimit-tokens-remaining")
            tokens_reset = reset_s(lowered, now, "x-ratelimit-reset-tokens", "anthropic-ratelimit-tokens-reset")
            if tokens_left is not None and tokens_left <= 0 and tokens_reset is not None:
                self.paused_until = max(self.paused_until, now + tokens_reset)
                self.reason = f"no token left in the upstream's window: nothing sent for {tokens_reset:g}s"
        return before != (self.paused_until, self.cap, self.cap_until)

    def limit(self, learned: int, now: float | None = None) -> int:
        """``learned``, capped by the requests left in the upstream's window."""
        now = time.time() if now is None else now
        if self.cap is not None and now < self.cap_until:
            return max(1, min(learned, self.cap))
        return learned


def _int_header(headers: dict[str, str], *names: str) -> int | None:
    for name in names:
        raw = headers.get(name)
        if raw is not None:
            try:
                return int(float(raw))
            except ValueError:
                return None
    return None


def retry_after_s(headers: dict[str, str], now: float) -> float | None:
    """``retry-after-ms`` or ``retry-after`` (seconds, or an HTTP date), in seconds."""
    if "retry-after-ms" in headers:
        try:
            return max(float(headers["retry-after-ms"]) / 1000, 0.0)
        except ValueError:
            pass
    raw = headers.get("retry-after")
    if raw is None:
        return None
    try:
        return max(float(raw), 0.0)
    except ValueError:
        pass
    from email.utils import parsedate_to_datetime
    try:
        return max(parsedate_to_datetime(raw).timestamp() - now, 0.0)
    except (TypeError, ValueError):
        return None


def reset_s(headers: dict[str, str], now: float, *names: str) -> float | None:
    """A window's reset in seconds from now: OpenAI's durations (``1s``, ``6m0s``, ``20ms``)
    or Anthropic's RFC 3339 time."""
    for name in names:
        raw = headers.get(name)
        if raw is None:
            continue
        seconds = _duration_s(raw)
        if seconds is not None:
            return seconds
        from datetime import datetime
        try:
            return max(datetime.fromisoformat(raw.replace("Z", "+00:00")).timestamp() - now, 0.0)
        except ValueError:
            return None
    return None


_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def _duration_s(text: str) -> float | None:
    """``6m0s`` -> 360.0; a bare number is seconds; None if it is not a duration."""
    text = text.strip()
    try:
        return max(float(text), 0.0)
    except ValueError:
        pass
    total, number = 0.0, ""
    i = 0
    matched = False
    while i < len(text):
        ch = text[i]
        if ch.isdigit() or ch == ".":
            number += ch
            i += 1
            continue
        unit = "ms" if text.startswith("ms", i) else ch
        if unit not in _UNITS or not number:
            return None
        total += float(number) * _UNITS[unit]
        number, matched = "", True
        i += len(unit)
    return total if matched and not number else None


# --------------------------------------------------------------------------- no engine metrics


@dataclass
class FirstTokens:
    """An engine's queue as iop's own streamed calls show it, where the engine reports none:
    a call still without its first token long after an unqueued one would have had it waits
    in the engine. ``reading`` makes of that what the engine's metrics would say
    (``running``: calls past their first token, decoding; ``waiting``: calls overdue; a call
    not yet overdue is neither, since it may be in its prefill or in the queue), for the same
    controller (:meth:`LimitController.note_engine`), several times a second, not only when
    calls end. The unqueued level is the time to first token of calls that found a slot
    free: started while fewer of iop's calls ran there than the most it has seen decoding at
    once (``proven``: the engine ran that many together). A call started with every proven
    slot taken may wait for one, and says nothing of the prefill alone."""

    calls: dict[object, tuple[float, float | None]] = field(default_factory=dict)  # key -> (start, first)
    clean: deque[float] = field(default_factory=lambda: deque(maxlen=128))
    proven: int = 0  # the most calls seen decoding at once
    _clean_start: set[object] = field(default_factory=set)

    def started(self, key: object, now: float) -> None:
        if len(self.calls) < max(self.proven, 1):
            self._clean_start.add(key)
        self.calls[key] = (now, None)

    def first_output(self, key: object, now: float) -> None:
        call = self.calls.get(key)
        if call is None or call[1] is not None:
            return
        self.calls[key] = (call[0], now)
        self.proven = max(self.proven, sum(1 for _, first in self.calls.values() if first is not None))
        if key in self._clean_start:
            self.clean.append(now - call[0])
            self._clean_start.discard(key)

    def ended(self, key: object) -> None:
        self.calls.pop(key, None)
        self._clean_start.discard(key)

    def overdue_after(self) -> float | None:
        """How long a call may wait for its first token unqueued (None: too few seen yet)."""
        if len(self.clean) < MIN_SAMPLES * 2:
            return None
        return max(FIRST_TOKEN_MARGIN * _quantile(self.clean, 0.9), 2 * statistics.median(self.clean))

    def reading(self, now: float) -> EngineLoad | None:
        limit = self.overdue_after()
        if limit is None or not self.calls:
            return None
        decoding = sum(1 for _, first in self.calls.values() if first is not None)
        waiting = sum(1 for start, first in self.calls.values() if first is None and now - start > limit)
        return EngineLoad(running=decoding, waiting=waiting, kv_usage=None, at=now)
