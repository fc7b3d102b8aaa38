"""bench/fleet_sim.py, the simulated inference server of bench/prefix_fleet.py and
bench/capacity_fleet.py: its prefix cache (hits, LRU eviction, pinned blocks), its OpenAI
shapes (the openai SDK reads its streams and their usage chunk), the endpoints
sglang-router reads, its engine metrics (written as prometheus_client writes them, refreshed
as vLLM and SGLang refresh theirs) and its run-time control. Real HTTP against a
server started in this event loop on a free port (one test starts the command line); the
simulated steps are 1 ms, and nothing here asserts a duration."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import asdict, replace
from typing import Any

import aiohttp
import prometheus_client
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from bench.fleet_sim import (
    SGLANG_DECODE_LOG_INTERVAL,
    SGLANG_FAMILIES,
    SGLANG_IDLE_LOG_S,
    VLLM_FAMILIES,
    Gauges,
    Scheduler,
    SimConfig,
    Stats,
    block_hashes,
    chat_tokens,
    command_args,
    controlled,
    parse_args,
    prometheus_text,
)
from iop.processes import Child, wait_port
from iop.redis_server import free_port
from tests.bench.conftest import Serve

pytestmark = pytest.mark.anyio

# Blocks of 4 tokens, 1 ms per step, no per-token cost: requests take milliseconds.
FAST = SimConfig(kv_blocks=64, block_tokens=4, max_batch=4, prefill_budget=64, step_ms=1.0,
                 prefill_ms_per_token=0.0, decode_ms_per_seq=0.0, max_tokens=3)

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


# --------------------------------------------------------------------------- engine metrics


def expected_exposition(families: tuple[tuple[str, str, str, Any], ...], labels: dict[str, str],
                        values: dict[str, float]) -> str:
    """What prometheus_client itself (the library vLLM and SGLang serve their metrics with)
    writes for these families, without the counters' ``_created`` series."""
    registry = prometheus_client.CollectorRegistry()
    for name, kind, doc, _ in families:
        if kind == "counter":
            counter = prometheus_client.Counter(name.removesuffix("_total"), doc, list(labels), registry=registry)
            counter.labels(**labels).inc(values[name])
        else:
            gauge = prometheus_client.Gauge(name, doc, list(labels), registry=registry)
            gauge.labels(**labels).set(values[name])
    text = prometheus_client.generate_latest(registry).decode()
    blocks = text.split("# HELP ")
    return "".join("# HELP " + b for b in blocks if b and "_created" not in b.split(" ", 1)[0])


def test_vllm_metrics_are_written_as_prometheus_client_writes_them() -> None:
    config = SimConfig(**{**FAST.__dict__, "metrics": "vllm", "model": "org/model"})
    gauges = Gauges(running=3, waiting=2, kv_used=16, at=0.0)
    stats = Stats(prompt_tokens=100, output_tokens=30, cached_tokens=40)
    values = {"vllm:num_requests_running": 3, "vllm:num_requests_waiting": 2, "vllm:kv_cache_usage_perc": 0.25,
              "vllm:prompt_tokens_total": 100, "vllm:generation_tokens_total": 30,
              "vllm:prefix_cache_queries_total": 100, "vllm:prefix_cache_hits_total": 40}
    text = prometheus_text(config, gauges, stats)
    assert text == expected_exposition(VLLM_FAMILIES, {"model_name": "org/model", "engine": "0"}, values)
    assert 'vllm:num_requests_running{engine="0",model_name="org/model"} 3.0\n' in text
    assert "# TYPE vllm:kv_cache_usage_perc gauge\n" in text


def test_sglang_metrics_are_written_as_prometheus_client_writes_them() -> None:
    config = SimConfig(**{**FAST.__dict__, "metrics": "sglang"})
    gauges = Gauges(running=2, waiting=5, kv_used=48, at=0.0)
    values = {"sglang:num_running_reqs": 2, "sglang:num_queue_reqs": 5, "sglang:token_usage": 0.75,
              "sglang:num_used_tokens": 48 * 4, "sglang:max_total_num_tokens": 64 * 4}
    labels = {"model_name": "sim", "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}
    text = prometheus_text(config, gauges, Stats())
    assert text == expected_exposition(SGLANG_FAMILIES, labels, values)
    assert 'sglang:token_usage{engine_type="unified",model_name="sim",pp_rank="0",tp_rank="0"} 0.75\n' in text


def step(s: Scheduler) -> None:
    s.admit()
    chunks, decoding, _ = s.plan()
    s.apply(chunks, decoding, 0.0)


def user_prompt(tag: str, n: int) -> list[str]:
    return chat_tokens([{"role": "user", "content": words(tag, n)}])


def test_vllm_gauges_follow_every_step() -> None:
    s = Scheduler(SimConfig(**{**FAST.__dict__, "max_batch": 1, "metrics": "vllm"}))
    a = s.submit(user_prompt("a", 6), 3)  # 8 prompt tokens + 3 out: 3 blocks of 4
    s.submit(user_prompt("b", 6), 3)
    assert (s.gauges.running, s.gauges.waiting) == (0, 0)  # nothing stepped yet
    step(s)
    assert (s.gauges.running, s.gauges.waiting, s.gauges.kv_used) == (1, 1, 3)
    step(s)
    step(s)  # A's third token: it finishes, and its 2 prompt blocks stay cached, evictable
    assert a.done
    assert (s.gauges.running, s.gauges.waiting, s.gauges.kv_used) == (0, 1, 0)
    step(s)  # B admitted
    assert (s.gauges.running, s.gauges.waiting) == (1, 0)


def test_a_request_that_arrives_during_a_step_is_not_waiting_in_its_stats() -> None:
    """vLLM's engine core adds new requests to its scheduler between steps: one that arrives
    while a step runs is in no queue of that step's stats, and the next step schedules it.
    One the batch leaves out is waiting."""
    s = Scheduler(SimConfig(**{**FAST.__dict__, "max_batch": 2, "metrics": "vllm"}))
    s.submit(user_prompt("a", 6), 5)
    s.admit()
    chunks, decoding, _ = s.plan()
    s.submit(user_prompt("b", 6), 5)  # during A's first step, with a slot free
    s.apply(chunks, decoding, time.monotonic())
    assert (s.gauges.running, s.gauges.waiting) == (1, 0)
    step(s)  # B scheduled beside A
    assert (s.gauges.running, s.gauges.waiting) == (2, 0)
    s.submit(user_prompt("c", 6), 5)
    step(s)  # the batch is full: C waits
    assert (s.gauges.running, s.gauges.waiting) == (2, 1)

def test_sglang_gauges_refresh_only_when_sglang_logs() -> None:
    s = Scheduler(SimConfig(**{**FAST.__dict__, "max_batch": 2, "metrics": "sglang", "kv_blocks": 256}))
    s.submit(user_prompt("a", 6), SGLANG_DECODE_LOG_INTERVAL + 5)
    step(s)  # a prefill batch forms: logged with the batch that ran before it (none) and the queue
    assert (s.gauges.running, s.gauges.waiting) == (0, 0)
    s.submit(user_prompt("b", 6), SGLANG_DECODE_LOG_INTERVAL + 5)
    s.submit(user_prompt("c", 6), SGLANG_DECODE_LOG_INTERVAL + 5)
    step(s)  # B joins A; C waits
    assert (s.gauges.running, s.gauges.waiting) == (1, 1)
    stale = s.gauges
    for _ in range(SGLANG_DECODE_LOG_INTERVAL - 3):  # decode steps 2..38: no refresh
        step(s)
        assert s.gauges == stale
    step(s)
    step(s)  # the 40th step that decodes
    assert s.gauges != stale
    assert (s.gauges.running, s.gauges.waiting) == (2, 1)


def test_an_idle_sglang_refreshes_its_gauges_after_30_s() -> None:
    s = Scheduler(SimConfig(**{**FAST.__dict__, "metrics": "sglang"}))
    s.gauges = Gauges(running=4, waiting=1, kv_used=9, at=time.monotonic())  # the last busy log
    assert s.current_gauges().running == 4  # idle, but logged less than 30 s ago
    s.gauges = Gauges(running=4, waiting=1, kv_used=9, at=time.monotonic() - SGLANG_IDLE_LOG_S - 1)
    assert s.current_gauges() == Gauges(0, 0, 0, s.gauges.at)


def test_slowdown_multiplies_the_cost_of_a_step() -> None:
    config = SimConfig(**{**FAST.__dict__, "step_ms": 10.0, "prefill_ms_per_token": 1.0, "decode_ms_per_seq": 2.0})
    durations = []
    for slowdown in (1.0, 3.0):
        s = Scheduler(replace(config, slowdown=slowdown))
        s.submit(user_prompt("a", 6), 3)
        s.admit()
        durations.append(s.plan()[2])
    assert durations[0] == pytest.approx((10 + 8) / 1000)
    assert durations[1] == pytest.approx(3 * durations[0])


def test_a_smaller_batch_lets_the_running_finish_and_admits_none_until_under_it() -> None:
    s = Scheduler(SimConfig(**{**FAST.__dict__, "max_batch": 3}))
    for tag in "abcd":
        s.submit(user_prompt(tag, 6), 2)
    s.admit()
    assert len(s.running) == 3
    s.configure({"max_batch": 1})
    step(s)  # their first tokens; nobody admitted beside the three
    assert len(s.running) == 3
    step(s)  # all three finish
    assert not s.running
    step(s)
    assert len(s.running) == 1
    assert not s.waiting


@pytest.mark.parametrize(("changes", "message"), [
    ({"step_ms": -1}, "'step_ms' must be a number ≥ 0"),
    ({"max_batch": 0}, "'max_batch' must be a whole number ≥ 1"),
    ({"max_batch": 2.5}, "'max_batch' must be a whole number ≥ 1"),
    ({"max_batch": True}, "'max_batch' must be a whole number ≥ 1"),
    ({"slowdown": 0}, "'slowdown' must be a number > 0"),
    ({"metrics": "tgi"}, "'metrics' must be one of vllm, sglang, none"),
    ({"kv_blocks": 9}, "not a run-time setting: kv_blocks"),
    ([1, 2], "the body must be a JSON object"),
])
def test_bad_controls_are_refused_and_change_nothing(changes: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        controlled(FAST, changes)
    # Valid changes beside a bad one are not applied either.
    if isinstance(changes, dict):
        with pytest.raises(ValueError, match=message):
            controlled(FAST, {"step_ms": 7, **changes})


async def test_metrics_and_control_over_http(serve: Serve) -> None:
    url = await serve(SimConfig(**{**FAST.__dict__, "metrics": "vllm"}))
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/metrics") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
            text = await resp.text()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert families["vllm:num_requests_running"].type == "gauge"
        assert families["vllm:prompt_tokens"].type == "counter"  # the parser drops the _total
        assert families["vllm:kv_cache_usage_perc"].samples[0].value == 0.0

        async with http.post(f"{url}/sim/control", json={"step_ms": 3, "max_batch": 2, "slowdown": 3,
                                                          "metrics": "sglang"}) as resp:
            assert resp.status == 200
            assert (await resp.json())["config"]["slowdown"] == 3.0
        async with http.get(f"{url}/metrics") as resp:
            assert "sglang:num_queue_reqs{" in await resp.text()
        async with http.post(f"{url}/sim/control", json={"max_batch": 0, "step_ms": 9}) as resp:
            assert resp.status == 400
            assert "'max_batch' must be a whole number ≥ 1" in (await resp.json())["error"]["message"]
        stats = await get(url, "/sim/stats")
        assert {k: stats["config"][k] for k in ("step_ms", "max_batch", "slowdown", "metrics")} == {
            "step_ms": 3.0, "max_batch": 2, "slowdown": 3.0, "metrics": "sglang"}
        assert (await get(url, "/get_server_info"))["max_running_requests"] == 2
        await post(url, chat("a b", "c"))  # it still serves, on the new settings

        async with http.post(f"{url}/sim/control", json={"metrics": "none"}) as resp:
            assert resp.status == 200
        async with http.get(f"{url}/metrics") as resp:
            assert resp.status == 404  # as a server without metrics
        async with http.post(f"{url}/sim/reset") as resp:
            assert resp.status == 200
        assert (await get(url, "/sim/stats"))["config"] == asdict(SimConfig(**{**FAST.__dict__, "metrics": "vllm"}))
        async with http.get(f"{url}/metrics") as resp:
            assert resp.status == 200


def test_command_args_serve_the_config() -> None:
    config = SimConfig(kv_blocks=123, block_tokens=8, max_batch=3, prefill_budget=512, step_ms=12.5,
                       prefill_ms_per_token=0.25, decode_ms_per_seq=1.5, max_tokens=7, model="m-1",
                       catch_up_ms=40.0, slowdown=2.0, metrics="sglang")
    assert parse_args(["--port", "9", *command_args(config)]) == (config, "127.0.0.1", 9)
