"""One node's worker process: publish and probe its providers, run the jobs dispatched
to the node, report every answer back, and give every slot back.

Built from small loops that run side by side in one task group:

* ``_provider_loop``  heartbeat a provider (its health and description) every
                      ``heartbeat_interval_ms``; probe it every ``probe_interval_ms`` while
                      it runs nothing, and while it is busy only every
                      ``busy_probe_interval_ms``, with a check that cannot disturb its
                      requests (none for some types): its traffic is its health meanwhile
* ``_consume``        read the node stream through the consumer group and start jobs
* ``_cancel_listener`` abort a running job when its API says the client left
* ``_renew_loop``     extend the leases of running jobs a third of a lease after the last
                      success (sooner after a failure), each call bounded well under that
* ``Reaper.run_forever`` the shared maintenance round (``dispatcher.reaper``)
* ``_watch_signals``  SIGTERM/SIGINT: stop taking jobs, let running ones finish within
                      ``drain_grace_s``, cancel the rest, exit
* ``_watch_hangups``  SIGHUP: read the config file again and apply it (:meth:`reload`):
                      providers added, removed (they drain), changed

Several worker processes may serve the same node: the consumer group hands each job
to one of them, and the slot accounting in Redis bounds them together. It also says
whether a provider is busy: its ``in_flight``, whichever worker runs the jobs.

A provider's health comes from its probes and from its calls: a call that fails its way
(unreachable, timed out, a 5xx) marks it unavailable at once with that call's error as
the reason, and it is probed as soon as it runs nothing; a call it answers whole brings
it back if only a failed call had put it out.

A run is a (job, fence) pair: after a lease expired the same job may be dispatched to
this very worker again, and the old run must then stop without touching the new one.
Through a Redis outage shorter than ``OUTAGE_LEASES`` leases, running provider calls go
on: streamed output is held by the sink and final answers by ``_finish`` until Redis
takes them.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import cast

import anyio
import msgspec
from anyio.abc import TaskGroup
from redis.exceptions import RedisError

from dispatcher import events, keys, tracing
from dispatcher.backoff import Backoff
from dispatcher.config import Config, NodeConfig
from dispatcher.endpoints import ENDPOINTS, RESPONSES
from dispatcher.envelope import JSON, RequestEnvelope, unwrap
from dispatcher.events import Assignment, Failed
from dispatcher.exceptions import (
    ConfigError,
    ConfigProblem,
    ProviderError,
    ProviderRejected,
    ProviderTimeout,
    ProviderUnreachable,
    WorkerLost,
)
from dispatcher.jsonbody import with_model, with_model_asking_usage
from dispatcher.multipart import with_field
from dispatcher.plans import Plans
from dispatcher.reaper import Reaper
from dispatcher.redis_conn import BLOCK_MS, Clients, blocking_timeout, server_warnings
from dispatcher.reloading import describe_changes, reread
from dispatcher.script_calls import FinishMode, FinishOutcome, ScriptCalls
from dispatcher.scripts import Scripts
from dispatcher.worker_side import WorkerSide
from workers.adapters.base import Adapter, ProbeResult, ProviderCall, Sink
from workers.adapters.factory import make_adapter
from workers.adapters.openai_http import HttpSession, new_session, session_size
from workers.sink import JobAborted, RedisSink
from workers.stored_responses import stored_response_sink
from workers.usage import ASKABLE, final_usage

log = logging.getLogger("iop.worker")

READ_BATCH = 64
# How long a worker keeps a job's output and slot through a Redis outage before leaving
# the job to its lease: the README promises two lease periods.
OUTAGE_LEASES = 2


RunKey = tuple[str, int]  # (job id, fence)
StreamReply = list[tuple[bytes, list[tuple[bytes, list[bytes]]]]] | None  # of XREADGROUP


@dataclass
class Running:
    job: Assignment
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    abort_reason: str | None = None
    # Its provider failed it before any output: another provider of its lane may take it.
    retry: bool = False
    # The call failed in a way that says something of the provider (``fails_the_provider``).
    provider_failed: bool = False

    @property
    def key(self) -> RunKey:
        return (self.job.job, self.job.fence)

    def abort(self, reason: str) -> None:
        if self.abort_reason is None:
            self.abort_reason = reason
        self.scope.cancel()


class Worker:
    """``config_path``: the file a reload (``SIGHUP``) reads again; None: no reloads."""

    def __init__(self, config: Config, node_id: str, config_path: str | None = None) -> None:
        node = config.node(node_id)
        if node is None:
            raise ConfigError([ConfigProblem("$.nodes", f"no node with id {node_id!r}")])
        self.config = config
        self.config_path = config_path
        self.node: NodeConfig = node
        self.worker_id = f"{node_id}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.clients = Clients.open(config.redis)
        self.redis = self.clients.control
        self.scripts = Scripts(self.redis, self.clients.fast)
        calls = ScriptCalls(self.scripts, config, Plans(config))
        self.side = WorkerSide(calls, self.redis, node_id, self.clients.fast)
        self.reaper = Reaper(calls, self.redis, self.worker_id)
        self.adapters: dict[str, Adapter] = {}
        # Adapters a reload replaced or whose provider it removed: jobs already dispatched
        # to them still run on them. Closed at exit.
        self.retired: dict[str, Adapter] = {}
        self._sessions: list[HttpSession] = []
        # Redis hands a new entry to whichever consumer is blocked reading. A worker that
        # froze mid-read must stop being one well before its leases expire, or it would
        # swallow the very jobs the reaper hands out again.
        self._block_ms = min(BLOCK_MS, config.dispatch.lease_ms // 3)
        self.health: dict[str, ProbeResult] = {}
        # Providers whose unavailability only a failed call decided: a call they answer undoes it.
        self._failed_by_call: set[str] = set()
        self.running: dict[RunKey, Running] = {}
        # Cancels that arrived before their job was read from the stream.
        self.early_cancels: dict[str, float] = {}
        self.draining = False
        self._consume_scope: anyio.CancelScope | None = None
        self._next_probe: dict[str, float] = {}
        self._next_busy_probe: dict[str, float] = {}
        self._providers_scope: anyio.CancelScope | None = None
        self._providers_tg: TaskGroup | None = None
        self._provider_scopes: dict[str, anyio.CancelScope] = {}
        self._wake: dict[str, anyio.Event] = {}
        self._idle: anyio.Event | None = None  # set whenever no job runs (drain waits on it)
        self._renew_soon: anyio.Event | None = None  # set to renew (and learn of cancels) now
        self._hold_s = OUTAGE_LEASES * config.dispatch.lease_ms / 1000

    # --- the process ------------------------------------------------------------------

    async def run(self) -> None:
        # anyio primitives need the running loop, so they are made here.
        self._idle = anyio.Event()
        self._idle.set()
        self._renew_soon = anyio.Event()
        self._consume_scope = anyio.CancelScope()
        self._providers_scope = anyio.CancelScope()
        session = self._session_for(self.node)
        self.adapters = {p.id: make_adapter(p, session) for p in self.node.providers}
        try:
            await self._wait_for_redis()
            for warning in await server_warnings(self.redis):
                log.warning("%s", warning)
            await self.scripts.load()
            await self.side.ensure_group()
            await self.reaper.reconcile()
            log.info("worker %s serving node %s: %s", self.worker_id, self.node.id,
                     ", ".join(f"{p.id}({p.type}, capacity {p.capacity})" for p in self.node.providers))
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_signals)
                if self.config_path is not None:
                    tg.start_soon(self._watch_hangups)
                tg.start_soon(self._provider_loops)
                tg.start_soon(self._cancel_listener)
                tg.start_soon(self._renew_loop)
                tg.start_soon(self.reaper.run_forever)
                async with anyio.create_task_group() as jobs:
                    await self._consume(jobs)
                    await self._drain(jobs)
                tg.cancel_scope.cancel()
            await self._leave_group()
        finally:
            for adapter in [*self.adapters.values(), *self.retired.values()]:
                await adapter.aclose()
            for session in self._sessions:
                await session.close()
            await self.clients.aclose()
        log.info("worker %s stopped", self.worker_id)

    def stop(self) -> None:
        """Stop taking jobs; running ones get the drain grace period."""
        self.draining = True
        if self._consume_scope is not None:
            self._consume_scope.cancel()
        if self._providers_scope is not None:
            self._providers_scope.cancel()

    async def _watch_signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("worker %s got %s: draining %d running job(s)", self.worker_id,
                         signal.Signals(signum).name, len(self.running))
                self.stop()
                return

    async def _watch_hangups(self) -> None:
        with anyio.open_signal_receiver(signal.SIGHUP) as signals:
            async for _ in signals:
                await self.reload()

    def _session_for(self, node: NodeConfig) -> HttpSession:
        """An HTTP session whose pool fits the node's capacity (a reload may have raised it)."""
        needed = sum(p.capacity for p in node.providers)
        if not self._sessions or session_size(self._sessions[-1]) < needed:
            self._sessions.append(new_session(needed))
        return self._sessions[-1]

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
        new = reread(self.config_path, self.config)
        if new is None:
            return False
        node = new.node(self.node.id)
        if node is None:
            log.error("reload: %s has no node %r, which this worker serves; nothing changed (stop this worker "
                      "to take the node away)", self.config_path, self.node.id)
            return False
        before = {p.id: p for p in self.node.providers}
        after = {p.id: p for p in node.providers}
        removed = [pid for pid in before if pid not in after]
        for pid in removed:
            self._stop_provider(pid)
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
        log.info("reload: %s applied (%s)", self.config_path, describe_changes(self.config, new))
        calls = ScriptCalls(self.scripts, new, Plans(new))
        self.side.calls = calls
        self.reaper.use(calls)
        self.config, self.node = new, node
        session = self._session_for(node)
        for pid, provider in after.items():
            if pid not in before:
                self.adapters[pid] = make_adapter(provider, session)
                self._start_provider(pid)
            elif provider != before[pid]:
                self.retired[f"{pid}@{len(self.retired)}"] = self.adapters[pid]
                self.adapters[pid] = make_adapter(provider, session)
                self._probe_now(pid)
            else:
                self._heartbeat_now(pid)  # its groups may have changed: pump them with the new plans
        return True

    def _start_provider(self, provider_id: str) -> None:
        if self._providers_tg is None:
            return
        self._provider_scopes[provider_id] = scope = anyio.CancelScope()
        self._providers_tg.start_soon(self._provider_loop, provider_id, scope)

    def _stop_provider(self, provider_id: str) -> None:
        scope = self._provider_scopes.pop(provider_id, None)
        if scope is not None:
            scope.cancel()
        adapter = self.adapters.pop(provider_id, None)
        if adapter is not None:
            self.retired[provider_id] = adapter
        self.health.pop(provider_id, None)
        self._failed_by_call.discard(provider_id)
        self._wake.pop(provider_id, None)

    async def _drain(self, jobs: TaskGroup) -> None:
        # No new work for this node's providers from this worker; another live worker of the
        # node puts them back within one heartbeat.
        with anyio.CancelScope(shield=True):
            for provider in self.node.providers:
                try:
                    await self.side.heartbeat(provider.id, "unavailable", [("reason", "worker draining")])
                except RedisError as exc:
                    log.warning("could not mark %s draining: %s", provider.id, exc)
            # Jobs dispatched here before the mark took effect go back to their queue now,
            # not when their lease runs out.
            await self._hand_back_unstarted(jobs)
        grace = self.config.dispatch.drain_grace_s
        with anyio.move_on_after(grace):
            assert self._idle is not None
            await self._idle.wait()
        for running in list(self.running.values()):
            running.abort("drain")

    async def _hand_back_unstarted(self, jobs: TaskGroup) -> None:
        """Requeue the node stream entries this worker was given (or would be) but never ran."""
        mine = {r.job.entry_id for r in self.running.values()}
        for start_id in ("0", ">"):  # delivered to this consumer and still pending; then new
            try:
                batch = await self.clients.blocking.execute(
                    "XREADGROUP", "GROUP", keys.NODE_GROUP, self.worker_id, "COUNT", 1000,
                    "STREAMS", self.side.node_key, start_id,
                )
            except RedisError as exc:
                log.warning("could not hand back undelivered jobs: %s (their leases will)", exc)
                return
            for _stream, entries in batch or []:
                for entry_id, fields in entries:
                    if not fields or (entry_id.decode() if isinstance(entry_id, bytes) else entry_id) in mine:
                        continue  # deleted entry, or a job running here
                    jobs.start_soon(self._hand_back, Assignment.from_entry(entry_id, fields))

    async def _hand_back(self, job: Assignment) -> None:
        lost = Failed.from_error(WorkerLost("the worker shut down before the job started"))
        await self._finish(Running(job), None, lost, mode="requeue")

    async def _settle_ghosts(self) -> None:
        """Hand back node stream entries delivered to this worker that it does not run.

        A finish (or a hand-back) that a Redis failover lost leaves its entry pending here
        and its lease on the new primary: nobody would renew it, and its slot would stay
        taken until the lease ran out. Entries younger than a third of a lease are left
        alone: they may be on their way to a run.
        """
        idle_ms = max(self.config.dispatch.lease_ms // 3, 1000)
        try:
            pending = await self.redis.xpending_range(
                self.side.node_key, keys.NODE_GROUP, "-", "+", 100, consumername=self.worker_id, idle=idle_ms
            )
            mine = {r.job.entry_id.encode() for r in self.running.values()}
            ghosts = [p["message_id"] for p in pending if p["message_id"] not in mine]
            for entry_id in ghosts:
                entries = await self.redis.xrange(self.side.node_key, entry_id, entry_id)
                if not entries:
                    await self.redis.xack(self.side.node_key, keys.NODE_GROUP, entry_id)
                    continue
                found_id, fields = cast(tuple[bytes, dict[bytes, bytes]], entries[0])
                job = Assignment.from_entry(found_id, fields)
                log.warning("job %s: delivered here but not running (a lost finish?); handing it back", job.job,
                            extra=job.log_context())
                await self._hand_back(job)
        except RedisError as exc:
            log.info("could not look for lost finishes: %s", exc)

    async def _leave_group(self) -> None:
        """A worker that exits cleanly leaves the node's consumer group (if it holds nothing)."""
        try:
            pending = await self.redis.xpending_range(
                self.side.node_key, keys.NODE_GROUP, "-", "+", 1, consumername=self.worker_id
            )
            if not pending:
                await self.redis.xgroup_delconsumer(self.side.node_key, keys.NODE_GROUP, self.worker_id)
        except RedisError as exc:
            log.info("could not leave the consumer group: %s", exc)

    async def _wait_for_redis(self) -> None:
        backoff = Backoff(0.1, 2.0)
        while True:
            try:
                await self.redis.ping()
                return
            except RedisError as exc:
                log.warning("waiting for Redis: %s", exc)
                await backoff.sleep()

    # --- jobs ---------------------------------------------------------------------------

    async def _consume(self, jobs: TaskGroup) -> None:
        # Short: after a failover, new dispatches wait on this read.
        backoff = Backoff(0.1, 0.5)
        assert self._consume_scope is not None
        with self._consume_scope:
            while not self.draining:
                try:
                    batch: StreamReply = await self.clients.blocking.execute(
                        "XREADGROUP", "GROUP", keys.NODE_GROUP, self.worker_id, "COUNT", READ_BATCH,
                        "BLOCK", self._block_ms, "STREAMS", self.side.node_key, ">",
                        reply_within=blocking_timeout(self._block_ms),
                    )
                    backoff.reset()
                except RedisError as exc:
                    if "NOGROUP" in str(exc):
                        await self.side.ensure_group()
                        continue
                    log.warning("reading node stream failed: %s", exc)
                    await backoff.sleep()
                    continue
                for _stream, entries in batch or []:
                    for entry_id, fields in entries:
                        job = Assignment.from_entry(entry_id, fields)
                        jobs.start_soon(self._hand_back if self.draining else self._run_job, job)

    async def _run_job(self, job: Assignment) -> None:
        running = Running(job)
        for other in self.running.values():
            if other.job.job == job.job:
                # Its lease ran out while this worker could not renew it, and the job came
                # back here: the old run is fenced off and must stop calling the provider.
                other.abort("stale")
        self.running[running.key] = running
        if self._idle is None or self._idle.is_set():
            self._idle = anyio.Event()
        sink = RedisSink(self.side, job, self.node.id, self._hold_s)
        final: events.Event | None = None
        try:
            if self.early_cancels.pop(job.job, None) is not None:
                running.abort_reason = "cancelled"
            else:
                final = await self._call(job, running, sink)
            if running.abort_reason == "drain" and final is None:
                # Given up at shutdown: dispatched again elsewhere unless output had started.
                final = Failed.from_error(WorkerLost("the worker shut down before the answer was complete"),
                                          sink.meta)
            elif running.abort_reason is not None:
                final = None
        except Exception:
            # One job's failure must not take down the task group, and every other job with it.
            log.exception("job %s: unexpected failure", job.job, extra=job.log_context())
            final = Failed.from_error(ProviderUnreachable("internal error in the worker"), sink.meta)
        finally:
            with anyio.CancelScope(shield=True):
                mode: FinishMode = "done"
                if running.abort_reason == "drain":
                    mode = "requeue"
                elif running.retry:
                    mode = "retry"
                try:
                    await self._finish(running, sink, final, mode=mode)
                finally:
                    self.running.pop(running.key, None)
                    if not self.running and self._idle is not None:
                        self._idle.set()
                    if running.provider_failed:
                        # Released: if it runs nothing else now, the whole probe may be asked.
                        self._probe_now(job.provider)

    async def _call(self, job: Assignment, running: Running, sink: RedisSink) -> events.Event | None:
        adapter = self.adapters.get(job.provider) or self.retired.get(job.provider)
        if adapter is None or job.endpoint not in ENDPOINTS:
            return Failed.from_error(
                ProviderUnreachable(f"node {self.node.id} cannot run {job.endpoint} on provider {job.provider}"),
                sink.meta,
            )
        with running.scope:
            try:
                # No local limiter: the slot accounting in Redis already bounds every worker
                # of the node together, which a per-process one could not.
                request = unwrap(job.body)
                out: Sink = sink
                if job.endpoint == RESPONSES:
                    out = stored_response_sink(sink, request, lambda rid: self.side.remember_response(rid, job),
                                               self.side.forget_response)
                with tracing.provider_span(job, self.node.id, request.traceparent, sink):
                    await adapter.call(provider_call(job, request, adapter.provider.asks_stream_usage), out)
                self._answered(job.provider)
                return sink.final_event()
            except JobAborted as exc:
                running.abort_reason = running.abort_reason or exc.reason
            except ProviderError as exc:
                if fails_the_provider(exc):
                    self._call_failed(job.provider, exc)
                    running.provider_failed = True
                # Before any output, another provider of the lane may serve it (lua/finish.lua).
                running.retry = exc.retry_elsewhere and not sink.started
                return Failed.from_error(exc, sink.meta)
            except RedisError as exc:
                # The sink held the output as long as it could (see workers/sink.py).
                log.warning("job %s: %s", job.job, exc, extra=job.log_context())
                sink.discard()
                return Failed.from_error(WorkerLost("the worker lost Redis while streaming"), sink.meta)
        return None

    async def _finish(
        self, running: Running, sink: RedisSink | None, final: events.Event | None, mode: FinishMode = "done"
    ) -> None:
        """Write what the sink holds, then the final event with the release; through a Redis
        outage of up to ``OUTAGE_LEASES`` leases (the job stays in ``running`` meanwhile, so
        its lease is renewed whenever Redis answers)."""
        job = running.job
        data = events.encode(final) if final is not None else None
        backoff = Backoff(0.05, 0.5)
        failing_since: float | None = None
        while True:
            try:
                if sink is not None and data is not None and mode == "done":
                    await sink.flush()
                usage = final_usage(final)
                outcome = await self.side.finish(job, data, mode=mode, tokens=usage.completion,
                                                 prompt=usage.prompt, cached=usage.cached)
                if outcome not in (FinishOutcome.RELEASED, FinishOutcome.STALE):
                    why = "given up at shutdown" if mode == "requeue" else f"provider {job.provider} failed it"
                    log.info("job %s %s: %s", job.job, why, outcome, extra=job.log_context())
                return
            except JobAborted as exc:
                # The client left (or the job was taken over) before its output was written.
                log.info("job %s: %s before its output was written", job.job, exc.reason, extra=job.log_context())
                data = None
            except RedisError as exc:
                now = time.monotonic()
                failing_since = failing_since or now
                if now - failing_since > self._hold_s:
                    # The lease runs out and the reaper settles the job instead.
                    log.error("job %s: could not release (%s); leaving it to the lease", job.job, exc,
                              extra=job.log_context())
                    return
                await backoff.sleep()

    # --- cancellation and leases ------------------------------------------------------------

    def _cancel(self, job_id: str) -> None:
        runs = [r for r in self.running.values() if r.job.job == job_id]
        for running in runs:
            running.abort("cancelled")
        if runs:
            return
        now = time.monotonic()
        self.early_cancels[job_id] = now + self.config.dispatch.lease_ms / 1000
        for jid, expiry in list(self.early_cancels.items()):
            if expiry < now:
                del self.early_cancels[jid]

    async def _cancel_listener(self) -> None:
        backoff = Backoff(0.1, 0.5)
        while True:
            pubsub = self.redis.pubsub()
            try:
                await pubsub.subscribe(keys.cancel_channel(self.node.id))
                backoff.reset()
                # Cancels published while this worker was not subscribed (a Redis outage)
                # were missed: a renewal now reports them (state 'c') instead of in a third
                # of a lease.
                self.renew_now()
                async for message in pubsub.listen():
                    if message["type"] == "message":
                        self._cancel(message["data"].decode())
            except RedisError as exc:
                log.warning("cancel channel lost: %s", exc)
            finally:
                with anyio.CancelScope(shield=True):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
            await backoff.sleep()

    def renew_now(self) -> None:
        if self._renew_soon is not None:
            self._renew_soon.set()

    async def _renew_loop(self) -> None:
        """Renew from the last success, not after each attempt: a failed or slow call must
        not push the next one to the lease's expiry, where the reaper races it."""
        lease_s = self.config.dispatch.lease_ms / 1000
        period = lease_s / 3
        timeout = min(period / 3, 2.0)  # a hung call fails with time for two more tries
        retry = min(period / 6, 0.25)
        next_at = time.monotonic() + period
        while True:
            assert self._renew_soon is not None
            with anyio.move_on_after(max(next_at - time.monotonic(), 0.0)):
                await self._renew_soon.wait()
            self._renew_soon = anyio.Event()
            started = time.monotonic()
            runs = list(self.running.values())
            try:
                aborts = await self.side.renew([r.key for r in runs], reply_within=timeout)
            except RedisError as exc:
                log.warning("lease renewal failed: %s", exc)
                next_at = started + retry
                continue
            next_at = started + period
            await self._settle_ghosts()
            for abort in aborts:
                running = self.running.get((abort.job, abort.fence))
                if running is not None:
                    log.info("job %s: aborting (%s)", abort.job, abort.reason, extra=running.job.log_context())
                    running.abort(abort.reason)

    # --- providers ----------------------------------------------------------------------------

    async def _provider_loops(self) -> None:
        assert self._providers_scope is not None
        with self._providers_scope:
            async with anyio.create_task_group() as tg:
                self._providers_tg = tg
                for provider in self.node.providers:
                    self._start_provider(provider.id)
                await anyio.sleep_forever()  # a reload may start more

    def _probe_now(self, provider_id: str) -> None:
        """At the next turn of its loop: the whole probe if it runs nothing, else its check
        that is harmless while busy, whenever it was last asked."""
        self._next_probe[provider_id] = 0.0
        self._next_busy_probe[provider_id] = 0.0
        self._heartbeat_now(provider_id)

    def _heartbeat_now(self, provider_id: str) -> None:
        wake = self._wake.get(provider_id)
        if wake is not None:
            wake.set()

    async def _provider_loop(self, provider_id: str, scope: anyio.CancelScope) -> None:
        with scope:
            await self._probe_and_heartbeat(provider_id)

    async def _probe_and_heartbeat(self, provider_id: str) -> None:
        d = self.config.dispatch
        self._next_probe[provider_id] = 0.0
        self._next_busy_probe[provider_id] = 0.0
        while True:
            # Made before the probe and the heartbeat: a wake-up asked during them is kept.
            self._wake[provider_id] = wake = anyio.Event()
            if time.monotonic() >= self._next_probe[provider_id]:
                await self._probe(provider_id)
            try:
                await self._heartbeat(provider_id)
            except RedisError as exc:
                log.warning("heartbeat of %s failed: %s", provider_id, exc)
            with anyio.move_on_after(d.heartbeat_interval_ms / 1000):
                await wake.wait()

    async def _probe(self, provider_id: str) -> None:
        """The whole probe when the provider runs nothing. While it is busy, every
        ``busy_probe_interval_ms`` at most, only its adapter's check that cannot disturb
        the running requests, if it has one: a probe must never be what cuts a stream."""
        d = self.config.dispatch
        adapter = self.adapters[provider_id]  # a reload may replace it
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
        if any(r.job.provider == provider_id for r in self.running.values()):
            return True
        try:
            in_flight = await self.redis.hget(keys.provider(provider_id), "in_flight")
        except RedisError as exc:
            log.debug("could not tell whether %s is busy (%s): taken as busy", provider_id, exc)
            return True
        return int(in_flight or 0) > 0

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
        if by_call:
            self._failed_by_call.add(provider_id)
        else:
            self._failed_by_call.discard(provider_id)

    def _call_failed(self, provider_id: str, exc: ProviderError) -> None:
        """Out of rotation at once, with the call's error as the reason; a probe (asked as
        soon as the provider runs nothing) or a call it answers brings it back."""
        if provider_id not in self.adapters:
            return  # removed by a reload: nothing publishes it any more
        self._judge(provider_id, self._keeping_details(provider_id, ProbeResult(False, str(exc))), by_call=True)
        self._heartbeat_now(provider_id)

    def _answered(self, provider_id: str) -> None:
        """A call the provider answered whole: it is healthy, if only a failed call said not."""
        if provider_id in self._failed_by_call:
            self._judge(provider_id, self._keeping_details(provider_id, ProbeResult(True, "")))
            self._heartbeat_now(provider_id)

    async def _heartbeat(self, provider_id: str) -> None:
        provider = next((p for p in self.node.providers if p.id == provider_id), None)
        result = self.health.get(provider_id)
        if provider is None or result is None:
            return  # removed by a reload meanwhile
        fields: list[tuple[str, str | int]] = [
            ("node", self.node.id),
            ("type", provider.type),
            ("category", provider.effective_category),
            ("capacity", provider.capacity),
            ("models", json.dumps(provider.models)),
            ("reason", result.reason),
            ("reported_models", json.dumps(result.models) if result.models is not None else ""),
            ("loaded_models", json.dumps(result.loaded) if result.loaded is not None else ""),
            ("endpoints", json.dumps(provider.served_endpoints)),
            ("slots", result.slots if result.slots is not None else ""),
            ("worker", self.worker_id),
            ("removed", ""),  # in the config again, if a reload had removed it
        ]
        await self.side.heartbeat(provider_id, "available" if result.healthy else "unavailable", fields)


def fails_the_provider(exc: ProviderError) -> bool:
    """Does a call's error speak of the provider itself (down, hung, broken), not of the
    request? A 4xx of its own is the caller's business."""
    if isinstance(exc, ProviderRejected):
        return exc.status >= 500
    return isinstance(exc, ProviderUnreachable | ProviderTimeout)


def provider_call(job: Assignment, request: RequestEnvelope, ask_usage: bool = False) -> ProviderCall:
    """The call a job makes, its model set to the provider's served name; ``ask_usage``: a
    streamed chat/completions asks for its usage too (the provider's ``stream_usage``)."""
    body = request.body
    usage_asked = False
    if body and request.content_type == JSON:
        if ask_usage and job.stream and job.endpoint in ASKABLE and not request.path:
            body, usage_asked = with_model_asking_usage(body, job.target)
        else:
            body = with_model(body, job.target)
    elif body and request.content_type.startswith("multipart/form-data"):
        body = with_field(body, request.content_type, "model", job.target)
    return ProviderCall(
        job.endpoint, body, job.target, job.stream, request.method, request.path, request.content_type,
        request.headers, usage_asked,
    )
