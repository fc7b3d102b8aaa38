"""Slot accounting under load, through real processes: 200 concurrent requests on
providers of capacity 1, 2 and 3. in_flight is sampled from Redis all along; the fake
providers count what they really received at once."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator

import anyio
import httpx
import pytest

from dispatcher import keys
from iop.redis_server import RedisServer
from tests.e2e.system import InFlightSampler, System, http_provider

pytestmark = pytest.mark.anyio

CAPACITY = {"p1": 1, "p2": 2, "p3": 3}
REQUESTS = 200


@pytest.fixture
def system(tmp_path: object, redis_server: RedisServer) -> Iterator[System]:
    sys_ = System(tmp_path, redis_server)  # type: ignore[arg-type]
    sys_.write_config({
        "queue": {"max_queue": REQUESTS, "queue_timeout_ms": 120_000},
        "models": [
            {"id": "pool", "providers": {p: f"served-{p}" for p in CAPACITY}},
            {"id": "solo", "providers": {"p3": "served-solo"}},
        ],
        "nodes": [
            {"id": "n1", "providers": [
                http_provider("p1", "vllm", sys_.port("p1"), CAPACITY["p1"], ["served-p1"]),
                http_provider("p2", "vllm", sys_.port("p2"), CAPACITY["p2"], ["served-p2"]),
            ]},
            {"id": "n2", "providers": [
                http_provider("p3", "ollama", sys_.port("p3"), CAPACITY["p3"], ["served-p3", "served-solo"]),
            ]},
        ],
    })
    try:
        for pid in CAPACITY:
            sys_.fake(pid, "--delay-ms", "5", "--tokens", "4", "--token-interval-ms", "2")
        sys_.worker("n1")
        sys_.worker("n2")
        sys_.api()
        sys_.wait_available(*CAPACITY)
        yield sys_
    finally:
        sys_.close()


async def test_in_flight_stays_within_capacity_and_every_request_gets_one_answer(system: System) -> None:
    sampler = InFlightSampler(system, list(CAPACITY))
    sampler.start()
    answers: Counter[str] = Counter()
    providers: Counter[str] = Counter()
    rng = random.Random(7)
    plan = [(rng.choice(["pool", "pool", "pool", "solo"]), rng.random() < 0.5) for _ in range(REQUESTS)]

    async def one(client: httpx.AsyncClient, i: int) -> None:
        model, stream = plan[i]
        body = {"model": model, "stream": stream, "messages": [{"role": "user", "content": f"#{i}"}]}
        if stream:
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                text = (await resp.aread()).decode()
                ok = resp.status_code == 200 and text.endswith("data: [DONE]\n\n") and text.count("[DONE]") == 1
        else:
            resp = await client.post("/v1/chat/completions", json=body)
            ok = resp.status_code == 200 and resp.json()["model"] == model
        answers["ok" if ok else f"bad-{resp.status_code}"] += 1
        providers[resp.headers.get("x-iop-provider", "?")] += 1

    limits = httpx.Limits(max_connections=REQUESTS, max_keepalive_connections=REQUESTS)
    async with (
        httpx.AsyncClient(base_url=system.api_url, timeout=120, limits=limits) as client,
        anyio.create_task_group() as tg,
    ):
        for i in range(REQUESTS):
            tg.start_soon(one, client, i)

    sampler.stop_flag.set()
    sampler.join()

    # Every request got exactly one answer, and it was a success.
    assert answers == Counter({"ok": REQUESTS}), system.logs()
    assert sum(providers.values()) == REQUESTS
    # Redis never counted more than a provider's capacity, nor less than zero...
    assert len(sampler.samples) > 10
    for sample in sampler.samples:
        for pid, value in sample.items():
            assert 0 <= value <= CAPACITY[pid], (pid, value)
    # ...the load really reached capacity (the test measured something)...
    assert max(s["p3"] for s in sampler.samples) == CAPACITY["p3"]
    # ...and the providers themselves never saw more than their capacity at once.
    for pid, cap in CAPACITY.items():
        stats = system.fakes[pid].stats()
        assert 1 <= stats["max_in_flight"] <= cap, (pid, stats)
    # Nothing leaked: slots, leases, queues, job records.
    system.wait_until("slots released", lambda: all(system.in_flight(p) == 0 for p in CAPACITY), timeout=10)
    assert system.redis.zcard(keys.LEASES) == 0
    assert system.redis.hlen(keys.JOBS) == 0
    assert system.redis.hlen(keys.BODIES) == 0
    assert system.redis.zcard(keys.queue("pool")) == 0
    assert system.redis.zcard(keys.DEADLINES) == 0
    assert system.redis.xlen(keys.node("n1")) == 0
    assert system.redis.xlen(keys.node("n2")) == 0
