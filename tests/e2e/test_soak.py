"""A bounded soak: 2,000 requests through two API processes while workers are killed
and restarted at random and one provider flaps between healthy and failing.

It ends with every request answered exactly once (a success or a clear OpenAI-style
error), every in_flight back to zero with no lease left, the queues empty, and no
key left without a TTL apart from configuration and provider state.
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest

from dispatcher import keys
from iop.redis_server import RedisServer
from tests.e2e.system import Proc, System, http_provider

pytestmark = pytest.mark.anyio

REQUESTS = 2000
CLIENTS = 32
CAPACITY = {"p1": 4, "p2": 2, "p3": 3}
# Clear answers a caller may get while workers die under it.
ACCEPTED_ERRORS = {"worker_lost", "provider_error", "queue_timeout"}
# Keys that hold configuration or provider state and live on with no TTL.
# (qrate: one field per queue that ever had a backlog, bounded by the config.)
PERSISTENT = ("{iop}:p:", "{iop}:n:", "{iop}:seq", "{iop}:fence", "{iop}:replicas", "{iop}:reaper:seen",
              "{iop}:qrate")


@pytest.fixture
def system(tmp_path: Path, redis_server: RedisServer) -> Iterator[System]:
    sys_ = System(tmp_path, redis_server)
    sys_.write_config({
        "dispatch": {"lease_ms": 1500, "heartbeat_interval_ms": 200, "heartbeat_ttl_ms": 1000,
                     "probe_interval_ms": 300, "probe_timeout_ms": 500, "reap_interval_ms": 200,
                     "replica_ttl_ms": 1500, "drain_grace_s": 2, "max_attempts": 3},
        # Workers are killed and restarted on purpose: requests wait for them (a model that
        # holds nothing answers no_provider_available while every provider is down).
        "queue": {"max_queue": REQUESTS, "queue_timeout_ms": 30_000, "hold_when_unavailable_ms": 30_000},
        "models": [
            {"id": "pool", "providers": {p: f"served-{p}" for p in CAPACITY}},
            {"id": "solo", "providers": {"p3": "served-solo"}},
        ],
        "nodes": [
            {"id": "n1", "providers": [
                http_provider("p1", "vllm", sys_.port("p1"), CAPACITY["p1"], ["served-p1"]),
                http_provider("p2", "sglang", sys_.port("p2"), CAPACITY["p2"], ["served-p2"]),
            ]},
            {"id": "n2", "providers": [
                http_provider("p3", "ollama", sys_.port("p3"), CAPACITY["p3"], ["served-p3", "served-solo"]),
            ]},
        ],
    })
    try:
        for pid in CAPACITY:
            sys_.fake(pid, "--delay-ms", "5", "--tokens", "4", "--token-interval-ms", "5")
        sys_.workers = [sys_.worker(node, f"worker-{node}-{i}") for node in ("n1", "n2") for i in (1, 2)]  # type: ignore[attr-defined]
        sys_.api("api-1")
        sys_.api("api-2")
        sys_.wait_available(*CAPACITY)
        yield sys_
    finally:
        sys_.close()


class Chaos(threading.Thread):
    """Kills a random worker (SIGKILL) and restarts it; flaps provider p2's health."""

    def __init__(self, system: System, workers: list[Proc]) -> None:
        super().__init__(daemon=True)
        self.system = system
        self.workers = workers
        self.stop_flag = threading.Event()
        self.kills = 0
        self.flaps = 0
        self.rng = random.Random(11)

    def run(self) -> None:
        healthy = True
        while not self.stop_flag.wait(self.rng.uniform(0.4, 1.2)):
            victim = self.rng.choice(self.workers)
            victim.kill()
            self.kills += 1
            self.stop_flag.wait(0.3)
            victim.start()
            healthy = not healthy
            self.system.fakes["p2"].control(healthy=healthy)
            self.flaps += 1
        self.system.fakes["p2"].control(healthy=True)


async def test_soak_with_worker_kills_and_a_flapping_provider(system: System) -> None:
    workers: list[Proc] = system.workers  # type: ignore[attr-defined]
    apis = [f"http://127.0.0.1:{system.port(name)}" for name in ("api-1", "api-2")]
    rng = random.Random(5)
    plan = [(rng.choice(["pool", "pool", "solo"]), rng.random() < 0.5, apis[i % 2]) for i in range(REQUESTS)]
    outcomes: Counter[str] = Counter()
    answered: list[int] = [0] * REQUESTS
    next_index = iter(range(REQUESTS))

    async def one(client: httpx.AsyncClient, i: int) -> str:
        model, stream, api = plan[i]
        body = {"model": model, "stream": stream, "messages": [{"role": "user", "content": f"#{i}"}]}
        if not stream:
            resp = await client.post(f"{api}/v1/chat/completions", json=body)
            if resp.status_code == 200:
                assert resp.json()["model"] == model
                return "ok"
            return resp.json()["error"]["code"]
        async with client.stream("POST", f"{api}/v1/chat/completions", json=body) as resp:
            text = (await resp.aread()).decode()
        if resp.status_code != 200:
            return str(json.loads(text)["error"]["code"])
        frames = [f[len("data: "):] for f in text.split("\n\n") if f.startswith("data: ")]
        if frames and frames[-1] == "[DONE]":
            assert text.count("[DONE]") == 1
            assert all(json.loads(f)["model"] == model for f in frames[:-1])
            return "ok"
        # A stream that failed after output started ends with exactly one error event.
        errors = [json.loads(f)["error"]["code"] for f in frames if "error" in json.loads(f)]
        assert len(errors) == 1, text
        assert "error" in json.loads(frames[-1]), text
        return str(errors[0])

    async def client_loop(client: httpx.AsyncClient) -> None:
        for i in next_index:
            outcome = await one(client, i)
            answered[i] += 1
            outcomes[outcome] += 1

    chaos = Chaos(system, workers)
    started = time.monotonic()
    chaos.start()
    try:
        limits = httpx.Limits(max_connections=CLIENTS * 2)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client, anyio.create_task_group() as tg:
            for _ in range(CLIENTS):
                tg.start_soon(client_loop, client)
    finally:
        chaos.stop_flag.set()
        chaos.join()
    elapsed = time.monotonic() - started

    # Exactly one answer per request, each a success or a clear error.
    assert answered == [1] * REQUESTS
    assert set(outcomes) <= {"ok"} | ACCEPTED_ERRORS, outcomes
    assert outcomes["ok"] >= REQUESTS * 0.9, outcomes
    assert chaos.kills >= 3, (chaos.kills, elapsed)

    for worker in workers:
        if not worker.alive():
            worker.start()
    system.wait_until(
        "every slot back and no lease left",
        lambda: all(system.in_flight(p) == 0 for p in CAPACITY) and system.redis.zcard(keys.LEASES) == 0,
        timeout=60,
    )
    for model in ("pool", "solo"):
        assert system.redis.zcard(keys.queue(model)) == 0
    assert system.redis.hlen(keys.JOBS) == 0
    assert system.redis.hlen(keys.BODIES) == 0
    assert system.redis.zcard(keys.DEADLINES) == 0
    # The providers never saw more than their capacity at once, even while workers died.
    for pid, cap in CAPACITY.items():
        assert system.fakes[pid].stats()["max_in_flight"] <= cap
    # Every key either holds configuration/provider state or expires by itself.
    no_ttl = [k.decode() for k in system.redis.scan_iter(count=1000) if system.redis.ttl(k) == -1]
    assert [k for k in no_ttl if not k.startswith(PERSISTENT)] == []
    # Node streams hold nothing once every job is acknowledged (pending lists included).
    for node in ("n1", "n2"):
        assert system.redis.xlen(keys.node(node)) == 0
        assert system.redis.xpending(keys.node(node), keys.NODE_GROUP)["pending"] == 0
    print(f"soak: {REQUESTS} requests in {elapsed:.1f}s, {chaos.kills} worker kills, "
          f"{chaos.flaps} provider flaps, outcomes {dict(outcomes)}")
    for worker in workers:
        worker.signal(signal.SIGTERM)
