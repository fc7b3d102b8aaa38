"""The worker's part of models that load and unload (docs/DESIGN.md "Models that load and
unload"): for each provider of its node whose models iop manages (``lifecycle: managed``),

* what its runtime holds, read from the runtime's own API (workers/adapters/model_runtime.py)
  every probe interval and right after each load, published for every replica
  (``lua/models.lua``, which pumps: a model that became loaded takes its waiting jobs);
* the loads iop orders there (``lua/lib/place.lua``, decided inside a pump in whichever
  process pumped): looked for every ``ORDER_POLL_S``, claimed by one worker of the node
  (``HSETNX load_by``: a node may run several), carried out through the runtime's API -- the
  model it evicts unloaded first, then the load, within the provider's ``load_timeout_s`` --
  and reported (``lua/load_done.lua``, which pumps: the jobs that waited for it start).

A load never interrupts a running request: the placement only ever evicts a model nothing of
iop's runs on, and a request goes only where its model is loaded (``lua/lib/warm.lua``).

Cost: one HMGET per managed provider per ``ORDER_POLL_S``, one runtime read and one script
per probe interval; nothing for a node with no managed provider.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import anyio
from redis.asyncio import Redis
from redis.exceptions import RedisError

from dispatcher import keys, wire
from dispatcher.config import Config, DispatchConfig, ProviderConfig
from dispatcher.exceptions import IopError
from workers.adapters.model_runtime import ModelRuntime, RuntimeModels, model_runtime
from workers.provider_loops import ProviderLoops
from workers.runtime import NodeRuntime, ProviderAdapters

log = logging.getLogger("iop.worker.models")

# How often a worker looks for a load ordered on one of its providers: a load takes seconds
# to minutes, so a quarter second more is noise, and the poll is one HMGET.
ORDER_POLL_S = 0.25
# Models held at once by a runtime that does not say, when the config does not either: one
# is the only number that never lets the runtime evict a model iop did not choose.
DEFAULT_MAX_LOADED = 1


def queues_of(config: Config, provider: ProviderConfig) -> dict[str, str]:
    """Each of ``provider``'s served names -> the queue keys of the model ids served as it
    there, a line each (``wire.ModelsReport.queues``)."""
    out: dict[str, list[str]] = {}
    for model in config.models:
        served = model.providers.get(provider.id)
        if served is not None:
            out.setdefault(served, []).append(keys.queue(model.id))
    return {served: "\n".join(sorted(qs)) for served, qs in out.items()}


def max_loaded(provider: ProviderConfig, said: int | None) -> int:
    """Models the provider holds at once: the config's (an operator may keep a runtime below
    what it could hold), else the runtime's word, else DEFAULT_MAX_LOADED."""
    if provider.max_loaded is not None:
        return provider.max_loaded
    return said if said is not None and said > 0 else DEFAULT_MAX_LOADED


def models_of(config: Config, provider: ProviderConfig) -> dict[str, str]:
    """Each of ``provider``'s served names -> the model ids served as it there, comma-separated
    (``wire.ModelsReport.models``)."""
    out: dict[str, list[str]] = {}
    for model in config.models:
        served = model.providers.get(provider.id)
        if served is not None:
            out.setdefault(served, []).append(model.id)
    return {served: ",".join(sorted(ids)) for served, ids in out.items()}


def report_of(config: Config, provider: ProviderConfig, seen: RuntimeModels) -> wire.ModelsReport:
    return wire.ModelsReport(
        provider=provider.id, states=dict(seen.states), queues=queues_of(config, provider),
        models=models_of(config, provider), max_loaded=max_loaded(provider, seen.max_loaded),
        load_ms=round(provider.load_s * 1000), idle_ms=round(provider.idle_floor_s * 1000),
        timeout_ms=round(provider.load_timeout_s * 1000))


class ModelLifecycle(ProviderLoops):
    """Reads, publishes and loads the models of ``runtime().node``'s managed providers."""

    def __init__(self, runtime: Callable[[], NodeRuntime], adapters: ProviderAdapters, redis: Redis,
                 worker_id: str, dispatch: DispatchConfig,
                 runtime_for: Callable[[ProviderConfig, ProviderAdapters], ModelRuntime | None] | None = None) -> None:
        super().__init__(runtime)
        self._adapters = adapters
        self._redis = redis
        self._worker_id = worker_id
        self._read_s = dispatch.probe_interval_ms / 1000
        self._runtime_for = runtime_for or _runtime_for

    def wants(self, provider: ProviderConfig) -> bool:
        """Only a provider whose models iop manages (``lifecycle: managed``)."""
        return provider.manages_models

    async def _loop(self, provider_id: str, scope: anyio.CancelScope) -> None:
        with scope:
            provider = self._runtime().provider(provider_id)
            if provider is None:
                return
            runtime = self._runtime_for(provider, self._adapters)
            if runtime is None:
                log.warning("provider %s: lifecycle managed, but its type %r has no API to load models with",
                            provider_id, provider.type)
                return
            next_read = 0.0
            while True:
                if time.monotonic() >= next_read:
                    await self.publish(provider, runtime)
                    next_read = time.monotonic() + self._read_s
                if await self.carry_out(provider, runtime):
                    next_read = 0.0
                    continue
                await anyio.sleep(ORDER_POLL_S)

    async def publish(self, provider: ProviderConfig, runtime: ModelRuntime) -> bool:
        """Read what the runtime holds and publish it; False when either could not be done
        (the provider's health says why: its heartbeat's probe)."""
        try:
            seen = await runtime.models()
        except IopError as exc:
            log.debug("provider %s: models not read: %s", provider.id, exc)
            return False
        try:
            await self._runtime().calls.models(provider.id, report_of(self._runtime().config, provider, seen))
        except RedisError as exc:
            log.warning("provider %s: models not published: %s", provider.id, exc)
            return False
        return True

    async def carry_out(self, provider: ProviderConfig, runtime: ModelRuntime) -> bool:
        """The load ordered on the provider, if one waits and this worker claims it: done and
        reported. Whether there was one."""
        pkey = keys.provider(provider.id)
        try:
            served, evict, claimed, unload, unload_claimed = await self._redis.hmget(
                pkey, ["load", "load_evict", "load_by", "unload", "unload_by"])
            if unload and not unload_claimed and await self._redis.hsetnx(pkey, "unload_by", self._worker_id):
                await self.unload(provider, runtime, _text(unload))
                return True
            if not served or claimed or not await self._redis.hsetnx(pkey, "load_by", self._worker_id):
                return False
        except RedisError:
            return False
        target, victim = _text(served), _text(evict)
        log.info("provider %s: loading model %s%s (placed by iop: its requests wait for it)", provider.id, target,
                 f", unloading {victim} first" if victim else "")
        evicted = False
        if victim:
            try:
                await runtime.unload(victim)
                evicted = True
            except IopError as exc:
                log.warning("provider %s: model %s not unloaded: %s", provider.id, victim, exc)
        started = time.monotonic()
        try:
            await runtime.load(target)
            took = round((time.monotonic() - started) * 1000)
            outcome = wire.LoadOutcome(provider=provider.id, served=target, ok=True, load_ms=took, evict=victim,
                                       evicted=evicted)
            log.info("provider %s: model %s loaded in %.1f s", provider.id, target, outcome.load_ms / 1000)
        except IopError as exc:
            outcome = wire.LoadOutcome(provider=provider.id, served=target, ok=False, reason=str(exc)[:500],
                                       evict=victim, evicted=evicted)
            log.warning("provider %s: model %s failed to load: %s", provider.id, target, exc)
        with anyio.CancelScope(shield=True):
            try:
                await self._runtime().calls.load_done(provider.id, outcome)
            except RedisError as exc:
                # The order lapses at its timeout; the next reading shows what the runtime holds.
                log.warning("provider %s: the end of the load of %s not reported: %s", provider.id, target, exc)
        await self.publish(provider, runtime)
        return True


    async def unload(self, provider: ProviderConfig, runtime: ModelRuntime, served: str) -> None:
        """Carry out an operator's unload (lua/model_order.lua), claimed by this worker: no
        new job goes to the model meanwhile, so wait for iop's jobs running on it to end
        (until the order's time), unload it, clear the order, publish what the runtime holds."""
        pkey = keys.provider(provider.id)
        log.info("provider %s: unloading model %s (an operator's order)", provider.id, served)
        while True:
            running, until = await self._redis.hmget(pkey, [f"mr:{served}", "unload_until"])
            if int(running or 0) <= 0:
                break
            if int(until or 0) <= int(time.time() * 1000):
                log.warning("provider %s: model %s not unloaded: requests still ran on it when the order lapsed",
                            provider.id, served)
                return
            await anyio.sleep(ORDER_POLL_S)
        try:
            await runtime.unload(served)
            log.info("provider %s: model %s unloaded", provider.id, served)
        except IopError as exc:
            log.warning("provider %s: model %s not unloaded: %s", provider.id, served, exc)
        with anyio.CancelScope(shield=True):
            try:
                await self._redis.hdel(pkey, "unload", "unload_until", "unload_by")
            except RedisError as exc:
                log.warning("provider %s: the unload of %s not cleared (it lapses by itself): %s", provider.id,
                            served, exc)
        await self.publish(provider, runtime)


def _runtime_for(provider: ProviderConfig, adapters: ProviderAdapters) -> ModelRuntime | None:
    session = getattr(adapters.for_job(provider.id), "session", None)
    if session is None:
        return None
    return model_runtime(provider, session)



def _text(raw: bytes | str | None) -> str:
    return raw.decode() if isinstance(raw, bytes) else (raw or "")
