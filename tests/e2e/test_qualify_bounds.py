"""A qualification run's bounds through real processes (issue 32, "bounded in time and
tokens"): an API, a worker and one fake provider, ``qualify.max_tokens`` 100 and every request
of the run asking 8. The API counts what each request may ask as it arrives and refuses the
one that takes the run past its budget: the twelfth fits (96), the thirteenth does not (104).
``iop qualify`` stops there, marks the report cancelled with the reason, and the provider
received no more than the twelve the budget allowed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from iop.redis_server import RedisServer
from tests.e2e.system import System, http_provider

BUDGET = 100
ASK = 8


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[System]:
    sys_ = System(tmp_path_factory.mktemp("qualify-bounds"), redis_server)
    sys_.write_config({
        "dispatch": {"heartbeat_interval_ms": 200, "probe_interval_ms": 300},
        "qualify": {"share": 1.0, "max_seconds": 300, "max_tokens": BUDGET},
        "models": [{"id": "m", "providers": {"a": "served"}}],
        "nodes": [{"id": "n1", "providers": [http_provider("a", "vllm", sys_.port("fa"), 16, ["served"])]}],
    })
    with sys_:
        sys_.fake("fa", "--models", "served", "--tokens", str(ASK), "--delay-ms", "20", "--parallel", "4")
        sys_.worker("n1")
        sys_.api()
        sys_.wait_available("a")
        yield sys_


def chat_requests(system: System) -> int:
    return sum(1 for r in system.fakes["fa"].requests() if r["path"] == "/v1/chat/completions")


@pytest.fixture(scope="module")
def run(system: System) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, "-m", "iop", "qualify", "--url", system.api_url, "--model", "m", "--json",
         "--max-concurrency", "16", "--requests", "4", "--max-tokens", str(ASK)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "NO_COLOR": "1"})
    doc: dict[str, Any] = json.loads(done.stdout) if done.stdout.strip() else {}
    return done, doc


def test_a_run_stops_at_its_token_budget(system: System,
                                         run: tuple[subprocess.CompletedProcess[str], dict[str, Any]]) -> None:
    done, report = run
    assert done.returncode == 0, done.stderr
    assert report["cancelled"] is True
    assert any("past its tokens" in n for n in report["notes"]), report["notes"]
    # The ladder got as far as the budget allowed: 4 calls at 1, 4 at 2, then 4 of the 8 at 4.
    assert set(report["providers"][0]["throughput"]) == {"1", "2"}
    assert report["providers"][0]["flags"] == ["not_compared"]  # stopped before the agreement prompts
    # The provider got no more than the budget allowed, and more than the two whole steps:
    # calls under way when the refusal came were let finish.
    assert 8 < chat_requests(system) <= BUDGET // ASK


def test_the_stopped_run_is_stored_and_refuses_more(system: System,
                                                    run: tuple[subprocess.CompletedProcess[str],
                                                               dict[str, Any]]) -> None:
    _, report = run
    stored = httpx.get(f"{system.api_url}/qualifications/m", timeout=10).json()
    assert stored["run"] == report["run"]
    assert stored["cancelled"] is True
    refused = httpx.post(f"{system.api_url}/v1/chat/completions", timeout=10,
                         headers={"x-iop-qualify": report["run"], "x-iop-provider": "a"},
                         json={"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    assert refused.status_code == 409
