"""What a worker publishes of its node's providers: their health and description.

One loop per provider heartbeats it every ``heartbeat_interval_ms``; probes it every
``probe_interval_ms`` while it runs nothing, and while it is busy only every
``busy_probe_interval_ms``, with a check that cannot disturb its requests (none for some
types): its traffic is its health meanwhile.

A provider's health comes from its probes and from its calls: a call that fails its way
(refused or reset, timed out, a stream cut, garbage) marks it unavailable at once with
that call's error as the reason, and it is probed as soon as it runs nothing; a call it
answers whole brings it back if only a failed call had put it out. Its 5xx answers are not
judged here: one may be the request's fault, and only the evidence of several requests,
kept in Redis by every worker's finishes, ejects a provider for them (lua/lib/evidence.lua).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import anyio
import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from dispatcher import keys
from dispatcher.config import DispatchConfig, ProviderConfig
from dispatcher.exceptions import ProviderError
from dispatcher.worker_side import WorkerSide
from workers.adapters.base import ProbeResult
from workers.leases import Runs
from workers.provider_loops import ProviderLoops
from workers.runtime import NodeRuntime, ProviderAdapters

log = logging.getLogger("iop.worker")


class ProviderState(ProviderLoops):
    """Probes and heartbeats the providers of ``runtime().node`` (the current config's).

    ``runs``: this worker's jobs (a provider running one is busy); ``redis``: where its
    ``in_flight`` (every worker's jobs) is read; ``worker_id``: the heartbeat's ``worker``.
    """

    def __init__(self, runtime: Callable[[], NodeRuntime], adapters: ProviderAdapters, runs: Runs,
                 side: WorkerSide, redis: Redis, dispatch: DispatchConfig, worker_id: str,
                 capacity_of: Callable[[ProviderConfig], int] | None = None,
                 on_back: Callable[[str, int | None], None] | None = None) -> None:
        super().__init__(runtime)
        # Told when a provider this worker saw down is available again, with its slots when
        # they are not the ones it reported before (a learned capacity starts over:
        # workers/capacity_control.py provider_back).
        self._on_back = on_back
        self._slots: dict[str, int] = {}  # the slots each provider's probes last reported
        # The capacity a heartbeat publishes: the limit in force (workers/capacity_control.py).
        self._capacity_of = capacity_of or (lambda p: p.capacity_bounds[0] if p.auto else p.fixed_capacity)
        self._adapters = adapters
        self._runs = runs
        self._side = side
        self._redis = redis
        self._dispatch = dispatch
        self._worker_id = worker_id
        self.health: dict[str, ProbeResult] = {}
        # Providers whose unavailability only a failed call decided: a call they answer undoes it.
        self._failed_by_call: set[str] = set()
        self._next_probe: dict[str, float] = {}
        self._next_busy_probe: dict[str, float] = {}
        self._wake: dict[str, anyio.Event] = {}

    # --- the loops --------------------------------------------------------------------

    def _forgotten(self, provider_id: str) -> None:
        """A reload removed the provider: nothing of it is kept."""
        self.health.pop(provider_id, None)
        self._slots.pop(provider_id, None)
        self._failed_by_call.discard(provider_id)
        self._wake.pop(provider_id, None)

    def probe_now(self, provider_id: str) -> None:
        """At the next turn of its loop: the whole probe if it runs nothing, else its check
        that is harmless while busy, whenever it was last asked."""
        self._next_probe[provider_id] = 0.0
        self._next_busy_probe[provider_id] = 0.0
        self.heartbeat_now(provider_id)

    def heartbeat_now(self, provider_id: str) -> None:
        wake = self._wake.get(provider_id)
        if wake is not None:
            wake.set()

    async def _loop(self, provider_id: str, scope: anyio.CancelScope) -> None:
        with scope:
            await self._probe_and_heartbeat(provider_id)

    async def _probe_and_heartbeat(self, provider_id: str) -> None:
        self._next_probe[provider_id] = 0.0
        self._next_busy_probe[provider_id] = 0.0
        ttl_s = self._dispatch.heartbeat_ttl_ms / 1000
        failing_since: float | None = None
        while True:
            # Made before the probe and the heartbeat: a wake-up asked during them is kept.
            self._wake[provider_id] = wake = anyio.Event()
            began = time.monotonic()
            if began >= self._next_probe[provider_id]:
                await self._probe(provider_id)
            try:
                await self._heartbeat(provider_id)
            except RedisError as exc:
                log.warning("heartbeat of %s failed: %s", provider_id, exc)
                failing_since = began if failing_since is None else failing_since
            else:
                # Said when it ends, so that a log shows how long the provider went unpublished.
                if failing_since is not None:
                    log.info("heartbeats of %s land again, %.1f s after the first that failed", provider_id,
                             time.monotonic() - failing_since)
                    failing_since = None
            # A turn this long lets the heartbeat expire: the provider looks silent to every router.
            took = time.monotonic() - began
            if took > ttl_s / 2:
                log.warning("probe and heartbeat of %s took %.1f s (heartbeat TTL %.1f s)", provider_id, took, ttl_s)
            with anyio.move_on_after(self._dispatch.heartbeat_interval_ms / 1000):
                await wake.wait()

    async def _probe(self, provider_id: str) -> None:
        """The whole probe when the provider runs nothing. While it is busy, every
        ``busy_probe_interval_ms`` at most, only its adapter's check that cannot disturb
        the running requests, if it has one: a probe must never be what cuts a stream."""
        d = self._dispatch
        adapter = self._adapters[provider_id]  # a reload may replace it
        timeout = d.probe_timeout_ms / 1000
        now = time.monotonic()
        # Busy or not, looked at again within a probe interval: a provider that went idle
        # gets its whole probe then, not a busy interval later.
        self._next_probe[provider_id] = now + d.probe_interval_ms / 1000
        if not await self._busy(provider_id):
            self._next_busy_probe[provider_id] = now + d.busy_probe_period_ms / 1000
            self._judge(provider_id, await adapter.probe(timeout))
            return
        if now < self._next_busy_probe[provider_id]:
            return
        self._next_busy_probe[provider_id] = now + d.busy_probe_period_ms / 1000
        result = await adapter.probe_while_busy(timeout)
        if result is not None:
            self._judge(provider_id, self._keeping_details(provider_id, result))

    async def _busy(self, provider_id: str) -> bool:
        """Does the provider run anything: a job of this worker, or of any worker of the node
        (its ``in_flight``, which only dispatch and release move)? Not knowing is busy."""
        if self._runs.on_provider(provider_id):
            return True
        try:
            in_flight = await self._redis.hget(keys.provider(provider_id), "in_flight")
        except RedisError as exc:
            log.debug("could not tell whether %s is busy (%s): taken as busy", provider_id, exc)
            return True
        return int(in_flight or 0) > 0

    # --- the verdicts -------------------------------------------------------------------

    def _keeping_details(self, provider_id: str, verdict: ProbeResult) -> ProbeResult:
        """``verdict``'s health and reason, with the models (loaded, slots) the last whole
        probe found: a busy probe or a call says nothing of them."""
        previous = self.health.get(provider_id)
        if previous is None:
            return verdict
        return msgspec.structs.replace(previous, healthy=verdict.healthy, reason=verdict.reason)

    def _judge(self, provider_id: str, result: ProbeResult, by_call: bool = False) -> None:
        previous = self.health.get(provider_id)
        if previous is None or previous.healthy != result.healthy:
            log.info("provider %s is %s%s", provider_id, "available" if result.healthy else "unavailable",
                     f" ({result.reason})" if result.reason else "")
        self.health[provider_id] = result
        before = self._slots.get(provider_id)
        if result.slots is not None:
            self._slots[provider_id] = result.slots
        if previous is not None and not previous.healthy and result.healthy and self._on_back is not None:
            changed = before is not None and result.slots is not None and result.slots != before
            self._on_back(provider_id, result.slots if changed else None)
        if by_call:
            self._failed_by_call.add(provider_id)
        else:
            self._failed_by_call.discard(provider_id)

    def call_failed(self, provider_id: str, exc: ProviderError) -> None:
        """Out of rotation at once, with the call's error as the reason; a probe (asked as
        soon as the provider runs nothing) or a call it answers brings it back."""
        if provider_id not in self._adapters:
            return  # removed by a reload: nothing publishes it any more
        self._judge(provider_id, self._keeping_details(provider_id, ProbeResult(False, str(exc))), by_call=True)
        self.heartbeat_now(provider_id)

    def answered(self, provider_id: str) -> None:
        """A call the provider answered whole: it is healthy, if only a failed call said not."""
        if provider_id in self._failed_by_call:
            self._judge(provider_id, self._keeping_details(provider_id, ProbeResult(True, "")))
            self.heartbeat_now(provider_id)

    async def _heartbeat(self, provider_id: str) -> None:
        runtime = self._runtime()
        provider = runtime.provider(provider_id)
        result = self.health.get(provider_id)
        if provider is None or result is None:
            return  # removed by a reload meanwhile
        fields: list[tuple[str, str | int]] = [
            ("node", runtime.node.id),
            ("type", provider.type),
            ("category", provider.effective_category),
            ("capacity", self._capacity_of(provider)),
            ("capacity_mode", "auto" if provider.auto else "fixed"),
            ("models", json.dumps(provider.models)),
            ("reason", result.reason),
            ("reported_models", json.dumps(result.models) if result.models is not None else ""),
            ("loaded_models", json.dumps(result.loaded) if result.loaded is not None else ""),
            ("endpoints", json.dumps(provider.served_endpoints)),
            ("slots", result.slots if result.slots is not None else ""),
            ("worker", self._worker_id),
            ("removed", ""),  # in the config again, if a reload had removed it
            ("leaving", ""),  # taken over, if another worker of the node was leaving
        ]
        await self._side.heartbeat(provider_id, "available" if result.healthy else "unavailable", fields)
