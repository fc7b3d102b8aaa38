"""The worker's part of capacity: what it reads of each of its node's providers, and what it
publishes of them for every API replica and worker (``lua/capacity.lua``).

One loop per provider reads, every ``BUSY_READ_S`` while the provider is busy (iop runs
requests there, or its engine reports any running or waiting) and every ``IDLE_READ_S``
while it is not:

* the engine's own load (workers/engine_metrics.py), where the provider's type publishes
  one: what it runs and queues beyond iop's ``in_flight`` there is **load iop does not
  send** (``external``), which counts against the provider in routing (``lib/pump.lua``);
* its ``in_flight`` (every worker's jobs), an operator's drain mark (a resume after one is
  taken as the engine's restart) and, for ``capacity: auto``, whether jobs wait in its lanes.

With ``capacity: auto`` a :class:`workers.capacity.LimitController` turns these, and the
calls the provider answered (``called``), into the limit in force. Every provider's answers'
rate-limit headers and 429s (:class:`workers.capacity.RateLimits`) pause it, or cap it, for as
long as the upstream says. What changed is published at once; the rest at least every
``PUBLISH_EVERY_S`` (the engine reading's age is shown in the catalog).

A learned limit outlives the worker: a restarted worker starts from the one in Redis. Two
workers of one node each learn from the calls they run and the engine readings they make;
what they publish is close, and the last write stands.

Cost: one small HTTP GET and one HMGET per provider per read (``bench.capacity_fleet cost``).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from dispatcher import keys, qualifications, wire
from dispatcher.config import ProviderConfig
from dispatcher.worker_side import WorkerSide
from workers.adapters.probes import lacks_health
from workers.capacity import CallSample, FirstTokens, LimitController, RateLimits
from workers.engine_metrics import SOURCES, EngineLoad, EngineMetrics
from workers.provider_loops import ProviderLoops
from workers.runtime import NodeRuntime, ProviderAdapters

log = logging.getLogger("iop.worker")

BUSY_READ_S = 0.25
IDLE_READ_S = 1.0
READ_TIMEOUT_S = 1.0
PUBLISH_EVERY_S = 2.0
SERVICE_WINDOW = 64  # calls the service time is the median of
EXTERNAL_WINDOW_S = 1.0  # load iop does not send: the least of this long's readings


@dataclass
class ProviderLoad:
    """What the worker knows of one provider's load now."""

    provider: ProviderConfig
    controller: LimitController | None
    rate_limits: RateLimits = field(default_factory=RateLimits)
    metrics: EngineMetrics | None = None
    engine: EngineLoad | None = None
    external: int = 0
    beyond: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=16))
    first_tokens: FirstTokens = field(default_factory=FirstTokens)
    service: deque[float] = field(default_factory=lambda: deque(maxlen=SERVICE_WINDOW))
    shed: dict[str, int] = field(default_factory=dict)  # queue -> refusals counted at the last tick
    drained: bool = False  # an operator's drain mark was on at the last reading
    published: tuple[int, int, int, str] | None = None
    published_at: float = 0.0
    moved: bool = False

    def limit(self) -> int:
        """The limit in force: the learned one (or the configured one), capped by the
        upstream's rate-limit window."""
        learned = self.controller.limit if self.controller is not None else self.provider.fixed_capacity
        return self.rate_limits.limit(learned)


class CapacityControl(ProviderLoops):
    """Reads and publishes the load of ``runtime().node``'s providers (workers/capacity.py)."""

    def __init__(self, runtime: Callable[[], NodeRuntime], adapters: ProviderAdapters, side: WorkerSide,
                 redis: Redis) -> None:
        super().__init__(runtime)
        self._adapters = adapters
        self._side = side
        self._redis = redis
        self.loads: dict[str, ProviderLoad] = {}

    # --- what others ask -------------------------------------------------------------------

    def capacity_of(self, provider: ProviderConfig) -> int:
        """The capacity a heartbeat publishes: the limit in force."""
        load = self.loads.get(provider.id)
        if load is None or load.provider != provider:
            return provider.capacity_bounds[0] if provider.auto else provider.fixed_capacity
        return load.limit()

    def call_started(self, provider_id: str, key: object) -> None:
        """A streamed call to the provider began (its first token's lateness: FirstTokens)."""
        load = self.loads.get(provider_id)
        if load is not None:
            load.first_tokens.started(key, time.monotonic())

    def first_output(self, provider_id: str, key: object) -> None:
        load = self.loads.get(provider_id)
        if load is not None:
            load.first_tokens.first_output(key, time.monotonic())

    def call_ended(self, provider_id: str, key: object) -> None:
        load = self.loads.get(provider_id)
        if load is not None:
            load.first_tokens.ended(key)

    def called(self, provider_id: str, sample: CallSample | None, status: int, headers: dict[str, str]) -> None:
        """A call the provider answered (``sample``: a 2xx, timed), with its status and headers."""
        load = self.loads.get(provider_id)
        if load is None:
            return
        if sample is not None:
            if load.controller is not None:
                load.controller.observe(sample)
            load.service.append(sample.e2e_s)
        if load.rate_limits.answered(status, headers):
            load.published = None  # publish at the next read

    def provider_back(self, provider_id: str, slots: int | None) -> None:
        """The provider is available again after being down (workers/provider_state.py): its
        learned limit starts over from where it is (``LimitController.restarted``), or from
        ``slots``: what its probe found the engine runs at once, when that changed."""
        load = self.loads.get(provider_id)
        if load is None or load.controller is None:
            return
        change = load.controller.restarted(slots)
        log.info("capacity of %s: back after being down; holds dropped, slow start from %d", provider_id,
                 load.controller.limit)
        if change is not None:
            load.moved = True
            load.published = None  # publish at the next read

    # --- the loops ---------------------------------------------------------------------------

    def _forgotten(self, provider_id: str) -> None:
        self.loads.pop(provider_id, None)

    async def _loop(self, provider_id: str, scope: anyio.CancelScope) -> None:
        with scope:
            provider = self._runtime().provider(provider_id)
            if provider is None:
                return
            load = await self._load_for(provider)
            self.loads[provider_id] = load
            while True:
                busy = await self._read(load)
                await self._publish(load)
                await anyio.sleep(BUSY_READ_S if busy else IDLE_READ_S)

    async def _load_for(self, provider: ProviderConfig) -> ProviderLoad:
        controller = None
        if provider.auto:
            floor, ceiling = provider.capacity_bounds
            learned = None
            try:
                fields = await self._redis.hmget(keys.provider(provider.id), ["capacity", "capacity_mode", "slots"])
                if fields[1] == b"auto" and fields[0]:
                    learned = int(fields[0])
                hint = int(fields[2]) if fields[2] else None
                # A qualification's knee (iop qualify) is a better start than the slots hint.
                seed = await qualifications.seeded_capacity(self._redis, provider.id)
                if seed is not None:
                    hint = seed
            except (RedisError, ValueError):
                hint = None
            controller = LimitController.starting(floor, ceiling, learned, hint)
        metrics = None
        adapter = self._adapters.current.get(provider.id)
        session = getattr(adapter, "session", None)
        if provider.type in SOURCES and provider.base_url and session is not None:
            root = getattr(adapter, "root", provider.base_url)
            silent = (lambda: lacks_health(root)) if provider.type == "llamacpp" else None
            metrics = EngineMetrics(session, provider.base_url, provider.type, getattr(adapter, "headers", None),
                                    silent)
        return ProviderLoad(provider, controller, metrics=metrics)

    async def _read(self, load: ProviderLoad) -> bool:
        """One reading of the provider; whether iop runs requests there."""
        pid = load.provider.id
        reading = None
        if load.metrics is not None and load.metrics.available:
            reading = await load.metrics.read(READ_TIMEOUT_S)
            if reading is not None:
                load.engine = reading
        plan_queues = self._runtime().calls.plans.provider_queues.get(pid, frozenset())
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hmget(keys.provider(pid), ["in_flight", "drain"])
                queues = sorted(plan_queues) if load.controller is not None else []
                for queue in queues:
                    pipe.zcard(queue)
                if queues:
                    pipe.hmget(keys.QUEUE_RATES, [keys.shed_field(q) for q in queues])
                replies = await pipe.execute()
        except RedisError as exc:
            log.debug("capacity of %s: %s", pid, exc)
            return True
        in_flight = int(replies[0][0] or 0)
        drained = bool(replies[0][1])
        backlog = any(int(n) for n in replies[1:1 + len(queues)])
        shed = {q: int(n or 0) for q, n in zip(queues, replies[-1], strict=True)} if queues else {}
        now = time.monotonic()
        if reading is not None:
            # What the engine runs and queues beyond iop's own requests there, at this reading.
            load.beyond.append((now, max((reading.running or 0) + (reading.waiting or 0) - in_flight, 0)))
        # The least of the last second's readings: a request of iop's the engine has not
        # counted yet, or one it still counts after iop saw it end, is not another client's.
        recent = [ext for at, ext in load.beyond if now - at <= EXTERNAL_WINDOW_S]
        load.external = min(recent) if recent else 0
        ctl = load.controller
        if load.drained and not drained and ctl is not None:
            # Resumed: the documented way to restart or update a provider's engine is a drain
            # around it (docs/OPERATIONS.md), which a restart quicker than a probe leaves the
            # only sign of. Learned afresh, as a provider back after being down is.
            ctl.restarted()
            log.info("capacity of %s: resumed after a drain; holds dropped, slow start from %d", pid, ctl.limit)
        load.drained = drained
        if ctl is not None:
            ctl.note_in_flight(in_flight)
            if reading is not None:
                ctl.note_engine(reading)
            elif load.metrics is None or not load.metrics.available or load.metrics.error:
                # No engine metrics: what iop's own streamed calls say of its queue.
                seen = load.first_tokens.reading(now)
                if seen is not None:
                    ctl.note_engine(seen)
            if ctl.due(now):
                # Requests refused since the last tick (load shedding, a full queue) were demand
                # too: shedding keeps the queue short, and would otherwise hold a low limit low
                # (a long predicted wait refusing all that would show it a backlog). Counted
                # from tick to tick, not reading to reading: there are two readings to a tick.
                refused = any(n > load.shed.get(q, n) for q, n in shed.items())
                load.shed = shed
                change = ctl.tick(now, backlog or refused, load.external)
                if change is not None:
                    load.moved = True
                    log.info("capacity of %s: %s", pid, change.reason)
        # Busy by other clients' requests too: an engine they fill looks full to routing (their
        # load counts against it), so iop sends it nothing, and a limit read once a second has
        # no two readings in a tick's window to move on. A fast server under another client's
        # load sat at its start of 2 for 11 s so.
        return in_flight > 0 or (reading is not None and bool(reading.running or reading.waiting))

    async def _publish(self, load: ProviderLoad) -> None:
        limit = load.limit()
        hold_s = max(load.rate_limits.paused_until - time.time(), 0.0)
        reason = load.controller.reason if load.controller is not None else ""
        state = (limit, load.external, round(hold_s), reason)
        now = time.monotonic()
        if state == load.published and now - load.published_at < PUBLISH_EVERY_S:
            return
        engine = load.engine
        report = wire.CapacityReport(
            capacity=limit, mode="auto" if load.provider.auto else "fixed", external=load.external,
            hold_ms=round(hold_s * 1000), hold_reason=load.rate_limits.reason if hold_s > 0 else "",
            reason=reason,
            engine=msgspec.json.encode(wire.EngineReading(
                running=engine.running, waiting=engine.waiting, kv_usage=engine.kv_usage,
                age_ms=round(engine.age_s(now) * 1000))).decode() if engine is not None else "",
            service_ms=round(statistics.median(load.service) * 1000, 1) if load.service else 0.0,
            moved=load.moved)
        try:
            await self._side.publish_capacity(load.provider.id, report)
        except RedisError as exc:
            log.debug("capacity of %s not published: %s", load.provider.id, exc)
            return
        load.published, load.published_at, load.moved = state, now, False
