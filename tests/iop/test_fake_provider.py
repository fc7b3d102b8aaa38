"""The fake OpenAI-compatible upstream, against a real server on a free port."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from iop.fake_provider import FakeOptions, _OptionsPatch, create_app, start
from iop.redis_server import free_port

pytestmark = pytest.mark.anyio

HOST = "127.0.0.1"


@dataclass
class Fake:
    options: FakeOptions
    session: aiohttp.ClientSession
    url: str

    async def stats(self) -> dict[str, int]:
        async with self.session.get("/_fake/stats") as resp:
            assert resp.status == 200
            result: dict[str, int] = await resp.json()
            return result

    async def wait_stats(self, **expected: int) -> dict[str, int]:
        """The stats once they show ``expected`` (or as they are after 5 s)."""
        deadline = time.monotonic() + 5.0
        while True:
            stats = await self.stats()
            if all(stats[k] == v for k, v in expected.items()) or time.monotonic() > deadline:
                return stats
            await asyncio.sleep(0.02)

    async def requests(self) -> list[dict[str, Any]]:
        async with self.session.get("/_fake/requests") as resp:
            assert resp.status == 200
            result: list[dict[str, Any]] = await resp.json()
            return result


@pytest.fixture
async def fake() -> AsyncIterator[Fake]:
    options = FakeOptions()
    port = free_port()
    runner = await start(HOST, port, options)
    url = f"http://{HOST}:{port}"
    try:
        async with aiohttp.ClientSession(base_url=url) as session:
            yield Fake(options, session, url)
    finally:
        await runner.cleanup()


def sse_events(text: str) -> list[str]:
    """The data payloads of an SSE body, in order."""
    events = []
    for block in text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        events.append(block[len("data: ") :])
    return events


async def post(fake: Fake, path: str, body: Any, **kwargs: Any) -> tuple[int, Any]:
    async with fake.session.post(path, json=body, **kwargs) as resp:
        text = await resp.text()
        return resp.status, json.loads(text) if text else None


def assert_openai_error(body: Any) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str)
    assert body["error"]["message"]


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
        "hang": False,
        "garbage": False,
        "healthy": True,
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
    for method, path in [("GET", "/nope"), ("POST", "/v1/responses"), ("GET", "/v1/models/x")]:
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


@pytest.mark.parametrize("overrides", [{"tokens": -1}, {"delay_ms": "1"}, {"nope": 1}, [1], 3])
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
