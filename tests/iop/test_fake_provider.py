"""The fake OpenAI-compatible upstream, against a real server on a free port."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import re
import struct
import time
import wave
import zlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx
import openai
import pytest
from aiohttp import web

from iop.fake_provider import FakeError, FakeOptions, _OptionsPatch, create_app, start
from iop.fake_provider import _responses as fake_responses
from iop.redis_server import free_port
from tests.iop.fake_client import Fake, post, running, sse_events

pytestmark = pytest.mark.anyio

HOST = "127.0.0.1"


@pytest.fixture
async def fake() -> AsyncIterator[Fake]:
    async with running(FakeOptions()) as fake:
        yield fake


def assert_openai_error(body: Any) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str)
    assert body["error"]["message"]


def assert_anthropic_error(body: Any, type_: str = "invalid_request_error") -> None:
    assert body["type"] == "error"
    assert body["error"]["type"] == type_
    assert isinstance(body["error"]["message"], str)
    assert body["error"]["message"]
    assert body["request_id"].startswith("req_")


def typed_events(text: str) -> list[tuple[str | None, Any]]:
    """The (event name, decoded data) pairs of an SSE body, in order."""
    events: list[tuple[str | None, Any]] = []
    for block in text.split("\n\n"):
        if not block:
            continue
        name = None
        data = None
        for line in block.split("\n"):
            field, _, value = line.partition(": ")
            if field == "event":
                name = value
            else:
                assert field == "data", block
                data = json.loads(value)
        events.append((name, data))
    return events


def openai_client(fake: Fake, **kwargs: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=fake.url + "/v1", api_key="sk-test", max_retries=0, **kwargs)


# --------------------------------------------------------------------------- chat completions


async def test_chat_json_echoes_model(fake: Fake) -> None:
    model = 'org/Weird "model" ü/v1'
    status, body = await post(fake, "/v1/chat/completions", {"model": model, "messages": [{"role": "user"}]})
    assert status == 200
    assert body["object"] == "chat.completion"
    assert body["model"] == model
    assert body["id"].startswith("chatcmpl-")
    assert isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice["index"] == 0
    assert choice["message"] == {"role": "assistant", "content": " ".join(f"tok{i}" for i in range(16))}
    assert choice["finish_reason"] == "stop"
    usage = body["usage"]
    assert usage["completion_tokens"] == 16
    assert usage["total_tokens"] == usage["prompt_tokens"] + 16


async def test_chat_ids_are_unique(fake: Fake) -> None:
    ids = set()
    for _ in range(3):
        _, body = await post(fake, "/v1/chat/completions", {"model": "m"})
        ids.add(body["id"])
    assert len(ids) == 3


async def test_chat_stream_chunks_in_order(fake: Fake) -> None:
    fake.options.tokens = 4
    model = "Écho/model"
    async with fake.session.post(
        "/v1/chat/completions", json={"model": model, "messages": [], "stream": True}
    ) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 1 + 4 + 1
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert all(c["model"] == model for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    contents = [c["choices"][0]["delta"]["content"] for c in chunks[1:5]]
    assert contents == ["tok0 ", "tok1 ", "tok2 ", "tok3"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:5])
    assert chunks[5]["choices"][0]["delta"] == {}
    assert chunks[5]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" not in c for c in chunks)


async def test_chat_stream_include_usage(fake: Fake) -> None:
    fake.options.tokens = 3
    body = {"model": "m", "stream": True, "stream_options": {"include_usage": True}}
    async with fake.session.post("/v1/chat/completions", json=body) as resp:
        events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 1 + 3 + 1 + 1
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    last = chunks[-1]
    assert last["choices"] == []
    assert last["model"] == "m"
    assert last["usage"]["completion_tokens"] == 3
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 3


async def test_stream_without_tokens(fake: Fake) -> None:
    fake.options.tokens = 0
    fake.options.token_interval_ms = 50
    async with fake.session.post("/v1/chat/completions", json={"model": "m", "stream": True}) as resp:
        events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "stop"]


async def test_stream_chunks_arrive_spaced_out(fake: Fake) -> None:
    fake.options.tokens = 5
    fake.options.token_interval_ms = 100
    arrivals: list[float] = []
    payloads: list[str] = []
    stats_at_first_chunk: dict[str, int] | None = None
    async with fake.session.post("/v1/chat/completions", json={"model": "m", "stream": True}) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            arrivals.append(time.monotonic())
            payloads.append(line.decode().strip()[len("data: ") :])
            if stats_at_first_chunk is None:
                stats_at_first_chunk = await fake.stats()
    assert payloads[-1] == "[DONE]"
    contents = [json.loads(p)["choices"][0]["delta"].get("content") for p in payloads[1:6]]
    assert contents == ["tok0 ", "tok1 ", "tok2 ", "tok3 ", "tok4"]
    # The first chunk was in the client's hands while the server was still producing the rest.
    assert stats_at_first_chunk is not None
    assert stats_at_first_chunk["in_flight"] == 1
    assert stats_at_first_chunk["completed"] == 0
    # Four 100 ms pauses separate the first content chunk from the last one.
    assert arrivals[0] < arrivals[-1]
    assert arrivals[-1] - arrivals[1] > 0.15
    assert (await fake.stats())["completed"] == 1


# --------------------------------------------------------------------------- completions


async def test_completions_json(fake: Fake) -> None:
    fake.options.tokens = 3
    status, body = await post(fake, "/v1/completions", {"model": "base-model", "prompt": "Say"})
    assert status == 200
    assert body["object"] == "text_completion"
    assert body["model"] == "base-model"
    assert body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == "tok0 tok1 tok2"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 3


async def test_completions_stream(fake: Fake) -> None:
    fake.options.tokens = 3
    fake.options.token_interval_ms = 10
    body = {"model": "base-model", "prompt": "Say", "stream": True, "stream_options": {"include_usage": True}}
    async with fake.session.post("/v1/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["model"] == "base-model" for c in chunks)
    texts = [c["choices"][0]["text"] for c in chunks[:3]]
    assert texts == ["tok0 ", "tok1 ", "tok2"]
    assert chunks[3]["choices"][0]["finish_reason"] == "stop"
    assert chunks[4]["choices"] == []
    assert chunks[4]["usage"]["completion_tokens"] == 3
    assert len(chunks) == 5


# --------------------------------------------------------------------------- embeddings


async def test_embeddings_deterministic(fake: Fake) -> None:
    _, first = await post(fake, "/v1/embeddings", {"model": "emb", "input": "hello"})
    _, again = await post(fake, "/v1/embeddings", {"model": "emb", "input": "hello"})
    _, other = await post(fake, "/v1/embeddings", {"model": "emb", "input": "world"})
    assert first["object"] == "list"
    assert first["model"] == "emb"
    [item] = first["data"]
    assert item["object"] == "embedding"
    assert item["index"] == 0
    vector = item["embedding"]
    assert len(vector) == 8
    assert all(isinstance(x, float) for x in vector)
    assert again["data"][0]["embedding"] == vector
    assert other["data"][0]["embedding"] != vector
    assert first["usage"]["prompt_tokens"] >= 1
    assert first["usage"]["total_tokens"] == first["usage"]["prompt_tokens"]


async def test_embeddings_list_input(fake: Fake) -> None:
    _, single = await post(fake, "/v1/embeddings", {"model": "emb", "input": "b"})
    status, body = await post(fake, "/v1/embeddings", {"model": "emb", "input": ["a", "b", [1, 2, 3]]})
    assert status == 200
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert body["data"][1]["embedding"] == single["data"][0]["embedding"]
    assert len({tuple(d["embedding"]) for d in body["data"]}) == 3
    # A flat token array is one input.
    status, tokens = await post(fake, "/v1/embeddings", {"model": "emb", "input": [1, 2, 3]})
    assert status == 200
    assert tokens["data"][0]["embedding"] == body["data"][2]["embedding"]


async def test_embeddings_base64(fake: Fake) -> None:
    _, floats = await post(fake, "/v1/embeddings", {"model": "emb", "input": "x"})
    _, encoded = await post(fake, "/v1/embeddings", {"model": "emb", "input": "x", "encoding_format": "base64"})
    decoded = struct.unpack("<8f", base64.b64decode(encoded["data"][0]["embedding"]))
    assert decoded == pytest.approx(floats["data"][0]["embedding"], abs=1e-6)


@pytest.mark.parametrize("value", [None, 3, [], [1.5], ["a", 3], [["a"]], {"a": 1}, [True]])
async def test_embeddings_bad_input(fake: Fake, value: Any) -> None:
    body: dict[str, Any] = {"model": "emb"}
    if value is not None:
        body["input"] = value
    status, answer = await post(fake, "/v1/embeddings", body)
    assert status == 400
    assert_openai_error(answer)
    assert answer["error"]["param"] == "input"


# --------------------------------------------------------------------------- model lists and probes


async def test_v1_models(fake: Fake) -> None:
    fake.options.models = ["a", "b"]
    async with fake.session.get("/v1/models") as resp:
        assert resp.status == 200
        body = await resp.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["a", "b"]
    assert all(m["object"] == "model" for m in body["data"])


PROBES = [
    "/health",
    "/health_generate",
    "/api/tags",
    "/api/ps",
    "/api/version",
    "/api/v1/health",
    "/api/v1/models",
    "/v1/models",
]


async def test_probes_healthy(fake: Fake) -> None:
    fake.options.models = ["llama3:8b", "qwen"]
    bodies: dict[str, Any] = {}
    for path in PROBES:
        async with fake.session.get(path) as resp:
            assert resp.status == 200, path
            text = await resp.text()
            bodies[path] = json.loads(text) if text else None
    assert bodies["/health"] is None
    assert bodies["/health_generate"] is None
    for path in ("/api/tags", "/api/ps"):
        models = bodies[path]["models"]
        assert [m["name"] for m in models] == ["llama3:8b", "qwen"]
        assert [m["model"] for m in models] == ["llama3:8b", "qwen"]
    assert bodies["/api/version"] == {"version": "0.0.0-fake"}
    assert bodies["/api/v1/health"] == {"status": "ok", "model_loaded": "llama3:8b"}
    for path in ("/api/v1/models", "/v1/models"):
        assert bodies[path]["object"] == "list"
        assert [m["id"] for m in bodies[path]["data"]] == ["llama3:8b", "qwen"]


async def test_lemonade_health_without_models(fake: Fake) -> None:
    fake.options.models = []
    async with fake.session.get("/api/v1/health") as resp:
        assert await resp.json() == {"status": "ok", "model_loaded": None}


async def test_probes_unhealthy(fake: Fake) -> None:
    fake.options.healthy = False
    for path in PROBES:
        async with fake.session.get(path) as resp:
            assert resp.status == 503, path
    # Switched back at run time through the control endpoint.
    status, _ = await post(fake, "/_fake/control", {"healthy": True})
    assert status == 200
    for path in PROBES:
        async with fake.session.get(path) as resp:
            assert resp.status == 200, path


# --------------------------------------------------------------------------- failure modes


async def test_api_key_required(fake: Fake) -> None:
    fake.options.api_key = "sk-secret"
    body = {"model": "m"}
    status, answer = await post(fake, "/v1/chat/completions", body)
    assert status == 401
    assert_openai_error(answer)
    status, _ = await post(fake, "/v1/chat/completions", body, headers={"Authorization": "Bearer nope"})
    assert status == 401
    status, answer = await post(
        fake, "/v1/chat/completions", body, headers={"Authorization": "Bearer sk-secret"}
    )
    assert status == 200
    assert answer["model"] == "m"
    async with fake.session.get("/v1/models") as resp:
        assert resp.status == 401
    async with fake.session.get("/v1/models", headers={"Authorization": "Bearer sk-secret"}) as resp:
        assert resp.status == 200
    # Probes and test hooks need no key.
    async with fake.session.get("/health") as resp:
        assert resp.status == 200
    assert (await fake.stats())["total"] == 3


@pytest.mark.parametrize("status", [429, 500, 503])
async def test_fail_status(fake: Fake, status: int) -> None:
    fake.options.fail_status = status
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
        got, answer = await post(fake, path, {"model": "m", "input": "x", "stream": True})
        assert got == status
        assert_openai_error(answer)
    assert (await fake.stats())["completed"] == 3


HTML = "<html><body><h1>502 Bad Gateway</h1></body></html>\n"


async def test_fail_with_answers_exactly_that_on_every_pipeline_endpoint(fake: Fake) -> None:
    answer = {"status": 502, "body": HTML, "content_type": "text/html",
              "headers": {"retry-after": "9", "x-request-id": "r"}}
    status, body = await post(fake, "/_fake/control", {"fail_with": answer})
    assert status == 200
    assert body["fail_with"] == answer
    for path in ("/v1/chat/completions", "/v1/messages", "/v1/responses", "/tokenize"):
        async with fake.session.post(path, json={"model": "m", "stream": True}) as resp:
            assert resp.status == 502
            assert resp.headers["Content-Type"] == "text/html"
            assert resp.headers.getall("retry-after") == ["9"]
            # The given headers replace the usual ones of the same name; the others stay.
            assert resp.headers.getall("x-request-id") == ["r"]
            assert resp.headers["x-ratelimit-remaining-requests"] == "99"
            assert await resp.text() == HTML
    assert (await fake.stats())["completed"] == 4
    assert len(await fake.requests()) == 4


async def test_fail_with_defaults_and_fail_status_first(fake: Fake) -> None:
    fake.options.fail_with = FakeError(status=404, body='{"detail":"Not Found"}')
    async with fake.session.post("/v1/messages/count_tokens", json={"model": "m"}) as resp:
        assert (resp.status, resp.headers["Content-Type"]) == (404, "application/json")
        assert resp.headers["request-id"].startswith("req_fake")
        assert await resp.read() == b'{"detail":"Not Found"}'
    fake.options.fail_with = FakeError(status=503)
    async with fake.session.post("/v1/chat/completions", json={"model": "m"}) as resp:
        assert resp.status == 503
        assert await resp.read() == b""
    fake.options.fail_status = 429
    got, answer = await post(fake, "/v1/chat/completions", {"model": "m"})
    assert got == 429
    assert_openai_error(answer)
    # Cleared, the pipeline answers again.
    status, _ = await post(fake, "/_fake/control", {"fail_status": None, "fail_with": None})
    assert status == 200
    got, _ = await post(fake, "/v1/chat/completions", {"model": "m"})
    assert got == 200


async def test_garbage_json(fake: Fake) -> None:
    fake.options.garbage = True
    async with fake.session.post("/v1/chat/completions", json={"model": "m"}) as resp:
        assert resp.status == 200
        text = await resp.text()
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


async def test_garbage_stream(fake: Fake) -> None:
    fake.options.garbage = True
    async with fake.session.post("/v1/chat/completions", json={"model": "m", "stream": True}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        text = await resp.text()
    broken = 0
    for block in text.split("\n\n"):
        if block.startswith("data: ") and block != "data: [DONE]":
            try:
                json.loads(block[len("data: ") :])
            except json.JSONDecodeError:
                broken += 1
    assert broken >= 1


async def test_hang_then_client_disconnect(fake: Fake) -> None:
    fake.options.hang = True
    with pytest.raises(TimeoutError):
        await post(fake, "/v1/chat/completions", {"model": "m"}, timeout=aiohttp.ClientTimeout(total=0.3))
    stats = await fake.wait_stats(disconnected=1, in_flight=0)
    assert stats["disconnected"] == 1
    assert stats["in_flight"] == 0
    assert stats["completed"] == 0
    assert stats["total"] == 1


async def test_hang_released_by_control(fake: Fake) -> None:
    fake.options.hang = True
    task = asyncio.ensure_future(post(fake, "/v1/chat/completions", {"model": "m"}))
    await fake.wait_stats(in_flight=1)
    assert not task.done()
    status, _ = await post(fake, "/_fake/control", {"hang": False})
    assert status == 200
    status, body = await asyncio.wait_for(task, 5)
    assert status == 200
    assert body["model"] == "m"
    assert (await fake.stats())["completed"] == 1


async def test_delay_interrupted_counts_disconnect(fake: Fake) -> None:
    fake.options.delay_ms = 10_000
    with pytest.raises(TimeoutError):
        await post(fake, "/v1/completions", {"model": "m"}, timeout=aiohttp.ClientTimeout(total=0.3))
    stats = await fake.wait_stats(disconnected=1, in_flight=0)
    assert (stats["disconnected"], stats["in_flight"]) == (1, 0)


async def test_delay(fake: Fake) -> None:
    fake.options.delay_ms = 150
    started = time.monotonic()
    status, _ = await post(fake, "/v1/chat/completions", {"model": "m"})
    assert status == 200
    assert time.monotonic() - started >= 0.14


async def test_stream_aborted_midway_counts_disconnect(fake: Fake) -> None:
    fake.options.tokens = 100
    fake.options.token_interval_ms = 50
    resp = await fake.session.post("/v1/chat/completions", json={"model": "m", "stream": True})
    assert resp.status == 200
    first = await resp.content.readline()
    assert first.startswith(b"data: ")
    resp.close()
    stats = await fake.wait_stats(disconnected=1, in_flight=0)
    assert (stats["disconnected"], stats["in_flight"], stats["completed"]) == (1, 0, 0)


async def test_disconnect_detected_without_handler_cancellation() -> None:
    """An app run by someone else's runner (no handler_cancellation) still sees clients leave."""
    options = FakeOptions(hang=True)
    runner = web.AppRunner(create_app(options))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, HOST, port).start()
    try:
        async with aiohttp.ClientSession(base_url=f"http://{HOST}:{port}") as session:
            fake = Fake(options, session, "")
            with pytest.raises(TimeoutError):
                await post(fake, "/v1/chat/completions", {"model": "m"}, timeout=aiohttp.ClientTimeout(total=0.2))
            stats = await fake.wait_stats(disconnected=1, in_flight=0)
            assert (stats["disconnected"], stats["in_flight"]) == (1, 0)
            options.hang = False
            options.tokens = 50
            options.token_interval_ms = 20
            resp = await session.post("/v1/chat/completions", json={"model": "m", "stream": True})
            await resp.content.readline()
            resp.close()
            stats = await fake.wait_stats(disconnected=2, in_flight=0)
            assert (stats["disconnected"], stats["in_flight"]) == (2, 0)
    finally:
        await runner.cleanup()


async def test_shutdown_answers_hanging_requests() -> None:
    options = FakeOptions(hang=True)
    port = free_port()
    runner = await start(HOST, port, options)
    async with aiohttp.ClientSession(base_url=f"http://{HOST}:{port}") as session:
        fake = Fake(options, session, "")
        task = asyncio.ensure_future(post(fake, "/v1/chat/completions", {"model": "m"}))
        await fake.wait_stats(in_flight=1)
        started = time.monotonic()
        await runner.cleanup()
        assert time.monotonic() - started < 1.5
        status, body = await asyncio.wait_for(task, 5)
    assert status == 503
    assert_openai_error(body)


# --------------------------------------------------------------------------- concurrency counters


async def test_in_flight_and_reset(fake: Fake) -> None:
    fake.options.delay_ms = 200
    results = await asyncio.gather(*(post(fake, "/v1/chat/completions", {"model": "m"}) for _ in range(5)))
    assert [status for status, _ in results] == [200] * 5
    stats = await fake.stats()
    assert stats == {"in_flight": 0, "max_in_flight": 5, "total": 5, "completed": 5, "disconnected": 0}
    async with fake.session.post("/_fake/stats/reset") as resp:
        assert resp.status == 200
    assert await fake.stats() == {
        "in_flight": 0,
        "max_in_flight": 0,
        "total": 0,
        "completed": 0,
        "disconnected": 0,
    }


async def test_reset_while_in_flight(fake: Fake) -> None:
    fake.options.hang = True
    task = asyncio.ensure_future(post(fake, "/v1/chat/completions", {"model": "m"}))
    await fake.wait_stats(in_flight=1)
    async with fake.session.post("/_fake/stats/reset") as resp:
        assert (await resp.json())["in_flight"] == 1
    fake.options.hang = False
    status, _ = await asyncio.wait_for(task, 5)
    assert status == 200
    stats = await fake.stats()
    assert (stats["in_flight"], stats["max_in_flight"], stats["total"]) == (0, 1, 0)


async def test_gets_are_not_counted(fake: Fake) -> None:
    async with fake.session.get("/v1/models") as resp:
        assert resp.status == 200
    assert (await fake.stats())["total"] == 0


# --------------------------------------------------------------------------- parallel slots, word stem


async def test_another_word_stem_is_another_word_list(fake: Fake) -> None:
    await post(fake, "/_fake/control", {"word": "alt", "tokens": 3})
    status, answer = await post(fake, "/v1/chat/completions", {"model": "m"})
    assert status == 200
    assert answer["choices"][0]["message"]["content"] == "alt0 alt1 alt2"


async def test_parallel_slots_make_the_others_wait(fake: Fake) -> None:
    await post(fake, "/_fake/control", {"parallel": 2, "delay_ms": 200, "tokens": 1})
    started = asyncio.get_running_loop().time()
    done: list[float] = []

    async def one() -> None:
        status, _ = await post(fake, "/v1/chat/completions", {"model": "m"})
        assert status == 200
        done.append(asyncio.get_running_loop().time() - started)

    await asyncio.gather(*(one() for _ in range(4)))
    done.sort()
    # Two run at once; the third starts its delay only once the first freed its slot.
    assert done[2] - done[0] >= 0.18
    assert (await fake.stats())["max_in_flight"] >= 2


# --------------------------------------------------------------------------- control endpoint


async def test_control_updates_in_place(fake: Fake) -> None:
    options = fake.options
    status, body = await post(
        fake,
        "/_fake/control",
        {"tokens": 2, "models": ["x", "y"], "api_key": "k", "fail_status": 502, "delay_ms": 1},
    )
    assert status == 200
    assert body == {
        "delay_ms": 1,
        "tokens": 2,
        "token_interval_ms": 0,
        "models": ["x", "y"],
        "api_key": "k",
        "fail_status": 502,
        "fail_with": None,
        "hang": False,
        "garbage": False,
        "healthy": True,
        "stream_no_done": False,
        "empty_200": False,
        "close_idle_keepalive": False,
        "parallel": 0,
        "word": "tok",
        "max_loaded": None,
        "load_ms": None,
        "keep_alive_s": None,
        "cut_after": None,
    }
    assert fake.options is options
    assert (options.tokens, options.models, options.api_key, options.fail_status) == (2, ["x", "y"], "k", 502)
    # null clears the optional fields; absent fields stay as they are.
    status, body = await post(fake, "/_fake/control", {"api_key": None, "fail_status": None})
    assert status == 200
    assert (body["api_key"], body["fail_status"], body["tokens"]) == (None, None, 2)
    status, answer = await post(fake, "/v1/chat/completions", {"model": "m"})
    assert status == 200
    assert answer["choices"][0]["message"]["content"] == "tok0 tok1"


@pytest.mark.parametrize(
    "patch",
    [
        {"tokens": "3"},
        {"tokens": True},
        {"tokens": -1},
        {"delay_ms": 1.5},
        {"models": "fake"},
        {"models": [1]},
        {"hang": "yes"},
        {"fail_status": 42},
        {"fail_with": {"status": 42}},
        {"fail_with": {"body": "no status"}},
        {"fail_with": {"status": 500, "headers": {"x": 1}}},
        {"fail_with": {"status": 500, "unknown": 1}},
        {"unknown_option": 1},
        ["tokens", 3],
    ],
)
async def test_control_rejects_bad_input(fake: Fake, patch: Any) -> None:
    status, body = await post(fake, "/_fake/control", patch)
    assert status == 400
    assert_openai_error(body)
    assert fake.options == FakeOptions()


async def test_control_rejects_malformed_json(fake: Fake) -> None:
    headers = {"Content-Type": "application/json"}
    async with fake.session.post("/_fake/control", data=b"{tokens", headers=headers) as resp:
        assert resp.status == 400
        assert_openai_error(await resp.json())


def test_control_covers_every_option() -> None:
    assert set(_OptionsPatch.__struct_fields__) == set(FakeOptions.__struct_fields__)


# --------------------------------------------------------------------------- recorded requests


async def test_requests_recorded(fake: Fake) -> None:
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with fake.session.post(
        "/v1/chat/completions", json=body, headers={"Authorization": "Bearer abc"}
    ) as resp:
        await resp.read()
    await post(fake, "/v1/embeddings", {"model": "m2", "input": "x"})
    recorded = await fake.requests()
    assert recorded == [
        {"path": "/v1/chat/completions", "model": "m1", "stream": True, "authorization": "Bearer abc", "body": body},
        {
            "path": "/v1/embeddings",
            "model": "m2",
            "stream": False,
            "authorization": None,
            "body": {"model": "m2", "input": "x"},
        },
    ]
    async with fake.session.delete("/_fake/requests") as resp:
        assert resp.status == 200
    assert await fake.requests() == []


async def test_requests_keeps_last_thousand(fake: Fake) -> None:
    for i in range(1005):
        async with fake.session.post("/v1/embeddings", json={"model": f"m{i}", "input": "x"}) as resp:
            await resp.read()
    recorded = await fake.requests()
    assert len(recorded) == 1000
    assert recorded[0]["model"] == "m5"
    assert recorded[-1]["model"] == "m1004"


# --------------------------------------------------------------------------- bad requests


async def test_malformed_json(fake: Fake) -> None:
    async with fake.session.post(
        "/v1/chat/completions", data=b'{"model": ', headers={"Content-Type": "application/json"}
    ) as resp:
        assert resp.status == 400
        assert_openai_error(await resp.json())
    [recorded] = await fake.requests()
    assert recorded["body"] is None


@pytest.mark.parametrize("body", [[1, 2], "text", 3, None])
async def test_body_not_an_object(fake: Fake, body: Any) -> None:
    status, answer = await post(fake, "/v1/chat/completions", body)
    assert status == 400
    assert_openai_error(answer)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
@pytest.mark.parametrize("body", [{"messages": []}, {"model": ""}, {"model": 3}, {"model": None}])
async def test_missing_model(fake: Fake, path: str, body: dict[str, Any]) -> None:
    status, answer = await post(fake, path, {**body, "input": "x"})
    assert status == 400
    assert_openai_error(answer)
    assert answer["error"]["param"] == "model"


async def test_unknown_path(fake: Fake) -> None:
    for method, path in [("GET", "/nope"), ("POST", "/v1/nope"), ("GET", "/v1/models/x"), ("GET", "/v1/responses/x/y")]:
        async with fake.session.request(method, path) as resp:
            assert resp.status == 404
            assert_openai_error(await resp.json())


async def test_wrong_method(fake: Fake) -> None:
    async with fake.session.get("/v1/chat/completions") as resp:
        assert resp.status == 405
        assert "POST" in resp.headers["Allow"]
        assert_openai_error(await resp.json())


# --------------------------------------------------------------------------- hooks: executions, overrides


async def test_hooks_are_off_by_default(fake: Fake) -> None:
    async with fake.session.get("/_fake/hooks") as resp:
        assert await resp.json() == {"track_executions": False, "body_overrides": False}
    body = {"model": "m", "user": "r1", "fake": {"tokens": 1}}
    status, answer = await post(fake, "/v1/chat/completions", body)
    assert status == 200
    # Without body_overrides the 'fake' object is an ordinary unknown field.
    assert answer["choices"][0]["message"]["content"] == " ".join(f"tok{i}" for i in range(16))
    async with fake.session.get("/_fake/executions") as resp:
        assert await resp.json() == []


async def test_executions_tracked_with_marker_and_outcome(fake: Fake) -> None:
    status, hooks = await post(fake, "/_fake/hooks", {"track_executions": True})
    assert (status, hooks) == (200, {"track_executions": True, "body_overrides": False})
    before = time.time()
    await post(fake, "/v1/chat/completions", {"model": "m", "user": "r1"})
    async with fake.session.post("/v1/chat/completions", json={"model": "m", "user": "r2", "stream": True}) as resp:
        await resp.read()
    fake.options.delay_ms = 10_000
    with pytest.raises(TimeoutError):
        await post(fake, "/v1/completions", {"model": "m", "user": "r3"}, timeout=aiohttp.ClientTimeout(total=0.3))
    await fake.wait_stats(in_flight=0)
    async with fake.session.get("/_fake/executions") as resp:
        executions = await resp.json()
    assert [(e["marker"], e["path"], e["stream"], e["outcome"]) for e in executions] == [
        ("r1", "/v1/chat/completions", False, "completed"),
        ("r2", "/v1/chat/completions", True, "completed"),
        ("r3", "/v1/completions", False, "disconnected"),
    ]
    for e in executions:
        assert before <= e["started"] <= e["ended"] <= time.time()
        assert isinstance(e["client_port"], int)
    async with fake.session.delete("/_fake/executions") as resp:
        assert resp.status == 200
    async with fake.session.get("/_fake/executions") as resp:
        assert await resp.json() == []


async def test_body_overrides_per_request(fake: Fake) -> None:
    await post(fake, "/_fake/hooks", {"body_overrides": True})
    status, answer = await post(fake, "/v1/chat/completions", {"model": "m", "fake": {"tokens": 2}})
    assert status == 200
    assert answer["choices"][0]["message"]["content"] == "tok0 tok1"
    # Only that request: the options themselves are unchanged.
    assert fake.options.tokens == 16
    started = time.monotonic()
    body = {"model": "m", "stream": True, "fake": {"delay_ms": 150, "tokens": 3, "token_interval_ms": 50}}
    async with fake.session.post("/v1/chat/completions", json=body) as resp:
        events = sse_events(await resp.text())
    assert time.monotonic() - started >= 0.25
    contents = [json.loads(e)["choices"][0]["delta"].get("content") for e in events[:-1]]
    assert contents == ["", "tok0 ", "tok1 ", "tok2", None]
    assert events[-1] == "[DONE]"


async def test_a_body_override_fails_that_request_alone(fake: Fake) -> None:
    await post(fake, "/_fake/hooks", {"body_overrides": True})
    status, answer = await post(fake, "/v1/chat/completions", {"model": "m", "fake": {"fail_status": 500}})
    assert status == 500
    assert_openai_error(answer)
    status, _ = await post(fake, "/v1/chat/completions", {"model": "m"})
    assert status == 200
    assert fake.options.fail_status is None


@pytest.mark.parametrize("overrides", [{"tokens": -1}, {"delay_ms": "1"}, {"nope": 1}, [1], 3,
                                       {"fail_status": 99}])
async def test_body_overrides_rejected_when_invalid(fake: Fake, overrides: Any) -> None:
    await post(fake, "/_fake/hooks", {"body_overrides": True})
    status, body = await post(fake, "/v1/chat/completions", {"model": "m", "fake": overrides})
    assert status == 400
    assert_openai_error(body)


@pytest.mark.parametrize("patch", [{"track_executions": "yes"}, {"unknown": True}, [True]])
async def test_hooks_reject_bad_input(fake: Fake, patch: Any) -> None:
    status, body = await post(fake, "/_fake/hooks", patch)
    assert status == 400
    assert_openai_error(body)
    async with fake.session.get("/_fake/hooks") as resp:
        assert await resp.json() == {"track_executions": False, "body_overrides": False}


# --------------------------------------------------------------------------- Responses API


RESPONSE_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.delta",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


async def test_responses_json_shape(fake: Fake) -> None:
    fake.options.tokens = 3
    model = 'served/"model" ü'
    status, body = await post(fake, "/v1/responses", {"model": model, "input": "Say hi", "instructions": "Be brief"})
    assert status == 200
    assert body["id"].startswith("resp_")
    assert body["object"] == "response"
    assert isinstance(body["created_at"], int)
    assert body["status"] == "completed"
    assert body["model"] == model
    assert body["instructions"] == "Be brief"
    assert body["previous_response_id"] is None
    assert body["store"] is True
    [message] = body["output"]
    assert message["type"] == "message"
    assert message["id"].startswith("msg_")
    assert (message["role"], message["status"]) == ("assistant", "completed")
    assert message["content"] == [
        {"type": "output_text", "text": "tok0 tok1 tok2", "annotations": [], "logprobs": []}
    ]
    usage = body["usage"]
    assert usage["output_tokens"] == 3
    assert usage["input_tokens"] >= 1
    assert usage["total_tokens"] == usage["input_tokens"] + 3


async def test_responses_with_the_openai_sdk(fake: Fake) -> None:
    fake.options.tokens = 4
    async with openai_client(fake) as client:
        response = await client.responses.create(model="gpt-fake", input="hello")
        assert response.model == "gpt-fake"
        assert response.output_text == "tok0 tok1 tok2 tok3"
        assert response.usage is not None
        assert response.usage.output_tokens == 4
        stream = await client.responses.create(model="gpt-fake", input="hello", stream=True)
        types = [event.type async for event in stream]
        assert types[:4] == RESPONSE_EVENTS[:4]
        assert types.count("response.output_text.delta") == 4
        assert types[-4:] == RESPONSE_EVENTS[-4:]
        async with client.responses.stream(model="gpt-fake", input="hi", previous_response_id=response.id) as events:
            final = await events.get_final_response()
        assert final.output_text == "tok0 tok1 tok2 tok3"
        assert final.previous_response_id == response.id
        assert final.model == "gpt-fake"


async def test_responses_stream_events_in_order(fake: Fake) -> None:
    fake.options.tokens = 3
    body = {"model": "stream-model", "input": [{"role": "user", "content": "hi"}], "stream": True}
    async with fake.session.post("/v1/responses", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        text = await resp.text()
    assert "[DONE]" not in text
    events = typed_events(text)
    assert [name for name, _ in events] == RESPONSE_EVENTS
    assert all(data["type"] == name for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    by_type = {name: data for name, data in events}
    for name in ("response.created", "response.in_progress", "response.completed"):
        assert by_type[name]["response"]["model"] == "stream-model"
    rid = by_type["response.created"]["response"]["id"]
    assert by_type["response.created"]["response"]["status"] == "in_progress"
    assert by_type["response.completed"]["response"]["id"] == rid
    assert by_type["response.completed"]["response"]["status"] == "completed"
    deltas = [data["delta"] for name, data in events if name == "response.output_text.delta"]
    assert deltas == ["tok0 ", "tok1 ", "tok2"]
    item_id = by_type["response.output_item.added"]["item"]["id"]
    assert all(data["item_id"] == item_id for name, data in events if "item_id" in data)
    assert by_type["response.output_text.done"]["text"] == "tok0 tok1 tok2"
    assert by_type["response.output_item.done"]["item"]["content"][0]["text"] == "tok0 tok1 tok2"
    completed = by_type["response.completed"]["response"]
    assert completed["output"][0]["id"] == item_id
    assert completed["usage"]["output_tokens"] == 3
    # The streamed response was stored under its id.
    async with fake.session.get(f"/v1/responses/{rid}") as resp:
        assert resp.status == 200
        assert (await resp.json())["output"] == completed["output"]


async def test_responses_stream_deltas_arrive_spaced_out(fake: Fake) -> None:
    fake.options.tokens = 4
    fake.options.token_interval_ms = 80
    arrivals: list[float] = []
    async with fake.session.post("/v1/responses", json={"model": "m", "input": "x", "stream": True}) as resp:
        async for line in resp.content:
            if line.startswith(b"event: response.output_text.delta"):
                arrivals.append(time.monotonic())
    assert len(arrivals) == 4
    assert arrivals[-1] - arrivals[0] > 0.15


async def test_responses_store_retrieve_items_delete(fake: Fake) -> None:
    status, created = await post(fake, "/v1/responses", {"model": "m", "input": "What is up?"})
    assert status == 200
    rid = created["id"]
    async with fake.session.get(f"/v1/responses/{rid}") as resp:
        assert resp.status == 200
        assert await resp.json() == created
    async with fake.session.get(f"/v1/responses/{rid}/input_items") as resp:
        assert resp.status == 200
        items = await resp.json()
    assert items["object"] == "list"
    assert items["has_more"] is False
    [item] = items["data"]
    assert item["type"] == "message"
    assert item["role"] == "user"
    assert item["content"] == [{"type": "input_text", "text": "What is up?"}]
    assert items["first_id"] == items["last_id"] == item["id"]
    async with fake.session.delete(f"/v1/responses/{rid}") as resp:
        assert resp.status == 200
        assert await resp.json() == {"id": rid, "object": "response", "deleted": True}
    for method, path in [("GET", f"/v1/responses/{rid}"), ("DELETE", f"/v1/responses/{rid}"),
                         ("GET", f"/v1/responses/{rid}/input_items"), ("POST", f"/v1/responses/{rid}/cancel")]:
        async with fake.session.request(method, path) as resp:
            assert resp.status == 404, (method, path)
            body = await resp.json()
            assert_openai_error(body)
            assert body["error"]["message"] == f"Response with id '{rid}' not found."


async def test_responses_input_items_order_and_pages(fake: Fake) -> None:
    conversation = [
        {"role": "system", "content": "Be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "assistant", "content": "Hello", "id": "msg_given"},
        {"role": "user", "content": "Bye"},
    ]
    _, created = await post(fake, "/v1/responses", {"model": "m", "input": conversation})
    path = f"/v1/responses/{created['id']}/input_items"
    async with fake.session.get(path, params={"order": "asc"}) as resp:
        ascending = (await resp.json())["data"]
    assert [i["role"] for i in ascending] == ["system", "user", "assistant", "user"]
    assert all(i["type"] == "message" for i in ascending)
    assert ascending[2]["id"] == "msg_given"
    assert ascending[2]["content"] == [{"type": "output_text", "text": "Hello"}]
    assert ascending[3]["content"] == [{"type": "input_text", "text": "Bye"}]
    async with fake.session.get(path) as resp:
        descending = await resp.json()
    assert descending["data"] == ascending[::-1]
    async with fake.session.get(path, params={"order": "asc", "limit": "2"}) as resp:
        page = await resp.json()
    assert page["data"] == ascending[:2]
    assert page["has_more"] is True
    async with fake.session.get(path, params={"order": "asc", "limit": "2", "after": page["last_id"]}) as resp:
        rest = await resp.json()
    assert rest["data"] == ascending[2:]
    assert rest["has_more"] is False
    async with fake.session.get(path, params={"limit": "0"}) as resp:
        assert resp.status == 400


async def test_responses_previous_response_id(fake: Fake) -> None:
    _, first = await post(fake, "/v1/responses", {"model": "m", "input": "one"})
    body = {"model": "m", "input": "two", "previous_response_id": first["id"]}
    status, second = await post(fake, "/v1/responses", body)
    assert status == 200
    assert second["previous_response_id"] == first["id"]
    status, body = await post(fake, "/v1/responses", {"model": "m", "input": "x", "previous_response_id": "resp_nope"})
    assert status == 404
    assert_openai_error(body)
    assert body["error"]["message"] == "Previous response with id 'resp_nope' not found."
    assert body["error"]["param"] == "previous_response_id"
    assert body["error"]["code"] == "previous_response_not_found"
    # store: false keeps nothing: neither retrievable nor usable as a previous response.
    _, unstored = await post(fake, "/v1/responses", {"model": "m", "input": "x", "store": False})
    assert unstored["store"] is False
    async with fake.session.get(f"/v1/responses/{unstored['id']}") as resp:
        assert resp.status == 404
    status, _ = await post(fake, "/v1/responses", {"model": "m", "input": "x", "previous_response_id": unstored["id"]})
    assert status == 404


async def test_responses_live_on_one_fake(fake: Fake) -> None:
    """Each fake keeps its own responses: a response created on one is unknown to the other."""
    port = free_port()
    runner = await start(HOST, port, FakeOptions())
    try:
        async with aiohttp.ClientSession(base_url=f"http://{HOST}:{port}") as session:
            other = Fake(FakeOptions(), session, f"http://{HOST}:{port}")
            _, created = await post(fake, "/v1/responses", {"model": "m", "input": "x"})
            rid = created["id"]
            async with other.session.get(f"/v1/responses/{rid}") as resp:
                assert resp.status == 404
            status, body = await post(other, "/v1/responses", {"model": "m", "input": "y", "previous_response_id": rid})
            assert status == 404
            assert body["error"]["code"] == "previous_response_not_found"
            status, _ = await post(fake, "/v1/responses", {"model": "m", "input": "y", "previous_response_id": rid})
            assert status == 200
            # Ids are unique across fakes.
            _, on_other = await post(other, "/v1/responses", {"model": "m", "input": "z"})
            assert on_other["id"] != rid
            async with fake.session.get(f"/v1/responses/{on_other['id']}") as resp:
                assert resp.status == 404
    finally:
        await runner.cleanup()


async def test_responses_store_is_bounded(fake: Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fake_responses, "_MAX_STORED", 3)
    ids = []
    for i in range(4):
        _, created = await post(fake, "/v1/responses", {"model": "m", "input": str(i)})
        ids.append(created["id"])
    statuses = []
    for rid in ids:
        async with fake.session.get(f"/v1/responses/{rid}") as resp:
            statuses.append(resp.status)
    assert statuses == [404, 200, 200, 200]


async def test_responses_cancel(fake: Fake) -> None:
    _, foreground = await post(fake, "/v1/responses", {"model": "m", "input": "x"})
    async with fake.session.post(f"/v1/responses/{foreground['id']}/cancel") as resp:
        assert resp.status == 400
        assert_openai_error(await resp.json())
    status, queued = await post(fake, "/v1/responses", {"model": "m", "input": "x", "background": True})
    assert status == 200
    assert (queued["status"], queued["background"], queued["output"]) == ("queued", True, [])
    async with fake.session.get(f"/v1/responses/{queued['id']}") as resp:
        assert (await resp.json())["status"] == "completed"
    async with fake.session.post(f"/v1/responses/{queued['id']}/cancel") as resp:
        assert resp.status == 200
        cancelled = await resp.json()
    assert (cancelled["id"], cancelled["status"]) == (queued["id"], "cancelled")
    async with fake.session.get(f"/v1/responses/{queued['id']}") as resp:
        assert (await resp.json())["status"] == "cancelled"


@pytest.mark.parametrize("body", [{"input": 3}, {"input": [1]}, {"input": "x", "previous_response_id": 3}])
async def test_responses_bad_input(fake: Fake, body: dict[str, Any]) -> None:
    status, answer = await post(fake, "/v1/responses", {"model": "m", **body})
    assert status == 400
    assert_openai_error(answer)


async def test_responses_wrong_method_lists_allowed(fake: Fake) -> None:
    async with fake.session.put("/v1/responses/resp_x") as resp:
        assert resp.status == 405
        assert resp.headers["Allow"] == "DELETE, GET"
        assert_openai_error(await resp.json())


# --------------------------------------------------------------------------- Anthropic Messages API


MESSAGES = [{"role": "user", "content": "Hello there, fake"}]


async def test_messages_json_shape_and_headers(fake: Fake) -> None:
    fake.options.tokens = 3
    body = {"model": "claude-served", "max_tokens": 100, "messages": MESSAGES}
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "tools-2024-04-04"}
    async with fake.session.post("/v1/messages", json=body, headers=headers) as resp:
        assert resp.status == 200
        answer = await resp.json()
        assert resp.headers["x-fake-anthropic-version"] == "2023-06-01"
        assert resp.headers["x-fake-anthropic-beta"] == "tools-2024-04-04"
        assert resp.headers["anthropic-ratelimit-requests-remaining"] == "99"
        assert resp.headers["request-id"].startswith("req_fake")
    assert answer["id"].startswith("msg_")
    assert (answer["type"], answer["role"], answer["model"]) == ("message", "assistant", "claude-served")
    assert answer["content"] == [{"type": "text", "text": "tok0 tok1 tok2"}]
    assert (answer["stop_reason"], answer["stop_sequence"]) == ("end_turn", None)
    assert answer["usage"]["input_tokens"] == 3  # "Hello there, fake"
    assert answer["usage"]["output_tokens"] == 3
    [recorded] = await fake.requests()
    assert recorded["headers"] == headers
    # Without the headers, nothing is echoed.
    async with fake.session.post("/v1/messages", json=body) as resp:
        assert "x-fake-anthropic-version" not in resp.headers
        assert "request-id" in resp.headers


async def test_messages_stop_at_max_tokens(fake: Fake) -> None:
    fake.options.tokens = 5
    _, answer = await post(fake, "/v1/messages", {"model": "c", "max_tokens": 2, "messages": MESSAGES})
    assert answer["content"][0]["text"] == "tok0 tok1"
    assert answer["stop_reason"] == "max_tokens"
    assert answer["usage"]["output_tokens"] == 2


async def test_messages_stream_events_in_order(fake: Fake) -> None:
    fake.options.tokens = 3
    body = {"model": "claude-served", "max_tokens": 100, "messages": MESSAGES, "stream": True}
    async with fake.session.post("/v1/messages", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["request-id"].startswith("req_fake")
        events = typed_events(await resp.text())
    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == name for name, data in events)
    start_message = events[0][1]["message"]
    assert start_message["model"] == "claude-served"
    assert start_message["content"] == []
    assert start_message["stop_reason"] is None
    assert start_message["usage"]["input_tokens"] == 3
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert [data["delta"] for _, data in events[3:6]] == [
        {"type": "text_delta", "text": "tok0 "},
        {"type": "text_delta", "text": "tok1 "},
        {"type": "text_delta", "text": "tok2"},
    ]
    assert events[7][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[7][1]["usage"] == {"output_tokens": 3}


async def test_messages_with_the_anthropic_sdk(fake: Fake) -> None:
    anthropic = pytest.importorskip("anthropic")
    fake.options.tokens = 4
    async with anthropic.AsyncAnthropic(base_url=fake.url, api_key="sk-ant", max_retries=0) as client:
        message = await client.messages.create(model="claude-x", max_tokens=64, messages=MESSAGES)
        assert message.model == "claude-x"
        assert message.content[0].text == "tok0 tok1 tok2 tok3"
        assert message.stop_reason == "end_turn"
        async with client.messages.stream(model="claude-x", max_tokens=3, messages=MESSAGES) as stream:
            texts = [text async for text in stream.text_stream]
            final = await stream.get_final_message()
        assert texts == ["tok0 ", "tok1 ", "tok2"]
        assert final.content[0].text == "tok0 tok1 tok2"
        assert (final.stop_reason, final.usage.output_tokens) == ("max_tokens", 3)
        count = await client.messages.count_tokens(model="claude-x", messages=MESSAGES, system="Be nice")
        assert count.input_tokens == 3 + 2
        with pytest.raises(anthropic.BadRequestError) as info:
            await client.messages.create(model="claude-x", max_tokens=0, messages=MESSAGES)
        assert info.value.body["error"]["type"] == "invalid_request_error"
    [*_, recorded] = await fake.requests()
    assert recorded["headers"]["anthropic-version"]
    assert "sk-ant" in (recorded["authorization"] or "") + recorded["headers"].get("x-api-key", "")


async def test_count_tokens_matches_usage(fake: Fake) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "one two three"}]},
        {"role": "assistant", "content": "four"},
    ]
    body = {"model": "c", "system": [{"type": "text", "text": "five six"}], "messages": messages}
    status, counted = await post(fake, "/v1/messages/count_tokens", body)
    assert (status, counted) == (200, {"input_tokens": 6})
    _, answer = await post(fake, "/v1/messages", {**body, "max_tokens": 10})
    assert answer["usage"]["input_tokens"] == 6


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"model": "c", "messages": MESSAGES}, "max_tokens: Field required"),
        ({"model": "c", "max_tokens": "10", "messages": MESSAGES}, "max_tokens"),
        ({"model": "c", "max_tokens": 10}, "messages: Field required"),
        ({"max_tokens": 10, "messages": MESSAGES}, "model: Field required"),
    ],
)
async def test_messages_bad_request_is_anthropic_shaped(fake: Fake, body: dict[str, Any], message: str) -> None:
    async with fake.session.post("/v1/messages", json=body) as resp:
        assert resp.status == 400
        assert resp.headers["request-id"].startswith("req_fake")
        answer = await resp.json()
    assert_anthropic_error(answer)
    assert answer["error"]["message"].startswith(message)


async def test_messages_api_key(fake: Fake) -> None:
    fake.options.api_key = "sk-ant-secret"
    body = {"model": "c", "max_tokens": 10, "messages": MESSAGES}
    status, answer = await post(fake, "/v1/messages", body)
    assert status == 401
    assert_anthropic_error(answer, "authentication_error")
    status, _ = await post(fake, "/v1/messages", body, headers={"x-api-key": "sk-ant-secret"})
    assert status == 200
    status, _ = await post(fake, "/v1/messages", body, headers={"Authorization": "Bearer sk-ant-secret"})
    assert status == 200
    # x-api-key is the Anthropic way only.
    status, answer = await post(fake, "/v1/responses", {"model": "m"}, headers={"x-api-key": "sk-ant-secret"})
    assert status == 401
    assert_openai_error(answer)


@pytest.mark.parametrize(
    ("status", "type_"), [(429, "rate_limit_error"), (529, "overloaded_error"), (500, "api_error")]
)
async def test_messages_fail_status_is_anthropic_shaped(fake: Fake, status: int, type_: str) -> None:
    fake.options.fail_status = status
    got, answer = await post(fake, "/v1/messages", {"model": "c", "max_tokens": 1, "messages": MESSAGES})
    assert got == status
    assert_anthropic_error(answer, type_)


# --------------------------------------------------------------------------- rerank, score, tokenize


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
async def test_rerank(fake: Fake, path: str) -> None:
    documents = ["the cat sat", {"text": "a dog barked"}, "the cat sat on the mat", "nothing"]
    body = {"model": "reranker", "query": "The cat sat on the mat", "documents": documents}
    status, answer = await post(fake, path, body)
    assert status == 200
    assert answer["model"] == "reranker"
    assert answer["id"]
    assert answer["usage"]["total_tokens"] > 0
    results = answer["results"]
    assert [r["index"] for r in results] == [2, 0, 1, 3]
    assert results[0]["relevance_score"] == 1.0
    assert results[0]["document"] == {"text": "the cat sat on the mat"}
    assert results[2]["document"] == {"text": "a dog barked"}
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    assert scores[-1] == 0.0
    _, again = await post(fake, path, body)
    assert again["results"] == results
    _, top = await post(fake, path, {**body, "top_n": 2, "return_documents": False})
    assert top["results"] == [{"index": r["index"], "relevance_score": r["relevance_score"]} for r in results[:2]]


@pytest.mark.parametrize(
    "body",
    [
        {"documents": ["a"]},
        {"query": "a"},
        {"query": "a", "documents": [3]},
        {"query": "a", "documents": ["a"], "top_n": -1},
    ],
)
async def test_rerank_bad_input(fake: Fake, body: dict[str, Any]) -> None:
    status, answer = await post(fake, "/v1/rerank", {"model": "r", **body})
    assert status == 400
    assert_openai_error(answer)


@pytest.mark.parametrize("path", ["/v1/score", "/score"])
async def test_score(fake: Fake, path: str) -> None:
    status, answer = await post(fake, path, {"model": "scorer", "text_1": "red apple", "text_2": "red apple"})
    assert status == 200
    assert (answer["object"], answer["model"]) == ("list", "scorer")
    assert answer["data"] == [{"index": 0, "object": "score", "score": 1.0}]
    assert answer["usage"]["total_tokens"] == 4
    _, many = await post(fake, path, {"model": "s", "text_1": "red apple", "text_2": ["red", "blue", "apple red"]})
    assert [d["score"] for d in many["data"]] == [0.5, 0.0, 1.0]
    _, pairs = await post(fake, path, {"model": "s", "text_1": ["a", "b"], "text_2": ["a", "c"]})
    assert [d["score"] for d in pairs["data"]] == [1.0, 0.0]
    status, bad = await post(fake, path, {"model": "s", "text_1": ["a", "b"], "text_2": ["a", "b", "c"]})
    assert status == 400
    assert_openai_error(bad)


@pytest.mark.parametrize("prefix", ["", "/v1"])
async def test_tokenize_detokenize_round_trip(fake: Fake, prefix: str) -> None:
    status, tokens = await post(fake, prefix + "/tokenize", {"model": "m", "prompt": "tok3 Hello  wörld tok0"})
    assert status == 200
    assert tokens["count"] == 4
    assert tokens["max_model_len"] > 0
    ids = tokens["tokens"]
    assert ids[0] == 3
    assert ids[3] == 0
    assert all(isinstance(t, int) and t >= 2**30 for t in ids[1:3])
    status, text = await post(fake, prefix + "/detokenize", {"model": "m", "tokens": ids})
    assert (status, text) == (200, {"prompt": "tok3 Hello wörld tok0"})
    # The answer words of the fake are tokens 0, 1, 2, ...
    _, words = await post(fake, prefix + "/detokenize", {"tokens": [0, 1, 2]})
    assert words == {"prompt": "tok0 tok1 tok2"}
    # llama.cpp's shape: "content", no model.
    _, llama = await post(fake, prefix + "/tokenize", {"content": "tok7 tok8"})
    assert llama["tokens"] == [7, 8]
    _, chat = await post(fake, prefix + "/tokenize", {"model": "m", "messages": [{"role": "user", "content": "tok5"}]})
    assert chat["tokens"] == [5]
    status, unknown = await post(fake, prefix + "/detokenize", {"tokens": [2**31 - 1]})
    assert status == 400
    assert_openai_error(unknown)


# --------------------------------------------------------------------------- audio


async def test_transcription_with_the_openai_sdk(fake: Fake) -> None:
    audio = bytes(range(256)) * 5
    async with openai_client(fake) as client:
        result = await client.audio.transcriptions.create(
            model="whisper-served", file=("speech.wav", audio, "audio/wav"), language="en"
        )
    assert result.text == f"fake transcript of {len(audio)} bytes by whisper-served"
    [recorded] = await fake.requests()
    assert recorded["path"] == "/v1/audio/transcriptions"
    assert recorded["model"] == "whisper-served"
    assert recorded["stream"] is False
    body = recorded["body"]
    assert body["model"] == "whisper-served"
    assert body["language"] == "en"
    assert body["file"] == {
        "filename": "speech.wav",
        "content_type": "audio/wav",
        "size": len(audio),
        "sha256": hashlib.sha256(audio).hexdigest(),
    }


def multipart(fields: dict[str, str | list[str]], audio: bytes = b"RIFF....") -> aiohttp.FormData:
    form = aiohttp.FormData()
    form.add_field("file", audio, filename="a.wav", content_type="audio/wav")
    for name, value in fields.items():
        for item in value if isinstance(value, list) else [value]:
            form.add_field(name, item)
    return form


@pytest.mark.parametrize(
    ("fmt", "content_type", "expected"),
    [
        ("text", "text/plain", "fake transcript of 8 bytes by w\n"),
        ("srt", "text/plain", "1\n00:00:00,000 --> 00:00:00,010\nfake transcript of 8 bytes by w\n\n"),
        ("vtt", "text/vtt", "WEBVTT\n\n00:00:00.000 --> 00:00:00.010\nfake transcript of 8 bytes by w\n\n"),
    ],
)
async def test_transcription_text_formats(fake: Fake, fmt: str, content_type: str, expected: str) -> None:
    form = multipart({"model": "w", "response_format": fmt})
    async with fake.session.post("/v1/audio/transcriptions", data=form) as resp:
        assert resp.status == 200
        assert resp.content_type == content_type
        assert await resp.text() == expected


async def test_transcription_verbose_json(fake: Fake) -> None:
    audio = b"\x00" * 64_000
    fields: dict[str, str | list[str]] = {
        "model": "w",
        "response_format": "verbose_json",
        "timestamp_granularities[]": ["word", "segment"],
    }
    async with fake.session.post("/v1/audio/transcriptions", data=multipart(fields, audio)) as resp:
        answer = await resp.json()
    assert answer["task"] == "transcribe"
    assert answer["duration"] == 2.0
    assert answer["text"] == "fake transcript of 64000 bytes by w"
    assert answer["segments"][0]["text"] == answer["text"]
    assert [w["word"] for w in answer["words"]] == answer["text"].split()
    [recorded] = await fake.requests()
    assert recorded["body"]["timestamp_granularities[]"] == ["word", "segment"]


async def test_transcription_stream(fake: Fake) -> None:
    fake.options.token_interval_ms = 30
    async with fake.session.post("/v1/audio/transcriptions", data=multipart({"model": "w", "stream": "true"})) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = typed_events(await resp.text())
    names = [name for name, _ in events]
    assert names == ["transcript.text.delta"] * 7 + ["transcript.text.done"]
    assert all(data["type"] == name for name, data in events)
    assert "".join(data["delta"] for _, data in events[:-1]) == "fake transcript of 8 bytes by w"
    assert events[-1][1]["text"] == "fake transcript of 8 bytes by w"
    assert events[-1][1]["usage"]["type"] == "tokens"
    [recorded] = await fake.requests()
    assert recorded["stream"] is True
    async with openai_client(fake) as client:
        stream = await client.audio.transcriptions.create(
            model="gpt-4o-transcribe", file=("a.wav", b"x" * 3), stream=True
        )
        sdk_events = [event async for event in stream]
    assert sdk_events[-1].type == "transcript.text.done"
    assert sdk_events[-1].text == "fake transcript of 3 bytes by gpt-4o-transcribe"


async def test_translation(fake: Fake) -> None:
    async with fake.session.post("/v1/audio/translations", data=multipart({"model": "w"}, b"12345")) as resp:
        assert resp.status == 200
        assert await resp.json() == {"text": "fake translation of 5 bytes by w"}


async def test_transcription_bad_requests(fake: Fake) -> None:
    status, answer = await post(fake, "/v1/audio/transcriptions", {"model": "w"})
    assert status == 400
    assert_openai_error(answer)
    assert "multipart/form-data" in answer["error"]["message"]
    form = aiohttp.FormData()
    form.add_field("model", "w")
    form.add_field("other", b"x", filename="x.bin")  # a file, not under "file"
    async with fake.session.post("/v1/audio/transcriptions", data=form) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "file"
    async with fake.session.post("/v1/audio/transcriptions", data=multipart({"response_format": "json"})) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "model"
    form = multipart({"model": "w", "response_format": "x"})
    async with fake.session.post("/v1/audio/transcriptions", data=form) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "response_format"


async def test_speech_wav_arrives_in_pieces(fake: Fake) -> None:
    fake.options.tokens = 4
    fake.options.token_interval_ms = 100
    text = "Hello, speech!"
    pieces: list[tuple[float, int]] = []
    stats_at_first_piece: dict[str, int] | None = None
    body = {"model": "tts-served", "input": text, "voice": "alloy", "response_format": "wav"}
    async with fake.session.post("/v1/audio/speech", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "audio/wav"
        assert resp.headers["Transfer-Encoding"] == "chunked"
        assert "Content-Length" not in resp.headers
        total = int(resp.headers["x-fake-audio-bytes"])
        data = b""
        async for piece in resp.content.iter_any():
            pieces.append((time.monotonic(), len(piece)))
            data += piece
            if stats_at_first_piece is None:
                stats_at_first_piece = await fake.stats()
    assert len(data) == total == 44 + len(text) * 480
    assert len(pieces) >= 3
    assert pieces[-1][0] - pieces[0][0] > 0.2
    assert stats_at_first_piece is not None
    assert stats_at_first_piece["in_flight"] == 1
    with wave.open(io.BytesIO(data)) as audio:
        assert (audio.getnchannels(), audio.getsampwidth(), audio.getframerate()) == (1, 2, 24_000)
        assert audio.getnframes() == len(text) * 240
    # Deterministic.
    async with fake.session.post("/v1/audio/speech", json=body) as resp:
        assert await resp.read() == data


@pytest.mark.parametrize(
    ("fmt", "content_type", "magic", "header"),
    [
        (None, "audio/mpeg", b"ID3", 10),
        ("mp3", "audio/mpeg", b"ID3", 10),
        ("pcm", "audio/pcm", b"", 0),
        ("flac", "audio/flac", b"fLaC", 4),
    ],
)
async def test_speech_formats(fake: Fake, fmt: str | None, content_type: str, magic: bytes, header: int) -> None:
    body: dict[str, Any] = {"model": "tts", "input": "hi", "voice": "alloy"}
    if fmt is not None:
        body["response_format"] = fmt
    async with fake.session.post("/v1/audio/speech", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == content_type
        data = await resp.read()
    assert data.startswith(magic)
    assert len(data) == header + 2 * 480 == int(resp.headers["x-fake-audio-bytes"])


async def test_speech_with_the_openai_sdk(fake: Fake) -> None:
    async with openai_client(fake) as client, client.audio.speech.with_streaming_response.create(
        model="tts-1", input="abc", voice="nova", response_format="wav"
    ) as response:
        data = await response.read()
    assert data[:4] == b"RIFF"
    assert len(data) == 44 + 3 * 480


async def test_speech_sse(fake: Fake) -> None:
    fake.options.tokens = 3
    body = {"model": "tts", "input": "abcd", "voice": "alloy", "response_format": "pcm", "stream_format": "sse"}
    async with fake.session.post("/v1/audio/speech", json=body) as resp:
        events = typed_events(await resp.text())
    assert [name for name, _ in events] == ["speech.audio.delta"] * 3 + ["speech.audio.done"]
    audio = b"".join(base64.b64decode(data["audio"]) for _, data in events[:-1])
    assert len(audio) == 4 * 480


@pytest.mark.parametrize(
    "body", [{"voice": "alloy"}, {"input": "x"}, {"input": "x", "voice": "a", "response_format": "ogg"}]
)
async def test_speech_bad_input(fake: Fake, body: dict[str, Any]) -> None:
    status, answer = await post(fake, "/v1/audio/speech", {"model": "tts", **body})
    assert status == 400
    assert_openai_error(answer)


# --------------------------------------------------------------------------- images


def assert_png(data: bytes) -> None:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    position = 8
    chunks: dict[bytes, bytes] = {}
    while position < len(data):
        (length,) = struct.unpack(">I", data[position : position + 4])
        tag = data[position + 4 : position + 8]
        content = data[position + 8 : position + 8 + length]
        (crc,) = struct.unpack(">I", data[position + 8 + length : position + 12 + length])
        assert crc == zlib.crc32(tag + content)
        chunks[tag] = content
        position += 12 + length
    assert list(chunks) == [b"IHDR", b"IDAT", b"IEND"]
    width, height = struct.unpack(">II", chunks[b"IHDR"][:8])
    assert (width, height) == (1, 1)
    assert len(zlib.decompress(chunks[b"IDAT"])) == 1 + 3


async def test_images_with_the_openai_sdk(fake: Fake) -> None:
    async with openai_client(fake) as client:
        result = await client.images.generate(model="image-served", prompt="a red fox", n=2)
    assert result.data is not None
    assert len(result.data) == 2
    images = [base64.b64decode(item.b64_json or "") for item in result.data]
    for image in images:
        assert_png(image)
    assert images[0] != images[1]
    assert result.data[0].revised_prompt == "a red fox"
    [recorded] = await fake.requests()
    assert recorded["model"] == "image-served"


async def test_images_url_and_bad_input(fake: Fake) -> None:
    status, answer = await post(fake, "/v1/images/generations", {"model": "i", "prompt": "x", "response_format": "url"})
    assert status == 200
    [item] = answer["data"]
    assert item["url"].startswith("data:image/png;base64,")
    assert_png(base64.b64decode(item["url"].split(",", 1)[1]))
    bad: list[dict[str, Any]] = [{"prompt": "x", "n": 0}, {"prompt": "x", "n": 11}, {"n": 1}]
    for body in [*bad, {"prompt": "x", "response_format": "gif"}]:
        status, answer = await post(fake, "/v1/images/generations", {"model": "i", **body})
        assert status == 400, body
        assert_openai_error(answer)


# --------------------------------------------------------------------------- knobs on every endpoint

NEW_POSTS = [
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/rerank",
    "/rerank",
    "/v2/rerank",
    "/v1/score",
    "/score",
    "/tokenize",
    "/detokenize",
    "/v1/tokenize",
    "/v1/detokenize",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/v1/audio/speech",
    "/v1/images/generations",
]


@pytest.mark.parametrize("path", NEW_POSTS)
async def test_fail_status_and_stats_on_every_endpoint(fake: Fake, path: str) -> None:
    fake.options.fail_status = 503
    async with fake.session.post(path, json={"model": "m"}, headers={"anthropic-version": "2023-06-01"}) as resp:
        assert resp.status == 503
        body = await resp.json()
        assert resp.headers["x-request-id"]
    if path.startswith("/v1/messages"):
        assert_anthropic_error(body, "api_error")
    else:
        assert_openai_error(body)
    assert (await fake.stats())["completed"] == 1
    [recorded] = await fake.requests()
    assert (recorded["path"], recorded["model"]) == (path, "m")
    assert recorded["headers"] == {"anthropic-version": "2023-06-01"}


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/rerank", "/v1/audio/speech", "/tokenize"])
async def test_api_key_delay_garbage_on_new_endpoints(fake: Fake, path: str) -> None:
    fake.options.api_key = "sk-key"
    status, answer = await post(fake, path, {"model": "m"})
    assert status == 401
    assert_openai_error(answer)
    fake.options.delay_ms = 150
    fake.options.garbage = True
    started = time.monotonic()
    async with fake.session.post(path, json={"model": "m"}, headers={"Authorization": "Bearer sk-key"}) as resp:
        assert resp.status == 200
        text = await resp.text()
    assert time.monotonic() - started >= 0.14
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


async def test_hang_on_a_new_endpoint(fake: Fake) -> None:
    fake.options.hang = True
    body = {"model": "c", "max_tokens": 5, "messages": MESSAGES}
    task = asyncio.ensure_future(post(fake, "/v1/messages", body))
    await fake.wait_stats(in_flight=1)
    assert not task.done()
    fake.options.hang = False
    status, answer = await asyncio.wait_for(task, 5)
    assert (status, answer["model"]) == (200, "c")


async def test_overrides_and_executions_on_new_endpoints(fake: Fake) -> None:
    await post(fake, "/_fake/hooks", {"track_executions": True, "body_overrides": True})
    _, response = await post(fake, "/v1/responses", {"model": "m", "input": "x", "user": "r1", "fake": {"tokens": 2}})
    assert response["output"][0]["content"][0]["text"] == "tok0 tok1"
    body = {"model": "c", "max_tokens": 9, "messages": MESSAGES, "metadata": {"user_id": "r2"}, "stream": True}
    async with fake.session.post("/v1/messages", json={**body, "fake": {"tokens": 1}}) as resp:
        events = typed_events(await resp.text())
    assert [d["delta"]["text"] for name, d in events if name == "content_block_delta"] == ["tok0"]
    async with fake.session.get("/_fake/executions") as resp:
        executions = await resp.json()
    assert [(e["marker"], e["path"], e["stream"], e["outcome"]) for e in executions] == [
        ("r1", "/v1/responses", False, "completed"),
        ("r2", "/v1/messages", True, "completed"),
    ]


async def test_stored_response_requests_are_recorded_with_method(fake: Fake) -> None:
    _, created = await post(fake, "/v1/responses", {"model": "m", "input": "x"})
    async with fake.session.get(f"/v1/responses/{created['id']}") as resp:
        assert resp.status == 200
    recorded = await fake.requests()
    assert "method" not in recorded[0]
    assert recorded[1] == {
        "path": f"/v1/responses/{created['id']}",
        "model": None,
        "stream": False,
        "authorization": None,
        "body": None,
        "method": "GET",
    }


# --------------------------------------------------------------------------- real servers' quirks

UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-8[0-9a-f]{3}-[0-9a-f]{12}")


async def test_v1_answer_headers(fake: Fake) -> None:
    seen: list[str] = []
    requests: list[tuple[str, Any]] = [
        ("/v1/chat/completions", {"model": "m"}),
        ("/v1/chat/completions", {"model": "m", "stream": True}),
        ("/v1/embeddings", {"model": "m"}),  # a 400
        ("/v1/rerank", {"model": "m", "query": "a", "documents": ["a"]}),
    ]
    fake.options.token_interval_ms = 1  # a prepared (streamed) answer too
    for path, body in requests:
        async with fake.session.post(path, json=body) as resp:
            await resp.read()
            headers = resp.headers
            assert UUID.fullmatch(headers["x-request-id"]), headers
            assert int(headers["openai-processing-ms"]) >= 0
            assert headers["x-ratelimit-remaining-requests"] == "99"
            assert headers["Keep-Alive"] == "timeout=5"
            assert "Connection" not in headers
            seen.append(headers["x-request-id"])
    for path in ("/v1/models", "/v1/nope"):
        async with fake.session.get(path) as resp:
            assert resp.headers["Keep-Alive"] == "timeout=5"
            seen.append(resp.headers["x-request-id"])
    assert all(UUID.fullmatch(s) for s in seen)
    assert len(set(seen)) == len(seen)


async def test_stream_no_done(fake: Fake) -> None:
    fake.options.tokens = 2
    fake.options.stream_no_done = True
    for path in ("/v1/chat/completions", "/v1/completions"):
        async with fake.session.post(path, json={"model": "m", "stream": True}) as resp:
            events = sse_events(await resp.text())
        assert "[DONE]" not in events
        assert json.loads(events[-1])["choices"][0]["finish_reason"] == "stop"
    async with openai_client(fake) as client:
        stream = await client.chat.completions.create(model="m", messages=[], stream=True)
        chunks = [chunk async for chunk in stream]
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_empty_200(fake: Fake) -> None:
    fake.options.empty_200 = True
    for body in ({"model": "m"}, {"model": "m", "stream": True}):
        async with fake.session.post("/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Length"] == "0"
            assert await resp.read() == b""
    async with fake.session.post("/v1/audio/speech", json={"model": "m"}) as resp:
        assert (resp.status, await resp.read()) == (200, b"")


async def test_close_idle_keepalive(fake: Fake) -> None:
    fake.options.close_idle_keepalive = True
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(base_url=fake.url, connector=connector) as session:
        async with session.post("/v1/chat/completions", json={"model": "m", "user": "first"}) as resp:
            assert resp.status == 200
            assert "Connection" not in resp.headers  # an ordinary keep-alive answer
            await resp.read()
        # The pooled connection is dead on next use.
        with pytest.raises(aiohttp.ServerDisconnectedError):
            async with session.post("/v1/chat/completions", json={"model": "m", "user": "second"}) as resp:
                await resp.read()
        # A new connection works (once).
        async with session.post("/v1/chat/completions", json={"model": "m", "user": "third"}) as resp:
            assert resp.status == 200
    # The dropped request was neither counted nor recorded.
    assert (await fake.stats())["total"] == 2
    assert [r["body"]["user"] for r in await fake.requests()] == ["first", "third"]
    async with httpx.AsyncClient(base_url=fake.url) as client:
        assert (await client.post("/v1/embeddings", json={"model": "m", "input": "x"})).status_code == 200
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post("/v1/embeddings", json={"model": "m", "input": "x"})
    # Switched off: connections live on.
    fake.options.close_idle_keepalive = False
    async with aiohttp.ClientSession(base_url=fake.url, connector=aiohttp.TCPConnector(limit=1)) as session:
        for _ in range(3):
            async with session.post("/v1/embeddings", json={"model": "m", "input": "x"}) as resp:
                assert resp.status == 200
