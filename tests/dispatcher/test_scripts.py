"""The Lua dispatch scripts against real Redis servers (every available version)."""

from __future__ import annotations

import uuid
from typing import Any

import anyio
import pytest
from redis.asyncio import Redis

from dispatcher import keys
from dispatcher.events import Assignment
from dispatcher.script_calls import Abort, AbortReason, CancelReason
from iop.redis_server import RedisServer
from tests.dispatcher.harness import Harness, make_config
from tests.dispatcher.monitor import MonitorRecorder

pytestmark = pytest.mark.anyio


@pytest.fixture
def harness(any_redis: Redis) -> Any:
    return lambda config: Harness(any_redis, config)


# --- selection: lowest in_flight/capacity ------------------------------------------------------------------

async def chosen(h: Harness, model: str = "m") -> str:
    job, status = await h.submit(model)
    assert status == "dispatched"
    return (await h.assignment(job)).provider


@pytest.mark.parametrize(
    ("state", "winner"),
    [
        ({"a": (1, 3), "b": (2, 3)}, "a"),  # 1/3 beats 2/3
        ({"a": (2, 3), "b": (1, 3)}, "b"),
        ({"a": (1, 3), "b": (2, 7)}, "b"),  # 2/7 < 1/3 although b runs more
        ({"a": (2, 6), "b": (1, 3)}, "b"),  # equal ratio: lower in_flight
        ({"a": (1, 2), "b": (1, 2)}, "a"),  # equal everything: lower provider id
        ({"b": (0, 1), "a": (0, 1)}, "a"),
        ({"a": (0, 4), "b": (0, 1)}, "a"),  # 0/4 vs 0/1 equal ratio and in_flight: id
        ({"a": (3, 3), "b": (2, 3)}, "b"),  # a is full
    ],
)
async def test_lowest_load_ratio_wins(harness: Any, state: dict[str, tuple[int, int]], winner: str) -> None:
    h = harness(make_config({p: cap for p, (_, cap) in state.items()}, {"m": list(state)}))
    for pid, (inf, _) in state.items():
        await h.up(pid)
        await h.set_in_flight(pid, inf)
    assert await chosen(h) == winner
    assert await h.in_flight(winner) == state[winner][0] + 1


async def test_served_name_is_the_candidates_own(harness: Any) -> None:
    h = harness(make_config({"a": 1, "b": 1}, {"qwen3.6:35b": ["a", "b"]}))
    await h.up("a")
    await h.up("b")
    j1, _ = await h.submit("qwen3.6:35b")
    j2, _ = await h.submit("qwen3.6:35b")
    targets = {(a.provider, a.target, a.model) for a in await h.assignments()}
    assert targets == {("a", "qwen3.6:35b@a", "qwen3.6:35b"), ("b", "qwen3.6:35b@b", "qwen3.6:35b")}
    assert {j1, j2} == {a.job for a in await h.assignments()}


async def test_unavailable_provider_is_excluded(harness: Any) -> None:
    h = harness(make_config({"a": 4, "b": 4}, {"m": ["a", "b"]}))
    await h.up("a", "unavailable")
    await h.up("b")
    await h.set_in_flight("b", 3)
    assert await chosen(h) == "b"


async def test_unknown_provider_is_excluded(harness: Any) -> None:
    # 'a' never heartbeated: no state in Redis at all.
    h = harness(make_config({"a": 4, "b": 4}, {"m": ["a", "b"]}))
    await h.up("b")
    await h.set_in_flight("b", 3)
    assert await chosen(h) == "b"


async def test_stale_heartbeat_is_excluded(harness: Any) -> None:
    h = harness(make_config({"a": 4, "b": 4}, {"m": ["a", "b"]}))
    await h.up("a")
    await h.up("b")
    await h.set_in_flight("b", 3)
    await h.redis.hset(keys.provider("a"), "hb_exp", 1)  # heartbeat long expired
    assert await chosen(h) == "b"


async def test_capacity_zero_is_excluded(harness: Any) -> None:
    h = harness(make_config({"a": 0, "b": 4}, {"m": ["a", "b"]}))
    await h.up("a")
    await h.up("b")
    await h.set_in_flight("b", 3)
    assert await chosen(h) == "b"
    # With b full, a capacity-0 provider still takes nothing: the job waits.
    _, status = await h.submit("m")
    assert status == "queued"


async def test_no_provider_up_is_refused_at_once_with_each_reason(harness: Any) -> None:
    h = harness(make_config({"a": 1, "b": 1}, {"m": ["a", "b"]}))
    await h.node.heartbeat("a", "unavailable", [("reason", "GET /health answered 404")])
    await h.up("b")
    await h.calls.drain("b", "drain")
    job = uuid.uuid4().hex
    result = await h.api.submit(job, h.calls.plans.main_lane("m"), b"{}", "chat/completions", False)
    assert result.status == "no_provider"
    assert result.why == "a: GET /health answered 404; b: drained by an operator"
    assert await h.record(job) is None
    assert await h.queued("m") == []
    assert await h.redis.scard(keys.replica_jobs("rep1")) == 0


async def test_a_silent_provider_may_be_coming_back_a_submit_waits_for_it(harness: Any) -> None:
    # Never heard of (its worker starting, or Redis lost its data), or a heartbeat past its
    # TTL (Redis was away): the job waits; only a reaper round, which knows whether Redis
    # was reachable meanwhile, judges such a provider down (tests/dispatcher/test_refuse.py).
    h = harness(make_config({"a": 1, "b": 1}, {"m": ["a", "b"]}))
    await h.node.heartbeat("b", "unavailable", [("reason", "down")])
    _, status = await h.submit("m")
    assert status == "queued"
    await h.up("a")
    await h.redis.hset(keys.provider("a"), "hb_exp", 1)
    _, status = await h.submit("m")
    assert status == "queued"


async def test_a_model_that_holds_keeps_the_job_waiting_for_a_provider(harness: Any) -> None:
    h = harness(make_config({"a": 1}, {"m": ["a"]}, hold_when_unavailable_ms=60_000))
    job, status = await h.submit("m")
    assert status == "queued"
    assert await h.assignments() == []
    assert await h.queued("m") == [job]


# --- queueing ------------------------------------------------------------------------

async def finish(h: Harness, job: str, event: bytes | None = b"x") -> str:
    return await h.node.finish(await h.assignment(job), event)


async def test_fifo_within_a_group(harness: Any) -> None:
    h = harness(make_config({"a": 1}, {"m": ["a"]}))
    await h.up("a")
    jobs = [await h.submit("m") for _ in range(4)]
    assert [s for _, s in jobs] == ["dispatched", "queued", "queued", "queued"]
    order = [jobs[0][0]]
    for _ in range(3):
        running = [a.job for a in await h.assignments()]
        assert running == [order[-1]]
        assert await finish(h, order[-1]) == "released"
        (nxt,) = [a.job for a in await h.assignments()]
        order.append(nxt)
    assert order == [j for j, _ in jobs]
    assert await h.in_flight("a") == 1


async def test_a_job_whose_queue_is_empty_never_enters_it_when_a_slot_is_free(
        any_redis_server: RedisServer, any_redis: Redis) -> None:
    # The pump is offered it as its lane's head as it is (lua/submit.lua, lib/pump.lua
    # `arriving`); one that must wait is queued with its deadline like any other.
    h = Harness(any_redis, make_config({"a": 1}, {"m": ["a"]}))
    await h.up("a")
    recorder = MonitorRecorder(any_redis_server.url).begin()
    try:
        first, status = await h.submit("m")
        second, second_status = await h.submit("m")
    finally:
        await any_redis.echo(recorder.marker)
    commands = recorder.end()
    assert (status, second_status) == ("dispatched", "queued")
    queue_writes = [(c.name, c.text(1), c.text(3)) for c in commands
                    if c.lua and c.name in ("ZADD", "ZREM") and c.text(1) in (keys.queue("m"), keys.DEADLINES)]
    assert queue_writes == [("ZADD", keys.queue("m"), second), ("ZADD", keys.DEADLINES, second)]
    # The dispatched one is as a dispatch from the queue leaves it: running, its body kept
    # for a redispatch, its assignment carrying that body.
    assert (await h.record(first)).state == "d"
    assert await h.redis.hget(keys.BODIES, first) == b'{"model":"m"}'
    assert (await h.assignment(first)).body == b'{"model":"m"}'
    assert await h.queued("m") == [second]
    assert await h.redis.zscore(keys.DEADLINES, first) is None
    assert await h.redis.zscore(keys.DEADLINES, second) is not None
    assert await finish(h, first) == "released"
    assert [a.job for a in await h.assignments()] == [second]


async def test_overflow_is_refused_at_exactly_max_queue(harness: Any) -> None:
    h = harness(make_config({"a": 1}, {"m": ["a"]}, max_queue=2))
    await h.up("a")
    statuses = [(await h.submit("m"))[1] for _ in range(5)]
    assert statuses == ["dispatched", "queued", "queued", "full", "full"]
    assert len(await h.queued("m")) == 2
    # A refused job leaves nothing behind.
    assert await h.redis.hlen(keys.JOBS) == 3
    assert await h.redis.hlen(keys.BODIES) == 3


async def test_max_queue_zero_refuses_rather_than_waits(harness: Any) -> None:
    h = harness(make_config({"a": 1}, {"m": ["a"]}, max_queue=0))
    await h.up("a")
    assert (await h.submit("m"))[1] == "dispatched"
    assert (await h.submit("m"))[1] == "full"


async def test_expired_head_is_dropped_not_dispatched(harness: Any) -> None:
    h = harness(make_config({"a": 1}, {"m": ["a"]}, queue_timeout_ms=50))
    await h.up("a")
    first, _ = await h.submit("m")
    late, status = await h.submit("m")
    assert status == "queued"
    await anyio.sleep(0.12)
    fresh, status = await h.submit("m")
    assert status == "queued"
    await finish(h, first)
    # The freed slot skipped the expired job and went to the next one.
    assert [a.job for a in await h.assignments()] == [fresh]
    assert (await h.record(late)).state == "x"
    cancelled = await h.api.cancel(late, keys.queue("m"), CancelReason.TIMEOUT)
    assert cancelled.outcome == "expired"
    assert await h.record(late) is None


async def test_timeout_before_the_deadline_says_wait(harness: Any) -> None:
    h = harness(make_config({"a": 1}, {"m": ["a"]}, queue_timeout_ms=60_000, hold_when_unavailable_ms=60_000))
    job, _ = await h.submit("m")
    result = await h.api.cancel(job, keys.queue("m"), CancelReason.TIMEOUT)
    assert result.outcome == "wait"
    assert 0 < result.wait_ms <= 60_000
    assert await h.queued("m") == [job]


async def test_timeout_of_a_dispatched_job_keeps_it_running(harness: Any) -> None:
    h = harness(make_config({"a": 1}, {"m": ["a"]}, queue_timeout_ms=1))
    await h.up("a")
    job, _ = await h.submit("m")
    await anyio.sleep(0.01)
    assert (await h.api.cancel(job, keys.queue("m"), CancelReason.TIMEOUT)).outcome == "running"
    assert await h.in_flight("a") == 1


async def test_release_is_idempotent(harness: Any) -> None:
    h = harness(make_config({"a": 2}, {"m": ["a"]}))
    await h.up("a")
    job, _ = await h.submit("m")
    a = await h.assignment(job)
    assert await h.node.finish(a, b"x") == "released"
    assert await h.node.finish(a, b"x") == "stale"
    assert await h.in_flight("a") == 0
    assert await h.redis.zcard(keys.LEASES) == 0
    # One final event only.
    assert await h.redis.xlen(keys.reply("rep1")) == 1


async def test_release_never_goes_below_zero(harness: Any) -> None:
    h = harness(make_config({"a": 2}, {"m": ["a"]}))
    await h.up("a")
    job, _ = await h.submit("m")
    await h.set_in_flight("a", 0)  # out of step, e.g. after a manual edit
    await finish(h, job)
    assert await h.in_flight("a") == 0


async def test_release_serves_the_oldest_head_across_groups(harness: Any) -> None:
    h = harness(make_config({"a": 1}, {"m1": ["a"], "m2": ["a"]}))
    await h.up("a")
    first, _ = await h.submit("m1")
    older, _ = await h.submit("m2")
    newer, _ = await h.submit("m1")
    await finish(h, first)
    assert [a.job for a in await h.assignments()] == [older]
    await finish(h, older)
    assert [a.job for a in await h.assignments()] == [newer]


async def test_heartbeat_of_a_recovered_provider_takes_waiting_jobs(harness: Any) -> None:
    h = harness(make_config({"a": 2}, {"m": ["a"]}, hold_when_unavailable_ms=60_000))
    await h.up("a", "unavailable")
    j1, s1 = await h.submit("m")
    j2, s2 = await h.submit("m")
    assert (s1, s2) == ("queued", "queued")
    await h.up("a")
    assert {a.job for a in await h.assignments()} == {j1, j2}


async def test_duplicate_job_id_is_refused(harness: Any) -> None:
    h = harness(make_config({"a": 1}, {"m": ["a"]}, hold_when_unavailable_ms=60_000))
    job, _ = await h.submit("m")
    assert (await h.submit("m", job))[1] == "duplicate"


# --- cancel, emit, renew -------------------------------------------------------------

async def test_cancel_of_a_waiting_job_removes_it(harness: Any) -> None:
    h = harness(make_config({"a": 1}, {"m": ["a"]}, hold_when_unavailable_ms=60_000))
    job, _ = await h.submit("m")
    assert (await h.api.cancel(job, keys.queue("m"), CancelReason.CLIENT)).outcome == "removed"
    assert await h.queued("m") == []
    assert await h.record(job) is None
    assert await h.redis.scard(keys.replica_jobs("rep1")) == 0
    assert (await h.api.cancel(job, keys.queue("m"), CancelReason.CLIENT)).outcome == "gone"


async def test_cancel_of_a_running_job_tells_its_node(harness: Any) -> None:
    h = harness(make_config({"a": 1}, {"m": ["a"]}))
    await h.up("a")
    job, _ = await h.submit("m")
    pubsub = h.redis.pubsub()
    await pubsub.subscribe(keys.cancel_channel("n1"))
    await pubsub.get_message(timeout=1)  # subscribe confirmation
    assert (await h.api.cancel(job, keys.queue("m"), CancelReason.CLIENT)).outcome == "cancelling"
    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=2)
    assert msg is not None
    assert msg["data"] == job.encode()
    await pubsub.aclose()
    a = await h.assignment(job)
    assert await h.node.renew([(job, a.fence)]) == [Abort(job, a.fence, AbortReason.CANCELLED)]
    assert await h.node.emit(a, b"start") == "cancelled"
    # The worker then finishes: the slot is back, and no event goes to the departed client.
    assert await h.node.finish(a, b"final") == "released"
    assert await h.in_flight("a") == 0
    assert await h.redis.xlen(keys.reply("rep1")) == 0


async def test_emit_and_renew_refuse_a_stale_fence(harness: Any) -> None:
    h = harness(make_config({"a": 1}, {"m": ["a"]}))
    await h.up("a")
    job, _ = await h.submit("m")
    a = await h.assignment(job)
    assert await h.node.emit(a, b"start") == "ok"
    assert (await h.record(job)).output_started == 1
    stale = Assignment(**{**{f: getattr(a, f) for f in a.__struct_fields__}, "fence": a.fence + 100})
    assert await h.node.emit(stale, b"start") == "stale"
    assert await h.node.renew([(job, a.fence + 100)]) == [Abort(job, a.fence + 100, AbortReason.STALE)]
    assert await h.node.finish(stale, b"x") == "stale"
    assert await h.in_flight("a") == 1
    assert await h.node.renew([(job, a.fence)]) == []


async def test_fences_never_go_back_after_the_counter_is_rolled_back(harness: Any) -> None:
    h = harness(make_config({"a": 1}, {"m": ["a"]}))
    await h.up("a")
    # A failover that lost the last writes: the new primary's counter is behind the fences
    # the old one handed out.
    await h.redis.set(keys.FENCE, 5)
    sec, usec = await h.redis.time()
    job, _ = await h.submit("m")
    fence = (await h.assignment(job)).fence
    assert fence >= (int(sec) * 1000 + int(usec) // 1000) * 10
    assert int(await h.redis.get(keys.FENCE)) == fence
