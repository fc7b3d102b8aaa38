"""What the caller gets back: a job's events shaped as a JSON (or text, or audio) answer,
a stream, or an error, with ``x-iop-*`` headers saying where the job ran and the
provider's own headers that pass on (``workers/adapters/base.py``).

Answers come back with ``model`` set to the id the caller asked for (the provider
answered with its served name) -- in a Responses event's ``response`` and a Messages
``message_start``'s ``message`` too. A stream is framed as its endpoint's kind
(``dispatcher/endpoints.py``); ``data: [DONE]`` ends it only when the provider sent one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from litestar import Response
from litestar.response import Stream

from api.continuation import CONTINUABLE_CODES, MAX_KEPT_BYTES, Continuer, Splice
from api.errors import stream_error
from api.exchange import Exchange
from dispatcher import events
from dispatcher.endpoints import Endpoint
from dispatcher.events import Chunks, Done, End, Failed, Meta, Start, Usage
from dispatcher.exceptions import (
    JobCancelled,
    ProviderRejected,
    RequestError,
    WorkerLost,
    error_from_code,
)
from dispatcher.jsonbody import renamed, with_model

DONE_FRAME = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def json_answer(event: Done, model_id: str) -> Response[bytes]:
    body = event.body
    if event.status < 300 and event.content_type.startswith("application/json"):
        body = renamed(body, model_id)
    return Response(body, status_code=event.status, media_type=event.content_type,
                    headers={**event.headers, **meta_headers(event.meta)})


def sse_answer(exchange: Exchange, first: Start | End, model_id: str, spec: Endpoint,
               continuer: Continuer | None = None) -> Stream:
    """The stream that relays the job's events from ``first`` on. It takes the exchange
    over, and ends it when it ends, however it ends."""
    exchange.stream_takes_over()
    media_type = first.content_type if isinstance(first, Start) else "text/event-stream"
    headers = {**first.headers} if isinstance(first, Start) else {}
    if spec.stream != "bytes":
        headers.update(SSE_HEADERS)
    return Stream(
        _stream(exchange, first, Framing(spec, model_id), continuer),
        media_type=media_type,
        status_code=first.status if isinstance(first, Start) else 200,
        headers={**headers, **(meta_headers(first.meta) if first.meta else {})},
    )


class StreamBroken(Exception):
    """A binary stream cannot carry an error: the connection is cut instead."""


class Framing:
    """How one endpoint's stream is written: its chunks, its end, and an error in it."""

    def __init__(self, spec: Endpoint, model_id: str) -> None:
        self.spec = spec
        self.model_id = model_id

    def chunks(self, chunks: list[bytes]) -> bytes:
        kind = self.spec.stream
        if kind == "sse":
            return sse_frames(chunks, self.model_id)
        if kind == "bytes":
            return b"".join(chunks)
        out = bytearray()
        for chunk in chunks:
            name, _, data = chunk.partition(b"\n")
            if name:
                out += b"event: " + name + b"\n"
            out += b"data: " + renamed(data, self.model_id) + b"\n\n"
        return bytes(out)

    def end(self, event: End) -> bytes:
        return DONE_FRAME if event.done and self.spec.stream != "bytes" else b""

    def error(self, exc: RequestError, provider_body: bytes | None = None) -> bytes:
        if self.spec.stream == "bytes":
            raise StreamBroken(exc.message)
        return stream_error(exc, self.spec, provider_body)


async def _stream(exchange: Exchange, first: Start | End, framing: Framing,
                  continuer: Continuer | None = None) -> AsyncIterator[bytes]:
    wait, clock = exchange.wait, exchange.clock
    assert wait is not None  # a stream follows a job's first event
    status = JobCancelled.status  # unless the stream reaches its end
    usage: Usage | None = None  # the provider's token counts, given with the end
    seen = 0  # the last chunk batch relayed (a retried write may come twice)
    wait.output_began()
    # A stream that may be continued keeps what it relayed: references, read only at a cut
    # (api/continuation.py), so a stream never cut pays a list append per batch.
    kept: list[bytes] | None = [] if continuer is not None and continuer.possible() else None
    kept_bytes = 0
    splice: Splice | None = None
    providers = [first.meta.provider] if first.meta is not None else []
    try:
        event: events.Event = first
        while True:
            broken = _broken(event, first, seen)
            if broken is not None:
                # Never splice: what the caller has is ended by one error event, and the
                # job is cancelled (the wait is not settled).
                status = broken.status
                yield framing.error(broken)
                return
            cut: RequestError | None = None
            if isinstance(event, Chunks) and event.seq and event.seq <= seen:
                pass
            elif isinstance(event, Start | Chunks):
                if isinstance(event, Chunks):
                    seen = event.seq or seen
                chunks = event.chunks
                if chunks:
                    if kept is not None:
                        kept_bytes += sum(map(len, chunks))
                        if kept_bytes > MAX_KEPT_BYTES:
                            kept = None
                        else:
                            kept.extend(chunks)
                    if splice is not None:
                        chunks = splice.chunks(chunks)
                    if chunks:
                        yield framing.chunks(chunks)
                    if event is first and splice is None:
                        clock.first_byte()
            elif isinstance(event, End):
                status = 200
                usage = event.usage if splice is None or event.usage is None else splice.end_usage(event.usage)
                end = framing.end(event)
                if end:
                    yield end
                return
            elif isinstance(event, Failed):
                cut = failure(event)
                if kept is None or event.code not in CONTINUABLE_CODES:
                    if continuer is not None and event.code in CONTINUABLE_CODES:
                        clock.continuation(event.code, f"refused: {continuer.why_off(kept_bytes)}")
                    status = event.status
                    yield framing.error(cut, event.body)
                    return
            else:  # Done cannot follow a stream's start; treat it as the end.
                status = 200
                return
            if cut is None:
                try:
                    event = await wait.next_event()
                    continue
                except RequestError as exc:
                    if kept is None or exc.code not in CONTINUABLE_CODES:
                        if continuer is not None and exc.code in CONTINUABLE_CODES:
                            clock.continuation(exc.code, f"refused: {continuer.why_off(kept_bytes)}")
                        status = exc.status
                        yield framing.error(exc)
                        return
                    cut = exc
            # The stream was cut after output began: go on on another provider, or end it.
            assert continuer is not None
            assert kept is not None
            resumed = await continuer.resume(kept, cut.code or "", providers)
            if isinstance(resumed, str):
                exchange.clock.continuation(cut.code or "", f"refused: {resumed}")
                status = cut.status
                yield framing.error(cut)
                return
            wait = exchange.continues_with(resumed.wait)
            splice = resumed.splice
            try:
                event = await wait.next_event()
                if isinstance(event, Failed):
                    raise failure(event)
            except RequestError as exc:
                # The continuation never started: the caller gets the cut's own error, which
                # says what happened to its answer, and why it did not go on.
                exchange.clock.continuation(cut.code or "", f"failed: {exc.code}")
                status = cut.status
                cut.message = f"{cut.message} (continuing it on another provider failed: {exc.message})"
                yield framing.error(cut)
                return
            exchange.clock.continuation(cut.code or "", "continued", wait.job_id)
            # Its output reaches the caller from here: a requeue before this point (the provider
            # it went to failed before any output) left it waiting in its queue, as any job.
            wait.output_began()
            if isinstance(event, Start):
                first, seen = event, 0
                if event.meta is not None:
                    providers.append(event.meta.provider)
                splice.providers = list(providers)
                yield b": iop continued on " + (providers[-1].encode() if event.meta else b"?") + \
                    b" after " + (cut.code or "").encode() + b"\n\n"
    finally:
        exchange.end(status, usage)


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


def failure(event: Failed) -> RequestError:
    """The error a ``Failed`` event stands for, to raise (api/error_handlers.py answers it)."""
    if event.body is not None:
        exc: RequestError = ProviderRejected(event.status, event.body, event.content_type)
    else:
        exc = error_from_code(event.code, event.message)
        exc.status = event.status
    exc.headers = {**event.headers, **meta_headers(event.meta)}
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
