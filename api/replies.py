"""One reader per API process: it reads the process's reply stream and hands each
event to the request waiting for it. Thousands of waiting requests cost one blocking
Redis connection, not one each.
"""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import RedisError, ResponseError

from dispatcher import events
from dispatcher.fastredis import FastRedis
from dispatcher.redis_conn import BLOCK_MS, blocking_timeout

log = logging.getLogger("iop.api.replies")

READ_BATCH = 1000


class ClientGone(Exception):
    """The caller closed its connection while waiting."""


_GONE = b""


class Waiter:
    """The events of one job, in the order its worker wrote them."""

    __slots__ = ("_queue", "watcher")

    def __init__(self) -> None:
        self._queue: asyncio.Queue[bytes] = asyncio.Queue()
        # The task watching for the caller to hang up, once one was started.
        self.watcher: asyncio.Future[None] | None = None

    def push(self, data: bytes) -> None:
        self._queue.put_nowait(data)

    def client_gone(self) -> None:
        self._queue.put_nowait(_GONE)

    async def next(self, wait_s: float | None) -> events.Event | None:
        """The next event, or None when ``wait_s`` seconds pass first."""
        if self._queue.empty():
            try:
                async with asyncio.timeout(wait_s):
                    data = await self._queue.get()
            except TimeoutError:
                return None
        else:
            data = self._queue.get_nowait()
        if data is _GONE:
            raise ClientGone
        return events.decode(data)


class ReplyReader:
    def __init__(self, conn: FastRedis, reply_key: str) -> None:
        # A connection of its own: XREAD BLOCK holds it until events come.
        self.conn = conn
        self.key = reply_key
        self.waiters: dict[str, Waiter] = {}
        self.last_id: bytes = b"0-0"
        # Successful reads so far, and when the last one ended: a watchdog must not call a
        # job lost while its answer may still sit unread in the stream.
        self.reads = 0
        self.last_read_at = 0.0

    def register(self, job_id: str) -> Waiter:
        waiter = Waiter()
        self.waiters[job_id] = waiter
        return waiter

    def unregister(self, job_id: str) -> None:
        self.waiters.pop(job_id, None)

    async def run(self) -> None:
        delay = 0.05
        trim = False
        while True:
            commands: list[tuple[str | bytes | int, ...]] = []
            if trim:
                # What was read is delivered: drop it in the same round trip as the next read.
                commands.append(("XTRIM", self.key, "MINID", self.last_id))
            commands.append(("XREAD", "COUNT", READ_BATCH, "BLOCK", BLOCK_MS, "STREAMS", self.key, self.last_id))
            try:
                result = (await self.conn.execute_many(commands, reply_within=blocking_timeout(BLOCK_MS)))[-1]
                if isinstance(result, ResponseError):
                    raise result
                self.reads += 1
                self.last_read_at = asyncio.get_running_loop().time()
                delay = 0.05
            except RedisError as exc:
                log.warning("reading replies failed: %s", exc)
                await asyncio.sleep(delay)
                # Short: while this reader is away, answers already written wait unread.
                delay = min(delay * 2, 0.5)
                continue
            trim = bool(result)
            for _stream, entries in result or []:
                for entry_id, fields in entries:
                    self.last_id = entry_id
                    # Fields come as [b"j", job, b"e", event], the order the writers use.
                    waiter = self.waiters.get(fields[1].decode())
                    if waiter is not None:
                        waiter.push(fields[3])
