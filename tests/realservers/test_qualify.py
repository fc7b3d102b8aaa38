"""``iop qualify`` in front of real servers (issue 32's goals): three llama.cpp ``llama-server``
processes of ``--parallel 4`` -- two on the tiny GGUF, one on a GGUF of other weights (another
seed: the same shapes and vocabulary, other answers) -- all serving model ``tiny`` under one
served name, and a fake provider slower to start, beside one of them under model ``ranked``.

* No knee is asserted here: a throughput curve is a timing claim (bench/, not pass/fail), and
  on a small shared machine llama-server's tiny model is bound by the CPU it shares with iop,
  not by its slots (its curve is flat from concurrency 1). The knee logic is tested on curves
  (tests/iop/qualify/test_workload.py) and through the fake of 4 slots (tests/e2e).
* The rank follows the TTFT a client measures (the report's own p50 at concurrency 1), and
  the fake's 300 ms start puts it behind llama-server's tiny model.
* Agreement: greedy decoding of one GGUF answers the same words on every server; the other
  seed's does not, and is flagged while the two that agree pass.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from iop.redis_server import RedisServer
from tests.e2e.system import System, http_provider
from tests.realservers.servers import LLAMA_SERVED, RealServer, start_llama_server, unavailable

OTHER_SEED = 777
SLOW_MS = 300
CAPACITY = 16  # above the servers' 4 slots: a knee, where it shows, is theirs


def _serve(tmp: pytest.TempPathFactory, name: str, seed: int | None = None) -> Iterator[RealServer]:
    reason = unavailable("llama-server")
    if reason is not None:
        pytest.skip(reason)
    server = start_llama_server(tmp.mktemp(name), seed=seed)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server_a(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    yield from _serve(tmp_path_factory, "ls-a")


@pytest.fixture(scope="module")
def server_b(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    yield from _serve(tmp_path_factory, "ls-b")


@pytest.fixture(scope="module")
def server_other(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    yield from _serve(tmp_path_factory, "ls-other", OTHER_SEED)


def _llama(pid: str, server: RealServer) -> dict[str, Any]:
    return {"id": pid, "type": "llamacpp", "base_url": server.url, "capacity": CAPACITY, "models": [LLAMA_SERVED],
            "endpoints": ["chat/completions", "completions"], "timeout_s": 120}


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, server_a: RealServer, server_b: RealServer,
           server_other: RealServer) -> Iterator[System]:
    with RedisServer() as redis_server:
        sys_ = System(tmp_path_factory.mktemp("iop-qualify-real"), redis_server)
        sys_.write_config({
            "queue": {"max_queue": 500, "queue_timeout_ms": 120_000},
            "qualify": {"share": 1.0, "max_seconds": 900, "max_tokens": 10_000_000},
            "models": [
                {"id": "tiny", "providers": {"ls-a": LLAMA_SERVED, "ls-b": LLAMA_SERVED, "ls-other": LLAMA_SERVED}},
                {"id": "ranked", "providers": {"ls-a": LLAMA_SERVED, "slow": "served"}},
            ],
            "nodes": [{"id": "n1", "providers": [
                _llama("ls-a", server_a), _llama("ls-b", server_b), _llama("ls-other", server_other),
                http_provider("slow", "vllm", sys_.port("slow"), CAPACITY, ["served"]),
            ]}],
        })
        with sys_:
            sys_.fake("slow", "--models", "served", "--delay-ms", str(SLOW_MS), "--tokens", "16",
                      "--token-interval-ms", "5")
            sys_.worker("n1")
            sys_.api()
            sys_.wait_available("ls-a", "ls-b", "ls-other", "slow")
            yield sys_


def qualify(system: System, model: str, *args: str) -> tuple[int, dict[str, Any]]:
    done = subprocess.run([sys.executable, "-m", "iop", "qualify", "--url", system.api_url, "--model", model,
                           "--json", *args], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "NO_COLOR": "1"})
    assert done.stdout.strip(), done.stderr
    return done.returncode, json.loads(done.stdout)


@pytest.fixture(scope="module")
def tiny(system: System) -> tuple[int, dict[str, Any]]:
    return qualify(system, "tiny", "--max-concurrency", "16", "--requests", "8", "--max-tokens", "64")


def by_provider(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["provider"]: p for p in doc["providers"]}


def test_the_other_weights_are_flagged_and_the_two_that_agree_pass(tiny: tuple[int, dict[str, Any]]) -> None:
    code, report = tiny
    ps = by_provider(report)
    assert code == 2  # a provider diverges
    assert sorted(report["config"]["agreeing_group"]) == ["ls-a", "ls-b"]
    assert ps["ls-a"]["flags"] == ps["ls-b"]["flags"] == []
    assert ps["ls-a"]["agreement"] == ps["ls-b"]["agreement"] == 1.0
    assert "diverges" in ps["ls-other"]["flags"]
    assert ps["ls-other"]["agreement"] < 0.5


def test_llama_servers_lifecycle_is_checked_by_safe_calls(tiny: tuple[int, dict[str, Any]]) -> None:
    life = by_provider(tiny[1])["ls-a"]["lifecycle"]
    assert life["list"]["verified"] is True
    assert life["delete"]["verified"] is None  # never called unless asked


def test_providers_are_ranked_by_the_ttft_a_client_measures(system: System) -> None:
    _, report = qualify(system, "ranked", "--max-concurrency", "1", "--requests", "6", "--max-tokens", "16")
    ps = by_provider(report)
    fast, slow = ps["ls-a"]["ttft_ms"]["1"]["p50"], ps["slow"]["ttft_ms"]["1"]["p50"]
    assert fast < slow
    assert slow >= SLOW_MS
    assert (ps["ls-a"]["rank"], ps["slow"]["rank"]) == (1, 2)
