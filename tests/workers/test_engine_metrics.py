"""Reading an engine's own load (workers/engine_metrics.py): the exposition formats of vLLM,
SGLang and llama.cpp's server, scanned for the few names wanted; and a real HTTP server
that answers them, or has no metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from iop.redis_server import free_port
from workers.engine_metrics import SOURCES, EngineMetrics, parse, sample_sum

pytestmark = pytest.mark.anyio

VLLM = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen"} 7.0
vllm:num_requests_running{engine="1",model_name="qwen"} 5.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="qwen"} 3.0
vllm:num_requests_waiting{engine="1",model_name="qwen"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="qwen"} 0.41
vllm:num_requests_running_total{engine="0"} 99
vllm:request_success_total{finished_reason="stop",model_name="qwen"} 1234.0
"""

SGLANG = b"""# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",engine_type="unified",tp_rank="0"} 4.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m",engine_type="unified",tp_rank="0"} 2.0
sglang:token_usage{model_name="m",engine_type="unified",tp_rank="0"} 0.25
"""

LLAMACPP = b"""# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 4
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 1
"""


def test_vllm_sums_its_engines_and_ignores_longer_names() -> None:
    load = parse(VLLM, SOURCES["vllm"], at=1.0)
    assert load is not None
    assert (load.running, load.waiting, load.kv_usage) == (12, 3, 0.41)


def test_vllm_before_0_10_names_its_kv_use_otherwise() -> None:
    old = VLLM.replace(b"kv_cache_usage_perc", b"gpu_cache_usage_perc")
    load = parse(old, SOURCES["vllm"], at=1.0)
    assert load is not None
    assert load.kv_usage == 0.41


def test_sglang() -> None:
    load = parse(SGLANG, SOURCES["sglang"], at=1.0)
    assert load is not None
    assert (load.running, load.waiting, load.kv_usage) == (4, 2, 0.25)
    assert load.at_events  # set as it logs its stats, not at every step


def test_vllm_and_llama_server_set_their_gauges_at_every_step_or_scrape() -> None:
    for text, kind in ((VLLM, "vllm"), (LLAMACPP, "llamacpp")):
        load = parse(text, SOURCES[kind], at=1.0)
        assert load is not None
        assert not load.at_events


def test_llama_server() -> None:
    load = parse(LLAMACPP, SOURCES["llamacpp"], at=1.0)
    assert load is not None
    assert (load.running, load.waiting, load.kv_usage) == (4, 1, None)


def test_an_exposition_without_the_names_is_no_reading() -> None:
    assert parse(b"# nothing\nprocess_cpu_seconds_total 3\n", SOURCES["vllm"], at=1.0) is None
    assert sample_sum(b"x_total 1\nx 2\n", "x") == 2.0
    assert sample_sum(b"x NaN\n", "x") is None
    assert sample_sum(b"# HELP x is x\n", "x") is None


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, dict[str, bytes | None]]]:
    body: dict[str, bytes | None] = {"metrics": VLLM}
    seen: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append(request.path)
        if body["metrics"] is None:
            return web.Response(status=404)
        return web.Response(body=body["metrics"], content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", body
    finally:
        await runner.cleanup()


async def test_a_real_server_is_read_and_one_without_metrics_left_alone(
        server: tuple[str, dict[str, bytes | None]]) -> None:
    url, body = server
    async with aiohttp.ClientSession() as session:
        reader = EngineMetrics(session, url, "vllm")
        load = await reader.read(1.0)
        assert load is not None
        assert load.waiting == 3
        assert reader.last == load
        body["metrics"] = None
        assert await reader.read(1.0) is None
        assert "404" in reader.error
        assert not reader.available  # not asked again for a while
        assert reader.last == load  # the last reading stays (its age says how old)


async def test_types_without_metrics_are_never_asked(server: tuple[str, dict[str, bytes | None]]) -> None:
    url, _ = server
    async with aiohttp.ClientSession() as session:
        for kind in ("openai_api", "ollama", "lemonade", "cli"):
            reader = EngineMetrics(session, url, kind)
            assert not reader.available
            assert await reader.read(1.0) is None
