"""Multi-tenant flow control through real processes: a flood does not make another tenant
wait, a higher band goes first, and a tenant's max_in_flight holds only that tenant.

The provider has one slot and a fixed service time; the fake's execution log says in
which order it ran the requests (each marked with its tenant in ``user``)."""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from dispatcher import keys
from iop.redis_server import RedisServer
from tests.e2e.system import Fake, System, http_provider

SERVICE_MS = 150


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[System]:
    sys_ = System(tmp_path_factory.mktemp("tenants"), redis_server)
    sys_.write_config({
        "api": {
            "priorities": ["interactive", "standard", "batch"],
            "keys": [
                {"name": "a", "key_sha256": sha("key-a")},
                {"name": "b", "key_sha256": sha("key-b")},
                {"name": "web", "key_sha256": sha("key-web"), "priority": "interactive"},
                {"name": "eval", "key_sha256": sha("key-eval"), "priority": "batch"},
                {"name": "capped", "key_sha256": sha("key-capped"), "max_in_flight": 1},
            ],
        },
        "queue": {"max_queue": 1000, "queue_timeout_ms": 60_000},
        "models": [{"id": "m", "providers": {"p": "served"}}, {"id": "m3", "providers": {"p3": "served"}}],
        "nodes": [{"id": "n1", "providers": [http_provider("p", "vllm", sys_.port("f"), 1, ["served"]),
                                             http_provider("p3", "vllm", sys_.port("f3"), 3, ["served"])]}],
    })
    with sys_:
        sys_.fake("f", "--models", "served", "--tokens", "1", "--delay-ms", str(SERVICE_MS))
        sys_.fake("f3", "--models", "served", "--tokens", "1", "--delay-ms", str(SERVICE_MS))
        sys_.worker("n1")
        sys_.api()
        sys_.wait_available("p")
        sys_.wait_available("p3")
        yield sys_


@pytest.fixture
def fake(system: System) -> Iterator[Fake]:
    fakes = [system.fakes["f"], system.fakes["f3"]]
    for f in fakes:
        f.hooks(track_executions=True)
        httpx.delete(f"{f.url}/_fake/executions", timeout=5)
    yield fakes[0]
    for f in fakes:
        f.control(hang=False)
    system.wait_until("slots released", lambda: system.in_flight("p") == system.in_flight("p3") == 0, timeout=60)


def send(system: System, key: str, marker: str, results: list[int], model: str = "m",
         **headers: str) -> threading.Thread:
    def run() -> None:
        resp = httpx.post(f"{system.api_url}/v1/chat/completions", timeout=120,
                          headers={"Authorization": f"Bearer {key}", **headers},
                          json={"model": model, "user": marker, "messages": [{"role": "user", "content": "hi"}]})
        results.append(resp.status_code)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def waiting(system: System, tenant: str) -> int:
    return int(system.redis.hget(keys.TENANTS, f"q:{tenant}") or 0)


def order(fake: Fake) -> list[str]:
    runs = sorted(fake.executions(), key=lambda e: e["started"])
    return [str(e["marker"]) for e in runs]


def flood(system: System, fake: Fake, key: str, tenant: str, n: int, results: list[int]) -> list[threading.Thread]:
    """One request of ``tenant`` holds the only slot (the fake hangs it) while ``n`` more queue."""
    fake.control(hang=True)
    threads = [send(system, key, f"{tenant}-block", results)]
    system.wait_until("the slot taken", lambda: system.in_flight("p") == 1, timeout=30)
    for i in range(n):
        threads.append(send(system, key, f"{tenant}-{i}", results))
        # One at a time, so that their order in the queue is known.
        system.wait_until(f"{tenant}-{i} waiting", lambda i=i: waiting(system, tenant) == i + 1, timeout=30)
    return threads


def release(fake: Fake, threads: list[threading.Thread]) -> None:
    fake.control(hang=False)
    for t in threads:
        t.join(120)


def test_a_flood_does_not_make_another_tenant_wait(system: System, fake: Fake) -> None:
    results: list[int] = []
    threads = flood(system, fake, "key-a", "a", 10, results)
    threads.append(send(system, "key-b", "b-0", results))
    system.wait_until("b waiting", lambda: waiting(system, "b") == 1, timeout=30)
    release(fake, threads)
    assert results == [200] * 12
    ran = order(fake)
    # Under plain FIFO b would run last; fairly, it is next: its tag is the lane's virtual time.
    assert ran[:2] == ["a-block", "b-0"], ran
    # a's own requests ran in the order they were queued (FIFO inside a tenant).
    assert [m for m in ran if m.startswith("a-") and m != "a-block"] == [f"a-{i}" for i in range(10)]


def test_a_higher_band_goes_first(system: System, fake: Fake) -> None:
    results: list[int] = []
    threads = flood(system, fake, "key-eval", "eval", 6, results)
    # The same tenant may ask for less: this one waits in the batch band.
    threads.append(send(system, "key-web", "web-low", results, **{"x-iop-priority": "batch"}))
    system.wait_until("web-low waiting", lambda: waiting(system, "web") == 1, timeout=30)
    threads.append(send(system, "key-web", "web-0", results))
    system.wait_until("web-0 waiting", lambda: waiting(system, "web") == 2, timeout=30)
    release(fake, threads)
    assert results == [200] * 9
    ran = order(fake)
    assert ran[:2] == ["eval-block", "web-0"], ran  # the interactive one first, though it came last
    assert ran.index("web-low") >= 2, ran


def test_max_in_flight_holds_only_its_tenant(system: System, fake: Fake) -> None:
    # Three slots (p3), every request held by the fake until released: capped may hold one
    # slot at a time, and its waiting requests do not keep b from the other two.
    f3 = system.fakes["f3"]
    f3.control(hang=True)
    results: list[int] = []
    threads = [send(system, "key-capped", f"capped-{i}", results, model="m3") for i in range(4)]
    system.wait_until("capped waiting", lambda: waiting(system, "capped") == 3, timeout=30)
    threads += [send(system, "key-b", f"b-{i}", results, model="m3") for i in range(3)]
    system.wait_until("b running", lambda: system.in_flight("p3") == 3, timeout=30)
    system.wait_until("b's third waiting", lambda: waiting(system, "b") == 1, timeout=30)
    running = sorted(str(e["marker"]).split("-")[0] for e in f3.executions())
    assert running == ["b", "b", "capped"]
    assert int(system.redis.hget(keys.TENANTS, "r:capped") or 0) == 1
    f3.control(hang=False)
    for t in threads:
        t.join(120)
    assert results == [200] * 7
    runs: list[dict[str, Any]] = f3.executions()
    capped = sorted((e["started"], e["ended"]) for e in runs if str(e["marker"]).startswith("capped"))
    for (_, end), (start, _) in itertools.pairwise(capped):
        assert start >= end - 0.01, capped  # never two of capped's at once
