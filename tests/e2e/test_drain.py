"""Drain and resume through real processes: provider a runs requests (its fake holds them,
``hang``), an operator drains it -- over HTTP, then with ``iop provider drain --wait`` --
and new requests go only to b while a's running ones finish; the catalog says
``draining`` then ``drained``; after a resume a takes work again at once. Which provider
answered each request comes from its ``x-iop-provider`` header, and every answer is
checked whole.

Capacities make the drain visible: a has 4 slots and b 2, so without the drain the
dispatcher (lowest in_flight/capacity) would hand a its free slots."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from iop.redis_server import RedisServer
from tests.e2e.system import Planned, System, answer_problem, http_provider

DELAY_MS = 50
TOKENS = 3


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[System]:
    sys_ = System(tmp_path_factory.mktemp("drain"), redis_server)
    sys_.write_config({
        "dispatch": {"heartbeat_interval_ms": 200, "probe_interval_ms": 300},
        "queue": {"max_queue": 100, "queue_timeout_ms": 60_000},
        "models": [{"id": "m", "providers": {"a": "served", "b": "served"}}],
        "nodes": [{"id": "n1", "providers": [http_provider("a", "vllm", sys_.port("fa"), 4, ["served"]),
                                             http_provider("b", "vllm", sys_.port("fb"), 2, ["served"])]}],
    })
    with sys_:
        for name in ("fa", "fb"):
            sys_.fake(name, "--models", "served", "--tokens", str(TOKENS), "--delay-ms", str(DELAY_MS))
        sys_.worker("n1")
        sys_.api()
        sys_.wait_available("a", "b")
        yield sys_


@pytest.fixture
def pool(system: System) -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=16) as executor:
        yield executor
        for name in ("fa", "fb"):
            system.fakes[name].control(hang=False)
    system.wait_until("slots released", lambda: system.in_flight("a") == system.in_flight("b") == 0, timeout=60)
    # Leave a open for the next test, whatever this one did.
    httpx.post(f"{system.api_url}/admin/providers/a/resume", timeout=10)


def ask(system: System, marker: str, stream: bool) -> tuple[Planned, int, str, str]:
    """One chat request: what was asked, status, body, and the provider that answered."""
    planned = Planned(marker, system.api_url, stream, DELAY_MS, TOKENS)
    url = f"{system.api_url}/v1/chat/completions"
    with httpx.stream("POST", url, json=planned.body(), timeout=60) as resp:
        text = resp.read().decode()
        return planned, resp.status_code, text, resp.headers.get("x-iop-provider", "")


def send(system: System, pool: ThreadPoolExecutor, prefix: str, n: int) -> list[Future[tuple[Planned, int, str, str]]]:
    return [pool.submit(ask, system, f"{prefix}-{i}", i % 2 == 0) for i in range(n)]


def served_by(futures: list[Future[tuple[Planned, int, str, str]]]) -> list[str]:
    """The provider of each answer, once every answer is checked complete and correct."""
    providers = []
    for future in futures:
        planned, status, text, provider = future.result(timeout=60)
        problem = answer_problem(planned, (status, text))
        assert problem is None, f"{planned.marker}: {problem}"
        providers.append(provider)
    return providers


def catalog_a(system: System) -> dict[str, Any]:
    doc = httpx.get(f"{system.api_url}/catalog", timeout=10).json()
    provider: dict[str, Any] = next(p for p in doc["providers"] if p["id"] == "a")
    return provider


def hold_both(system: System, pool: ThreadPoolExecutor, prefix: str) -> list[Future[tuple[Planned, int, str, str]]]:
    """Both fakes hold what they get; four requests: two run on a, two on b (b full)."""
    system.fakes["fa"].control(hang=True)
    system.fakes["fb"].control(hang=True)
    held = send(system, pool, prefix, 4)
    system.wait_until("2 running on a and 2 on b", lambda: system.in_flight("a") == system.in_flight("b") == 2)
    return held


def test_drain_over_http_then_resume(system: System, pool: ThreadPoolExecutor) -> None:
    held = hold_both(system, pool, "held")
    resp = httpx.post(f"{system.api_url}/admin/providers/a/drain", timeout=10)
    assert resp.status_code == 200
    assert resp.json() == {"provider": "a", "drain": "draining", "in_flight": 2}
    assert (catalog_a(system)["drain"], catalog_a(system)["health"]) == ("draining", "available")

    # b frees and takes everything new; a has two free slots but gets none.
    system.fakes["fb"].control(hang=False)
    during = send(system, pool, "during", 6)
    assert served_by(during) == ["b"] * 6
    assert system.in_flight("a") == 2
    assert catalog_a(system)["drain"] == "draining"

    # a's running requests finish normally: answered, slots released, a drained.
    system.fakes["fa"].control(hang=False)
    assert sorted(served_by(held)) == ["a", "a", "b", "b"]
    system.wait_until("a drained", lambda: catalog_a(system)["drain"] == "drained")
    assert catalog_a(system)["in_flight"] == 0
    state = httpx.get(f"{system.api_url}/admin/providers/a", timeout=10).json()
    assert state == {"provider": "a", "drain": "drained", "in_flight": 0}

    # b full and a drained: new requests wait; the resume hands them to a.
    system.fakes["fb"].control(hang=True)
    b_full = send(system, pool, "b-full", 2)
    system.wait_until("b full", lambda: system.in_flight("b") == 2)
    waiting = send(system, pool, "waiting", 2)
    system.wait_until("two waiting", lambda: system.redis.zcard("{iop}:q:m") == 2)
    time.sleep(0.5)  # several heartbeats of a: none of them dispatches to it
    assert system.redis.zcard("{iop}:q:m") == 2
    resp = httpx.post(f"{system.api_url}/admin/providers/a/resume", timeout=10)
    assert resp.json()["drain"] is None
    assert served_by(waiting) == ["a", "a"]
    assert catalog_a(system)["drain"] is None
    system.fakes["fb"].control(hang=False)
    assert served_by(b_full) == ["b", "b"]


def iop(*args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "iop", *args], capture_output=True, text=True, timeout=60,
                          **kwargs)


def catalog_row(system: System, pid: str) -> str:
    """The provider's row of the ``iop catalog`` table."""
    table = iop("catalog", "--url", system.api_url, "--no-colour").stdout.split("model groups")[0]
    (row,) = [line for line in table.splitlines() if line.split()[:1] == [pid]]
    return row


def test_drain_with_the_cli_waits_until_drained(system: System, pool: ThreadPoolExecutor) -> None:
    held = hold_both(system, pool, "cli-held")
    out = system.dir / "drain.out"
    with out.open("w") as sink:
        waiter = subprocess.Popen([sys.executable, "-m", "iop", "provider", "drain", "a", "--wait",
                                   "--url", system.api_url], stdout=sink, stderr=subprocess.STDOUT, text=True)
    try:
        system.wait_until("the CLI drained a", lambda: "a: draining (2 running)" in out.read_text(), timeout=30)
        assert "available (draining)" in catalog_row(system, "a")
        # New requests go to b only, while the CLI keeps waiting on a's two.
        system.fakes["fb"].control(hang=False)
        assert served_by(send(system, pool, "cli-during", 4)) == ["b"] * 4
        assert waiter.poll() is None, out.read_text()
        system.fakes["fa"].control(hang=False)
        assert waiter.wait(timeout=30) == 0, out.read_text()
    finally:
        if waiter.poll() is None:
            waiter.kill()
            waiter.wait()
    assert out.read_text().splitlines()[-1] == "a: drained"
    assert sorted(served_by(held)) == ["a", "a", "b", "b"]
    assert "available (drained)" in catalog_row(system, "a")

    resumed = iop("provider", "resume", "a", "--url", system.api_url)
    assert (resumed.returncode, resumed.stdout.strip()) == (0, "a: open"), resumed.stderr
    # Both idle: equal load, so the lower id, a, takes the next request again.
    system.wait_until("both idle", lambda: system.in_flight("a") == system.in_flight("b") == 0)
    assert served_by(send(system, pool, "cli-after", 1)) == ["a"]
    # An id not in the config: a clear refusal.
    unknown = iop("provider", "drain", "nope", "--url", system.api_url)
    assert unknown.returncode == 1
    assert "404" in unknown.stderr
    assert "provider_not_found" in unknown.stderr
