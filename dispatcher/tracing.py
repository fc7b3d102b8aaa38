"""Traces (OpenTelemetry), off unless configured.

On when ``tracing.endpoint`` is set in the config, or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
/ ``OTEL_EXPORTER_OTLP_ENDPOINT`` in the environment (``OTEL_SDK_DISABLED=true`` turns it
off again). Each process calls :func:`setup` once; spans leave in batches over OTLP/HTTP.

One request is one trace, across processes:

* ``iop.request`` (API, server) -- the relayed request, continuing the caller's W3C
  ``traceparent``; its own ``traceparent`` travels to the worker in the job's
  :class:`~dispatcher.envelope.RequestEnvelope`.
* ``iop.queue_wait`` (API) -- submit to dispatch; drawn from the ``queue_ms`` Redis measured.
* ``iop.provider_call`` (worker, client) -- the provider call, a child of ``iop.request``.

Off, nothing of OpenTelemetry is imported, :data:`tracer` stays None, and the request
path checks only that.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

from dispatcher.exceptions import RequestError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    from dispatcher.config import Config
    from dispatcher.events import Assignment, Event, Meta, Usage

log = logging.getLogger("iop.tracing")

# None while tracing is off: all the request path ever looks at.
tracer: Tracer | None = None
_provider: TracerProvider | None = None
_w3c: TraceContextTextMapPropagator | None = None

TRACES_PATH = "v1/traces"
_NO_SPAN: contextlib.nullcontext[None] = contextlib.nullcontext()


def traces_url(base: str) -> str:
    """``base`` as ``OTEL_EXPORTER_OTLP_ENDPOINT`` means it: the traces path is added
    (unless it is there already)."""
    if base.rstrip("/").endswith(TRACES_PATH):
        return base
    return base + TRACES_PATH if base.endswith("/") else f"{base}/{TRACES_PATH}"


def endpoint(config: Config) -> str | None:
    """Where spans go, or None: tracing is off."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if config.tracing.endpoint:
        return traces_url(config.tracing.endpoint)
    traces = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if traces:
        return traces  # the signal-specific variable is used as it is, as the SDK does
    base = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    return traces_url(base) if base else None


def setup(config: Config, role: str, node: str | None = None) -> bool:
    """Turn tracing on in this process if configured; True when it is on. Idempotent."""
    global tracer, _provider, _w3c
    if tracer is not None:
        return True
    url = endpoint(config)
    if url is None:
        return False
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError as exc:
        log.error("tracing is configured (spans to %s) but OpenTelemetry is not installed (%s): "
                  # Not `pip install 'iop[otel]'`: on PyPI `iop` is another project.
                  "install the otel extra (from a clone: .venv/bin/pip install -e '.[otel]'). "
                  "Running without tracing.", url, exc)
        return False
    attributes: dict[str, str | int] = {
        # OTEL_SERVICE_NAME is the operator's usual way to name a service: it wins.
        "service.name": os.environ.get("OTEL_SERVICE_NAME") or config.tracing.service_name,
        "iop.role": role,
        "host.name": socket.gethostname(),
        "process.pid": os.getpid(),
    }
    if node is not None:
        attributes["iop.node"] = node
    # Parent-based: a caller's sampling decision is kept; the ratio applies to new traces.
    sampler = ParentBased(TraceIdRatioBased(config.tracing.sample_ratio))
    provider = TracerProvider(resource=Resource.create(attributes), sampler=sampler)
    # Batched, off the request path (OTEL_BSP_* tune it); an exporter error is logged, never raised.
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    _provider, _w3c = provider, TraceContextTextMapPropagator()
    tracer = provider.get_tracer("iop")
    log.info("tracing on: %s spans to %s", role, url)
    return True


def shutdown() -> None:
    """Export what is left and turn tracing off (at the process's end)."""
    global tracer, _provider
    provider, _provider, tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


def _tokens(usage: Usage | None) -> dict[str, int]:
    """An answer's token counts (where its provider reported them), as GenAI attributes."""
    if usage is None:
        return {}
    return {"gen_ai.usage.input_tokens": usage.prompt, "gen_ai.usage.output_tokens": usage.completion}


def _meta_attributes(meta: Meta) -> dict[str, str | int]:
    return {"iop.provider": meta.provider, "iop.node": meta.node, "iop.target": meta.target,
            "iop.queue_ms": meta.queue_ms, "iop.attempt": meta.attempt}


class RequestTrace:
    """The API's span of one relayed request, and its queue wait. Made only when
    :data:`tracer` is set; ended once, with the answer's status (``RequestClock.done``)."""

    __slots__ = ("_dispatched", "_submitted_ns", "_tracer", "span", "traceparent")

    def __init__(self, method: str, route: str, headers: Mapping[str, str]) -> None:
        from opentelemetry.trace import SpanKind, set_span_in_context

        assert tracer is not None
        assert _w3c is not None
        # Kept: a request still running at shutdown (tracer None again) ends its spans anyway.
        self._tracer = tracer
        self.span: Span = tracer.start_span(
            "iop.request", context=_w3c.extract(headers), kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "http.route": route},
        )
        carrier: dict[str, str] = {}
        _w3c.inject(carrier, context=set_span_in_context(self.span))
        # For the worker's span (dispatcher/envelope.py carries it).
        self.traceparent = carrier.get("traceparent", "")
        self._submitted_ns = 0
        self._dispatched = False

    def submitted(self, job_id: str) -> None:
        self.span.set_attribute("iop.job", job_id)
        self._submitted_ns = time.time_ns()

    def first(self, event: Event) -> None:
        """The job's first event: where it ran, how long it waited."""
        meta: Meta | None = getattr(event, "meta", None)
        if meta is not None and not self._dispatched:
            self._dispatched = True
            self.span.set_attributes(_meta_attributes(meta))
            if self._submitted_ns:
                # Redis timed the wait (dispatch - submit, one clock); laid from this
                # process's submit time.
                self._queue_span(self._submitted_ns + meta.queue_ms * 1_000_000, meta.queue_ms, True)

    def continued(self, reason: str, outcome: str, job_id: str = "") -> None:
        """The stream was cut (``reason``), and what iop did: continued as job ``job_id``, or
        not (api/continuation.py)."""
        self.span.add_event("iop.continuation", {"iop.reason": reason, "iop.outcome": outcome, "iop.job": job_id})

    def end(self, status: int, model: str, tenant: str, usage: Usage | None = None) -> None:
        from opentelemetry.trace import StatusCode

        span = self.span
        span.set_attributes({"http.response.status_code": status, "iop.model": model, "iop.tenant": tenant,
                             **_tokens(usage)})
        if self._submitted_ns and not self._dispatched:
            # Never dispatched (a queue timeout, a hang-up): the wait lasted until now.
            end_ns = time.time_ns()
            self._queue_span(end_ns, (end_ns - self._submitted_ns) // 1_000_000, False)
        if status >= 500:
            # A server span's 4xx is the caller's error, not ours (OpenTelemetry's HTTP conventions).
            span.set_status(StatusCode.ERROR)
        span.end()

    def _queue_span(self, end_ns: int, queue_ms: int, dispatched: bool) -> None:
        from opentelemetry.trace import set_span_in_context

        wait = self._tracer.start_span(
            "iop.queue_wait", context=set_span_in_context(self.span), start_time=self._submitted_ns,
            attributes={"iop.queue_ms": queue_ms, "iop.dispatched": dispatched},
        )
        wait.end(end_time=end_ns)


class _Final(Protocol):
    def final_event(self) -> Event: ...


def provider_span(
    job: Assignment, node: str, traceparent: str, sink: _Final
) -> contextlib.AbstractContextManager[None]:
    """Around a worker's provider call: its span, a child of the request's (``traceparent``)."""
    if tracer is None:
        return _NO_SPAN
    return _ProviderSpan(tracer, job, node, traceparent, sink)


class _ProviderSpan:
    def __init__(self, tracer: Tracer, job: Assignment, node: str, traceparent: str, sink: _Final) -> None:
        self.tracer = tracer
        self.job = job
        self.node = node
        self.traceparent = traceparent
        self.sink = sink
        self.span: Span | None = None

    def __enter__(self) -> None:
        from opentelemetry.trace import SpanKind

        assert _w3c is not None
        job = self.job
        parent = _w3c.extract({"traceparent": self.traceparent}) if self.traceparent else None
        self.span = self.tracer.start_span("iop.provider_call", context=parent, kind=SpanKind.CLIENT, attributes={
            "iop.job": job.job, "iop.model": job.model, "iop.provider": job.provider, "iop.node": self.node,
            "iop.target": job.target, "iop.endpoint": job.endpoint, "iop.stream": job.stream,
            "iop.queue_ms": job.queue_ms, "iop.attempt": job.attempt,
        })

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        from opentelemetry.trace import StatusCode

        span = self.span
        assert span is not None
        if exc is None:
            final = self.sink.final_event()
            span.set_attribute("iop.outcome", "ok")
            # A JSON answer's status, else the stream's (the sink's).
            status = getattr(final, "status", getattr(self.sink, "status", None))
            if isinstance(status, int):
                span.set_attribute("http.response.status_code", status)
            span.set_attributes(_tokens(getattr(final, "usage", None)))
        elif isinstance(exc, RequestError):
            # The provider's failure (unreachable, 5xx, timeout, its own 4xx).
            span.set_attributes({"iop.outcome": exc.code or "error", "error.type": exc.code or type(exc).__name__,
                                 "http.response.status_code": exc.status})
            span.set_status(StatusCode.ERROR, exc.message)
        elif not isinstance(exc, Exception) or isinstance(getattr(exc, "reason", None), str):
            # Stopped from outside -- cancelled, or the sink's JobAborted (the caller left, a
            # takeover), which says why in ``reason``: not the provider's failure.
            span.set_attribute("iop.outcome", "aborted")
            reason = getattr(exc, "reason", None)
            if reason is not None:
                span.set_attribute("iop.abort_reason", reason)
        else:
            span.set_attributes({"iop.outcome": "error", "error.type": type(exc).__name__})
            span.set_status(StatusCode.ERROR, str(exc))
        span.end()
