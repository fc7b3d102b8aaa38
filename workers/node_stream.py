"""A worker's side of its node's stream: the jobs dispatched to the node, read through the
stream's consumer group (one consumer per worker process).

Several worker processes may serve the same node: the consumer group hands each job to
one of them, and the slot accounting in Redis bounds them together.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any, cast

import anyio
from anyio.abc import TaskGroup
from redis.asyncio import Redis
from redis.exceptions import RedisError

from dispatcher import keys
from dispatcher.backoff import Backoff
from dispatcher.events import Assignment
from dispatcher.fastredis import FastRedis
from dispatcher.redis_conn import BLOCK_MS, blocking_timeout
from dispatcher.worker_side import WorkerSide
from workers.leases import Runs

log = logging.getLogger("iop.worker")

READ_BATCH = 64

StreamReply = list[tuple[bytes, list[tuple[bytes, list[bytes]]]]] | None  # of XREADGROUP
JobTask = Callable[[Assignment], Coroutine[Any, Any, None]]


class NodeStream:
    """Reads the node stream as consumer ``consumer`` and starts ``run`` for each job, or
    ``hand_back`` once the worker shuts down.

    ``blocking``: the client whose connection a blocking read holds; ``redis``: the one
    for everything else; ``runs``: the jobs running here (their entries are not ghosts).
    """

    def __init__(self, side: WorkerSide, blocking: FastRedis, redis: Redis, consumer: str, lease_ms: int,
                 runs: Runs, run: JobTask, hand_back: JobTask) -> None:
        self._side = side
        self._blocking = blocking
        self._redis = redis
        self._consumer = consumer
        self._runs = runs
        self._run = run
        self._hand_back = hand_back
        # Redis hands a new entry to whichever consumer is blocked reading. A worker that
        # froze mid-read must stop being one well before its leases expire, or it would
        # swallow the very jobs the reaper hands out again.
        self._block_ms = min(BLOCK_MS, lease_ms // 3)
        # Entries delivered here this long ago and not running are ghosts (settle_ghosts).
        self._ghost_idle_ms = max(lease_ms // 3, 1000)
        self.shutting_down = False
        self._scope: anyio.CancelScope | None = None

    async def consume(self, jobs: TaskGroup) -> None:
        """Start each job read in ``jobs``, until :meth:`stop`."""
        # Short: after a failover, new dispatches wait on this read.
        backoff = Backoff(0.1, 0.5)
        self._scope = anyio.CancelScope()
        with self._scope:
            while not self.shutting_down:
                try:
                    batch: StreamReply = await self._blocking.execute(
                        "XREADGROUP", "GROUP", keys.NODE_GROUP, self._consumer, "COUNT", READ_BATCH,
                        "BLOCK", self._block_ms, "STREAMS", self._side.node_key, ">",
                        reply_within=blocking_timeout(self._block_ms),
                    )
                    backoff.reset()
                except RedisError as exc:
                    if "NOGROUP" in str(exc):
                        await self._side.ensure_group()
                        continue
                    log.warning("reading node stream failed: %s", exc)
                    await backoff.sleep()
                    continue
                for _stream, entries in batch or []:
                    for entry_id, fields in entries:
                        job = Assignment.from_entry(entry_id, fields)
                        jobs.start_soon(self._hand_back if self.shutting_down else self._run, job)

    def stop(self) -> None:
        """Take no more jobs: the read in progress ends now."""
        self.shutting_down = True
        if self._scope is not None:
            self._scope.cancel()

    async def hand_back_unstarted(self, jobs: TaskGroup) -> None:
        """Requeue the node stream entries this worker was given (or would be) but never ran."""
        mine = self._runs.entry_ids()
        for start_id in ("0", ">"):  # delivered to this consumer and still pending; then new
            try:
                batch = await self._blocking.execute(
                    "XREADGROUP", "GROUP", keys.NODE_GROUP, self._consumer, "COUNT", 1000,
                    "STREAMS", self._side.node_key, start_id,
                )
            except RedisError as exc:
                log.warning("could not hand back undelivered jobs: %s (their leases will)", exc)
                return
            for _stream, entries in batch or []:
                for entry_id, fields in entries:
                    if not fields or (entry_id.decode() if isinstance(entry_id, bytes) else entry_id) in mine:
                        continue  # deleted entry, or a job running here
                    jobs.start_soon(self._hand_back, Assignment.from_entry(entry_id, fields))

    async def settle_ghosts(self) -> None:
        """Hand back node stream entries delivered to this worker that it does not run.

        A finish (or a hand-back) that a Redis failover lost leaves its entry pending here
        and its lease on the new primary: nobody would renew it, and its slot would stay
        taken until the lease ran out. Entries younger than a third of a lease are left
        alone: they may be on their way to a run.
        """
        node_key = self._side.node_key
        try:
            pending = await self._redis.xpending_range(
                node_key, keys.NODE_GROUP, "-", "+", 100, consumername=self._consumer, idle=self._ghost_idle_ms
            )
            mine = {entry_id.encode() for entry_id in self._runs.entry_ids()}
            ghosts = [p["message_id"] for p in pending if p["message_id"] not in mine]
            for entry_id in ghosts:
                entries = await self._redis.xrange(node_key, entry_id, entry_id)
                if not entries:
                    await self._redis.xack(node_key, keys.NODE_GROUP, entry_id)
                    continue
                found_id, fields = cast(tuple[bytes, dict[bytes, bytes]], entries[0])
                job = Assignment.from_entry(found_id, fields)
                log.warning("job %s: delivered here but not running (a lost finish?); handing it back", job.job,
                            extra=job.log_context())
                await self._hand_back(job)
        except RedisError as exc:
            log.info("could not look for lost finishes: %s", exc)

    async def leave_group(self) -> None:
        """A worker that exits cleanly leaves the node's consumer group (if it holds nothing)."""
        node_key = self._side.node_key
        try:
            pending = await self._redis.xpending_range(node_key, keys.NODE_GROUP, "-", "+", 1,
                                                       consumername=self._consumer)
            if not pending:
                await self._redis.xgroup_delconsumer(node_key, keys.NODE_GROUP, self._consumer)
        except RedisError as exc:
            log.info("could not leave the consumer group: %s", exc)


async def wait_for_redis(redis: Redis) -> None:
    """Until Redis answers a ping."""
    backoff = Backoff(0.1, 2.0)
    while True:
        try:
            await redis.ping()
            return
        except RedisError as exc:
            log.warning("waiting for Redis: %s", exc)
            await backoff.sleep()
