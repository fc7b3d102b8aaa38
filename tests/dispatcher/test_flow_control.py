"""Flow control in the dispatch scripts, against real Redis servers: priority bands first,
weighted fair shares between tenants inside a band, FIFO inside a tenant, a requeued job
keeps its place, and the per-tenant limits."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from redis.asyncio import Redis

from dispatcher import config as cfg
from dispatcher import keys
from dispatcher.plans import Plans
from dispatcher.script_calls import CancelReason
from dispatcher.tenants import Tenants, flow_control
from tests.dispatcher.harness import FairHarness, drain, tenant_of

pytestmark = pytest.mark.anyio

SHA = "0" * 64


def fc_config(tenants: dict[str, dict[str, Any]], capacity: int = 1, priorities: list[str] | None = None,
              providers: int = 1, **queue: Any) -> cfg.Config:
    pids = [f"p{i}" for i in range(providers)]
    return cfg.parse({
        "queue": {"max_queue": 100_000, **queue},
        "api": {"keys": [{"name": n, "key_sha256": f"{i:064x}", **opts} for i, (n, opts) in enumerate(tenants.items())],
                **({"priorities": priorities} if priorities else {})},
        "nodes": [{"id": "n1", "providers": [
            {"id": p, "type": "vllm", "base_url": "http://127.0.0.1:1", "capacity": capacity, "models": [f"m@{p}"]}
            for p in pids]}],
        "models": [{"id": "m", "providers": {p: f"m@{p}" for p in pids}}],
    }).config


@pytest.fixture
def fair(any_redis: Redis) -> Any:
    async def make(config: cfg.Config) -> FairHarness:
        h = FairHarness(any_redis, config)
        await h.start()
        return h
    return make


def test_flow_control_is_off_for_one_tenant_one_band_no_limits() -> None:
    assert not flow_control(fc_config({"only": {}}))
    assert b'"fair"' not in Plans(fc_config({"only": {}})).by_provider["p0"].header
    assert flow_control(fc_config({"a": {}, "b": {}}))
    assert flow_control(fc_config({"only": {"max_in_flight": 2}}))
    assert flow_control(fc_config({"only": {}}, priorities=["high", "standard"]))


async def test_weighted_shares_between_backlogged_tenants(fair: Any) -> None:
    h = await fair(fc_config({"a": {"weight": 3}, "b": {"weight": 1}}))
    for _ in range(60):
        await h.send("a")
        await h.send("b")
    order = await drain(h, 40)
    assert Counter(order) == {"a": 30, "b": 10}
    # Not just in total: every window of four slots is three to one.
    for i in range(0, 40, 4):
        assert Counter(order[i:i + 4]) == {"a": 3, "b": 1}, order


async def test_a_newcomer_does_not_wait_behind_a_flood(fair: Any) -> None:
    h = await fair(fc_config({"a": {}, "b": {}}))
    for _ in range(200):
        await h.send("a")
    await drain(h, 20)
    _, status = await h.send("b")
    assert status == "queued"
    order = await drain(h, 2)
    assert "b" in order  # behind at most one of a's 180 waiting jobs


async def test_fifo_inside_a_tenant(fair: Any) -> None:
    h = await fair(fc_config({"a": {"weight": 2}, "b": {}}))
    sent: dict[str, list[str]] = {"a": [], "b": []}
    for i in range(30):
        who = "a" if i % 3 else "b"
        job, _ = await h.send(who)
        sent[who].append(job)
    dispatched: list[str] = [a.job for a in await h.assignments()]
    for _ in range(29):
        dispatched += await h.finish_one((await h.running())[0])
    for who, jobs in sent.items():
        assert [j for j in dispatched if tenant_of(j) == who] == jobs


async def test_a_higher_band_goes_first(fair: Any) -> None:
    h = await fair(fc_config({"web": {"priority": "interactive"}, "eval": {"priority": "batch"}},
                             priorities=["interactive", "standard", "batch"]))
    for _ in range(20):
        await h.send("eval")
    urgent, status = await h.send("web")
    assert status == "queued"
    assert await h.redis.zcard(keys.queue("m", "#interactive")) == 1
    # The next free slot is the interactive job's, though 19 batch jobs waited longer.
    assert (await h.finish_one((await h.running())[0])) == [urgent]


async def test_a_request_may_lower_its_band_never_raise_it(fair: Any) -> None:
    config = fc_config({"web": {"priority": "interactive"}, "eval": {"priority": "batch"}},
                       priorities=["interactive", "standard", "batch"])
    tenants = Tenants(config)
    web, ev = tenants.by_name["web"], tenants.by_name["eval"]
    assert tenants.band_for(web, {"x-iop-priority": "batch"}) == 2
    assert tenants.band_for(ev, {"x-iop-priority": "interactive"}) == 2
    assert tenants.band_for(ev, {}) == 2


async def test_a_requeued_job_keeps_its_place(fair: Any) -> None:
    h = await fair(fc_config({"a": {}, "b": {}}))
    first, _ = await h.send("a")
    for _ in range(5):
        await h.send("a")
        await h.send("b")
    # The running job's worker gives it back unfinished: it is the next to run again.
    assert await h.node.finish(await h.assignment(first), b"", mode="requeue") == "requeued"
    assert first in await h.running()


async def test_max_queued_refuses_with_tenant_full(fair: Any) -> None:
    h = await fair(fc_config({"a": {"max_queued": 3}, "b": {}}))
    statuses = [(await h.send("a"))[1] for _ in range(5)]
    assert statuses == ["dispatched", "queued", "queued", "queued", "tenant_full"]
    assert (await h.send("b"))[1] == "queued"  # another tenant is not held up
    assert (await h.counters())["q:a"] == 3


async def test_max_in_flight_makes_a_tenant_wait_without_holding_others(fair: Any) -> None:
    h = await fair(fc_config({"a": {"max_in_flight": 1}, "b": {}}, capacity=4))
    a_jobs = [(await h.send("a"))[0] for _ in range(4)]
    b_jobs = [(await h.send("b"))[0] for _ in range(2)]
    running = await h.running()
    assert sorted(tenant_of(j) for j in running) == ["a", "b", "b"]
    assert (await h.counters())["r:a"] == 1
    # a's slot frees: its next job takes it, in order.
    assert await h.finish_one(a_jobs[0]) == [a_jobs[1]]
    assert set(b_jobs) <= set(await h.running())


async def test_counters_come_back_to_zero(fair: Any) -> None:
    h = await fair(fc_config({"a": {}, "b": {"max_in_flight": 2}}, capacity=2, providers=2))
    for _ in range(10):
        await h.send("a")
        await h.send("b")
    assert (await h.counters())["q:a:m"] + (await h.counters())["q:b:m"] == 16
    while running := await h.running():
        await h.finish_one(running[0])
    assert await h.counters() == {}
    for pid in ("p0", "p1"):
        assert await h.in_flight(pid) == 0


async def test_requests_that_left_unserved_are_not_charged_to_their_tenant(fair: Any) -> None:
    h = await fair(fc_config({"a": {}, "b": {}, "c": {}}))
    gone = [(await h.send("a"))[0] for _ in range(50)]
    for _ in range(30):
        await h.send("b")
        await h.send("c")
    for job in gone[1:]:  # the first was dispatched at once; the rest give up waiting
        assert (await h.api.cancel(job, keys.queue("m"), CancelReason.CLIENT)).outcome == "removed"
    _, status = await h.send("a")
    assert status == "queued"
    # a is a newcomer again, not behind 49 requests it never got served.
    order = await drain(h, 3)
    assert "a" in order, order
