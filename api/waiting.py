"""Waiting for a job's events: everything between submitting a job and answering it.

* :class:`JobWait` -- one request's wait: its events, its queue deadline (the ``cancel``
  script decides, atomically, whether the job was still waiting), a watchdog for a
  dispatched job, and the cancel when the caller or the request gives up. A request ends
  with exactly one answer even if a worker or Redis goes away.
* :class:`HangUpWatch` -- notices a caller that hangs up while its job runs.
* :class:`Waiter` and :class:`ReplyReader` -- one reader per API process reads the
  process's reply stream and hands each event to the waiter of its job: thousands of
  waiting requests cost one blocking Redis connection, not one each.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from litestar import Request
from redis.exceptions import RedisError, ResponseError

from dispatcher import events
from dispatcher.backoff import Backoff
from dispatcher.events import Chunks, Done, End, Failed, Requeued, Start
from dispatcher.exceptions import QueueTimeout, RedisUnavailable, WorkerLost
from dispatcher.fastredis import FastRedis
from dispatcher.holding import held
from dispatcher.redis_conn import BLOCK_MS, blocking_timeout
from dispatcher.script_calls import Cancelled, CancelOutcome, CancelReason, SubmitStatus, Submitted

log = logging.getLogger("iop.api.replies")

READ_BATCH = 1000
WATCH_AFTER_S = 0.05


class ClientGone(Exception):
    """The caller closed its connection while waiting."""


class JobCalls(Protocol):
    """What a wait asks of Redis (``dispatcher/api_side.py`` ApiSide)."""

    async def cancel(self, job_id: str, queue_key: str, reason: CancelReason) -> Cancelled: ...

    async def states(self, job_ids: list[str]) -> list[bytes | None]: ...


@dataclass(frozen=True, slots=True)
class WaitRules:
    """The timings a wait keeps, from the config its request started with."""

    # No event for this long: the watchdog looks for the job (a lease period).
    watch_s: float
    # A queue deadline that passes while Redis is away is decided within this (failover_hold_ms).
    hold_s: float
    # How long a job of a model waits in its queue again when its worker was lost.
    queue_timeout_ms: Callable[[str], int]


class JobWait:
    """The API's side of one job: its events, its queue deadline, and a watchdog. Its state
    changes only through its methods: what its events say, and what the request tells it
    (:meth:`submitted_to`, :meth:`refused`, :meth:`waiting`, :meth:`output_began`)."""

    __slots__ = ("_gone_at_read", "_model_id", "_output_started", "_queue_key", "_queued_until",
                 "_redis_down_since", "_settled", "job_id", "jobs", "replies", "rules", "spawn", "waiter")

    def __init__(
        self, job_id: str, model_id: str, queue_key: str, *, replies: ReplyReader, jobs: JobCalls, rules: WaitRules,
        spawn: Callable[[Coroutine[Any, Any, Any]], None],
    ) -> None:
        self.job_id = job_id
        self._model_id = model_id
        self._queue_key = queue_key  # of the job's lane
        self.replies = replies
        self.jobs = jobs
        self.rules = rules
        self.spawn = spawn
        self.waiter = replies.register(job_id)
        # True once Redis holds nothing more of this job that the API must clean up.
        self._settled = False
        self._queued_until: float | None = None
        # Reads of the reply reader when the job was first seen gone from Redis.
        self._gone_at_read: int | None = None
        self._redis_down_since: float | None = None
        # Output reached the caller: a second run must never be spliced into it.
        self._output_started = False

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def queue_key(self) -> str:
        return self._queue_key

    @property
    def settled(self) -> bool:
        return self._settled

    @property
    def output_started(self) -> bool:
        return self._output_started

    def submitted_to(self, model_id: str, queue_key: str) -> None:
        """The job went to another model's lane (a fallback's) than the wait began with."""
        self._model_id, self._queue_key = model_id, queue_key

    def refused(self) -> None:
        """Its submit did not take the job: nothing of it is in Redis."""
        self._settled = True

    def output_began(self) -> None:
        """Its first output is on its way to the caller."""
        self._output_started = True

    def waiting(self, submitted: Submitted) -> None:
        if submitted.status == SubmitStatus.QUEUED:
            self._queued_until = _now() + submitted.wait_ms / 1000

    async def next_event(self) -> Start | Chunks | End | Done | Failed:
        watch = self.rules.watch_s
        while True:
            timeout = watch if self._queued_until is None else max(self._queued_until - _now(), 0.0)
            event = await self.waiter.next(wait_s=timeout)
            if isinstance(event, Requeued):
                if self._output_started:
                    # Only a failover that lost the mark of its output does this: a second
                    # run would be spliced into what the caller already has.
                    raise WorkerLost("The worker's stream was lost in a Redis failover")
                # Its worker was lost before any output: it waits in its queue again, with a
                # fresh deadline (lua/lib/jobs.lua settle_lost).
                self._queued_until = _now() + self.rules.queue_timeout_ms(self._model_id) / 1000
                continue
            if event is not None:
                self._queued_until = None  # dispatched: the queue deadline no longer applies
                if isinstance(event, Done | End | Failed):
                    self._settled = True
                return event
            try:
                if self._queued_until is not None:
                    await self._deadline_passed()
                else:
                    await self._watchdog()
                self._redis_down_since = None
            except RedisError as exc:
                # A Redis restart must not fail a dispatched job that will still be answered:
                # the watchdog tolerates an outage of two lease periods before giving up.
                if self._queued_until is not None:
                    raise RedisUnavailable(f"Redis is unavailable: {exc}") from None
                if self._redis_down_since is None or self.replies.last_read_at > self._redis_down_since:
                    # Redis was back in between (the reader read): a new outage starts now.
                    self._redis_down_since = _now()
                elif _now() - self._redis_down_since > 2 * watch:
                    raise RedisUnavailable(f"Redis is unavailable: {exc}") from None

    async def _deadline_passed(self) -> None:
        # Held like the submit: a deadline that passes during a failover or a restart is
        # decided once Redis is back (it may have been dispatched meanwhile), not answered 503.
        result = await held(lambda: self.jobs.cancel(self.job_id, self._queue_key, CancelReason.TIMEOUT),
                            self.rules.hold_s)
        if result.outcome in (CancelOutcome.REMOVED, CancelOutcome.EXPIRED):
            self._settled = True
            raise QueueTimeout(f"No provider for '{self._model_id}' became free before the queue deadline")
        if result.outcome == CancelOutcome.WAIT:
            self._queued_until = _now() + result.wait_ms / 1000
        else:
            # Dispatched (or already over): the deadline no longer applies.
            self._queued_until = None

    async def _watchdog(self) -> None:
        """No event for a lease period: make sure the job still exists somewhere."""
        (raw,) = await self.jobs.states([self.job_id])
        if raw is not None:
            self._gone_at_read = None
            record = events.decode_record(raw)
            if record.state in ("q", "x"):
                # Its worker was lost and it went back to its queue.
                self._queued_until = _now()
            return
        reads = self.replies.reads
        if self._gone_at_read is None:
            self._gone_at_read = reads
        elif reads >= self._gone_at_read + 2:
            # A job's final event is written before its record goes, so a read issued after
            # the record was seen gone would have brought it (the second read since then
            # surely was): none came, so Redis lost the job.
            self._settled = True
            raise WorkerLost("The request was lost (Redis restarted or its worker vanished)")

    def close(self) -> None:
        """The request is answered (or failed): stop listening, and stop the job unless it
        is over -- in the background, so the answer does not wait for Redis."""
        self.replies.unregister(self.job_id)
        if not self._settled:
            self.spawn(self.cancel())

    async def cancel(self) -> None:
        """The caller went away (or we failed): stop the job wherever it is.

        Retried through a Redis outage of up to two lease periods, so the provider stops
        generating for a caller who hung up while Redis was away."""
        if self._settled:
            return
        self._settled = True
        # Given up after two leases: its lease, or the reaper's orphan sweep, ends it then.
        with contextlib.suppress(RedisError):
            await held(lambda: self.jobs.cancel(self.job_id, self._queue_key, CancelReason.CLIENT),
                       2 * self.rules.watch_s)


class HangUpWatch:
    """Until a stream response takes over (Litestar then listens itself), notice a caller
    that hangs up, so its job is cancelled and the provider stops generating. Most
    answers come sooner than WATCH_AFTER_S: only slower ones pay for the watching task."""

    __slots__ = ("_request", "_task", "_timer", "_waiter")

    def __init__(self, request: Request[Any, Any, Any], waiter: Waiter) -> None:
        self._request = request
        self._waiter = waiter
        self._task: asyncio.Future[None] | None = None
        self._timer = asyncio.get_running_loop().call_later(WATCH_AFTER_S, self._start)

    def stop(self) -> None:
        self._timer.cancel()
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def _start(self) -> None:
        self._task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while (await self._request.receive())["type"] != "http.disconnect":
            pass
        self._waiter.client_gone()


_GONE = b""


class Waiter:
    """The events of one job, in the order its worker wrote them. One reader: the job's
    request. A deque and one future while it waits, not an ``asyncio.Queue`` and a timeout
    context: every request makes one, and most wait once."""

    __slots__ = ("_data", "_woken")

    def __init__(self) -> None:
        self._data: collections.deque[bytes] = collections.deque()
        # While the reader waits: done when data comes (or its wait is up).
        self._woken: asyncio.Future[None] | None = None

    def push(self, data: bytes) -> None:
        self._data.append(data)
        _wake(self._woken)

    def client_gone(self) -> None:
        self.push(_GONE)

    async def next(self, wait_s: float | None) -> events.Event | None:
        """The next event, or None when ``wait_s`` seconds pass first."""
        if not self._data:
            loop = asyncio.get_running_loop()
            woken = self._woken = loop.create_future()
            timer = None if wait_s is None else loop.call_later(wait_s, _wake, woken)
            try:
                await woken
            finally:
                self._woken = None
                if timer is not None:
                    timer.cancel()
            if not self._data:
                return None
        data = self._data.popleft()
        if data is _GONE:
            raise ClientGone
        return events.decode(data)


def _wake(woken: asyncio.Future[None] | None) -> None:
    if woken is not None and not woken.done():
        woken.set_result(None)


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
        # Short delays: while this reader is away, answers already written wait unread, and
        # the requests held through an outage (dispatcher.holding) wait for it once Redis is back.
        backoff = Backoff(first=0.05, cap=0.2)
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
                backoff.reset()
            except RedisError as exc:
                log.warning("reading replies failed: %s", exc)
                await backoff.sleep()
                continue
            trim = bool(result)
            for _stream, entries in result or []:
                for entry_id, fields in entries:
                    self.last_id = entry_id
                    # Fields come as [b"job", job, b"event", event], the order every writer uses
                    # (tests/dispatcher/test_wire.py).
                    waiter = self.waiters.get(fields[1].decode())
                    if waiter is not None:
                        waiter.push(fields[3])


def _now() -> float:
    return asyncio.get_running_loop().time()
