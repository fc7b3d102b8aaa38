"""The fake provider's Ollama model lifecycle: /api/ps, /api/tags, load/unload through /api/generate
and /api/chat, loading on demand, LRU eviction at max_loaded, keep-alive expiry, the counters."""

from __future__ import annotations

import asyncio
import datetime
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from iop import cli
from iop.fake_provider import FakeOptions, start
from iop.fake_provider._lifecycle import parse_keep_alive
from iop.redis_server import free_port

pytestmark = pytest.mark.anyio

HOST = "127.0.0.1"
# Ollama's ProcessModelResponse / ListModelResponse / ModelDetails (api/types.go).
PS_KEYS = {"name", "model", "size", "digest", "details", "expires_at", "size_vram", "context_length"}
TAGS_KEYS = {"name", "model", "modified_at", "size", "digest", "details"}
DETAILS_KEYS = {"parent_model", "format", "family", "families", "parameter_size", "quantization_level"}
# A pause no test waits out: a stream that holds its model until the client goes away.
FOREVER_MS = 600_000


@dataclass
class Fake:
    options: FakeOptions
    session: aiohttp.ClientSession
    url: str

    async def get(self, path: str) -> Any:
        async with self.session.get(path) as resp:
            assert resp.status == 200, path
            return await resp.json()

    async def post(self, path: str, body: Any) -> tuple[int, Any]:
        async with self.session.post(path, json=body) as resp:
            text = await resp.text()
            return resp.status, json.loads(text) if text else None

    async def lifecycle(self) -> dict[str, Any]:
        result: dict[str, Any] = await self.get("/_fake/lifecycle")
        return result

    async def ps(self) -> list[str]:
        return [m["name"] for m in (await self.get("/api/ps"))["models"]]

    async def wait_lifecycle(self, condition: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """The lifecycle state once ``condition`` holds (or as it is after 5 s)."""
        deadline = time.monotonic() + 5.0
        while True:
            state = await self.lifecycle()
            if condition(state) or time.monotonic() > deadline:
                return state
            await asyncio.sleep(0.01)


@pytest.fixture
async def make_fake() -> AsyncIterator[Callable[..., Any]]:
    runners: list[Any] = []
    sessions: list[aiohttp.ClientSession] = []

    async def make(**fields: Any) -> Fake:
        options = FakeOptions(**fields)
        port = free_port()
        runners.append(await start(HOST, port, options))
        url = f"http://{HOST}:{port}"
        session = aiohttp.ClientSession(base_url=url)
        sessions.append(session)
        return Fake(options, session, url)

    try:
        yield make
    finally:
        for session in sessions:
            await session.close()
        for runner in runners:
            await runner.cleanup()


async def hold(fake: Fake, model: str) -> tuple[aiohttp.ClientSession, aiohttp.ClientResponse]:
    """A stream of ``model`` that keeps it busy until the returned session closes: its first chunk
    has arrived, so its model is loaded and in use."""
    session = aiohttp.ClientSession(base_url=fake.url)
    body = {"model": model, "stream": True, "fake": {"token_interval_ms": FOREVER_MS}}
    resp = await session.post("/v1/chat/completions", json=body)
    assert resp.status == 200
    await resp.content.readline()
    return session, resp


async def switch_on_overrides(fake: Fake) -> None:
    status, _ = await fake.post("/_fake/hooks", {"body_overrides": True})
    assert status == 200


def parse_go_time(text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))


# --------------------------------------------------------------------------- shapes


async def test_tags_lists_every_model_and_ps_the_loaded_ones(make_fake: Callable[..., Any]) -> None:
    fake = await make_fake(models=["a", "b"], max_loaded=2)
    tags = (await fake.get("/api/tags"))["models"]
    assert [m["name"] for m in tags] == ["a", "b"]
    for entry in tags:
        assert set(entry) == TAGS_KEYS
        assert set(entry["details"]) == DETAILS_KEYS
    assert await fake.get("/api/ps") == {"models": []}  # a fresh Ollama holds nothing

    status, _ = await fake.post("/api/generate", {"model": "b"})
    assert status == 200
    ps = (await fake.get("/api/ps"))["models"]
    assert [m["name"] for m in ps] == ["b"]
    assert set(ps[0]) == PS_KEYS
    assert ps[0]["model"] == "b"
    assert set(ps[0]["details"]) == DETAILS_KEYS
    assert ps[0]["digest"] == tags[1]["digest"]
    # No keep-alive: it never expires (Ollama's "forever" is ~292 years away).
    assert parse_go_time(ps[0]["expires_at"]).year > 2200


async def test_lifecycle_off_every_model_always_loaded(make_fake: Callable[..., Any]) -> None:
    fake = await make_fake(models=["a", "b"])
    assert await fake.ps() == ["a", "b"]
    for body, reason in (({"model": "a"}, "load"), ({"model": "a", "keep_alive": 0}, "unload")):
        status, answer = await fake.post("/api/generate", body)
        assert (status, answer["done_reason"]) == (200, reason)
    assert await fake.ps() == ["a", "b"]
    state = await fake.lifecycle()
    assert state["on"] is False
    assert (state["loads"], state["unloads"], state["total_loads"]) == ({}, {}, 0)


# --------------------------------------------------------------------------- load and unload through the API


async def test_load_through_generate_and_chat(make_fake: Callable[..., Any]) -> None:
    fake = await make_fake(models=["a", "b"], load_ms=0)
    status, answer = await fake.post("/api/generate", {"model": "a"})
    assert status == 200
    assert set(answer) == {"model", "created_at", "response", "done", "done_reason"}
    assert (answer["model"], answer["response"], answer["done"], answer["done_reason"]) == ("a", "", True, "load")
    parse_go_time(answer["created_at"])

    status, answer = await fake.post("/api/chat", {"model": "b", "messages": []})
    assert status == 200
    assert answer["message"] == {"role": "assistant", "content": ""}
    assert (answer["done"], answer["done_reason"]) == (True, "load")

    assert sorted(await fake.ps()) == ["a", "b"]
    state = await fake.lifecycle()
    assert state["loads"] == {"a": {"request": 0, "api": 1}, "b": {"request": 0, "api": 1}}
    assert state["total_loads"] == 2


async def test_loading_a_loaded_model_loads_nothing(make_fake: Callable[..., Any]) -> None:
    fake = await make_fake(models=["a"], load_ms=0)
    for _ in range(3):
        status, _ = await fake.post("/api/generate", {"model": "a", "prompt": ""})
        assert status == 200
    assert (await fake.lifecycle())["loads"] == {"a": {"request": 0, "api": 1}}


@pytest.mark.parametrize("keep_alive", [0, 0.0, "0", "0s", "0m"])
async def test_unload_with_keep_alive_zero(make_fake: Callable[..., Any], keep_alive: Any) -> None:
    fake = await make_fake(models=["a", "b"], load_ms=0)
    await fake.post("/api/generate", {"model": "a"})
    await fake.post("/api/generate", {"model": "b"})
    status, answer = await fake.post("/api/generate", {"model": "a", "keep_alive": keep_alive})
    assert status == 200
    assert set(answer) == {"model", "created_at", "response", "done", "done_reason"}
    assert (answer["model"], answer["response"], answer["done"], answer["done_reason"]) == ("a", "", True, "unload")
    assert await fake.ps() == ["b"]
    assert (await fake.lifecycle())["unloads"] == {"a": {"api": 1, "keep_alive": 0, "evict": 0}}


async def test_unload_through_chat_and_of_a_model_not_loaded(make_fake: Callable[..., Any]) -> None:
    fake = await make_fake(models=["a"], load_ms=0)
    status, answer = await fake.post("/api/chat", {"model": "a", "keep_alive": 0})
    assert (status, answer["done_reason"], answer["message"]) == (200, "unload", {"role": "assistant", "content": ""})
    assert (await fake.lifecycle())["total_unloads"] == 0  # nothing was loaded
    await fake.post("/api/chat", {"model": "a"})
    status, answer = await fake.post("/api/chat", {"model": "a", "messages": [], "keep_alive": "0s"})
    assert (status, answer["done_reason"]) == (200, "unload")
    assert await fake.ps() == []


async def test_unload_of_a_busy_model_waits_until_it_is_idle(make_fake: Callable[..., Any]) -> None:
    fake = await make_fake(models=["a"], load_ms=0)
    await switch_on_overrides(fake)
    session, _ = await hold(fake, "a")
    try:
        status, answer = await fake.post("/api/generate", {"model": "a", "keep_alive": 0})
        assert (status, answer["done_reason"]) == (200, "unload")
        assert await fake.ps() == ["a"]  # still running its request
    finally:
        await session.close()
    state = await fake.wait_lifecycle(lambda s: not s["loaded"])
    assert state["loaded"] == []
    assert state["unloads"] == {"a": {"api": 1, "keep_alive": 0, "evict": 0}}


async def test_native_errors_in_ollama_shape(make_fake: Callable[..., Any]) -> None:
    fake = await make_fake(models=["a"], max_loaded=1)
    assert await fake.post("/api/generate", {"model": "zzz"}) == (404, {"error": "model 'zzz' not found"})
    assert await fake.post("/api/chat", {}) == (404, {"error": "model '' not found"})
    status, answer = await fake.post("/api/generate", {"model": "a", "keep_alive": "5"})
    assert (status, answer) == (400, {"error": 'time: missing unit in duration "5"'})
    status, answer = await fake.post("/api/generate", {"model": "a", "keep_alive": True})
    assert (status, answer) == (400, {"error": "Unsupported type: 'bool'"})
    assert (await fake.lifecycle())["total_loads"] == 0


# --------------------------------------------------------------------------- loading on demand


async def test_request_for_an_unloaded_model_loads_it_first(make_fake: Callable[..., Any]) -> None:
    load_ms = 150
    fake = await make_fake(models=["a", "b"], load_ms=load_ms)
    async with fake.session.post("/v1/chat/completions", json={"model": "a"}) as resp:
        assert resp.status == 200
        assert (await resp.json())["model"] == "a"
        # The answer waited for the load.
        assert int(resp.headers["openai-processing-ms"]) >= load_ms
    async with fake.session.post("/v1/chat/completions", json={"model": "a"}) as resp:
        assert resp.status == 200
        assert int(resp.headers["openai-processing-ms"]) < load_ms  # loaded now
    status, body = await fake.post("/v1/embeddings", {"model": "b", "input": "x"})
    assert (status, body["model"]) == (200, "b")
    state = await fake.lifecycle()
    assert state["loads"] == {"a": {"request": 1, "api": 0}, "b": {"request": 1, "api": 0}}
    assert state["loaded"] == ["a", "b"]


async def test_generate_with_a_prompt_loads_and_answers(make_fake: Callable[..., Any]) -> None:
    fake = await make_fake(models=["a"], load_ms=50, tokens=3)
    status, answer = await fake.post("/api/generate", {"model": "a", "prompt": "hi", "stream": False})
    assert status == 200
    expected = ("a", "tok0 tok1 tok2", True, "stop")
    assert (answer["model"], answer["response"], answer["done"], answer["done_reason"]) == expected
    assert answer["eval_count"] == 3
    assert answer["load_duration"] >= 50_000_000  # nanoseconds, as Ollama
    # Streams unless told not to, as NDJSON: a line per token, then the done line.
    async with fake.session.post("/api/generate", json={"model": "a", "prompt": "hi"}) as resp:
        assert resp.headers["Content-Type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in (await resp.text()).splitlines()]
    assert [line["response"] for line in lines] == ["tok0 ", "tok1 ", "tok2", ""]
    assert [line["done"] for line in lines] == [False, False, False, True]
    assert lines[-1]["done_reason"] == "stop"
    status, answer = await fake.post("/api/chat", {"model": "a", "messages": [{"role": "user", "content": "hi"}],
                                                   "stream": False})
    assert (status, answer["message"], answer["done_reason"]) == (
        200, {"role": "assistant", "content": "tok0 tok1 tok2"}, "stop")
    assert (await fake.lifecycle())["loads"] == {"a": {"request": 1, "api": 0}}


async def test_concurrent_requests_for_one_model_load_it_once(make_fake: Callable[..., Any]) -> None:
    fake = await make_fake(models=["a"], load_ms=100)
    results = await asyncio.gather(*(fake.post("/v1/chat/completions", {"model": "a"}) for _ in range(4)))
    assert [status for status, _ in results] == [200] * 4
    assert (await fake.lifecycle())["loads"] == {"a": {"request": 1, "api": 0}}


async def test_one_load_at_a_time(make_fake: Callable[..., Any]) -> None:
    load_ms = 150
    fake = await make_fake(models=["a", "b"], load_ms=load_ms)

    async def processing_ms(model: str) -> int:
        async with fake.session.post("/v1/chat/completions", json={"model": model}) as resp:
            assert resp.status == 200
            return int(resp.headers["openai-processing-ms"])

    times = await asyncio.gather(processing_ms("a"), processing_ms("b"))
    # The second load started when the first ended.
    assert max(times) >= 2 * load_ms
    assert (await fake.lifecycle())["total_loads"] == 2


async def test_unknown_model_answers_as_before(make_fake: Callable[..., Any]) -> None:
    fake = await make_fake(models=["a"], max_loaded=1, load_ms=0)
    status, body = await fake.post("/v1/chat/completions", {"model": "zzz"})
    assert (status, body["model"]) == (200, "zzz")
    state = await fake.lifecycle()
    assert (state["total_loads"], state["loaded"]) == (0, [])


# --------------------------------------------------------------------------- eviction


async def test_lru_idle_model_evicted_at_max_loaded(make_fake: Callable[..., Any]) -> None:
    fake = await make_fake(models=["a", "b", "c"], max_loaded=2, load_ms=0)
    await fake.post("/api/generate", {"model": "a"})
    await fake.post("/api/generate", {"model": "b"})
    status, _ = await fake.post("/v1/chat/completions", {"model": "a"})  # a is now the most recent
    assert status == 200
    status, _ = await fake.post("/v1/chat/completions", {"model": "c"})
    assert status == 200
    assert sorted(await fake.ps()) == ["a", "c"]
    state = await fake.lifecycle()
    assert state["loaded"] == ["a", "c"]
    assert state["unloads"] == {"b": {"api": 0, "keep_alive": 0, "evict": 1}}
    assert state["loads"]["c"] == {"request": 1, "api": 0}


async def test_busy_model_is_not_evicted_the_load_waits(make_fake: Callable[..., Any]) -> None:
    fake = await make_fake(models=["a", "b"], max_loaded=1, load_ms=0)
    await switch_on_overrides(fake)
    session, _ = await hold(fake, "a")
    try:
        waiting = asyncio.ensure_future(fake.post("/v1/chat/completions", {"model": "b"}))
        state = await fake.wait_lifecycle(lambda s: s["waiting"] == ["b"])
        assert state["waiting"] == ["b"]
        assert (state["loaded"], state["in_use"]) == (["a"], {"a": 1})
        assert await fake.ps() == ["a"]
        assert not waiting.done()
    finally:
        await session.close()  # a goes idle: b's load proceeds
    status, body = await asyncio.wait_for(waiting, 5)
    assert (status, body["model"]) == (200, "b")
    state = await fake.lifecycle()
    assert (state["loaded"], state["waiting"]) == (["b"], [])
    assert state["unloads"] == {"a": {"api": 0, "keep_alive": 0, "evict": 1}}


async def test_raising_max_loaded_frees_a_waiting_load(make_fake: Callable[..., Any]) -> None:
    fake = await make_fake(models=["a", "b"], max_loaded=1, load_ms=0)
    await switch_on_overrides(fake)
    session, _ = await hold(fake, "a")
    try:
        waiting = asyncio.ensure_future(fake.post("/v1/chat/completions", {"model": "b"}))
        await fake.wait_lifecycle(lambda s: s["waiting"] == ["b"])
        status, _ = await fake.post("/_fake/control", {"max_loaded": 2})
        assert status == 200
        status, _ = await asyncio.wait_for(waiting, 5)
        assert status == 200
        assert sorted(await fake.ps()) == ["a", "b"]
    finally:
        await session.close()


# --------------------------------------------------------------------------- keep-alive


async def test_idle_model_expires_after_keep_alive(make_fake: Callable[..., Any]) -> None:
    fake = await make_fake(models=["a"], keep_alive_s=0.05)
    status, _ = await fake.post("/v1/chat/completions", {"model": "a"})
    assert status == 200
    state = await fake.wait_lifecycle(lambda s: not s["loaded"])
    assert state["loaded"] == []
    assert state["unloads"] == {"a": {"api": 0, "keep_alive": 1, "evict": 0}}
    assert await fake.ps() == []


async def test_busy_model_does_not_expire(make_fake: Callable[..., Any]) -> None:
    fake = await make_fake(models=["a", "b"], keep_alive_s=0)
    await switch_on_overrides(fake)
    session, _ = await hold(fake, "a")
    try:
        # b, loaded and done after a, expires at once; a, busy, stays.
        await fake.post("/v1/chat/completions", {"model": "b"})
        state = await fake.wait_lifecycle(lambda s: s["total_unloads"] == 1)
        assert (state["loaded"], state["unloads"]) == (["a"], {"b": {"api": 0, "keep_alive": 1, "evict": 0}})
    finally:
        await session.close()
    state = await fake.wait_lifecycle(lambda s: not s["loaded"])
    assert state["unloads"]["a"] == {"api": 0, "keep_alive": 1, "evict": 0}


async def test_request_keep_alive_sets_the_expiry(make_fake: Callable[..., Any]) -> None:
    fake = await make_fake(models=["a", "b"], load_ms=0)
    await fake.post("/api/generate", {"model": "a", "keep_alive": "5m"})
    await fake.post("/api/generate", {"model": "b", "keep_alive": -1})
    before = datetime.datetime.now(datetime.UTC)
    ps = (await fake.get("/api/ps"))["models"]
    # Longest time left first, as Ollama sorts it.
    assert [m["name"] for m in ps] == ["b", "a"]
    left = parse_go_time(ps[1]["expires_at"]) - before
    assert datetime.timedelta(seconds=290) < left <= datetime.timedelta(seconds=300)
    assert parse_go_time(ps[0]["expires_at"]).year > 2200
    # A short one runs out.
    await fake.post("/api/generate", {"model": "a", "keep_alive": "10ms"})
    state = await fake.wait_lifecycle(lambda s: s["loaded"] == ["b"])
    assert state["loaded"] == ["b"]
    assert state["unloads"] == {"a": {"api": 0, "keep_alive": 1, "evict": 0}}


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(300, 300.0), (1.5, 1.5), ("5m", 300.0), ("1h30m", 5400.0), ("1.5s", 1.5), ("250ms", 0.25),
     ("0", 0.0), (-1, None), ("-1s", None), ("-5m", None)],
)
def test_keep_alive_parsed_as_ollama(value: object, seconds: float | None) -> None:
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize(
    ("value", "message"),
    [("5", 'time: missing unit in duration "5"'), ("", 'time: invalid duration ""'),
     ("abc", 'time: invalid duration "abc"'), ("5x", 'time: unknown unit "x" in duration "5x"'),
     ([1], "Unsupported type: '[]interface {}'")],
)
def test_keep_alive_rejected_as_ollama(value: object, message: str) -> None:
    with pytest.raises(ValueError, match="^" + message.replace("[", r"\[").replace("]", r"\]") + "$"):
        parse_keep_alive(value)


# --------------------------------------------------------------------------- counters, options


async def test_counters_reset(make_fake: Callable[..., Any]) -> None:
    fake = await make_fake(models=["a", "b"], max_loaded=1, load_ms=0)
    await fake.post("/v1/chat/completions", {"model": "a"})
    await fake.post("/v1/chat/completions", {"model": "b"})
    state = await fake.lifecycle()
    assert (state["total_loads"], state["total_unloads"]) == (2, 1)
    async with fake.session.post("/_fake/lifecycle/reset") as resp:
        assert resp.status == 200
        state = await resp.json()
    assert (state["loads"], state["unloads"], state["total_loads"], state["total_unloads"]) == ({}, {}, 0, 0)
    assert state["loaded"] == ["b"]  # the counters only


async def test_control_validates_lifecycle_options(make_fake: Callable[..., Any]) -> None:
    fake = await make_fake()
    for body in ({"max_loaded": 0}, {"load_ms": -1}, {"keep_alive_s": -0.5}):
        status, _ = await fake.post("/_fake/control", body)
        assert status == 400, body
    status, options = await fake.post("/_fake/control", {"max_loaded": 3, "load_ms": 10, "keep_alive_s": 1.5})
    assert status == 200
    assert (options["max_loaded"], options["load_ms"], options["keep_alive_s"]) == (3, 10, 1.5)


def test_cli_options(monkeypatch: pytest.MonkeyPatch) -> None:
    import iop.fake_provider

    seen: list[FakeOptions] = []
    monkeypatch.setattr(iop.fake_provider, "run", lambda host, port, options: seen.append(options))
    argv = ["fake-provider", "--port", "1", "--models", "a,b", "--max-loaded", "2", "--load-ms", "300",
            "--keep-alive-s", "300"]
    assert cli.main(argv) == 0
    (options,) = seen
    assert (options.models, options.max_loaded, options.load_ms, options.keep_alive_s) == (["a", "b"], 2, 300, 300.0)
    assert cli.main(["fake-provider", "--port", "1"]) == 0
    assert (seen[1].max_loaded, seen[1].load_ms, seen[1].keep_alive_s) == (None, None, None)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["fake-provider", "--port", "1", "--max-loaded", "0"])
