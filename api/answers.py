"""What the caller gets back: a job's events shaped as an OpenAI JSON answer, an SSE
stream, or an error, with ``x-iop-*`` headers saying where the job ran.

Answers come back with ``model`` set to the id the caller asked for (the provider
answered with its served name).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import msgspec
from litestar import Response
from litestar.response import Stream

from api.metrics import RequestClock
from api.waiting import JobWait
from dispatcher import events
from dispatcher.events import Chunks, Done, End, Failed, Meta, Start
from dispatcher.exceptions import JobCancelled, ProviderRejected, RequestError, WorkerLost, error_from_code
from dispatcher.jsonbody import with_model

DONE_FRAME = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def json_answer(event: Done, model_id: str) -> Response[bytes]:
    body = event.body
    if event.status < 300 and event.content_type == "application/json":
        body = _rename(body, model_id)
    return Response(body, status_code=event.status, media_type=event.content_type,
                    headers=meta_headers(event.meta))


def sse_answer(
    wait: JobWait, first: Start | End, model_id: str, clock: RequestClock, release: Callable[[], None]
) -> Stream:
    """The stream that relays the job's events from ``first`` on; when it ends, however it
    ends, the request is counted, ``release`` called and the wait closed."""
    return Stream(
        _sse(wait, first, model_id, clock, release),
        media_type="text/event-stream",
        status_code=first.status if isinstance(first, Start) else 200,
        headers={**SSE_HEADERS, **(meta_headers(first.meta) if first.meta else {})},
    )


async def _sse(
    wait: JobWait, first: Start | End, model_id: str, clock: RequestClock, release: Callable[[], None]
) -> AsyncIterator[bytes]:
    status = JobCancelled.status  # unless the stream reaches its end
    seen = 0  # the last chunk batch relayed (a retried write may come twice)
    wait.output_started = True
    try:
        event: events.Event = first
        while True:
            broken = _broken(event, first, seen)
            if broken is not None:
                # Never splice: what the caller has is ended by one error event, and the
                # job is cancelled (the wait is not settled).
                status = broken.status
                yield b"data: " + msgspec.json.encode(broken.body()) + b"\n\n"
                return
            if isinstance(event, Chunks) and event.seq and event.seq <= seen:
                pass
            elif isinstance(event, Start | Chunks):
                if isinstance(event, Chunks):
                    seen = event.seq or seen
                if event.chunks:
                    yield sse_frames(event.chunks, model_id)
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
        release()
        wait.close()


def _broken(event: events.Event, first: Start | End, seen: int) -> WorkerLost | None:
    """Why ``event`` cannot follow what was relayed: a second run's start, or a chunk batch
    after a gap (both only after a Redis failover lost writes)."""
    if isinstance(event, Start) and event is not first:
        return WorkerLost("The worker's stream was lost in a Redis failover and started again")
    if isinstance(event, Chunks) and event.seq > seen + 1:
        return WorkerLost("Part of the stream was lost in a Redis failover")
    return None


def sse_frames(chunks: list[bytes], model_id: str) -> bytes:
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
    return b"data: " + msgspec.json.encode(failure(event).body()) + b"\n\n"


def failure(event: Failed) -> RequestError:
    """The error a ``Failed`` event stands for, to raise (api/errors.py answers it)."""
    if event.body is not None:
        exc: RequestError = ProviderRejected(event.status, event.body, event.content_type)
    else:
        exc = error_from_code(event.code, event.message)
        exc.status = event.status
    exc.headers = meta_headers(event.meta)
    return exc


def meta_headers(meta: Meta | None) -> dict[str, str]:
    if meta is None:
        return {}
    return {
        "x-iop-provider": meta.provider,
        "x-iop-node": meta.node,
        "x-iop-served-model": meta.target,
        "x-iop-queue-ms": str(meta.queue_ms),
    }
