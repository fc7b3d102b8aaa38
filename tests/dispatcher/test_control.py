"""Drain and resume (dispatcher/control.py, lua/drain.lua, the mark in lua/lib/pump.lua)
against real Redis servers (every available version): a drained provider gets no new job
from any script that dispatches, its running jobs finish and release, resume hands its
free slots out at once."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import Redis

from dispatcher import events, keys
from dispatcher.catalog import read_catalog
from dispatcher.control import Control, DrainState
from dispatcher.exceptions import UnknownProvider
from tests.dispatcher.harness import LaneHarness, lane_config

pytestmark = pytest.mark.anyio


class DrainHarness(LaneHarness):
    def __init__(self, redis: Redis, config: Any) -> None:
        super().__init__(redis, config)
        self.control = Control(self.calls, redis)

    async def running_on(self, pid: str) -> list[str]:
        return [a.job for a in await self.assignments() if a.provider == pid]


@pytest.fixture
def drains(any_redis: Redis) -> Any:
    return lambda config: DrainHarness(any_redis, config)


async def test_a_drained_provider_gets_nothing_from_submit(drains: Any) -> None:
    h = drains(lane_config({"a": None, "b": None}, capacity=2))
    await h.up("a")
    await h.up("b")
    assert await h.control.drain("a") == DrainState("a", "drained", 0)
    main = h.calls.plans.main_lane("m")
    statuses = [(await h.submit_to(main))[1] for _ in range(3)]
    # a is idle and the less loaded, but drained: b takes two, the third waits for b.
    assert statuses == ["dispatched", "dispatched", "queued"]
    assert await h.running_on("a") == []
    assert len(await h.running_on("b")) == 2
    assert await h.in_flight("a") == 0


async def test_running_jobs_finish_and_a_freed_slot_elsewhere_skips_the_drained_one(drains: Any) -> None:
    h = drains(lane_config({"a": None, "b": None}, capacity=1))
    await h.up("a")
    await h.up("b")
    main = h.calls.plans.main_lane("m")
    on_a, _ = await h.submit_to(main)
    on_b, _ = await h.submit_to(main)
    assert await h.running_on("a") == [on_a]
    waiting = [(await h.submit_to(main))[0] for _ in range(2)]
    assert await h.control.drain("a") == DrainState("a", "draining", 1)
    # a's running job finishes normally: released, its slot back, and the waiting job that
    # slot would have gone to stays queued.
    assert await h.done(on_a) == "released"
    assert await h.in_flight("a") == 0
    assert await h.control.state("a") == DrainState("a", "drained", 0)
    assert await h.queued("m") == waiting
    # b frees: its pump hands the oldest waiting job to b, never to the idle drained a.
    assert await h.done(on_b) == "released"
    assert await h.running_on("b") == [waiting[0]]
    assert await h.running_on("a") == []
    assert await h.queued("m") == waiting[1:]


async def test_resume_dispatches_waiting_jobs_at_once(drains: Any) -> None:
    # Held: without a hold, requests to a model whose one provider is drained are refused.
    h = drains(lane_config({"a": None}, capacity=2, hold_ms=60_000))
    await h.up("a")
    await h.control.drain("a")
    main = h.calls.plans.main_lane("m")
    jobs = [(await h.submit_to(main))[0] for _ in range(3)]
    assert await h.queued("m") == jobs
    # No heartbeat in between: the resume itself pumps a's lanes.
    assert await h.control.resume("a") == DrainState("a", None, 2)
    assert await h.running_on("a") == jobs[:2]
    assert await h.queued("m") == jobs[2:]
    assert not await h.redis.hexists(keys.provider("a"), "drain")
    # Resuming an open provider changes nothing.
    assert await h.control.resume("a") == DrainState("a", None, 2)


async def test_a_heartbeat_keeps_the_mark(drains: Any) -> None:
    h = drains(lane_config({"a": None}, hold_ms=60_000))
    # Drained before its worker ever reported: the mark holds from the first heartbeat on.
    await h.control.drain("a")
    mark = await h.redis.hget(keys.provider("a"), "drain")
    assert mark is not None
    job, status = await h.submit_to(h.calls.plans.main_lane("m"))
    assert status == "queued"
    await h.up("a")  # would pump a's lanes if it were open
    await h.up("a")
    assert await h.redis.hget(keys.provider("a"), "drain") == mark
    assert await h.queued("m") == [job]
    # Draining again keeps the first mark's time.
    await h.control.drain("a")
    assert await h.redis.hget(keys.provider("a"), "drain") == mark
    await h.control.resume("a")
    assert await h.running_on("a") == [job]


async def test_a_pinned_request_to_a_drained_provider_is_refused_like_a_down_one(drains: Any) -> None:
    h = drains(lane_config({"a": None, "b": None}))
    await h.up("a")
    await h.up("b")
    pinned = h.calls.plans.pinned_lane("m", "b")
    # One queued before the drain (b full), one submitted during it.
    running, _ = await h.submit_to(pinned, pinned=True, endpoint="responses")
    queued, status = await h.submit_to(pinned, pinned=True, endpoint="responses")
    assert status == "queued"
    await h.control.drain("b")
    refused, status = await h.submit_to(pinned, pinned=True, endpoint="responses")
    assert status == "unavailable"
    assert await h.record(refused) is None
    # The queued one is answered at once too (never given to a free a), not at its deadline.
    assert await h.record(queued) is None
    assert await h.redis.zrange(pinned.queue, 0, -1) == []
    (_, fields), = await h.redis.xrange(keys.reply("rep1"))
    assert fields[b"job"] == queued.encode()
    assert events.decode(fields[b"event"]).code == "response_provider_unavailable"  # type: ignore[union-attr]
    assert await h.done(running) == "released"
    assert await h.running_on("a") == []


async def test_a_retry_does_not_count_a_drained_provider_as_another_candidate(drains: Any) -> None:
    h = drains(lane_config({"a": None, "b": None}))
    await h.up("a")
    await h.up("b")
    await h.control.drain("b")
    job, _ = await h.submit_to(h.calls.plans.main_lane("m"))
    assert await h.running_on("a") == [job]
    # As when b is down: the failure goes to the client instead of waiting for b.
    assert await h.fail(job) == "failed"
    assert await h.record(job) is None


async def test_unknown_provider(drains: Any) -> None:
    h = drains(lane_config({"a": None}))
    for action in (h.control.drain, h.control.resume, h.control.state):
        with pytest.raises(UnknownProvider) as info:
            await action("nope")
        assert info.value.status == 404
        assert info.value.code == "provider_not_found"
    assert not await h.redis.exists(keys.provider("nope"))


async def test_the_catalog_shows_draining_then_drained(drains: Any) -> None:
    h = drains(lane_config({"a": None, "b": None}, capacity=2))
    await h.up("a")
    await h.up("b")
    job, _ = await h.submit_to(h.calls.plans.main_lane("m"))
    assert await h.running_on("a") == [job]
    await h.control.drain("a")

    async def views() -> tuple[dict[str, str | None], int]:
        catalog = await read_catalog(h.redis, h.config)
        (model,) = catalog.models
        return {p.id: p.drain for p in catalog.providers}, model.available_slots

    # a's free slot is not the group's while it drains.
    assert await views() == ({"a": "draining", "b": None}, 2)
    assert await h.done(job) == "released"
    assert await views() == ({"a": "drained", "b": None}, 2)
    await h.control.resume("a")
    assert await views() == ({"a": None, "b": None}, 4)
