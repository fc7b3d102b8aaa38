"""A continuation's submit (api/continuation.py; lua/submit.lua ``excluded``, ``first``)
against real Redis servers: it never goes to a provider whose type cannot continue, and it
waits ahead of the lane's new work, FIFO and under flow control."""

from __future__ import annotations

import uuid

import pytest
from redis.asyncio import Redis

from dispatcher import config as cfg
from dispatcher import keys
from tests.dispatcher.harness import FairHarness, LaneHarness, lane_config

pytestmark = pytest.mark.anyio


def fc_config(tenants: list[str]) -> cfg.Config:
    """Flow control: tenants of one band over one provider of capacity 1 serving model m."""
    return cfg.parse({
        "api": {"keys": [{"name": n, "key_sha256": f"{i:064x}"} for i, n in enumerate(tenants)]},
        "nodes": [{"id": "n1", "providers": [{"id": "p0", "type": "vllm", "base_url": "http://127.0.0.1:1",
                                               "capacity": 1, "models": ["m@p0"]}]}],
        "models": [{"id": "m", "providers": {"p0": "m@p0"}}],
    }).config


async def test_a_continuation_never_goes_to_an_excluded_provider(any_redis: Redis) -> None:
    h = LaneHarness(any_redis, lane_config({"a": None, "b": None}, capacity=2))
    await h.up("a")
    await h.up("b")
    main = h.calls.plans.main_lane("m")
    busy, _ = await h.submit_to(main)  # on a (ties: a first), so b is the more loaded only after the next
    on_b, _ = await h.submit_to(main)
    assert {(await h.assignment(j)).provider for j in (busy, on_b)} == {"a", "b"}
    # a and b both have one free slot; a continuation excluding a takes b's.
    job = uuid.uuid4().hex
    done = await h.api.submit(job, main, b'{"model":"m"}', "chat/completions", True, excluded=["a"], first=True)
    assert done.status == "dispatched"
    assert (await h.assignment(job)).provider == "b"
    # b is full now: one excluding a waits, though a has a free slot, until b frees one.
    waiting = uuid.uuid4().hex
    assert (await h.api.submit(waiting, main, b'{"model":"m"}', "chat/completions", True, excluded=["a"],
                               first=True)).status == "queued"
    assert await h.done(on_b) == "released"
    assert (await h.assignment(waiting)).provider == "b"


async def test_a_continuation_waits_ahead_of_new_work(any_redis: Redis) -> None:
    h = LaneHarness(any_redis, lane_config({"a": None}, capacity=1))
    await h.up("a")
    main = h.calls.plans.main_lane("m")
    running, _ = await h.submit_to(main)
    older = [(await h.submit_to(main))[0] for _ in range(2)]
    cont = uuid.uuid4().hex
    assert (await h.api.submit(cont, main, b'{"model":"m"}', "chat/completions", True, first=True)).status == "queued"
    assert await h.queued("m") == [cont, *older]
    assert await h.done(running) == "released"
    assert (await h.assignment(cont)).provider == "a"


async def test_under_flow_control_a_continuation_waits_ahead_and_charges_its_tenant_nothing(
        any_redis: Redis) -> None:
    h = FairHarness(any_redis, fc_config(["a", "b"]))
    await h.start()
    running, _ = await h.send("a")
    waiting = [(await h.send(t))[0] for t in ("a", "b", "a", "b")]
    tags_before = await any_redis.hgetall(keys.FINISH_TAGS)
    tenant = h.tenants.by_name["b"]
    cont = tenant.job_id(uuid.uuid4().hex[:12])
    main = h.calls.plans.main_lane("m")
    queued = await h.api.submit(cont, main, b'{"model":"m"}', "chat/completions", True, tenant=tenant, first=True)
    assert queued.status == "queued"
    assert await any_redis.hgetall(keys.FINISH_TAGS) == tags_before
    # The freed slot goes to the continuation, before every job that waited already.
    assert await h.finish_one(running) == [cont]
    queued_now = {j.decode() for j in await any_redis.zrange(keys.queue("m"), 0, -1)}
    assert queued_now == set(waiting)


async def test_a_continuation_waits_for_a_provider_that_can_continue_rather_than_take_another(
        any_redis: Redis) -> None:
    # A retry's exclusions are dropped when the providers that failed it are its only chance
    # left (lib/route.lua); a continuation's are not: the other type would not continue it.
    h = LaneHarness(any_redis, lane_config({"a": None, "b": None}, capacity=1, hold_ms=60_000))
    await h.up("a")
    await h.up("b", "unavailable")
    main = h.calls.plans.main_lane("m")
    job = uuid.uuid4().hex
    submitted = await h.api.submit(job, main, b'{"model":"m"}', "chat/completions", True, excluded=["a"], first=True)
    assert submitted.status == "queued"
    await h.up("a")  # a heartbeat pumps a's lanes: still not a
    assert [a.job for a in await h.assignments()] == []
    await h.up("b")
    assert (await h.assignment(job)).provider == "b"
