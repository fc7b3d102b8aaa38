"""One node's worker process: publish and probe its providers, run the jobs dispatched
to the node, report every answer back, and give every slot back.

``Worker`` is the wiring of small parts that run side by side in one task group:

* ``ProviderState.run``   heartbeat and probe each provider (``workers/provider_state.py``)
* ``CapacityControl.run`` read each provider's load (its engine's metrics, its calls' latency
                          and rate limits) and publish the limit in force, learned for
                          ``capacity: auto`` (``workers/capacity_control.py``)
* ``ModelLifecycle.run``  read which models each managed provider's runtime holds, and
                          carry out the loads iop places there (``workers/model_lifecycle.py``)
* ``NodeStream.consume``  read the node stream through the consumer group and start jobs
                          (``workers/node_stream.py``); each runs in ``JobRunner.run``
                          (``workers/job_run.py``)
* ``CancelListener.run``  abort a running job when its API says the client left
                          (``workers/cancels.py``)
* ``Leases.run``          extend the leases of running jobs (``workers/leases.py``)
* ``Reaper.run_forever``  the shared maintenance round (``dispatcher.reaper``)
* ``ProviderAdapters.run`` close the adapters a reload retired once nothing runs on them
                          (``workers/runtime.py``)
* ``_flush_live``         write the calls' live figures, tallied in ``WorkerSide``, every
                          second (``lua/live.lua``), and once more at the end
* ``_watch_signals``      SIGTERM/SIGINT: shut down -- stop taking jobs, let running ones
                          finish within ``dispatch.drain_grace_s``, cancel the rest, exit
* ``_watch_hangups``      SIGHUP: read the config file again and apply it (:meth:`reload`):
                          providers added, removed (they finish what they run), changed
* ``OverrideWatch.run``   keep the config in step with the operators' overrides in Redis
                          (``dispatcher/overrides.py``), and let lapse those whose time came

What the config implies for the node is one :class:`NodeRuntime`; a reload builds a new one
and swaps ``Worker.runtime``, the one reference to it: every part reads the config in force
through ``Worker.current`` at each use (the script calls of ``WorkerSide`` and the reaper
too), and is given at the start only what a reload cannot change (the ``dispatch`` section).

Several worker processes may serve the same node: the consumer group hands each job
to one of them, and the slot accounting in Redis bounds them together. It also says
whether a provider is busy: its ``in_flight``, whichever worker runs the jobs.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import uuid

import anyio
from anyio.abc import TaskGroup
from redis.exceptions import RedisError

from dispatcher import overrides
from dispatcher.config import Config, config_digest
from dispatcher.control import Control, audit_once
from dispatcher.exceptions import ConfigError, ConfigProblem
from dispatcher.live import FLUSH_S
from dispatcher.overrides import OverrideWatch
from dispatcher.reaper import Reaper
from dispatcher.redis_conn import Clients, server_warnings
from dispatcher.reloading import describe_changes, reread
from dispatcher.scripts import Scripts
from dispatcher.worker_side import WorkerSide
from workers.cancels import CancelListener
from workers.capacity_control import CapacityControl
from workers.job_run import JobRunner
from workers.leases import SHUTDOWN, Leases, Runs
from workers.model_lifecycle import ModelLifecycle
from workers.node_stream import READ_BATCH, NodeStream, wait_for_redis
from workers.provider_state import ProviderState
from workers.runtime import NodeRuntime, ProviderAdapters
from workers.telemetry import TelemetryLoop

__all__ = ["READ_BATCH", "Worker"]  # READ_BATCH: bench/redis_capacity.py reads it here

log = logging.getLogger("iop.worker")


class Worker:
    """``config_path``: the file a reload (``SIGHUP``) reads again; None: no reloads."""

    def __init__(self, config: Config, node_id: str, config_path: str | None = None) -> None:
        self.config_path = config_path
        self.worker_id = f"{node_id}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.clients = Clients.open(config.redis)
        self.redis = self.clients.control
        self.scripts = Scripts(self.redis, self.clients.fast)
        runtime = NodeRuntime.build(config, node_id, self.scripts)
        if runtime is None:
            raise ConfigError([ConfigProblem("$.nodes", f"no node with id {node_id!r}")])
        # The config in force: the one reference a reload swaps. Every part that sees what a
        # reload may change reads it through current(), at each use; what it may not (the
        # dispatch section, RESTART: dispatcher/reloading.py keeps its running values) is
        # given to the parts once, here.
        self.runtime = runtime
        # The file's config, as loaded or last reloaded; the runtime runs it with the
        # operators' overrides applied (dispatcher/overrides.py), which the watch keeps up.
        self.file_config = config
        self.overrides = OverrideWatch(self.redis, self._apply_overrides, self._lapse)
        dispatch = config.dispatch
        self.side = WorkerSide(lambda: self.current().calls, self.redis, node_id, self.clients.fast)
        self.reaper = Reaper(lambda: self.current().calls, self.redis, self.worker_id)
        self.lease_s = dispatch.lease_ms / 1000
        self.drain_grace_s = dispatch.drain_grace_s
        self.runs = Runs(keep_s=self.lease_s)
        # A retired adapter outlives its last run, and a lease after the reload.
        self.adapters = ProviderAdapters(self.runs, keep_s=self.lease_s)
        self.capacity = CapacityControl(self.current, self.adapters, self.side, self.redis)
        self.providers = ProviderState(self.current, self.adapters, self.runs, self.side, self.redis,
                                       dispatch, self.worker_id, capacity_of=self.capacity.capacity_of,
                                       on_back=self.capacity.provider_back)
        self.jobs = JobRunner(self.side, node_id, self.adapters, self.runs, self.providers, dispatch.lease_ms,
                              capacity=self.capacity)
        self.stream = NodeStream(self.side, self.clients.blocking, self.redis, self.worker_id, dispatch.lease_ms,
                                 self.runs, run=self.jobs.run, hand_back=self.jobs.hand_back)
        self.leases = Leases(self.runs, self.side, dispatch.lease_ms, after_renewal=self.stream.settle_ghosts)
        self.cancels = CancelListener(self.redis, node_id, self.runs, renew_now=self.leases.renew_now)
        self.models = ModelLifecycle(self.current, self.adapters, self.redis, self.worker_id, dispatch)
        self.telemetry = TelemetryLoop(self.redis, lambda: self.current().node, self.worker_id,
                                       dispatch.heartbeat_interval_ms / 1000)

    def current(self) -> NodeRuntime:
        """The runtime of the config in force."""
        return self.runtime

    # --- the process ------------------------------------------------------------------

    async def run(self) -> None:
        node = self.runtime.node
        self.adapters.open(node)
        try:
            await wait_for_redis(self.redis)
            for warning in await server_warnings(self.redis):
                log.warning("%s", warning)
            await self.scripts.load()
            await self.side.ensure_group()
            await self.reaper.reconcile()
            await self.overrides.start()
            log.info("worker %s serving node %s: %s", self.worker_id, node.id,
                     ", ".join(f"{p.id}({p.type}, capacity {p.capacity})" for p in node.providers))
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_signals)
                if self.config_path is not None:
                    tg.start_soon(self._watch_hangups)
                tg.start_soon(self.providers.run)
                tg.start_soon(self.capacity.run)
                tg.start_soon(self.models.run)
                tg.start_soon(self.cancels.run)
                tg.start_soon(self.leases.run)
                tg.start_soon(self.reaper.run_forever)
                tg.start_soon(self.telemetry.run)
                tg.start_soon(self.adapters.run, self.lease_s)
                tg.start_soon(self._flush_live)
                tg.start_soon(self.overrides.run)
                async with anyio.create_task_group() as jobs:
                    await self.stream.consume(jobs)
                    await self._shut_down(jobs)
                tg.cancel_scope.cancel()
            with anyio.CancelScope(shield=True):
                await self._flush_live_once()  # what the last jobs added
            await self.stream.leave_group()
        finally:
            await self.adapters.aclose()
            await self.clients.aclose()
        log.info("worker %s stopped", self.worker_id)

    def stop(self) -> None:
        """Stop taking jobs; running ones get ``dispatch.drain_grace_s`` to finish."""
        self.stream.stop()
        self.providers.stop()
        self.capacity.stop()
        self.models.stop()

    async def _watch_signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("worker %s got %s: draining %d running job(s)", self.worker_id,
                         signal.Signals(signum).name, len(self.runs))
                self.stop()
                return

    async def _flush_live(self) -> None:
        while True:
            await anyio.sleep(FLUSH_S)
            await self._flush_live_once()

    async def _flush_live_once(self) -> None:
        try:
            await self.side.flush_live()
        except RedisError as exc:  # kept for the next flush
            log.debug("live figures not written (%s): kept for the next flush", exc)

    async def _watch_hangups(self) -> None:
        with anyio.open_signal_receiver(signal.SIGHUP) as signals:
            async for _ in signals:
                await self.reload()

    async def _shut_down(self, jobs: TaskGroup) -> None:
        """After :meth:`stop`: hand back what never started, give running jobs the grace
        period (``dispatch.drain_grace_s``), then abort them (they go back to their queue
        unless their output had started)."""
        # No new work for this node's providers from this worker; another live worker of the
        # node puts them back within one heartbeat. Until this heartbeat's TTL passes, a
        # request for them waits rather than being refused (`leaving`:
        # lua/lib/unavailable_reason.lua): a rolling restart refuses nobody.
        with anyio.CancelScope(shield=True):
            for provider in self.runtime.node.providers:
                try:
                    await self.side.heartbeat(provider.id, "unavailable", [("reason", "worker draining"),
                                                                           ("leaving", 1)])
                except RedisError as exc:
                    log.warning("could not mark %s draining: %s", provider.id, exc)
            # Jobs dispatched here before the mark took effect go back to their queue now,
            # not when their lease runs out.
            await self.stream.hand_back_unstarted(jobs)
        with anyio.move_on_after(self.drain_grace_s):
            await self.runs.idle()
        self.runs.abort_all(SHUTDOWN)

    # --- reload -----------------------------------------------------------------------

    async def reload(self) -> bool:
        """Read the config file again and switch to it; False if it is refused.

        A provider the file no longer has is marked unavailable at once -- every process
        that still has it in its plans reads that mark before dispatching to it -- and its
        running jobs finish on its old adapter. A new provider is probed, published and
        pumped at once; a changed one gets a new adapter (running calls keep the old one)
        and its new description (capacity, models) at its next heartbeat, which is now.
        """
        if self.config_path is None:
            return False
        old = self.runtime
        new = reread(self.config_path, self.file_config)
        if new is None:
            return False
        runtime = NodeRuntime.build(overrides.effective(new, self.overrides.snapshot), old.node.id, self.scripts)
        if runtime is None:
            log.error("reload: %s has no node %r, which this worker serves; nothing changed (stop this worker "
                      "to take the node away)", self.config_path, old.node.id)
            return False
        before_file, self.file_config = self.file_config, new
        await self._switch(runtime)
        log.info("reload: %s applied (%s)", self.config_path, describe_changes(old.config, new))
        with anyio.CancelScope(shield=True):
            try:
                # Read now, not the watch's last snapshot: one set just before the reload counts too.
                await Control(runtime.calls, self.redis, new).drop_stale(await overrides.read(self.redis))
                if before_file != new:
                    await audit_once(runtime.calls, "reload", "config", config_digest(before_file),
                                     {"digest": config_digest(new), "changes": describe_changes(before_file, new)},
                                     "iop", "reload", once_digest=config_digest(new))
            except RedisError as exc:
                log.warning("reload: overrides not checked against the new file, nor the reload audited: %s", exc)
        return True

    async def _apply_overrides(self, snapshot: overrides.Snapshot) -> None:
        """Run the file's config with ``snapshot`` applied, if that changes what it is for
        this node (a capacity's bounds, a model's preference in the plans)."""
        config = overrides.effective(self.file_config, snapshot)
        if config == self.runtime.config:
            return
        runtime = NodeRuntime.build(config, self.runtime.node.id, self.scripts)
        if runtime is not None:
            await self._switch(runtime)
            log.info("overrides applied (version %d)", snapshot.version)

    async def _lapse(self, name: overrides.Field, target_id: str) -> None:
        await Control(self.runtime.calls, self.redis, self.file_config).lapse(name, target_id)

    async def _switch(self, runtime: NodeRuntime) -> None:
        """Run ``runtime`` from now on: providers it adds start, those it removes are marked
        removed and finish what they run, those it changes get a new adapter."""
        old = self.runtime
        before, after = old.providers, runtime.providers
        removed = [pid for pid in before if pid not in after]
        for pid in removed:
            self.providers.forget(pid)
            self.capacity.forget(pid)
            self.models.forget(pid)
            self.adapters.retire(pid)
        with anyio.CancelScope(shield=True):
            for pid in removed:
                try:
                    # The running config's plans: the new ones no longer know the provider.
                    # "removed": not down for a lane's sake (lib/pump.lua unavailable_reason):
                    # processes not yet reloaded keep sending its lanes' jobs, which the
                    # providers that now serve those keys take.
                    await self.side.heartbeat(pid, "unavailable", [("reason", "removed from the config"),
                                                                   ("removed", 1)])
                except RedisError as exc:
                    log.warning("reload: could not mark %s removed (its heartbeat expires instead): %s", pid, exc)
        self.runtime = runtime  # every part sees it from its next use on (current())
        for pid, provider in after.items():
            if pid not in before:
                self.adapters.add(provider, runtime.node)
                self.providers.start(pid)
                self.capacity.start(pid)
                self.models.start(pid)
            elif provider != before[pid]:
                self.adapters.replace(provider, runtime.node)
                self.capacity.start(pid)  # afresh: its capacity, bounds or server may have changed
                self.models.start(pid)
                self.providers.probe_now(pid)
            else:
                self.providers.heartbeat_now(pid)  # its groups may have changed: pump them with the new plans
