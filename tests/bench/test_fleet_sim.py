"""bench/fleet_sim.py, the simulated inference server of bench/prefix_fleet.py: its prefix
cache (hits, LRU eviction, pinned blocks), its OpenAI shapes (the openai SDK reads its
streams and their usage chunk) and the endpoints sglang-router reads. Real HTTP against a
server started in this event loop on a free port (one test starts the command line); the
simulated steps are 1 ms, and nothing here asserts a duration."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from bench.fleet_sim import Scheduler, SimConfig, block_hashes, chat_tokens, start
from iop.processes import Child, wait_port
from iop.redis_server import free_port

pytestmark = pytest.mark.anyio

# Blocks of 4 tokens, 1 ms per step, no per-token cost: requests take milliseconds.
FAST = SimConfig(kv_blocks=64, block_tokens=4, max_batch=4, prefill_budget=64, step_ms=1.0,
                 prefill_ms_per_token=0.0, decode_ms_per_seq=0.0, max_tokens=3)

Serve = Callable[[SimConfig], Awaitable[str]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """Start servers with a given config; each is the base URL of one."""
    runners = []

    async def one(config: SimConfig) -> str:
        port = free_port()
        runners.append(await start(config, "127.0.0.1", port))
        return f"http://127.0.0.1:{port}"

    yield one
    for runner in runners:
        await runner.cleanup()


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def chat(system: str, user: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            **extra}


async def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http, http.post(f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        data: dict[str, Any] = await resp.json()
        return data


async def get(url: str, path: str) -> Any:
    async with aiohttp.ClientSession() as http, http.get(f"{url}{path}") as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


def cached(answer: dict[str, Any]) -> int:
    n: int = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    return n


async def test_a_repeated_prefix_is_cached(serve: Serve) -> None:
    url = await serve(FAST)
    system = words("s", 20)  # <|system|> + 20 words + <|user|>: 22 shared tokens, 5 full blocks of 4
    first = await post(url, chat(system, "first question"))
    second = await post(url, chat(system, "another question here"))
    third = await post(url, chat(system, "another question here"))
    assert first["usage"]["prompt_tokens"] == 1 + 20 + 1 + 2 + 1
    assert cached(first) == 0
    assert cached(second) == 20
    # The whole prompt of the third was computed before (6 full blocks of its 26 tokens).
    assert cached(third) == 24
    assert second["usage"]["completion_tokens"] == 3
    assert second["choices"][0]["message"]["content"] == "tok0 tok1 tok2 "
    stats = await get(url, "/sim/stats")
    assert (stats["requests"], stats["cached_tokens"], stats["running"], stats["waiting"]) == (3, 44, 0, 0)


async def test_lru_eviction_when_the_cache_is_full(serve: Serve) -> None:
    # 10 blocks. A prompt of 27 tokens plus its 1-token answer takes 7, of which 6 stay cached.
    url = await serve(SimConfig(**{**FAST.__dict__, "kv_blocks": 10, "max_tokens": 1}))
    a, b = chat(words("a", 23), "q"), chat(words("b", 23), "q")
    assert cached(await post(url, a)) == 0
    assert cached(await post(url, a)) == 24
    # B needs 7 blocks, 4 are free: three of A's go, its deepest first, so A keeps its first three.
    assert cached(await post(url, b)) == 0
    assert cached(await post(url, a)) == 12
    stats = await get(url, "/sim/stats")
    assert stats["kv_evictions"] == 6  # 3 of A's for B, then 3 of B's for A's return
    assert stats["kv_used"] <= 10


def test_blocks_of_running_requests_are_pinned() -> None:
    s = Scheduler(SimConfig(**{**FAST.__dict__, "kv_blocks": 10}))
    # 27 prompt tokens: 6 full blocks and a partial one; A's 2 answer tokens make 8 blocks, B's 1 makes 7.
    a = s.submit(chat_tokens([{"role": "user", "content": words("a", 25)}]), 2)
    b = s.submit(chat_tokens([{"role": "user", "content": words("b", 25)}]), 1)
    s.admit()
    assert s.running == [a]  # B needs 7 blocks, 2 are free: it waits (FIFO)
    chunks, decoding, _ = s.plan()
    s.apply(chunks, decoding, 0.0)  # A's prefill, and its first token: its 6 full blocks are cached, pinned
    assert a.generated == 1
    assert len(s.kv.refs) == 6
    assert not s.kv.lru
    s.admit()
    assert list(s.waiting) == [b]  # nothing A holds can be evicted while it runs
    chunks, decoding, _ = s.plan()
    s.apply(chunks, decoding, 0.0)  # A's second token: it finishes and lets its blocks go to the LRU
    assert a.done
    assert len(s.kv.lru) == 6
    assert not s.kv.refs
    s.admit()
    assert s.running == [b]
    assert s.kv.evictions == 3  # 4 blocks were free; three of A's made room


def test_prefix_matching_is_by_chained_blocks() -> None:
    one = block_hashes(list("xyzw1234"), 4)
    two = block_hashes(list("xyzw1235"), 4)
    other_root = block_hashes(list("qyzw1234"), 4)
    assert one[0] == two[0]
    assert one[1] != two[1]
    assert one[1] != other_root[1]  # the same second block after another first one is another block


async def test_the_openai_sdk_reads_its_streams(serve: Serve) -> None:
    url = await serve(FAST)
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
    system = words("p", 12)
    texts, usages = [], []
    for _ in range(2):
        stream = await client.chat.completions.create(
            model="served", messages=[{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
            max_tokens=5, stream=True, stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
        assert chunks[-1].choices == []
        assert chunks[-1].model == "served"
        usages.append(chunks[-1].usage)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes == ["length"]
    assert texts == ["tok0 tok1 tok2 tok3 tok4 "] * 2
    first, second = usages
    assert first is not None
    assert second is not None
    assert (first.prompt_tokens, first.completion_tokens) == (16, 5)
    # The same prompt again: cached but for its last token, which a server computes for the first output.
    assert first.prompt_tokens_details is not None
    assert second.prompt_tokens_details is not None
    assert (first.prompt_tokens_details.cached_tokens, second.prompt_tokens_details.cached_tokens) == (0, 15)

    completion = await client.completions.create(model="served", prompt=system, max_tokens=2, stream=True,
                                                  stream_options={"include_usage": True})
    parts = [c async for c in completion]
    assert "".join(c.choices[0].text for c in parts if c.choices) == "tok0 tok1 "
    assert parts[-1].usage is not None
    assert parts[-1].usage.completion_tokens == 2
    await client.close()


async def test_a_stream_without_usage_asked_has_none(serve: Serve) -> None:
    url = await serve(FAST)
    async with aiohttp.ClientSession() as http, http.post(
            f"{url}/v1/chat/completions", json=chat("a b", "c", stream=True)) as resp:
        body = await resp.text()
    events = [line for line in body.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert "usage" not in body
    assert resp.headers["Content-Type"].startswith("text/event-stream")


async def test_what_sglang_router_reads(serve: Serve) -> None:
    config = SimConfig(**{**FAST.__dict__, "model": "sim-model"})
    url = await serve(config)
    for path in ("/get_server_info", "/server_info"):
        info = await get(url, path)
        assert info["model_path"] == "sim-model"
        assert info["dp_size"] == 1
        assert info["max_running_requests"] == config.max_batch
        assert info["max_total_num_tokens"] == config.kv_blocks * config.block_tokens
    for path in ("/get_model_info", "/model_info"):
        assert await get(url, path) == {"model_path": "sim-model", "tokenizer_path": "sim-model",
                                        "is_generation": True}
    load = await get(url, "/get_load")
    assert load[0]["dp_rank"] == 0
    assert load[0]["num_reqs"] == 0
    models = await get(url, "/v1/models")
    assert [m["id"] for m in models["data"]] == ["sim-model"]
    async with aiohttp.ClientSession() as http:
        for path in ("/health", "/health_generate"):
            async with http.get(f"{url}{path}") as resp:
                assert resp.status == 200
        async with http.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": []}) as resp:
            assert resp.status == 400
            assert "error" in await resp.json()
        too_long = chat(words("w", 300), "q")
        async with http.post(f"{url}/v1/chat/completions", json=too_long) as resp:
            assert resp.status == 400  # 64 blocks of 4 tokens cannot hold it
    stats = await get(url, "/sim/stats")
    assert stats["paths"]["GET /get_server_info"] == 1


async def test_reset_empties_the_cache(serve: Serve) -> None:
    url = await serve(FAST)
    body = chat(words("r", 10), "q")
    await post(url, body)
    async with aiohttp.ClientSession() as http, http.post(f"{url}/sim/reset") as resp:
        assert resp.status == 200
    assert cached(await post(url, body)) == 0
    assert (await get(url, "/sim/stats"))["requests"] == 1


def test_the_command_line_serves(tmp_path: Any) -> None:
    port = free_port()
    child = Child("sim", [sys.executable, "-m", "bench.fleet_sim", "--port", str(port), "--kv-blocks", "32",
                          "--model", "cli-model"], {}, log_path=tmp_path / "sim.log").start()
    try:
        wait_port(child, "127.0.0.1", port, timeout=20)
        out = subprocess.run([sys.executable, "-c", f"import urllib.request; print(urllib.request.urlopen("
                              f"'http://127.0.0.1:{port}/v1/models').read().decode())"],
                             capture_output=True, text=True, timeout=20)
        assert '"cli-model"' in out.stdout
    finally:
        assert child.stop(timeout=10) == 0
