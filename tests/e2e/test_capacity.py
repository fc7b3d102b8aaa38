"""Capacity that iop learns, through real processes (issue 30): a simulated continuous-batching
server (``bench/fleet_sim.py``, a process of its own, with vLLM's engine metrics or none) behind
iop's worker and API processes with ``capacity: auto``, kept busy by a load beyond its batch.
The learned limit settles near the server's batch (within the benchmark's 0.75x-2x), shows in
the catalog with its mode, reason and history, and nothing is lost."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from iop.redis_server import RedisServer
from tests.e2e.system import Proc, System, fast_dispatch

BATCH = 4


def start_sim(system: System, name: str, metrics: str) -> None:
    port = system.port(name)
    proc = Proc(name, [sys.executable, "-m", "bench.fleet_sim", "--port", str(port), "--max-batch", str(BATCH),
                       "--step-ms", "10", "--prefill-ms-per-token", "0.02", "--metrics", metrics], system.env,
                system.dir).start()
    system.procs.append(proc)
    system.wait_until(f"{name} up", lambda: _up(port), timeout=60)


def _up(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(params=["vllm", "none"], ids=["engine-metrics", "latency-only"])
def system(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           redis_server: RedisServer) -> Iterator[System]:
    sys_ = System(tmp_path_factory.mktemp("capacity"), redis_server)
    sys_.write_config({
        "models": [{"id": "m", "providers": {"p": "sim"}}],
        "nodes": [{"id": "n1", "providers": [
            {"id": "p", "type": "vllm", "base_url": f"http://127.0.0.1:{sys_.port('sim')}", "models": ["sim"],
             "capacity": "auto", "max_capacity": 32, "timeout_s": 60}]}],
        "queue": {"max_queue": 500, "queue_timeout_ms": 120_000},
        "dispatch": fast_dispatch(lease_ms=15_000),
    })
    with sys_:
        start_sim(sys_, "sim", request.param)
        sys_.worker("n1")
        sys_.api()
        sys_.wait_available("p")
        yield sys_


def provider_view(system: System) -> dict[str, Any]:
    catalog = httpx.get(f"{system.api_url}/catalog", timeout=10).json()
    return next(p for p in catalog["providers"] if p["id"] == "p")


async def keep_busy(system: System, seconds: float, concurrency: int) -> list[int]:
    """``concurrency`` callers, each sending streamed requests one after the other."""
    statuses: list[int] = []
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    body = {"model": "m", "max_tokens": 24, "stream": True, "messages": [{"role": "user", "content": "hello there"}]}

    async def caller(client: httpx.AsyncClient) -> None:
        while loop.time() < end:
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                async for _ in resp.aiter_bytes():
                    pass
                statuses.append(resp.status_code)

    async with httpx.AsyncClient(base_url=system.api_url, timeout=120) as client:
        await asyncio.gather(*(caller(client) for _ in range(concurrency)))
    return statuses


def test_the_learned_capacity_settles_near_the_server_s_batch(system: System) -> None:
    statuses = asyncio.run(keep_busy(system, seconds=25, concurrency=3 * BATCH))
    assert statuses, "no request finished"
    assert set(statuses) == {200}  # nothing lost on the way
    view = provider_view(system)
    assert view["capacity_mode"] == "auto"
    assert view["capacity_bounds"] == [1, 32]
    history = [limit for _, limit in view["capacity_history"]]
    assert history, "a learned limit that never moved"
    # Settled within the benchmark's band: at least 0.75x the batch, at most twice it.
    assert 0.75 * BATCH <= view["capacity"] <= 2 * BATCH, (view["capacity"], history, view["capacity_reason"])
    assert view["capacity_reason"]
