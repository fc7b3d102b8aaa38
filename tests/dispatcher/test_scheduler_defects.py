"""Where lanes, tenants, retries, pins and reloads meet (issue 19): each case, against real
Redis servers, failed before its fix."""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any

import pytest
from redis.asyncio import Redis

from dispatcher import config as cfg
from dispatcher import keys
from dispatcher.reaper import Reaper
from dispatcher.script_calls import CancelReason
from dispatcher.tenants import Tenants
from tests.dispatcher.harness import FairHarness, LaneHarness, drain, lane_config

pytestmark = pytest.mark.anyio


def reloaded(h: LaneHarness, config: cfg.Config) -> LaneHarness:
    """The same Redis, seen by a process that applied ``config`` (its plans, its calls)."""
    return LaneHarness(h.redis, config)


async def test_a_provider_added_by_a_reload_never_takes_a_job_of_an_endpoint_it_does_not_serve(
    any_redis: Redis,
) -> None:
    both = ["chat/completions", "rerank"]
    old = LaneHarness(any_redis, lane_config({"a": both, "b": both}))
    await old.up("a")
    await old.up("b")
    main = old.calls.plans.main_lane("m")
    assert old.calls.plans.lane_for("m", "rerank") == main  # every provider serves rerank
    running = [(await old.submit_to(main))[0] for _ in range(2)]
    rerank, status = await old.submit_to(main, endpoint="rerank")
    assert status == "queued"
    chat, _ = await old.submit_to(main)
    # A reload adds c, which serves chat only: the key of the lane of all providers is the
    # same, its meaning is not. c's first heartbeat pumps it.
    new = reloaded(old, lane_config({"a": both, "b": both, "c": ["chat/completions"]}))
    await new.up("c")
    record = await new.record(rerank)
    assert record is not None
    assert record.state == "q"
    # The chat job behind it is not held: it goes to c.
    assert (await new.assignment(chat)).provider == "c"
    # A slot of a or b frees: the rerank job goes there.
    await new.done(running[0])
    assert (await new.assignment(rerank)).provider in ("a", "b")


async def test_a_job_pinned_to_the_only_provider_stays_with_it_when_a_reload_adds_another(
    any_redis: Redis,
) -> None:
    old = LaneHarness(any_redis, lane_config({"a": None}))
    await old.up("a")
    pinned = old.calls.plans.pinned_lane("m", "a")
    assert pinned.queue == keys.queue("m")  # alone, a's own lane is the lane of all providers
    first, _ = await old.submit_to(pinned, pinned=True, endpoint="responses")
    held, status = await old.submit_to(pinned, pinned=True, endpoint="responses")
    assert status == "queued"
    new = reloaded(old, lane_config({"a": None, "b": None}))
    await new.up("b")
    assert (await new.record(held)).state == "q"
    await new.done(first)
    assert (await new.assignment(held)).provider == "a"


def two_models(tenants: dict[str, dict[str, Any]]) -> cfg.Config:
    """One provider p (capacity 1) serving models m1 and m2; named tenants."""
    return cfg.parse({
        "queue": {"max_queue": 1000},
        "api": {"keys": [{"name": n, "key_sha256": f"{i:064x}", **o} for i, (n, o) in enumerate(tenants.items())]},
        "nodes": [{"id": "n1", "providers": [
            {"id": "p", "type": "vllm", "base_url": "http://127.0.0.1:1", "capacity": 1,
             "models": ["m1@p", "m2@p"]}]}],
        "models": [{"id": m, "providers": {"p": f"{m}@p"}} for m in ("m1", "m2")],
    }).config


async def test_weights_hold_across_the_lanes_of_a_provider(any_redis: Redis) -> None:
    config = two_models({"a": {"weight": 2}, "b": {"weight": 1}})
    h = FairHarness(any_redis, config)
    await h.start()
    tenants = Tenants(config)

    async def send(tenant: str, model: str) -> None:
        t = tenants.by_name[tenant]
        lane = h.calls.plans.main_lane(model)
        await h.api.submit(t.job_id(uuid.uuid4().hex[:12]), lane, b"{}", "chat/completions", False, tenant=t)

    # a floods m1 first, then b floods m2.
    for _ in range(40):
        await send("a", "m1")
    for _ in range(40):
        await send("b", "m2")
    shares = Counter(await drain(h, 30))
    assert abs(shares["a"] - 20) <= 1, shares
    assert abs(shares["b"] - 10) <= 1, shares


async def test_jobs_in_a_lane_a_reload_renamed_are_moved_to_their_lane_and_run(any_redis: Redis) -> None:
    chat, both = ["chat/completions"], ["chat/completions", "rerank"]
    old = LaneHarness(any_redis, lane_config({"a": chat, "b": both, "c": both}))
    for pid in "abc":
        await old.up(pid)
    rerank = old.calls.plans.lane_for("m", "rerank")
    assert rerank is not None
    assert rerank.name == "b,c"
    running = [(await old.submit_to(rerank, endpoint="rerank"))[0] for _ in range(2)]
    waiting = [(await old.submit_to(rerank, endpoint="rerank"))[0] for _ in range(2)]
    assert await old.redis.zrange(rerank.queue, 0, -1) == [j.encode() for j in waiting]
    # A reload removes c: the rerank lane is now "b" alone, and nothing pumps "b,c".
    new = reloaded(old, lane_config({"a": chat, "b": both}))
    assert rerank.queue not in new.calls.plans.by_queue
    providers = [(await new.assignment(j)).provider for j in running]
    on_b = running[providers.index("b")]
    await new.done(on_b)  # b's freed slot: its plan has no "b,c" lane
    assert [(await new.record(j)).state for j in waiting] == ["q", "q"]
    reaper = Reaper(new.calls, any_redis, "test")
    assert await reaper.rehome() == 2
    assert await any_redis.exists(rerank.queue) == 0
    # The oldest went to b at once; the other waits, first in b's lane.
    assert (await new.assignment(waiting[0])).provider == "b"
    b_lane = new.calls.plans.lane_for("m", "rerank")
    assert b_lane is not None
    assert await any_redis.zrange(b_lane.queue, 0, -1) == [waiting[1].encode()]
    assert (await new.record(waiting[1])).lane == "b"
    assert await reaper.rehome() == 0


async def test_jobs_of_a_renamed_band_go_to_the_default_band(any_redis: Redis) -> None:
    def banded(priorities: list[str]) -> cfg.Config:
        return cfg.parse({
            "api": {"keys": [{"name": "t", "key_sha256": "0" * 64, "priority": priorities[-1]}],
                    "priorities": priorities, "default_priority": priorities[0]},
            "nodes": [{"id": "n1", "providers": [
                {"id": "p", "type": "vllm", "base_url": "http://127.0.0.1:1", "capacity": 1, "models": ["m@p"]}]}],
            "models": [{"id": "m", "providers": {"p": "m@p"}}],
        }).config

    old = FairHarness(any_redis, banded(["high", "batch"]))
    await old.start()
    t = old.tenants.by_name["t"]
    lane = old.calls.plans.banded(old.calls.plans.main_lane("m"), t.band)
    assert lane.name == "#batch"
    jobs = [t.job_id(uuid.uuid4().hex[:12]) for _ in range(2)]
    for job in jobs:
        await old.api.submit(job, lane, b"{}", "chat/completions", False, tenant=t)
    new = FairHarness(any_redis, banded(["high", "bulk"]))
    assert await Reaper(new.calls, any_redis, "test").rehome() == 1
    assert await any_redis.zrange(keys.queue("m"), 0, -1) == [jobs[1].encode()]
    await new.node.finish(await new.assignment(jobs[0]), b"", mode="done")
    assert (await new.assignment(jobs[1])).provider == "p"


async def test_a_capped_tenant_leaves_no_capacity_idle_however_deep_its_backlog(any_redis: Redis) -> None:
    # a: weight 20, max_in_flight 1, a deep backlog; b: 30 jobs; one provider of capacity 32.
    config = cfg.parse({
        "queue": {"max_queue": 1000, "hold_when_unavailable_ms": 60_000},
        "api": {"keys": [{"name": "a", "key_sha256": "0" * 64, "weight": 20, "max_in_flight": 1},
                         {"name": "b", "key_sha256": "1" * 64}]},
        "nodes": [{"id": "n1", "providers": [
            {"id": "p", "type": "vllm", "base_url": "http://127.0.0.1:1", "capacity": 32, "models": ["m@p"]}]}],
        "models": [{"id": "m", "providers": {"p": "m@p"}}],
    }).config
    h = FairHarness(any_redis, config)
    await h.start()
    await h.redis.hset(keys.provider("p"), "health", "unavailable")  # nothing runs while they arrive
    a = [(await h.send("a"))[0] for _ in range(200)]
    for _ in range(30):
        await h.send("b")
    await h.up("p")
    running = await h.running()
    assert len(running) == 31  # a's one, and all of b's: one slot stays free for a
    assert sum(j in a for j in running) == 1
    # a's running job finishes: its next (parked) job comes back and runs at once.
    first = next(j for j in running if j in a)
    started = await h.finish_one(first)
    assert started == [a[1]]
    assert (await h.counters())["q:a"] == 198


async def test_a_job_parked_by_its_own_submit_is_answered_queued(any_redis: Redis) -> None:
    config = cfg.parse({
        "api": {"keys": [{"name": "a", "key_sha256": "0" * 64, "max_in_flight": 1},
                         {"name": "b", "key_sha256": "1" * 64}]},
        "nodes": [{"id": "n1", "providers": [
            {"id": "p", "type": "vllm", "base_url": "http://127.0.0.1:1", "capacity": 4, "models": ["m@p"]}]}],
        "models": [{"id": "m", "providers": {"p": "m@p"}}],
    }).config
    h = FairHarness(any_redis, config)
    await h.start()
    _, first = await h.send("a")
    job, second = await h.send("a")
    # a is at its limit: its second job is parked by its own submit's pump, a free slot or not.
    assert (first, second) == ("dispatched", "queued")
    assert await any_redis.zscore(keys.parked_in("a", keys.queue("m")), job) is not None
    assert (await h.record(job)).state == "q"


async def test_a_tenant_back_under_its_cap_gets_another_providers_idle_slot_at_once(any_redis: Redis) -> None:
    # a may run one at a time; its first job runs on p1 (model m1), its second waits for
    # model m2, which only p2 serves, idle.
    config = cfg.parse({
        "api": {"keys": [{"name": "a", "key_sha256": "0" * 64, "max_in_flight": 1},
                         {"name": "b", "key_sha256": "1" * 64}]},
        "nodes": [{"id": "n1", "providers": [
            {"id": p, "type": "vllm", "base_url": "http://127.0.0.1:1", "capacity": 1, "models": [f"{m}@{p}"]}
            for p, m in (("p1", "m1"), ("p2", "m2"))]}],
        "models": [{"id": m, "providers": {p: f"{m}@{p}"}} for p, m in (("p1", "m1"), ("p2", "m2"))],
    }).config
    h = FairHarness(any_redis, config)
    await h.start()
    t = h.tenants.by_name["a"]
    first, second = t.job_id("first"), t.job_id("second")
    await h.api.submit(first, h.calls.plans.main_lane("m1"), b"{}", "chat/completions", False, tenant=t)
    result = await h.api.submit(second, h.calls.plans.main_lane("m2"), b"{}", "chat/completions", False, tenant=t)
    assert result.status == "queued"
    # p1 frees: a is under its limit again, and p2 takes its waiting job now, not at p2's
    # next heartbeat.
    await h.node.finish(await h.assignment(first), b"", mode="done")
    assert (await h.assignment(second)).provider == "p2"


async def test_a_moved_job_given_up_by_its_api_leaves_no_entry_behind(any_redis: Redis) -> None:
    chat, both = ["chat/completions"], ["chat/completions", "rerank"]
    old = LaneHarness(any_redis, lane_config({"a": chat, "b": both, "c": both}, hold_ms=60_000))
    rerank = old.calls.plans.lane_for("m", "rerank")
    assert rerank is not None
    job, status = await old.submit_to(rerank, endpoint="rerank")  # nobody up: held
    assert status == "queued"
    new = reloaded(old, lane_config({"a": chat, "b": both}, hold_ms=60_000))
    assert await Reaper(new.calls, any_redis, "test").rehome() == 1
    moved_to = new.calls.plans.lane_for("m", "rerank")
    assert moved_to is not None
    # Its API cancels it with the queue it submitted to.
    assert (await old.api.cancel(job, rerank.queue, CancelReason.CLIENT)).outcome == "removed"
    assert await any_redis.zcard(moved_to.queue) == 0
