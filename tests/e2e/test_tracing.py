"""One trace spans the API and worker processes: the caller's ``traceparent`` is continued
by the API's request span, whose queue wait and the worker's provider call are its children.

The "in-memory exporter" here is an OTLP/HTTP receiver in the test process: the API and
worker processes export to it as they would to a collector.
"""

from __future__ import annotations

import gzip
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanProto

from iop.redis_server import RedisServer
from tests.e2e.system import System, http_provider, sse_payloads


@dataclass(frozen=True)
class Received:
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    resource: dict[str, Any]
    start_ns: int
    end_ns: int


def _value(value: AnyValue) -> Any:
    return getattr(value, value.WhichOneof("value") or "string_value")


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs if isinstance(kv, KeyValue)}


class Receiver:
    """An OTLP/HTTP traces endpoint that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[Received] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                data = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    data = gzip.decompress(data)
                if self.path == "/v1/traces":
                    receiver.take(ExportTraceServiceRequest.FromString(data))
                    status, body = 200, ExportTraceServiceResponse().SerializeToString()
                else:
                    status, body = 404, b""
                self.send_response(status)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def take(self, request: ExportTraceServiceRequest) -> None:
        found = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    found.append(Received(
                        span.name, span.kind, span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(),
                        _attributes(span.attributes), resource, span.start_time_unix_nano, span.end_time_unix_nano,
                    ))
        with self.lock:
            self.spans += found

    def trace(self, trace_id: str, names: set[str], timeout: float = 20) -> dict[str, Received]:
        """The spans of one trace, once every one of ``names`` has arrived."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                spans = {s.name: s for s in self.spans if s.trace_id == trace_id}
            if names <= spans.keys() or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with Receiver() as r:
        yield r


@pytest.fixture
def system(tmp_path: Path, redis_server: RedisServer, receiver: Receiver) -> Iterator[System]:
    sys_ = System(tmp_path, redis_server)
    # Short batches: spans reach the receiver within a tenth of a second.
    sys_.env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "100"})
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED", "OTEL_SERVICE_NAME"):
        sys_.env.pop(name, None)
    sys_.write_config({
        "models": [{"id": "m", "providers": {"p": "served"}}],
        "nodes": [{"id": "n1", "providers": [http_provider("p", "vllm", sys_.port("f"), 1, ["served"])]}],
    })
    try:
        sys_.fake("f", "--models", "served", "--tokens", "4")
        sys_.worker("n1")
        sys_.api()
        sys_.wait_available("p")
        yield sys_
    finally:
        sys_.close()


SPANS = {"iop.request", "iop.queue_wait", "iop.provider_call"}


def post(system: System, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{system.api_url}/v1/chat/completions", json=body, headers=headers, timeout=30)


@pytest.mark.parametrize(("stream", "queued"), [(False, False), (True, False), (False, True)],
                         ids=["json", "stream", "queued"])
def test_one_trace_spans_the_api_and_the_worker(
    system: System, receiver: Receiver, stream: bool, queued: bool
) -> None:
    trace_id, caller_span = secrets.token_hex(16), secrets.token_hex(8)
    blocker = None
    if queued:
        # The provider's one slot is busy for a while: the traced request waits for it.
        system.fakes["f"].control(delay_ms=400)
        blocker = threading.Thread(target=post, args=(system, {"model": "m", "messages": []}))
        blocker.start()
        system.wait_until("the slot taken", lambda: system.in_flight("p") == 1)
    resp = post(system, {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]},
                {"traceparent": f"00-{trace_id}-{caller_span}-01", "tracestate": "caller=1"})
    assert resp.status_code == 200, resp.text
    if blocker is not None:
        blocker.join()
    if stream:
        assert sse_payloads(resp.text)[-1] == "[DONE]"
    # The envelope's traceparent is iop's: the provider gets the body as sent, no header added.
    got = system.fakes["f"].requests()[-1]
    assert "headers" not in got
    assert (got["body"]["model"], got["body"]["messages"]) == ("served", [{"role": "user", "content": "hi"}])
    assert "00-" + trace_id not in str(got)

    spans = receiver.trace(trace_id, SPANS)
    assert spans.keys() >= SPANS, f"{sorted(spans)}\n{system.logs()}"
    request, wait, call = spans["iop.request"], spans["iop.queue_wait"], spans["iop.provider_call"]

    # The API process's request span continues the caller's.
    assert request.resource["iop.role"] == "api"
    assert request.resource["service.name"] == "iop"
    assert request.kind == SpanProto.SPAN_KIND_SERVER
    assert request.parent_id == caller_span
    attributes = request.attributes
    assert (attributes["iop.model"], attributes["iop.provider"], attributes["iop.node"]) == ("m", "p", "n1")
    assert attributes["http.route"] == "/v1/chat/completions"
    assert attributes["http.response.status_code"] == 200
    assert attributes["iop.queue_ms"] == int(resp.headers["x-iop-queue-ms"])
    assert attributes["iop.job"]
    assert attributes["gen_ai.usage.output_tokens"] == 4  # the fake's answer has 4 tokens
    if queued:
        assert attributes["iop.queue_ms"] >= 100

    # Its queue wait, from the queue_ms Redis measured.
    assert wait.resource["iop.role"] == "api"
    assert wait.parent_id == request.span_id
    assert wait.end_ns - wait.start_ns == attributes["iop.queue_ms"] * 1_000_000

    # The worker process's provider call, a child of the request span (through the job).
    assert call.resource["iop.role"] == "worker"
    assert call.resource["iop.node"] == "n1"
    assert call.kind == SpanProto.SPAN_KIND_CLIENT
    assert call.parent_id == request.span_id
    assert call.attributes["iop.job"] == attributes["iop.job"]
    assert (call.attributes["iop.model"], call.attributes["iop.provider"], call.attributes["iop.node"],
            call.attributes["iop.target"]) == ("m", "p", "n1", "served")
    assert call.attributes["iop.queue_ms"] == attributes["iop.queue_ms"]
    assert call.attributes["iop.outcome"] == "ok"
    assert call.attributes["iop.stream"] is stream
    assert call.attributes["gen_ai.usage.output_tokens"] == 4
    # Inside the request, as one clock sees it (the processes share this machine's).
    assert request.start_ns <= call.start_ns <= call.end_ns <= request.end_ns
