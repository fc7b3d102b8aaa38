"""One OpenAI request through iop: submit the job, wait for its events, answer.

The caller's body goes to the provider untouched but for ``model`` (the worker sets
the served name); answers come back with ``model`` set to the id the caller asked
for. The API enforces the queue deadline itself (the ``cancel`` script decides,
atomically, whether the job was still waiting) and watches a dispatched job, so a
request ends with exactly one answer even if a worker or Redis goes away.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException
from litestar.response import Stream
from redis.exceptions import RedisError

from api.gateway import Gateway
from api.metrics import RequestClock
from api.replies import ClientGone, Waiter
from dispatcher import events
from dispatcher.events import Chunks, Done, End, Failed, Meta, Requeued, Start
from dispatcher.exceptions import (
    JobCancelled,
    ModelNotFound,
    Overloaded,
    ProviderRejected,
    QueueFull,
    QueueTimeout,
    RedisUnavailable,
    RequestError,
    RequestTimeout,
    WorkerLost,
    error_from_code,
)
from dispatcher.jobs import Submitted
from dispatcher.jsonbody import parse_request, with_model

DONE_FRAME = b"data: [DONE]\n\n"
WATCH_AFTER_S = 0.05
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class JobWait:
    """The API's side of one job: its events, its queue deadline, and a watchdog."""

    def __init__(self, gw: Gateway, job_id: str, model_id: str, waiter: Waiter) -> None:
        self.gw = gw
        self.job_id = job_id
        self.model_id = model_id
        self.waiter = waiter
        # True once Redis holds nothing more of this job that the API must clean up.
        self.settled = False
        self._queued_until: float | None = None
        # Reads of the reply reader when the job was first seen gone from Redis.
        self._gone_at_read: int | None = None
        self._redis_down_since: float | None = None

    def waiting(self, submitted: Submitted) -> None:
        if submitted.status == "queued":
            self._queued_until = _now() + submitted.wait_ms / 1000

    async def next_event(self) -> Start | Chunks | End | Done | Failed:
        watch = self.gw.config.dispatch.lease_ms / 1000
        while True:
            timeout = watch if self._queued_until is None else max(self._queued_until - _now(), 0.0)
            event = await self.waiter.next(wait_s=timeout)
            if isinstance(event, Requeued):
                # Its worker was lost before any output: it waits in its queue again, with a
                # fresh deadline (lua/lib/jobs.lua settle_lost).
                self._queued_until = _now() + self.gw.config.queue_timeout_ms(self.gw.models[self.model_id]) / 1000
                continue
            if event is not None:
                if isinstance(event, Done | End | Failed):
                    self.settled = True
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
                if self._redis_down_since is None or self.gw.replies.last_read_at > self._redis_down_since:
                    # Redis was back in between (the reader read): a new outage starts now.
                    self._redis_down_since = _now()
                elif _now() - self._redis_down_since > 2 * watch:
                    raise RedisUnavailable(f"Redis is unavailable: {exc}") from None

    async def _deadline_passed(self) -> None:
        result = await self.gw.jobs.cancel(self.job_id, self.model_id, "timeout")
        if result.outcome in ("removed", "expired"):
            self.settled = True
            raise QueueTimeout(f"No provider for '{self.model_id}' became free before the queue deadline")
        if result.outcome == "wait":
            self._queued_until = _now() + result.wait_ms / 1000
        else:
            # Dispatched (or already over): the deadline no longer applies.
            self._queued_until = None

    async def _watchdog(self) -> None:
        """No event for a lease period: make sure the job still exists somewhere."""
        (raw,) = await self.gw.jobs.states([self.job_id])
        if raw is not None:
            self._gone_at_read = None
            record = events.decode_record(raw)
            if record.state in ("q", "x"):
                # Its worker was lost and it went back to its queue.
                self._queued_until = _now()
            return
        reads = self.gw.replies.reads
        if self._gone_at_read is None:
            self._gone_at_read = reads
        elif reads >= self._gone_at_read + 2:
            # A job's final event is written before its record goes, so a read issued after
            # the record was seen gone would have brought it (the second read since then
            # surely was): none came, so Redis lost the job.
            self.settled = True
            raise WorkerLost("The request was lost (Redis restarted or its worker vanished)")

    async def cancel(self) -> None:
        """The caller went away (or we failed): stop the job wherever it is.

        Retried through a Redis outage of up to two lease periods, so the provider stops
        generating for a caller who hung up while Redis was away."""
        if self.settled:
            return
        self.settled = True
        give_up = _now() + 2 * self.gw.config.dispatch.lease_ms / 1000
        delay = 0.05
        while True:
            try:
                await self.gw.jobs.cancel(self.job_id, self.model_id, "client")
                return
            except RedisError:
                if _now() > give_up:
                    return  # its lease, or the reaper's orphan sweep, ends it
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)


async def relay(request: Request[Any, Any, Any], gw: Gateway, endpoint: str) -> Response[Any]:
    clock = RequestClock(gw.metrics)
    try:
        return await _relay(request, gw, endpoint, clock)
    except RequestError as exc:
        clock.done(exc.status)
        raise
    except HTTPException as exc:
        clock.done(exc.status_code)
        raise
    except BaseException:
        clock.done(500)
        raise


async def _relay(request: Request[Any, Any, Any], gw: Gateway, endpoint: str, clock: RequestClock) -> Response[Any]:
    gw.caller_keys.check(request.headers)
    try:
        async with asyncio.timeout(gw.config.api.body_timeout_s):
            body = await request.body()
    except TimeoutError:
        raise RequestTimeout("The request body did not arrive in time") from None
    model_id, stream = parse_request(body)
    model = gw.models.get(model_id)
    if model is None:
        raise ModelNotFound(model_id)
    clock.model = model_id
    if endpoint == "embeddings":
        stream = False
    if stream:
        if gw.streams >= gw.config.api.max_streams:
            raise Overloaded(f"This API process already relays {gw.streams} streams; retry later")
        gw.streams += 1

    job_id = gw.next_job_id()
    waiter = gw.replies.register(job_id)
    wait = JobWait(gw, job_id, model_id, waiter)
    handed_off = False
    # Until a stream response takes over (Litestar then listens itself), notice a caller
    # that hangs up, so its job is cancelled and the provider stops generating. Most
    # answers come sooner than WATCH_AFTER_S: only slower ones pay for the watching task.
    watcher = asyncio.get_running_loop().call_later(WATCH_AFTER_S, _start_watching, request, waiter)
    try:
        try:
            submitted = await gw.jobs.submit(job_id, model, body, endpoint, stream)
        except RedisError as exc:
            wait.settled = True
            raise RedisUnavailable(f"Redis is unavailable: {exc}") from None
        if submitted.status == "full":
            wait.settled = True
            raise QueueFull(
                f"The queue of '{model_id}' is full ({submitted.queued} waiting); retry later"
            )
        wait.waiting(submitted)
        first = await wait.next_event()
        _stop_watching(watcher, waiter)
        if isinstance(first, Chunks):  # only a Start can come before Chunks
            raise WorkerLost("The worker's stream began without its start")
        if first.meta is not None:
            clock.provider = first.meta.provider
            clock.queued(first.meta.queue_ms)
        if isinstance(first, Done):
            clock.done(first.status)
            return _json_answer(first, model_id)
        if isinstance(first, Failed):
            raise _error(first)
        handed_off = True
        return Stream(
            _sse(wait, first, model_id, clock),
            media_type="text/event-stream",
            status_code=first.status if isinstance(first, Start) else 200,
            headers={**SSE_HEADERS, **(_meta_headers(first.meta) if first.meta else {})},
        )
    except ClientGone:
        raise JobCancelled("The client closed the connection") from None
    finally:
        _stop_watching(watcher, waiter)
        if not handed_off:
            if stream:
                gw.streams -= 1
            gw.replies.unregister(job_id)
            if not wait.settled:
                gw.spawn(wait.cancel())


def _stop_watching(timer: asyncio.TimerHandle, waiter: Waiter) -> None:
    timer.cancel()
    if waiter.watcher is not None:
        waiter.watcher.cancel()
        waiter.watcher = None


def _start_watching(request: Request[Any, Any, Any], waiter: Waiter) -> None:
    waiter.watcher = asyncio.ensure_future(_watch_disconnect(request, waiter))


async def _watch_disconnect(request: Request[Any, Any, Any], waiter: Waiter) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    waiter.client_gone()


async def _sse(wait: JobWait, first: Start | End, model_id: str, clock: RequestClock) -> AsyncIterator[bytes]:
    status = JobCancelled.status  # unless the stream reaches its end
    seen = 0  # the last chunk batch relayed (a retried write may come twice)
    try:
        event: events.Event = first
        while True:
            if isinstance(event, Chunks) and event.seq and event.seq <= seen:
                pass
            elif isinstance(event, Start | Chunks):
                if isinstance(event, Chunks):
                    seen = event.seq or seen
                if event.chunks:
                    yield _frames(event.chunks, model_id)
                    if event is first:
                        clock.first_byte()
            elif isinstance(event, End):
                status = 200
                yield DONE_FRAME
                return
            elif isinstance(event, Failed):
                status = event.status
                yield _error_frame(event)
                return
            else:  # Done cannot follow a stream's start; treat it as the end.
                status = 200
                yield DONE_FRAME
                return
            try:
                event = await wait.next_event()
            except RequestError as exc:
                status = exc.status
                yield b"data: " + msgspec.json.encode(exc.body()) + b"\n\n"
                return
    finally:
        clock.done(status)
        wait.gw.streams -= 1
        wait.gw.replies.unregister(wait.job_id)
        if not wait.settled:
            wait.gw.spawn(wait.cancel())


def _frames(chunks: list[bytes], model_id: str) -> bytes:
    out = bytearray()
    for chunk in chunks:
        out += b"data: "
        out += _rename(chunk, model_id)
        out += b"\n\n"
    return bytes(out)


def _rename(payload: bytes, model_id: str) -> bytes:
    try:
        return with_model(payload, model_id)
    except msgspec.DecodeError:
        return payload


def _error_frame(event: Failed) -> bytes:
    if event.body is not None:
        return b"data: " + event.body + b"\n\n"
    return b"data: " + msgspec.json.encode(_error(event).body()) + b"\n\n"


def _json_answer(event: Done, model_id: str) -> Response[bytes]:
    body = event.body
    if event.status < 300 and event.content_type == "application/json":
        body = _rename(body, model_id)
    return Response(body, status_code=event.status, media_type=event.content_type,
                    headers=_meta_headers(event.meta))


def _error(event: Failed) -> RequestError:
    if event.body is not None:
        exc: RequestError = ProviderRejected(event.status, event.body, event.content_type)
    else:
        exc = error_from_code(event.code, event.message)
        exc.status = event.status
    exc.headers = _meta_headers(event.meta)
    return exc


def _meta_headers(meta: Meta | None) -> dict[str, str]:
    if meta is None:
        return {}
    return {
        "x-iop-provider": meta.provider,
        "x-iop-node": meta.node,
        "x-iop-served-model": meta.target,
        "x-iop-queue-ms": str(meta.queue_ms),
    }


def _now() -> float:
    return asyncio.get_running_loop().time()
