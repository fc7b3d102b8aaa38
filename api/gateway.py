"""Everything one API process holds: its Redis clients and scripts, its reply reader, its
metrics and stream slots, the background loops that keep it registered and Redis tidy --
and one reference to the :class:`api.runtime.Runtime` of its current config, which a
reload (``SIGHUP``) replaces."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
import signal
import socket
from collections.abc import Coroutine, Iterator
from typing import Any

from redis.exceptions import RedisError

from api.metrics import RequestMetrics
from api.runtime import Runtime
from api.stream_slots import StreamSlots
from api.waiting import ReplyReader
from dispatcher import keys, overrides, tracing
from dispatcher.config import Config, config_digest
from dispatcher.control import Control, audit_once
from dispatcher.overrides import OverrideWatch
from dispatcher.reaper import Reaper
from dispatcher.redis_conn import Clients, server_warnings
from dispatcher.reloading import describe_changes, reread
from dispatcher.scripts import Scripts

log = logging.getLogger("iop.api")


class Gateway:
    """``config_path``: the file a reload (``SIGHUP``) reads again; None: no reloads."""

    def __init__(self, config: Config, config_path: str | None = None) -> None:
        self.config_path = config_path
        self.replica_id = f"api-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.clients = Clients.open(config.redis)
        self.redis = self.clients.control
        self.scripts = Scripts(self.redis, self.clients.fast)
        self.replies = ReplyReader(self.clients.blocking, keys.reply(self.replica_id))
        self.metrics = RequestMetrics()
        self.streams = StreamSlots(config.api.max_streams)
        # The file's config, as loaded or last reloaded; the runtime runs it with the
        # operators' overrides applied (dispatcher/overrides.py), which the watch keeps up.
        self.file_config = config
        self.runtime = Runtime.build(config, self.scripts, self.redis, self.replica_id)
        self.overrides = OverrideWatch(self.redis, self._apply_overrides, self._lapse)
        self.reaper = Reaper(self.runtime.calls, self.redis, self.replica_id)
        self._tasks: set[asyncio.Task[Any]] = set()
        # Job ids: a random prefix per process and a counter, unique without a syscall each.
        self._job_prefix = secrets.token_hex(8)
        self._job_counter = itertools.count()
        self._loops: list[asyncio.Task[None]] = []
        self._closing = False

    @property
    def config(self) -> Config:
        return self.runtime.config

    def _use(self, runtime: Runtime) -> None:
        """Switch to ``runtime``: a request in flight keeps the one it started with."""
        self.runtime = runtime
        self.reaper.use(runtime.calls)
        self.streams.limit = runtime.config.api.max_streams

    async def reload(self) -> bool:
        """Read the config file again and switch to it (``dispatcher/reloading.py``); False
        if there is no file or it is refused."""
        if self.config_path is None:
            log.warning("reload: this API process was not started from a config file")
            return False
        new = reread(self.config_path, self.file_config)
        if new is None:
            return False
        before = self.file_config
        self.file_config = new
        self._use(Runtime.build(overrides.effective(new, self.overrides.snapshot), self.scripts, self.redis,
                                self.replica_id))
        await self._after_reload(before, new)
        if self.runtime.tenants.flow_control:
            try:
                await self.publish_limits()
            except RedisError as exc:
                log.warning("reload: could not publish the tenants' limits: %s", exc)
        log.info("reload: %s applied (%s)", self.config_path, describe_changes(before, new))
        return True

    async def _after_reload(self, before: Config, new: Config) -> None:
        """Drop the overrides the new file no longer fits, and audit the reload (once for the
        fleet: every process reloads the same file)."""
        control = Control(self.runtime.calls, self.redis, new)
        try:
            # Read now, not the watch's last snapshot: one set just before the reload counts too.
            await control.drop_stale(await overrides.read(self.redis))
            changes = describe_changes(before, new)
            if before != new:
                await audit_once(self.runtime.calls, "reload", "config", config_digest(before), {
                    "digest": config_digest(new), "changes": changes}, "iop", "reload", once_digest=config_digest(new))
        except RedisError as exc:
            log.warning("reload: overrides not checked against the new file, nor the reload audited: %s", exc)

    async def _apply_overrides(self, snapshot: overrides.Snapshot) -> None:
        """Run the file's config with ``snapshot`` applied, if that changes what it is."""
        config = overrides.effective(self.file_config, snapshot)
        if config != self.runtime.config:
            self._use(Runtime.build(config, self.scripts, self.redis, self.replica_id))
            log.info("overrides applied (version %d)", snapshot.version)

    async def _lapse(self, name: overrides.Field, target_id: str) -> None:
        await Control(self.runtime.calls, self.redis, self.file_config).lapse(name, target_id)

    def next_job_id(self) -> str:
        return f"{self._job_prefix}{next(self._job_counter):x}"

    async def publish_limits(self) -> None:
        """The tenants' max_in_flight, where dispatch reads them (``lua/lib/pump.lua``)."""
        limits = self.runtime.tenants.limits()
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(keys.TENANT_LIMITS)
            if limits:
                pipe.hset(keys.TENANT_LIMITS, mapping=limits)  # type: ignore[arg-type]
            await pipe.execute()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` in the background, keeping a reference until it ends."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def start(self) -> None:
        try:
            for warning in await server_warnings(self.redis):
                log.warning("%s", warning)
            await self.scripts.load()
            await self.runtime.jobs.heartbeat()
            if self.runtime.tenants.flow_control:
                await self.publish_limits()
            await self.overrides.start()
        except RedisError as exc:
            # Not fatal: /readyz says so, and requests answer 503 until Redis is back.
            log.warning("Redis not reachable at start-up: %s", exc)
        self._loops = [
            asyncio.create_task(self.replies.run(), name="iop-replies"),
            asyncio.create_task(self._heartbeat_loop(), name="iop-replica-heartbeat"),
            asyncio.create_task(self.reaper.run_forever(), name="iop-reaper"),
            asyncio.create_task(self.overrides.run(), name="iop-overrides"),
        ]
        tracing.setup(self.config, "api")
        log.info("API replica %s started", self.replica_id)

    async def close(self) -> None:
        self._closing = True
        # Cancel until they are gone: a cancellation that lands inside a Redis call can be
        # absorbed on Python 3.11 (asyncio.timeout races), and the loop would sleep on.
        pending = set(self._loops)
        while pending:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=0.5)
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        await self.clients.aclose()
        await asyncio.to_thread(tracing.shutdown)  # its last export may wait on the collector

    async def ready(self) -> tuple[bool, str]:
        try:
            # A keyed script write through the request path's client: PING and SCRIPT EXISTS
            # also succeed on a cluster node that does not serve {iop}, or on a replica.
            await self.runtime.jobs.heartbeat()
            if not await self.scripts.loaded():
                await self.scripts.load()
        except RedisError as exc:
            return False, f"redis unavailable: {exc}"
        return True, "ready"

    async def _heartbeat_loop(self) -> None:
        period = self.config.dispatch.replica_ttl_ms / 5000
        while not self._closing:
            try:
                await self.runtime.jobs.heartbeat()
            except RedisError as exc:
                log.warning("replica heartbeat failed: %s", exc)
            await asyncio.sleep(period)


@contextlib.contextmanager
def reload_on_hangup(gw: Gateway) -> Iterator[None]:
    """While serving, ``SIGHUP`` reloads the config file (a process serving from one, whose
    loop runs on the main thread: an app run by a test client in a thread takes none)."""
    loop = asyncio.get_running_loop()
    try:
        if gw.config_path is None:
            raise ValueError("no config file")
        loop.add_signal_handler(signal.SIGHUP, lambda: gw.spawn(gw.reload()))
    except (ValueError, RuntimeError, NotImplementedError):
        yield
        return
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGHUP)
