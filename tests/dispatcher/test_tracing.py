"""Tracing (dispatcher/tracing.py): off unless configured, a caller's traceparent continued,
the request's span carried to the worker's through the job's envelope."""

from __future__ import annotations

import builtins
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from dispatcher import tracing
from dispatcher.config import Config, TracingConfig, parse
from dispatcher.envelope import JSON, RequestEnvelope, unwrap, wrap
from dispatcher.events import Assignment, Done, End, Meta, Usage
from dispatcher.exceptions import ConfigError, ProviderUnreachable
from tests.dispatcher.config.one_model import with_one_model
from workers.job_run import provider_call
from workers.sink import JobAborted

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
CALLER = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
OTEL_ENV = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED",
            "OTEL_SERVICE_NAME")


@pytest.fixture(autouse=True)
def _no_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OTEL_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process, its spans kept in memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "tracer", provider.get_tracer("test"))
    monkeypatch.setattr(tracing, "_w3c", TraceContextTextMapPropagator())
    yield exporter
    provider.shutdown()


def by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {s.name: s for s in exporter.get_finished_spans()}


def job(body: bytes = b'{"model": "m"}', attempt: int = 1) -> Assignment:
    return Assignment("1-0", "job-1", 7, "p", "served", "m", "", "api-1", "chat/completions", True, attempt,
                      1_000, 1_042, body)


class FinalSink:
    def __init__(self, final: Any) -> None:
        self.final = final

    def final_event(self) -> Any:
        return self.final


# --- off unless configured ----------------------------------------------------------------


def test_off_by_default_nothing_of_opentelemetry_is_imported() -> None:
    """The request path's modules, and setup() without configuration, import nothing of it.

    redis-py (8.x) imports OpenTelemetry's metrics SDK itself when it is installed, for its
    own opt-in metrics (off unless initialised): what it loads is the baseline."""
    code = (
        "import sys\n"
        "import redis, redis.asyncio\n"
        "baseline = {m for m in sys.modules if m.startswith('opentelemetry')}\n"
        "import api.app, api.relay, api.answers, api.intake, workers.worker, iop.serve\n"
        "from dispatcher import tracing\n"
        "from dispatcher.config import Config\n"
        "assert tracing.setup(Config(), 'api') is False\n"
        "assert tracing.tracer is None\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('opentelemetry') and m not in baseline)\n"
        "assert not loaded, loaded\n"
        "assert 'opentelemetry.sdk.trace' not in sys.modules\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in OTEL_ENV}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_where_spans_go(monkeypatch: pytest.MonkeyPatch) -> None:
    assert tracing.endpoint(Config()) is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    assert tracing.endpoint(Config()) == "http://collector:4318/v1/traces"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://other:4318/custom")
    assert tracing.endpoint(Config()) == "http://other:4318/custom"  # used as it is
    configured = Config(tracing=TracingConfig(endpoint="https://otel.example/"))
    assert tracing.endpoint(configured) == "https://otel.example/v1/traces"
    assert tracing.traces_url("http://c:4318/v1/traces") == "http://c:4318/v1/traces"
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert tracing.endpoint(configured) is None


def test_setup_names_the_process_and_shutdown_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracing, "tracer", None)
    config = Config(tracing=TracingConfig(endpoint="http://127.0.0.1:9", service_name="gw", sample_ratio=0.5))
    try:
        assert tracing.setup(config, "worker", "n1") is True
        assert tracing.tracer is not None
        assert tracing._provider is not None
        attributes = tracing._provider.resource.attributes
        assert (attributes["service.name"], attributes["iop.role"], attributes["iop.node"]) == ("gw", "worker", "n1")
        assert "0.5" in tracing._provider.sampler.get_description()
        assert tracing.setup(config, "worker", "n1") is True  # once per process
    finally:
        tracing.shutdown()
    assert tracing.tracer is None


def test_configured_without_the_package_logs_one_error_and_runs_without(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(tracing, "tracer", None)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    real_import = builtins.__import__

    def no_sdk(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("opentelemetry.sdk"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_sdk)
    with caplog.at_level(logging.ERROR, logger="iop.tracing"):
        assert tracing.setup(Config(), "api") is False
    assert tracing.tracer is None
    [record] = caplog.records
    assert ".venv/bin/pip install -e '.[otel]'" in record.getMessage()
    assert "http://collector:4318/v1/traces" in record.getMessage()


def test_the_tracing_section_is_checked() -> None:
    loaded = parse(with_one_model({"tracing": {"endpoint": "http://c:4318", "service_name": "iop-eu",
                                               "sample_ratio": 0.25}}))
    assert loaded.config.tracing == TracingConfig("http://c:4318", "iop-eu", 0.25)
    with pytest.raises(ConfigError) as info:
        parse(with_one_model({"tracing": {"endpoint": "c:4317", "service_name": "", "sample_ratio": 2}}))
    assert {p.path for p in info.value.problems} == {
        "$.tracing.endpoint", "$.tracing.service_name", "$.tracing.sample_ratio",
    }
    with pytest.raises(ConfigError):
        parse(with_one_model({"tracing": {"exporter": "grpc"}}))


# --- the API's spans ------------------------------------------------------------------------


def test_a_callers_traceparent_is_continued(spans: InMemorySpanExporter) -> None:
    trace = tracing.RequestTrace("POST", "/v1/chat/completions", {"traceparent": CALLER, "tracestate": "k=v"})
    trace.submitted("job-1")
    trace.first(Done(Meta("p", "n1", "served", 42, 2), 200, b"{}"))
    trace.end(200, "m", "default", Usage(11, 5))
    found = by_name(spans)
    request, wait = found["iop.request"], found["iop.queue_wait"]
    assert request.kind == SpanKind.SERVER
    assert f"{request.context.trace_id:032x}" == CALLER_TRACE
    assert request.parent is not None
    assert f"{request.parent.span_id:016x}" == CALLER_SPAN
    assert request.context.trace_state.get("k") == "v"
    assert dict(request.attributes or {}) == {
        "http.request.method": "POST", "http.route": "/v1/chat/completions", "iop.job": "job-1",
        "iop.provider": "p", "iop.node": "n1", "iop.target": "served", "iop.queue_ms": 42, "iop.attempt": 2,
        "gen_ai.usage.input_tokens": 11, "gen_ai.usage.output_tokens": 5,
        "http.response.status_code": 200, "iop.model": "m", "iop.tenant": "default",
    }
    # The worker's span is to be the request span's child.
    assert trace.traceparent == f"00-{CALLER_TRACE}-{request.context.span_id:016x}-01"
    assert wait.parent is not None
    assert wait.parent.span_id == request.context.span_id
    assert wait.start_time is not None
    assert wait.end_time is not None
    assert wait.end_time - wait.start_time == 42_000_000
    assert dict(wait.attributes or {}) == {"iop.queue_ms": 42, "iop.dispatched": True}


def test_a_new_trace_without_a_caller_and_errors_marked(spans: InMemorySpanExporter) -> None:
    trace = tracing.RequestTrace("POST", "/v1/chat/completions", {})
    trace.submitted("job-2")
    trace.end(503, "m", "default")  # a queue timeout: never dispatched
    found = by_name(spans)
    request, wait = found["iop.request"], found["iop.queue_wait"]
    assert request.parent is None
    assert request.status.status_code == StatusCode.ERROR
    assert (wait.attributes or {})["iop.dispatched"] is False
    assert len(trace.traceparent) == 55

    spans.clear()
    tracing.RequestTrace("POST", "/v1/chat/completions", {}).end(404, "_unknown", "default")
    [not_found] = spans.get_finished_spans()  # never submitted: no queue wait
    assert not_found.status.status_code == StatusCode.UNSET  # the caller's error


# --- the worker's span -----------------------------------------------------------------------


def test_the_provider_call_is_a_child_of_the_request(spans: InMemorySpanExporter) -> None:
    parent = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
    sink = FinalSink(End(None, True, Usage(3, 20)))
    with tracing.provider_span(job(), "n1", parent, sink):
        pass
    [call] = spans.get_finished_spans()
    assert call.name == "iop.provider_call"
    assert call.kind == SpanKind.CLIENT
    assert f"{call.context.trace_id:032x}" == CALLER_TRACE
    assert call.parent is not None
    assert f"{call.parent.span_id:016x}" == CALLER_SPAN
    attributes = dict(call.attributes or {})
    assert attributes == {
        "iop.job": "job-1", "iop.model": "m", "iop.provider": "p", "iop.node": "n1", "iop.target": "served",
        "iop.endpoint": "chat/completions", "iop.stream": True, "iop.queue_ms": 42, "iop.attempt": 1,
        "iop.outcome": "ok", "gen_ai.usage.input_tokens": 3, "gen_ai.usage.output_tokens": 20,
    }


def test_the_provider_calls_failures(spans: InMemorySpanExporter) -> None:
    sink = FinalSink(None)
    with pytest.raises(ProviderUnreachable), tracing.provider_span(job(), "n1", "", sink):
        raise ProviderUnreachable("provider p unreachable: connection refused")
    with pytest.raises(JobAborted), tracing.provider_span(job(), "n1", "", sink):
        raise JobAborted("cancelled")
    with pytest.raises(KeyError), tracing.provider_span(job(), "n1", "", sink):
        raise KeyError("x")
    unreachable, aborted, broken = spans.get_finished_spans()
    assert unreachable.parent is None  # no traceparent: a trace of its own
    assert unreachable.status.status_code == StatusCode.ERROR
    assert (unreachable.attributes or {})["iop.outcome"] == "provider_error"
    assert (unreachable.attributes or {})["http.response.status_code"] == 502
    assert aborted.status.status_code == StatusCode.UNSET
    assert ((aborted.attributes or {})["iop.outcome"], (aborted.attributes or {})["iop.abort_reason"]) == (
        "aborted", "cancelled")
    assert (broken.attributes or {})["error.type"] == "KeyError"


def test_off_the_worker_pays_for_no_span() -> None:
    assert tracing.tracer is None
    assert tracing.provider_span(job(), "n1", CALLER, FinalSink(None)) is tracing._NO_SPAN


# --- the envelope -----------------------------------------------------------------------------


class FiveFields(msgspec.Struct, frozen=True, array_like=True):
    """The envelope before ``traceparent``: what older workers decode."""

    body: bytes = b""
    method: str = "POST"
    path: str = ""
    content_type: str = JSON
    headers: dict[str, str] = {}


@pytest.mark.parametrize("envelope", [
    RequestEnvelope(b'{"model": "m"}'),
    RequestEnvelope(b'{"model": "m"}', headers={"anthropic-version": "2023-06-01"}),
    RequestEnvelope(b"", "GET", "responses/resp_1", JSON, {}),
    RequestEnvelope(b"--b\r\n", content_type="multipart/form-data; boundary=b"),
])
def test_untraced_envelopes_are_stored_as_before(envelope: RequestEnvelope) -> None:
    stored = wrap(envelope)
    if envelope.plain:
        assert stored == envelope.body
    else:
        before = FiveFields(envelope.body, envelope.method, envelope.path, envelope.content_type, envelope.headers)
        assert stored == b"\x00" + msgspec.msgpack.encode(before)
    assert unwrap(stored) == envelope


def test_the_traceparent_travels_in_the_envelope_and_never_to_the_provider() -> None:
    envelope = RequestEnvelope(b'{"model": "m"}', traceparent=CALLER)
    assert not envelope.plain
    stored = wrap(envelope)
    assert unwrap(stored) == envelope
    assert unwrap(stored).traceparent == CALLER
    # A worker that predates the field reads the rest.
    assert msgspec.msgpack.decode(stored[1:], type=FiveFields) == FiveFields(b'{"model": "m"}')
    call = provider_call(job(stored), unwrap(stored))
    assert call.headers == {}
    assert CALLER.encode() not in call.body
