"""Everything one API process holds: config, Redis client, scripts, its reply reader,
and the background loops that keep it registered and Redis tidy."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import socket
from collections.abc import Coroutine
from typing import Any

from redis.exceptions import RedisError

from api.metrics import RequestMetrics
from api.streams import StreamSlots
from api.waiting import ReplyReader
from dispatcher import keys
from dispatcher.api_side import ApiSide
from dispatcher.config import Config
from dispatcher.plans import Plans
from dispatcher.protocol import ScriptCalls
from dispatcher.reaper import Reaper
from dispatcher.redis_conn import Clients, server_warnings
from dispatcher.scripts import Scripts
from dispatcher.tenants import Tenants

log = logging.getLogger("iop.api")


class Gateway:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.replica_id = f"api-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.clients = Clients.open(config.redis)
        self.redis = self.clients.control
        self.scripts = Scripts(self.redis, self.clients.fast)
        self.plans = Plans(config)
        calls = ScriptCalls(self.scripts, config, self.plans)
        self.jobs = ApiSide(calls, self.redis, self.replica_id)
        self.replies = ReplyReader(self.clients.blocking, keys.reply(self.replica_id))
        self.reaper = Reaper(calls, self.redis, self.replica_id)
        self.models = {m.id: m for m in config.models}
        self.metrics = RequestMetrics()
        self.tenants = Tenants(config)
        self.streams = StreamSlots(config.api.max_streams)
        self._tasks: set[asyncio.Task[Any]] = set()
        # Job ids: a random prefix per process and a counter, unique without a syscall each.
        self._job_prefix = secrets.token_hex(8)
        self._job_counter = itertools.count()
        self._loops: list[asyncio.Task[None]] = []
        self._closing = False

    def next_job_id(self) -> str:
        return f"{self._job_prefix}{next(self._job_counter):x}"

    async def publish_limits(self) -> None:
        """The tenants' max_in_flight, where dispatch reads them (``lua/lib/pump.lua``)."""
        limits = self.tenants.limits()
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
            await self.jobs.heartbeat()
            if self.tenants.flow_control:
                await self.publish_limits()
        except RedisError as exc:
            # Not fatal: /readyz says so, and requests answer 503 until Redis is back.
            log.warning("Redis not reachable at start-up: %s", exc)
        self._loops = [
            asyncio.create_task(self.replies.run(), name="iop-replies"),
            asyncio.create_task(self._heartbeat_loop(), name="iop-replica-heartbeat"),
            asyncio.create_task(self.reaper.run_forever(), name="iop-reaper"),
        ]
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

    async def ready(self) -> tuple[bool, str]:
        try:
            # A keyed script write through the request path's client: PING and SCRIPT EXISTS
            # also succeed on a cluster node that does not serve {iop}, or on a replica.
            await self.jobs.heartbeat()
            if not await self.scripts.loaded():
                await self.scripts.load()
        except RedisError as exc:
            return False, f"redis unavailable: {exc}"
        return True, "ready"

    async def _heartbeat_loop(self) -> None:
        period = self.config.dispatch.replica_ttl_ms / 5000
        while not self._closing:
            try:
                await self.jobs.heartbeat()
            except RedisError as exc:
                log.warning("replica heartbeat failed: %s", exc)
            await asyncio.sleep(period)
