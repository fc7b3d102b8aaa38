"""OpenAIHttpAdapter against real servers on free ports: the project's fake provider, small
aiohttp apps and raw sockets for what the fake cannot do (redirects, missing headers, cut streams)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from dispatcher.config import ProviderConfig, normalise_base_url, parse
from dispatcher.exceptions import ProviderRejected, ProviderTimeout, ProviderUnreachable
from iop.fake_provider import FakeError, FakeOptions, start
from iop.redis_server import free_port
from tests.waiting import EVENTUALLY_S, eventually
from tests.workers.adapters.recording import RecordingSink
from workers.adapters import openai_http
from workers.adapters.base import ProbeResult, ProviderCall, passed_headers
from workers.adapters.openai_http import OpenAIHttpAdapter, new_session

pytestmark = pytest.mark.anyio

HOST = "127.0.0.1"
MODEL = "served-model"


# --------------------------------------------------------------------------- helpers


@dataclass
class Fake:
    options: FakeOptions
    hooks: aiohttp.ClientSession
    url: str

    async def stats(self) -> dict[str, int]:
        async with self.hooks.get(f"{self.url}/_fake/stats") as resp:
            assert resp.status == 200
            result: dict[str, int] = await resp.json()
            return result

    async def wait_stats(self, **expected: int) -> dict[str, int]:
        """The stats once they show ``expected``."""
        return await eventually(self.stats, lambda stats: all(stats[k] == v for k, v in expected.items()),
                                what=f"the fake's stats showing {expected}", every=0.02)

    async def requests(self) -> list[dict[str, Any]]:
        async with self.hooks.get(f"{self.url}/_fake/requests") as resp:
            assert resp.status == 200
            result: list[dict[str, Any]] = await resp.json()
            return result


@pytest.fixture
async def fake() -> AsyncIterator[Fake]:
    options = FakeOptions(models=[MODEL, "other-model"])
    port = free_port()
    runner = await start(HOST, port, options)
    try:
        async with aiohttp.ClientSession() as hooks:
            yield Fake(options, hooks, f"http://{HOST}:{port}")
    finally:
        await runner.cleanup()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    s = new_session(4)
    try:
        yield s
    finally:
        await s.close()


def provider(base_url: str, *, timeout_s: float = 30.0, api_key_env: str | None = None) -> ProviderConfig:
    return ProviderConfig(
        id="p", type="vllm", base_url=base_url, models=[MODEL], timeout_s=timeout_s, api_key_env=api_key_env
    )


def body(stream: bool = False, model: str = MODEL, **extra: Any) -> bytes:
    obj: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}
    if stream:
        obj["stream"] = True
    return json.dumps(obj).encode()


def chat(stream: bool = False, model: str = MODEL, **extra: Any) -> ProviderCall:
    return ProviderCall(endpoint="chat/completions", body=body(stream, model, **extra), target=model, stream=stream)


async def app_server(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, HOST, port).start()
    return runner, f"http://{HOST}:{port}"


@dataclass
class RawServer:
    """Answers every connection with ``response`` (raw bytes) after reading the request head and body,
    then closes (or holds the connection open when ``response`` is None)."""

    response: bytes | None
    heads: list[bytes] = field(default_factory=list)
    server: asyncio.Server | None = None
    url: str = ""
    _held: list[asyncio.StreamWriter] = field(default_factory=list)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            self.heads.append(head)
            length = 0
            for line in head.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value.strip())
            if length:
                await reader.readexactly(length)
            if self.response is None:
                self._held.append(writer)
                await reader.read()  # until the client goes away
                return
            writer.write(self.response)
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def __aenter__(self) -> RawServer:
        port = free_port()
        self.server = await asyncio.start_server(self._handle, HOST, port)
        self.url = f"http://{HOST}:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        for writer in self._held:
            writer.close()
        self.server.close()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.server.wait_closed(), 5)


def raw_response(status_line: bytes, headers: dict[str, str], payload: bytes, *, length: bool = True) -> bytes:
    lines = [b"HTTP/1.1 " + status_line]
    lines += [f"{k}: {v}".encode() for k, v in headers.items()]
    if length:
        lines.append(b"Content-Length: %d" % len(payload))
    lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n" + payload


def header_names(head: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in head.split(b"\r\n")[1:]:
        if line:
            name, _, value = line.decode().partition(":")
            out[name.strip().lower()] = value.strip()
    return out


# --------------------------------------------------------------------------- JSON calls


async def test_json_call_returns_the_providers_body(fake: Fake, session: aiohttp.ClientSession) -> None:
    adapter = OpenAIHttpAdapter(provider(fake.url), session)
    sink = RecordingSink()
    await adapter.call(chat(), sink)
    assert sink.events == ["done"]
    assert sink.answer is not None
    status, raw, content_type = sink.answer
    assert (status, content_type) == (200, "application/json")
    answer = sink.json()
    assert answer["object"] == "chat.completion"
    assert answer["model"] == MODEL
    assert answer["choices"][0]["message"]["content"].startswith("tok0")
    # The very body the provider sent, untouched.
    assert json.loads(raw) == answer
    (recorded,) = await fake.requests()
    assert recorded["path"] == "/v1/chat/completions"
    assert recorded["body"] == json.loads(body())
    assert recorded["authorization"] is None


async def test_model_echo_is_the_target_in_the_body(fake: Fake, session: aiohttp.ClientSession) -> None:
    adapter = OpenAIHttpAdapter(provider(fake.url), session)
    sink = RecordingSink()
    await adapter.call(chat(model="other-model"), sink)
    assert sink.json()["model"] == "other-model"
    (recorded,) = await fake.requests()
    assert recorded["model"] == "other-model"


async def test_body_goes_out_byte_for_byte(session: aiohttp.ClientSession) -> None:
    seen: list[bytes] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(await request.read())
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner, url = await app_server(app)
    try:
        raw = b'{"model":"m",  "messages":[],"extra":{"x":1.50}}'
        await OpenAIHttpAdapter(provider(url), session).call(
            ProviderCall(endpoint="chat/completions", body=raw, target="m", stream=False), RecordingSink()
        )
        assert seen == [raw]
    finally:
        await runner.cleanup()


async def test_completions_and_embeddings_endpoints(fake: Fake, session: aiohttp.ClientSession) -> None:
    adapter = OpenAIHttpAdapter(provider(fake.url), session)
    sink = RecordingSink()
    prompt = json.dumps({"model": MODEL, "prompt": "hi"}).encode()
    await adapter.call(ProviderCall(endpoint="completions", body=prompt, target=MODEL, stream=False), sink)
    assert sink.json()["object"] == "text_completion"
    sink = RecordingSink()
    embed = json.dumps({"model": MODEL, "input": ["a", "b"]}).encode()
    await adapter.call(ProviderCall(endpoint="embeddings", body=embed, target=MODEL, stream=False), sink)
    answer = sink.json()
    assert answer["object"] == "list"
    assert [d["index"] for d in answer["data"]] == [0, 1]
    assert [r["path"] for r in await fake.requests()] == ["/v1/completions", "/v1/embeddings"]


async def test_request_headers(session: aiohttp.ClientSession) -> None:
    ok = raw_response(b"200 OK", {"Content-Type": "application/json"}, b"{}")
    async with RawServer(ok) as server:
        await OpenAIHttpAdapter(provider(server.url), session).call(chat(), RecordingSink())
        (head,) = server.heads
    assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    headers = header_names(head)
    assert headers["content-type"] == "application/json"
    assert "authorization" not in headers
    assert "user-agent" not in headers
    assert "cookie" not in headers


# --------------------------------------------------------------------------- base_url


def test_normalise_base_url() -> None:
    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/", "http://h:8000/v1//"):
        assert normalise_base_url(url) == "http://h:8000", url
    assert normalise_base_url("http://h:8000/prefix/v1") == "http://h:8000/prefix"
    assert normalise_base_url("http://h:8000/v10") == "http://h:8000/v10"


async def test_base_url_with_v1_is_normalised_by_the_config_loader(fake: Fake, session: aiohttp.ClientSession) -> None:
    config = parse(
        {
            "models": [{"id": "m", "providers": {"p": MODEL}}],
            "nodes": [
                {
                    "id": "n",
                    "providers": [{"id": "p", "type": "vllm", "base_url": f"{fake.url}/v1/", "models": [MODEL]}],
                }
            ],
        }
    ).config
    (_, prov), *_ = list(config.providers())
    assert prov.base_url == fake.url
    sink = RecordingSink()
    await OpenAIHttpAdapter(prov, session).call(chat(), sink)
    assert sink.json()["model"] == MODEL
    (recorded,) = await fake.requests()
    assert recorded["path"] == "/v1/chat/completions"  # not /v1/v1/...


# --------------------------------------------------------------------------- streams


async def test_stream_relays_chunks_in_order_without_done(fake: Fake, session: aiohttp.ClientSession) -> None:
    fake.options.tokens = 5
    adapter = OpenAIHttpAdapter(provider(fake.url), session)
    sink = RecordingSink()
    await adapter.call(chat(stream=True), sink)
    assert sink.events[0] == "start"
    assert sink.started == [200]
    assert set(sink.events[1:-1]) == {"chunks"}
    assert sink.events[-1] == "ended"
    assert b"[DONE]" not in sink.payloads
    objects = sink.objects
    assert all(o["object"] == "chat.completion.chunk" and o["model"] == MODEL for o in objects)
    # role chunk, 5 content chunks, finish chunk
    assert len(objects) == 7
    assert objects[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(o["choices"][0]["delta"].get("content", "") for o in objects)
    assert content == "tok0 tok1 tok2 tok3 tok4"
    assert objects[-1]["choices"][0]["finish_reason"] == "stop"


async def test_stream_with_usage_chunk(fake: Fake, session: aiohttp.ClientSession) -> None:
    fake.options.tokens = 2
    sink = RecordingSink()
    call = chat(stream=True, stream_options={"include_usage": True})
    await OpenAIHttpAdapter(provider(fake.url), session).call(call, sink)
    assert sink.objects[-1]["usage"]["completion_tokens"] == 2


async def test_stream_delivers_chunks_while_the_provider_is_generating(
    fake: Fake, session: aiohttp.ClientSession
) -> None:
    fake.options.tokens = 5
    fake.options.token_interval_ms = 100
    seen: list[dict[str, int]] = []

    async def look() -> None:
        seen.append(await fake.stats())

    sink = RecordingSink(on_first_chunk=look)
    await OpenAIHttpAdapter(provider(fake.url), session).call(chat(stream=True), sink)
    (stats,) = seen
    assert stats["in_flight"] == 1
    assert stats["completed"] == 0
    assert len(sink.payloads) == 7
    assert sink.events.count("chunks") > 1
    assert (await fake.wait_stats(completed=1))["completed"] == 1


async def test_completions_stream(fake: Fake, session: aiohttp.ClientSession) -> None:
    fake.options.tokens = 3
    prompt = json.dumps({"model": MODEL, "prompt": "hi", "stream": True}).encode()
    sink = RecordingSink()
    await OpenAIHttpAdapter(provider(fake.url), session).call(
        ProviderCall(endpoint="completions", body=prompt, target=MODEL, stream=True), sink
    )
    assert "".join(o["choices"][0]["text"] for o in sink.objects) == "tok0 tok1 tok2"


async def test_stream_without_done_and_without_final_blank_line(session: aiohttp.ClientSession) -> None:
    # The stream ends with the connection (no Content-Length): close() flushes the last event.
    sse = b'data: {"n":1}\n\n: comment\ndata: {"n":2}\r\n\r\ndata: {"n":3}'
    response = raw_response(b"200 OK", {"Content-Type": "text/event-stream; charset=utf-8"}, sse, length=False)
    async with RawServer(response) as server:
        sink = RecordingSink()
        # Every event reaches the caller, and then an error: a stream without [DONE] was cut,
        # and no [DONE] is invented for it.
        with pytest.raises(ProviderUnreachable, match="the stream ended early"):
            await OpenAIHttpAdapter(provider(server.url), session).call(chat(stream=True), sink)
    assert sink.started == [200]
    assert sink.objects == [{"n": 1}, {"n": 2}, {"n": 3}]
    assert "ended" not in sink.events


async def test_empty_stream_is_an_error_not_an_answer(session: aiohttp.ClientSession) -> None:
    response = raw_response(b"200 OK", {"Content-Type": "text/event-stream"}, b"", length=False)
    async with RawServer(response) as server:
        with pytest.raises(ProviderUnreachable, match="the stream ended empty"):
            await OpenAIHttpAdapter(provider(server.url), session).call(chat(stream=True), RecordingSink())


async def test_stream_stops_at_done(session: aiohttp.ClientSession) -> None:
    sse = b'data: {"n":1}\n\ndata: [DONE]\n\ndata: {"n":2}\n\ndata: not json\n\n'
    response = raw_response(b"200 OK", {"Content-Type": "text/event-stream"}, sse)
    async with RawServer(response) as server:
        sink = RecordingSink()
        await OpenAIHttpAdapter(provider(server.url), session).call(chat(stream=True), sink)
    assert sink.objects == [{"n": 1}]


async def test_stream_cut_mid_chunk_is_unreachable(session: aiohttp.ClientSession) -> None:
    # Chunked transfer, the connection closes before the terminating chunk.
    event = b'data: {"n":1}\n\n'
    response = raw_response(
        b"200 OK",
        {"Content-Type": "text/event-stream", "Transfer-Encoding": "chunked"},
        b"%x\r\n%s\r\n" % (len(event), event) + b"100\r\ndata: {",
        length=False,
    )
    async with RawServer(response) as server:
        sink = RecordingSink()
        with pytest.raises(ProviderUnreachable):
            await OpenAIHttpAdapter(provider(server.url), session).call(chat(stream=True), sink)
    assert sink.started == [200]
    assert sink.objects == [{"n": 1}]


async def test_stream_request_answered_with_json_is_unreachable(fake: Fake, session: aiohttp.ClientSession) -> None:
    # The body does not ask the fake for a stream, so it answers application/json.
    call = ProviderCall(endpoint="chat/completions", body=body(stream=False), target=MODEL, stream=True)
    sink = RecordingSink()
    with pytest.raises(ProviderUnreachable, match="event stream"):
        await OpenAIHttpAdapter(provider(fake.url), session).call(call, sink)
    assert sink.events == []


async def test_stream_request_answered_without_content_type_is_unreachable(
    session: aiohttp.ClientSession,
) -> None:
    response = raw_response(b"200 OK", {}, b'data: {"n":1}\n\n')
    async with RawServer(response) as server:
        sink = RecordingSink()
        with pytest.raises(ProviderUnreachable, match="event stream"):
            await OpenAIHttpAdapter(provider(server.url), session).call(chat(stream=True), sink)
    assert sink.events == []


# --------------------------------------------------------------------------- provider errors


@pytest.mark.parametrize("status", [400, 404, 422, 429])
async def test_provider_4xx_is_rejected_with_its_status_and_body(
    fake: Fake, session: aiohttp.ClientSession, status: int
) -> None:
    fake.options.fail_status = status
    sink = RecordingSink()
    with pytest.raises(ProviderRejected) as info:
        await OpenAIHttpAdapter(provider(fake.url), session).call(chat(), sink)
    err = info.value
    assert err.status == status
    assert err.content_type == "application/json"
    assert json.loads(err.raw_body) == {
        "error": {
            "message": f"fake provider failure (status {status})",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }
    assert err.retry_elsewhere == (status == 429)
    assert sink.events == []


async def test_provider_4xx_on_a_stream_request(fake: Fake, session: aiohttp.ClientSession) -> None:
    # The fake's own validation: no model -> 400, before any stream starts.
    call = ProviderCall(endpoint="chat/completions", body=b'{"stream":true}', target=MODEL, stream=True)
    sink = RecordingSink()
    with pytest.raises(ProviderRejected) as info:
        await OpenAIHttpAdapter(provider(fake.url), session).call(call, sink)
    assert info.value.status == 400
    assert json.loads(info.value.raw_body)["error"]["param"] == "model"
    assert sink.events == []


async def test_provider_error_of_another_shape_is_wrapped(session: aiohttp.ClientSession) -> None:
    response = raw_response(b"403 Forbidden", {"Content-Type": "text/plain; charset=utf-8"}, b"nope\n")
    async with RawServer(response) as server:
        with pytest.raises(ProviderRejected) as info:
            await OpenAIHttpAdapter(provider(server.url), session).call(chat(), RecordingSink())
    assert (info.value.status, info.value.content_type) == (403, "application/json")
    assert json.loads(info.value.raw_body) == {"error": {
        "message": "provider p answered 403: nope", "type": "invalid_request_error", "param": None,
        "code": "upstream_error"}}


async def test_provider_4xx_without_content_type_defaults_to_json(session: aiohttp.ClientSession) -> None:
    response = raw_response(b"400 Bad Request", {}, b'{"error":{"message":"bad"}}')
    async with RawServer(response) as server:
        with pytest.raises(ProviderRejected) as info:
            await OpenAIHttpAdapter(provider(server.url), session).call(chat(), RecordingSink())
    assert info.value.content_type == "application/json"
    assert info.value.raw_body == b'{"error":{"message":"bad"}}'


async def test_error_body_over_the_cap_is_wrapped_not_cut(session: aiohttp.ClientSession) -> None:
    # In shape, but longer than iop reads: cut, it would no longer be JSON.
    big = b'{"error":{"message":"' + b"x" * (openai_http._ERROR_BODY_BYTES * 3) + b'"}}'

    async def handler(request: web.Request) -> web.Response:
        return web.Response(status=500, body=big, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner, url = await app_server(app)
    try:
        for stream in (False, True):
            with pytest.raises(ProviderRejected) as info:
                await OpenAIHttpAdapter(provider(url), session).call(chat(stream=stream), RecordingSink())
            assert info.value.status == 500
            error = json.loads(info.value.raw_body)["error"]
            assert error["code"] == "upstream_error"
            assert error["message"].startswith('provider p answered 500: {"error":{"message":"xxx')
            assert error["message"].endswith("x…")
            assert len(error["message"]) < 1100
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("status", [500, 501, 502, 503, 504, 529])
async def test_provider_5xx_is_the_providers_answer(fake: Fake, session: aiohttp.ClientSession, status: int) -> None:
    fake.options.fail_status = status
    for stream in (False, True):
        sink = RecordingSink()
        with pytest.raises(ProviderRejected) as info:
            await OpenAIHttpAdapter(provider(fake.url), session).call(chat(stream=stream), sink)
        err = info.value
        assert err.status == status
        # In OpenAI's shape already: the fake's body, whole.
        assert json.loads(err.raw_body) == {"error": {
            "message": f"fake provider failure (status {status})", "type": "server_error", "param": None,
            "code": None}}
        assert err.headers["x-request-id"]
        assert "keep-alive" not in err.headers
        # 502 counts as unreachable; 501 and 504 another provider would answer alike.
        assert err.retry_elsewhere == (status in (500, 502, 503, 529))
        assert sink.events == []


async def test_a_long_error_body_is_kept_whole(fake: Fake, session: aiohttp.ClientSession) -> None:
    raw = json.dumps({"error": {"message": "no: " + "reason " * 1000, "type": "server_error"}})
    fake.options.fail_with = FakeError(status=503, body=raw, headers={"retry-after": "4"})
    with pytest.raises(ProviderRejected) as info:
        await OpenAIHttpAdapter(provider(fake.url), session).call(chat(), RecordingSink())
    assert info.value.raw_body == raw.encode()
    assert info.value.headers["retry-after"] == "4"


ANTHROPIC_OVERLOADED = b'{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"},"request_id":"r1"}'


@pytest.mark.parametrize(("answer", "expected"), [
    # Anthropic's own: passed as it is.
    (FakeError(status=529, body=ANTHROPIC_OVERLOADED.decode()), ANTHROPIC_OVERLOADED),
    # OpenAI's shape is not what an Anthropic client reads.
    (FakeError(status=529, body='{"error":{"message":"busy","type":"server_error"}}'),
     b'{"type":"error","error":{"type":"overloaded_error","message":'
     b'"provider p answered 529: {\\"error\\":{\\"message\\":\\"busy\\",\\"type\\":\\"server_error\\"}}"}}'),
    (FakeError(status=404, body='{"detail":"Not Found"}'),
     b'{"type":"error","error":{"type":"not_found_error",'
     b'"message":"provider p answered 404: {\\"detail\\":\\"Not Found\\"}"}}'),
])
async def test_anthropic_endpoints_answer_anthropics_shape(
    fake: Fake, session: aiohttp.ClientSession, answer: FakeError, expected: bytes
) -> None:
    fake.options.fail_with = answer
    for endpoint in ("messages", "messages/count_tokens"):
        call = ProviderCall(endpoint=endpoint, body=body(), target=MODEL, stream=False)
        with pytest.raises(ProviderRejected) as info:
            await OpenAIHttpAdapter(provider(fake.url), session).call(call, RecordingSink())
        assert (info.value.status, info.value.raw_body) == (answer.status, expected)
        assert info.value.headers["request-id"].startswith("req_fake")


async def test_timeout_before_the_answer(fake: Fake, session: aiohttp.ClientSession) -> None:
    fake.options.delay_ms = 2000
    adapter = OpenAIHttpAdapter(provider(fake.url, timeout_s=0.3), session)
    for stream in (False, True):
        sink = RecordingSink()
        with pytest.raises(ProviderTimeout, match=r"0\.3s"):
            await adapter.call(chat(stream=stream), sink)
        assert sink.events == []


async def test_timeout_covers_the_whole_stream(fake: Fake, session: aiohttp.ClientSession) -> None:
    # timeout_s bounds the whole call: a stream still going when it runs out is cut.
    fake.options.tokens = 100
    fake.options.token_interval_ms = 100
    sink = RecordingSink()
    with pytest.raises(ProviderTimeout):
        await OpenAIHttpAdapter(provider(fake.url, timeout_s=1.0), session).call(chat(stream=True), sink)
    assert sink.started == [200]
    assert 0 < len(sink.payloads) < 100
    assert (await fake.wait_stats(disconnected=1))["disconnected"] == 1


async def test_timeout_when_the_server_never_answers(session: aiohttp.ClientSession) -> None:
    async with RawServer(None) as server:
        with pytest.raises(ProviderTimeout):
            await OpenAIHttpAdapter(provider(server.url, timeout_s=0.3), session).call(chat(), RecordingSink())


async def test_nothing_listening_is_unreachable(session: aiohttp.ClientSession) -> None:
    url = f"http://{HOST}:{free_port()}"
    for stream in (False, True):
        with pytest.raises(ProviderUnreachable) as info:
            await OpenAIHttpAdapter(provider(url), session).call(chat(stream=stream), RecordingSink())
        assert not isinstance(info.value, (ProviderRejected, ProviderTimeout))
        assert "provider p unreachable" in str(info.value)


async def test_connection_closed_without_answer_is_unreachable(session: aiohttp.ClientSession) -> None:
    async with RawServer(b"") as server:
        with pytest.raises(ProviderUnreachable):
            await OpenAIHttpAdapter(provider(server.url), session).call(chat(), RecordingSink())


async def test_garbage_json_is_unreachable(fake: Fake, session: aiohttp.ClientSession) -> None:
    fake.options.garbage = True
    sink = RecordingSink()
    with pytest.raises(ProviderUnreachable, match="invalid JSON"):
        await OpenAIHttpAdapter(provider(fake.url), session).call(chat(), sink)
    assert sink.events == []


async def test_json_answer_that_is_not_an_object_is_unreachable(session: aiohttp.ClientSession) -> None:
    response = raw_response(b"200 OK", {"Content-Type": "application/json"}, b"[1, 2]")
    async with RawServer(response) as server:
        with pytest.raises(ProviderUnreachable, match="invalid JSON"):
            await OpenAIHttpAdapter(provider(server.url), session).call(chat(), RecordingSink())


async def test_garbage_sse_is_unreachable(fake: Fake, session: aiohttp.ClientSession) -> None:
    fake.options.garbage = True
    sink = RecordingSink()
    with pytest.raises(ProviderUnreachable, match="not a JSON object"):
        await OpenAIHttpAdapter(provider(fake.url), session).call(chat(stream=True), sink)
    assert sink.started == [200]
    assert "done" not in sink.events
    # Whatever was relayed before the broken event is valid JSON.
    assert all(isinstance(o, dict) for o in sink.objects)


async def test_broken_event_after_good_ones(session: aiohttp.ClientSession) -> None:
    # The bad event is only written once the good one reached the sink (same event loop).
    relayed = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"n":1}\n\n')
        await asyncio.wait_for(relayed.wait(), EVENTUALLY_S)
        await response.write(b"data: {broken\n\n")
        await response.write_eof()
        return response

    async def on_first_chunk() -> None:
        relayed.set()

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner, url = await app_server(app)
    try:
        sink = RecordingSink(on_first_chunk=on_first_chunk)
        with pytest.raises(ProviderUnreachable, match="not a JSON object"):
            await OpenAIHttpAdapter(provider(url), session).call(chat(stream=True), sink)
    finally:
        await runner.cleanup()
    assert sink.started == [200]
    assert sink.objects == [{"n": 1}]


async def test_oversized_json_answer_is_unreachable(
    fake: Fake, session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(openai_http, "MAX_BODY_BYTES", 1000)
    fake.options.tokens = 500  # well over 1000 bytes, with a Content-Length
    with pytest.raises(ProviderUnreachable, match="larger than 1000"):
        await OpenAIHttpAdapter(provider(fake.url), session).call(chat(), RecordingSink())


async def test_oversized_json_answer_without_length_is_unreachable(
    session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(openai_http, "MAX_BODY_BYTES", 1000)
    payload = b'{"x":"' + b"y" * 5000 + b'"}'
    response = raw_response(b"200 OK", {"Content-Type": "application/json"}, payload, length=False)
    async with RawServer(response) as server:
        with pytest.raises(ProviderUnreachable, match="larger than 1000"):
            await OpenAIHttpAdapter(provider(server.url), session).call(chat(), RecordingSink())


async def test_oversized_stream_event_is_unreachable(session: aiohttp.ClientSession) -> None:
    huge = b'data: {"x":"' + b"y" * (17 * 1024 * 1024) + b'"}\n\n'
    response = raw_response(b"200 OK", {"Content-Type": "text/event-stream"}, huge)
    async with RawServer(response) as server:
        sink = RecordingSink()
        with pytest.raises(ProviderUnreachable, match="oversized"):
            await OpenAIHttpAdapter(provider(server.url), session).call(chat(stream=True), sink)
    assert sink.payloads == []


# --------------------------------------------------------------------------- the provider's key


async def test_provider_key_from_env(
    fake: Fake, session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.options.api_key = "sk-provider"
    monkeypatch.setenv("IOP_TEST_PROVIDER_KEY", "sk-provider")
    adapter = OpenAIHttpAdapter(provider(fake.url, api_key_env="IOP_TEST_PROVIDER_KEY"), session)
    sink = RecordingSink()
    await adapter.call(chat(), sink)
    assert sink.json()["model"] == MODEL
    sink = RecordingSink()
    await adapter.call(chat(stream=True), sink)
    assert sink.started == [200]
    recorded = await fake.requests()
    assert [r["authorization"] for r in recorded] == ["Bearer sk-provider"] * 2
    probe = await adapter.probe(5.0)
    assert probe.healthy, probe.reason


async def test_without_the_key_the_providers_401_is_passed_on(
    fake: Fake, session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.options.api_key = "sk-provider"
    monkeypatch.delenv("IOP_TEST_PROVIDER_KEY", raising=False)
    for prov in (provider(fake.url), provider(fake.url, api_key_env="IOP_TEST_PROVIDER_KEY")):
        adapter = OpenAIHttpAdapter(prov, session)
        with pytest.raises(ProviderRejected) as info:
            await adapter.call(chat(), RecordingSink())
        assert info.value.status == 401
        assert json.loads(info.value.raw_body)["error"]["code"] == "invalid_api_key"
        probe = await adapter.probe(5.0)
        assert not probe.healthy
        assert "401" in probe.reason
    assert [r["authorization"] for r in await fake.requests()] == [None, None]


async def test_wrong_key_is_passed_on(
    fake: Fake, session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.options.api_key = "sk-provider"
    monkeypatch.setenv("IOP_TEST_PROVIDER_KEY", "sk-wrong")
    adapter = OpenAIHttpAdapter(provider(fake.url, api_key_env="IOP_TEST_PROVIDER_KEY"), session)
    with pytest.raises(ProviderRejected) as info:
        await adapter.call(chat(stream=True), RecordingSink())
    assert info.value.status == 401


# --------------------------------------------------------------------------- redirects


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
async def test_redirects_are_not_followed(fake: Fake, session: aiohttp.ClientSession, status: int) -> None:
    target = f"{fake.url}/v1/chat/completions"

    async def redirect(request: web.Request) -> web.Response:
        return web.Response(status=status, headers={"Location": target}, text="moved")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", redirect)
    runner, url = await app_server(app)
    try:
        adapter = OpenAIHttpAdapter(provider(url), session)
        for stream in (False, True):
            sink = RecordingSink()
            # 3xx is neither success (< 300) nor the provider's 4xx: _raise_for_status calls it unreachable.
            with pytest.raises(ProviderUnreachable) as info:
                await adapter.call(chat(stream=stream), sink)
            assert not isinstance(info.value, ProviderRejected)
            assert f"provider p answered {status}" in str(info.value)
            assert sink.events == []
        probe = await adapter.probe(5.0)
        assert not probe.healthy
        assert str(status) in probe.reason
    finally:
        await runner.cleanup()
    assert await fake.requests() == []
    assert (await fake.stats())["total"] == 0


# --------------------------------------------------------------------------- cancellation


async def _cancel_and_wait(task: asyncio.Task[None]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, EVENTUALLY_S)


async def test_cancelling_a_call_held_by_the_provider_disconnects(fake: Fake, session: aiohttp.ClientSession) -> None:
    fake.options.hang = True
    sink = RecordingSink()
    task = asyncio.create_task(OpenAIHttpAdapter(provider(fake.url), session).call(chat(stream=True), sink))
    assert (await fake.wait_stats(in_flight=1))["in_flight"] == 1
    await _cancel_and_wait(task)
    stats = await fake.wait_stats(disconnected=1, in_flight=0)
    assert (stats["disconnected"], stats["in_flight"], stats["completed"]) == (1, 0, 0)
    assert sink.events == []


async def test_cancelling_a_running_stream_disconnects(fake: Fake, session: aiohttp.ClientSession) -> None:
    fake.options.tokens = 1000
    fake.options.token_interval_ms = 50
    sink = RecordingSink()
    task = asyncio.create_task(OpenAIHttpAdapter(provider(fake.url), session).call(chat(stream=True), sink))
    await asyncio.wait_for(sink.got_chunk.wait(), EVENTUALLY_S)
    await _cancel_and_wait(task)
    stats = await fake.wait_stats(disconnected=1, in_flight=0)
    assert (stats["disconnected"], stats["in_flight"], stats["completed"]) == (1, 0, 0)
    received = len(sink.payloads)
    await asyncio.sleep(0.2)
    assert len(sink.payloads) == received  # nothing relayed after the cancellation


async def test_cancelling_a_json_call_disconnects(fake: Fake, session: aiohttp.ClientSession) -> None:
    fake.options.delay_ms = 60_000
    task = asyncio.create_task(OpenAIHttpAdapter(provider(fake.url), session).call(chat(), RecordingSink()))
    assert (await fake.wait_stats(in_flight=1))["in_flight"] == 1
    await _cancel_and_wait(task)
    stats = await fake.wait_stats(disconnected=1, in_flight=0)
    assert (stats["disconnected"], stats["in_flight"]) == (1, 0)


async def test_session_still_works_after_a_cancelled_stream(fake: Fake, session: aiohttp.ClientSession) -> None:
    fake.options.tokens = 1000
    fake.options.token_interval_ms = 50
    adapter = OpenAIHttpAdapter(provider(fake.url), session)
    sink = RecordingSink()
    task = asyncio.create_task(adapter.call(chat(stream=True), sink))
    await asyncio.wait_for(sink.got_chunk.wait(), EVENTUALLY_S)
    await _cancel_and_wait(task)
    fake.options.tokens = 3
    fake.options.token_interval_ms = 0
    sink = RecordingSink()
    await adapter.call(chat(stream=True), sink)
    assert len(sink.payloads) == 5
    sink = RecordingSink()
    await adapter.call(chat(), sink)
    assert sink.json()["model"] == MODEL


async def test_concurrent_calls_share_the_session(fake: Fake, session: aiohttp.ClientSession) -> None:
    fake.options.tokens = 3
    fake.options.token_interval_ms = 20
    adapter = OpenAIHttpAdapter(provider(fake.url), session)
    sinks = [RecordingSink() for _ in range(8)]
    await asyncio.gather(*(adapter.call(chat(stream=i % 2 == 0), s) for i, s in enumerate(sinks)))
    for i, s in enumerate(sinks):
        if i % 2 == 0:
            assert len(s.payloads) == 5
        else:
            assert s.json()["model"] == MODEL
    assert (await fake.stats())["completed"] == 8


# --------------------------------------------------------------------------- probe


async def test_probe_healthy_reports_the_models(fake: Fake, session: aiohttp.ClientSession) -> None:
    result = await OpenAIHttpAdapter(provider(fake.url), session).probe(5.0)
    assert result == ProbeResult(True, "", [MODEL, "other-model"])


async def test_probe_follows_the_providers_model_list(fake: Fake, session: aiohttp.ClientSession) -> None:
    adapter = OpenAIHttpAdapter(provider(fake.url), session)
    fake.options.models = []
    assert await adapter.probe(5.0) == ProbeResult(True, "", [])
    fake.options.models = ["a", "b", "c"]
    assert (await adapter.probe(5.0)).models == ["a", "b", "c"]


async def test_probe_unhealthy(fake: Fake, session: aiohttp.ClientSession) -> None:
    fake.options.healthy = False
    result = await OpenAIHttpAdapter(provider(fake.url), session).probe(5.0)
    assert not result.healthy
    assert "503" in result.reason
    assert result.models is None


async def test_probe_unreachable(session: aiohttp.ClientSession) -> None:
    result = await OpenAIHttpAdapter(provider(f"http://{HOST}:{free_port()}"), session).probe(5.0)
    assert not result.healthy
    assert result.reason
    assert "failed" in result.reason
    assert result.models is None


async def test_probe_timeout(session: aiohttp.ClientSession) -> None:
    async with RawServer(None) as server:
        result = await OpenAIHttpAdapter(provider(server.url), session).probe(0.3)
        (head,) = server.heads
    assert head.startswith(b"GET /health HTTP/1.1\r\n")  # vllm: health first, then the model list
    assert not result.healthy
    assert "timed out" in result.reason
    assert result.models is None


@pytest.mark.parametrize(
    "payload",
    [b"not json", b"[1,2]", b'{"data": 5}', b'{"data": [1, 2]}', b'{"data": null}'],
)
async def test_probe_garbage_model_list(session: aiohttp.ClientSession, payload: bytes) -> None:
    response = raw_response(b"200 OK", {"Content-Type": "application/json"}, payload)
    async with RawServer(response) as server:
        result = await OpenAIHttpAdapter(provider(server.url), session).probe(5.0)
    assert not result.healthy
    assert "not a model list" in result.reason


async def test_probe_skips_entries_without_id(session: aiohttp.ClientSession) -> None:
    payload = b'{"object":"list","data":[{"id":"a"},{"name":"no-id"},{"id":7}]}'
    response = raw_response(b"200 OK", {"Content-Type": "application/json"}, payload)
    async with RawServer(response) as server:
        result = await OpenAIHttpAdapter(provider(server.url), session).probe(5.0)
    assert result == ProbeResult(True, "", ["a", "7"])


async def test_probe_list_without_data(session: aiohttp.ClientSession) -> None:
    response = raw_response(b"200 OK", {"Content-Type": "application/json"}, b'{"object":"list"}')
    async with RawServer(response) as server:
        result = await OpenAIHttpAdapter(provider(server.url), session).probe(5.0)
    assert result == ProbeResult(True, "", [])


async def test_aclose_is_harmless(fake: Fake, session: aiohttp.ClientSession) -> None:
    adapter = OpenAIHttpAdapter(provider(fake.url), session)
    await adapter.aclose()
    assert not session.closed


# --- the other endpoints, and relaying faithfully ------------------------------------------------------


def call_of(endpoint: str, payload: dict[str, Any], *, stream: bool = False, **kw: Any) -> ProviderCall:
    body = {"model": MODEL, **payload, **({"stream": True} if stream else {})}
    return ProviderCall(endpoint, json.dumps(body).encode(), MODEL, stream, **kw)


async def test_a_pooled_connection_the_provider_closed_is_retried_on_a_fresh_one(
    fake: Fake, session: aiohttp.ClientSession
) -> None:
    # The fake closes each keep-alive connection once idle; a pooled connection is then dead on
    # its next use, before any byte of an answer: the caller must not see that.
    fake.options.close_idle_keepalive = True
    adapter = OpenAIHttpAdapter(provider(fake.url), session)
    try:
        for _ in range(6):
            for stream in (False, True):
                sink = RecordingSink()
                await adapter.call(chat(stream=stream), sink)
                assert sink.payloads if stream else (sink.answer and sink.answer[0] == 200)  # answered
                await asyncio.sleep(0.05)  # let the fake close the idle connection
        # The retry ran: a dead pooled connection sent the call to the fresh-connection session.
        assert adapter._fresh is not None
    finally:
        await adapter.aclose()


async def test_provider_headers_pass_from_an_allow_list(fake: Fake, session: aiohttp.ClientSession) -> None:
    adapter = OpenAIHttpAdapter(provider(fake.url), session)
    for stream in (False, True):
        sink = RecordingSink()
        await adapter.call(chat(stream=stream), sink)
        assert "x-request-id" in sink.headers
        assert "openai-processing-ms" in sink.headers
        assert sink.headers["x-ratelimit-remaining-requests"] == "99"
        assert not {"content-type", "content-length", "connection", "keep-alive", "date", "server"} & set(sink.headers)


def test_the_allow_list() -> None:
    got = passed_headers([("X-Request-Id", "a"), ("Retry-After", "3"), ("OpenAI-Model", "x"),
                          ("x-ratelimit-limit-tokens", "9"), ("anthropic-ratelimit-requests-remaining", "1"),
                          ("request-id", "r"), ("Connection", "keep-alive"), ("Transfer-Encoding", "chunked"),
                          ("Set-Cookie", "s=1"), ("Server", "x")])
    assert got == {"x-request-id": "a", "retry-after": "3", "openai-model": "x", "x-ratelimit-limit-tokens": "9",
                   "anthropic-ratelimit-requests-remaining": "1", "request-id": "r"}


async def test_a_typed_stream_keeps_event_names_and_ends_with_its_terminal_event(
    fake: Fake, session: aiohttp.ClientSession
) -> None:
    fake.options.tokens = 3
    sink = RecordingSink()
    await OpenAIHttpAdapter(provider(fake.url), session).call(call_of("responses", {"input": "hi"}, stream=True), sink)
    names = [p.partition(b"\n")[0] for p in sink.payloads]
    assert names[0] == b"response.created"
    assert names[-1] == b"response.completed"
    assert names.count(b"response.output_text.delta") == 3
    assert sink.events[-1] == "ended without [DONE]"  # Responses streams have no [DONE]
    created = json.loads(sink.payloads[0].partition(b"\n")[2])
    assert created["response"]["model"] == MODEL


async def test_anthropic_headers_are_forwarded(fake: Fake, session: aiohttp.ClientSession) -> None:
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "tools-2024"}
    sink = RecordingSink()
    call = call_of("messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}, headers=headers)
    await OpenAIHttpAdapter(provider(fake.url), session).call(call, sink)
    assert sink.json()["type"] == "message"
    assert sink.headers.get("anthropic-ratelimit-requests-remaining") == "99"
    assert sink.headers.get("request-id", "").startswith("req_")


async def test_tokenize_goes_to_the_runtimes_root_for_vllm(fake: Fake, session: aiohttp.ClientSession) -> None:
    sink = RecordingSink()
    await OpenAIHttpAdapter(provider(fake.url), session).call(call_of("tokenize", {"prompt": "a b c"}), sink)
    assert sink.json()["count"] == 3
    assert (await fake.requests())[-1]["path"] == "/tokenize"


async def test_a_speech_stream_arrives_as_bytes_in_pieces(fake: Fake, session: aiohttp.ClientSession) -> None:
    fake.options.tokens = 4
    fake.options.token_interval_ms = 20
    sink = RecordingSink()
    call = call_of("audio/speech", {"input": "hello there", "voice": "alloy", "response_format": "wav"}, stream=True)
    await OpenAIHttpAdapter(provider(fake.url), session).call(call, sink)
    audio = b"".join(sink.payloads)
    assert audio.startswith(b"RIFF")
    assert len(sink.payloads) > 1
    assert sink.events[-1] == "ended without [DONE]"


async def test_a_transcription_as_text_is_passed_as_text(fake: Fake, session: aiohttp.ClientSession) -> None:
    ct = "multipart/form-data; boundary=b0undary"
    form = (b'--b0undary\r\nContent-Disposition: form-data; name="model"\r\n\r\n' + MODEL.encode() +
            b'\r\n--b0undary\r\nContent-Disposition: form-data; name="response_format"\r\n\r\ntext'
            b'\r\n--b0undary\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
            b"Content-Type: audio/wav\r\n\r\n" + bytes(range(256)) * 4 + b"\r\n--b0undary--\r\n")
    sink = RecordingSink()
    call = ProviderCall("audio/transcriptions", form, MODEL, False, content_type=ct)
    await OpenAIHttpAdapter(provider(fake.url), session).call(call, sink)
    assert sink.answer is not None
    assert sink.answer[2].startswith("text/plain")
    assert b"1024 bytes" in sink.answer[1]
