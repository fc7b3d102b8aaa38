"""Ollama's model lifecycle for the fake: which models are loaded, loading them, unloading them.

Modelled on Ollama's scheduler (server/sched.go): a request for a model that is not loaded
waits for its load; loads happen one at a time; at ``max_loaded`` (``OLLAMA_MAX_LOADED_MODELS``)
an idle model is unloaded to make room, and when every loaded model is busy the load waits until
one is idle; a model whose last request ended starts its keep-alive timer (``OLLAMA_KEEP_ALIVE``,
or the ``keep_alive`` of the last native request that named it) and is unloaded when it runs out.
Unlike Ollama, which evicts the idle model with the shortest keep-alive (then by name), the fake
evicts the least recently used idle one: what a test of a fleet's routing wants to predict.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import math
import re
import time
from typing import Final, Literal

import msgspec

from ._common import FakeOptions

LoadReason = Literal["request", "api"]
UnloadReason = Literal["api", "keep_alive", "evict"]
_LOAD_REASONS: Final[tuple[LoadReason, ...]] = ("request", "api")
_UNLOAD_REASONS: Final[tuple[UnloadReason, ...]] = ("api", "keep_alive", "evict")

# Go's time.Duration(math.MaxInt64), what Ollama makes of a negative keep_alive: "forever".
_FOREVER_S: Final = (2**63 - 1) / 1e9


def is_on(options: FakeOptions) -> bool:
    """Whether the lifecycle runs; off (every model always loaded) unless one of its options is set."""
    return options.max_loaded is not None or options.load_ms is not None or options.keep_alive_s is not None


class _Runner:
    """One loaded (or loading) model, as Ollama's runnerRef."""

    __slots__ = ("expires_at", "loading", "name", "ready", "refs", "session", "timer", "unload_reason", "used")

    def __init__(self, name: str, session: float | None, used: int) -> None:
        self.name = name
        self.refs = 0
        self.loading = True
        self.ready = asyncio.Event()
        self.session = session
        """Keep-alive in seconds once idle; None: forever."""
        self.expires_at: float | None = None
        """Wall-clock seconds the keep-alive timer runs out, while it runs."""
        self.timer: asyncio.TimerHandle | None = None
        self.unload_reason: UnloadReason = "keep_alive"
        """Why it is unloaded when a zero keep-alive runs out: an unload asked for (``api``) or not."""
        self.used = used


class _Counts(msgspec.Struct):
    """What ``GET /_fake/lifecycle`` answers."""

    on: bool
    loaded: list[str]
    """Least recently used first."""
    loading: list[str]
    waiting: list[str]
    """A model whose load waits for room: every loaded model is busy."""
    in_use: dict[str, int]
    loads: dict[str, dict[str, int]]
    unloads: dict[str, dict[str, int]]
    total_loads: int
    total_unloads: int


class Lifecycle:
    def __init__(self, options: FakeOptions) -> None:
        self.options = options
        self.loaded: dict[str, _Runner] = {}
        self.loads: dict[str, dict[str, int]] = {}
        self.unloads: dict[str, dict[str, int]] = {}
        self._load_lock = asyncio.Lock()
        self._changed = asyncio.Event()
        self._ticks = itertools.count()
        self._waiting: str | None = None

    # ---------------------------------------------------------------- requests

    async def acquire(self, model: str, keep_alive: float | msgspec.UnsetType | None, reason: LoadReason) -> _Runner:
        """The loaded ``model``, held (busy) until ``release``; loads it first if need be.
        ``keep_alive``: the request's (None: forever), or UNSET to leave the model's as it is."""
        while True:
            runner = self.loaded.get(model)
            if runner is not None:
                if runner.loading:
                    await runner.ready.wait()
                    continue  # loaded, or its load was given up: look again
                self._use(runner, keep_alive)
                return runner
            async with self._load_lock:  # one load at a time, as Ollama's pending queue
                if model in self.loaded:
                    continue  # loaded while this request queued for the lock
                await self._make_room(model)
                session = self._default_session() if keep_alive is msgspec.UNSET else keep_alive
                runner = _Runner(model, session, next(self._ticks))
                runner.refs = 1
                # Listed (and counted against max_loaded) while it loads, as Ollama lists it.
                self.loaded[model] = runner
                try:
                    load_ms = self.options.load_ms or 0
                    if load_ms > 0:
                        await asyncio.sleep(load_ms / 1000)
                except BaseException:
                    # The requester went away: the load is given up, as Ollama's on a cancelled context.
                    del self.loaded[model]
                    runner.ready.set()
                    self._notify()
                    raise
                runner.loading = False
                runner.ready.set()
                self._count(self.loads, model, reason, _LOAD_REASONS)
                return runner

    def release(self, runner: _Runner) -> None:
        """The end of a request that held ``runner``: when idle, its keep-alive starts."""
        runner.refs -= 1
        runner.used = next(self._ticks)
        if runner.refs > 0:
            return
        if self.loaded.get(runner.name) is runner:
            session = runner.session
            if session is not None and session <= 0:
                self._unload(runner, runner.unload_reason)
            elif session is not None:
                runner.timer = asyncio.get_running_loop().call_later(session, self._expire, runner)
                runner.expires_at = time.time() + session
        self._notify()

    def unload(self, model: str) -> None:
        """Unload ``model`` now, or once its requests end (Ollama's expireRunner); nothing when not loaded."""
        runner = self.loaded.get(model)
        if runner is None:
            return
        self._stop_timer(runner)
        runner.session = 0
        runner.unload_reason = "api"
        runner.expires_at = time.time()
        if runner.refs <= 0:
            self._unload(runner, "api")

    def notify(self) -> None:
        """The options may have changed (``max_loaded`` raised): a waiting load looks again."""
        self._notify()

    # ---------------------------------------------------------------- what it shows

    def expires_at(self, runner: _Runner, now: float) -> float:
        if runner.expires_at is not None and runner.refs <= 0 and not runner.loading:
            return runner.expires_at
        # Busy or loading: Ollama estimates it from the keep-alive.
        return now + (_FOREVER_S if runner.session is None else runner.session)

    def counts(self) -> _Counts:
        by_use = sorted(self.loaded.values(), key=lambda r: r.used)
        return _Counts(
            on=is_on(self.options),
            loaded=[r.name for r in by_use if not r.loading],
            loading=[r.name for r in by_use if r.loading],
            waiting=[] if self._waiting is None else [self._waiting],
            in_use={r.name: r.refs for r in by_use if r.refs > 0},
            loads=self.loads,
            unloads=self.unloads,
            total_loads=sum(sum(c.values()) for c in self.loads.values()),
            total_unloads=sum(sum(c.values()) for c in self.unloads.values()),
        )

    def reset_counts(self) -> None:
        self.loads.clear()
        self.unloads.clear()

    # ---------------------------------------------------------------- inside

    def _default_session(self) -> float | None:
        return self.options.keep_alive_s

    def _use(self, runner: _Runner, keep_alive: float | msgspec.UnsetType | None) -> None:
        runner.refs += 1
        runner.used = next(self._ticks)
        self._stop_timer(runner)
        if keep_alive is not msgspec.UNSET:
            # As Ollama: a request's keep_alive replaces the model's, a pending unload included.
            runner.session = keep_alive
            runner.unload_reason = "keep_alive"

    async def _make_room(self, model: str) -> None:
        while True:
            limit = self.options.max_loaded
            if limit is None or len(self.loaded) < limit:
                return
            idle = [r for r in self.loaded.values() if r.refs <= 0 and not r.loading]
            if idle:
                self._unload(min(idle, key=lambda r: r.used), "evict")
                continue
            changed = self._changed
            self._waiting = model
            try:
                await changed.wait()
            finally:
                self._waiting = None

    def _expire(self, runner: _Runner) -> None:
        runner.timer = None
        if self.loaded.get(runner.name) is runner and runner.refs <= 0:
            self._unload(runner, "keep_alive")

    def _unload(self, runner: _Runner, reason: UnloadReason) -> None:
        self._stop_timer(runner)
        del self.loaded[runner.name]
        self._count(self.unloads, runner.name, reason, _UNLOAD_REASONS)
        self._notify()

    @staticmethod
    def _stop_timer(runner: _Runner) -> None:
        if runner.timer is not None:
            runner.timer.cancel()
            runner.timer = None
        runner.expires_at = None

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    @staticmethod
    def _count(counts: dict[str, dict[str, int]], model: str, reason: str, reasons: tuple[str, ...]) -> None:
        per_model = counts.get(model)
        if per_model is None:
            per_model = counts[model] = dict.fromkeys(reasons, 0)
        per_model[reason] += 1


# --------------------------------------------------------------------------- Ollama's keep_alive

_UNITS: Final = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART: Final = re.compile(r"(\d*)(?:\.(\d*))?([^\d.]*)")


def parse_keep_alive(value: object) -> float | None:
    """A request's ``keep_alive`` in seconds (None: forever), as Ollama's ``api.Duration`` reads it:
    a number of seconds, or a Go duration string (``"5m"``, ``"1h30m"``, ``"0"``); negative: forever.
    Raises ValueError with Go's message otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"Unsupported type: '{_go_type(value)}'")
    seconds = value if not isinstance(value, str) else _parse_go_duration(value)
    if seconds < 0 or seconds >= _FOREVER_S or math.isnan(seconds):
        return None
    return float(seconds)


def _parse_go_duration(text: str) -> float:
    """Go's time.ParseDuration, in seconds."""
    invalid = ValueError(f'time: invalid duration "{text}"')
    rest = text
    sign = 1.0
    if rest[:1] in ("-", "+"):
        sign = -1.0 if rest[0] == "-" else 1.0
        rest = rest[1:]
    if rest == "0":
        return 0.0
    if not rest:
        raise invalid
    total = 0.0
    while rest:
        match = _PART.match(rest)
        assert match is not None  # the pattern matches the empty string
        whole, fraction, unit = match.groups()
        if not whole and not fraction:
            raise invalid
        if not unit:
            raise ValueError(f'time: missing unit in duration "{text}"')
        if unit not in _UNITS:
            raise ValueError(f'time: unknown unit "{unit}" in duration "{text}"')
        total += float(f"{whole or 0}.{fraction or 0}") * _UNITS[unit]
        rest = rest[match.end():]
    return sign * total


def _go_type(value: object) -> str:
    if value is None:
        return "<nil>"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, dict):
        return "map[string]interface {}"
    if isinstance(value, list):
        return "[]interface {}"
    return type(value).__name__


def go_time(seconds: float) -> str:
    """A wall-clock time as Go marshals a UTC ``time.Time`` (RFC 3339 with fractional seconds)."""
    moment = datetime.datetime.fromtimestamp(0, datetime.UTC) + datetime.timedelta(seconds=seconds)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")
