"""Deadlines in the scripts, against a real Redis: a queue's drain rate is measured while it
has a backlog (``lua/lib/drain_rate.lua`` note_drain), and a submit whose place in the queue times
that rate is over its deadline is refused at once (``lua/submit.lua``); a caller's deadline
shortens the queue wait."""

from __future__ import annotations

import math
import uuid
from typing import Any

import anyio
import pytest
from redis.asyncio import Redis

from dispatcher import keys, wire
from dispatcher.script_calls import SubmitStatus, Submitted
from tests.dispatcher.harness import Harness, make_config

pytestmark = pytest.mark.anyio


class DeadlineHarness(Harness):
    # The server's clock just before and just after each finish of ``backlog``.
    finished: list[tuple[int, int]]

    async def send(self, deadline_ms: int = 0) -> tuple[str, Submitted]:
        job = uuid.uuid4().hex
        lane = self.calls.plans.main_lane("m")
        return job, await self.api.submit(job, lane, b'{"model":"m"}', "chat/completions", False,
                                          deadline_ms=deadline_ms)

    async def finish(self, job: str) -> None:
        await self.node.finish(await self.assignment(job), b"", mode="done")

    async def interval(self) -> float | None:
        raw = await self.redis.hget(keys.QUEUE_RATES, self.calls.plans.main_lane("m").queue)
        tail = raw.decode().split("|")[2] if raw else ""  # '<block start>|<count>|<interval>'
        return float(tail) if tail else None


async def backlog(redis: Redis, spacing_s: float, **queue: Any) -> tuple[DeadlineHarness, list[str]]:
    """One slot; a job running and eleven waiting; nine finish ``spacing_s`` apart: the
    queue drained one job per ``spacing_s`` while it had a backlog (a block of eight
    intervals, lua/lib/drain_rate.lua note_drain); one runs and two wait."""
    h = DeadlineHarness(redis, make_config({"p": 1}, {"m": ["p"]}, **queue))
    h.finished = []
    await h.up("p")
    jobs = [(await h.send())[0] for _ in range(12)]
    assert await h.interval() is None  # nothing waited yet: no rate
    for i, job in enumerate(jobs[:9]):
        await anyio.sleep(spacing_s)
        before = await h.now_ms()
        await h.finish(job)
        h.finished.append((before, await h.now_ms()))
        if i < 8:
            assert await h.interval() is None  # a block of eight intervals first: bursts even out
    return h, jobs


async def test_the_drain_rate_is_measured_while_the_queue_has_a_backlog(any_redis: Redis) -> None:
    h, jobs = await backlog(any_redis, 0.1)
    interval = await h.interval()
    assert interval is not None
    # The block's mean: from the first dispatch of a job that waited to the eighth after it,
    # each read off the server's clock around its finish (however loaded the machine), and
    # written to 0.1 ms.
    (first_before, first_after), (last_before, last_after) = h.finished[0], h.finished[8]
    assert (last_before - first_after) / 8 - 0.05 <= interval <= (last_after - first_before) / 8 + 0.05
    assert interval >= 99  # the finishes were 100 ms apart at least (whole ms on both ends)
    # Emptied, the queue keeps its rate, but the idle time until the next backlog never counts.
    for job in jobs[9:]:
        await h.finish(job)
    kept = await h.interval()
    await anyio.sleep(0.5)
    job, _ = await h.send()
    await h.finish(job)
    assert await h.interval() == kept


async def test_a_wait_predicted_over_the_deadline_is_refused_at_once(any_redis: Redis) -> None:
    h, _ = await backlog(any_redis, 0.1)
    interval = await h.interval()
    assert interval is not None
    assert interval >= 99  # the finishes were 100 ms apart at least (whole ms on both ends)
    # Two wait, one runs: a third's place is k = 3 intervals away, and its 95th percentile
    # k + 1.65 sqrt(k) intervals (lua/submit.lua): over 500 ms, the deadline 150 ms.
    _, refused = await h.send(deadline_ms=150)
    assert refused.status == SubmitStatus.DEADLINE_UNMEETABLE
    # The predicted wait beyond the deadline, ms.
    assert int(refused.why) == math.ceil((3 + 1.65 * math.sqrt(3)) * interval - 150)
    assert refused.queued == 2  # and it left the queue
    # A deadline the queue can meet (a second over that percentile): it waits, and no longer
    # than its deadline.
    meetable = math.ceil((3 + 1.65 * math.sqrt(3)) * interval) + 1_000
    _, queued = await h.send(deadline_ms=meetable)
    assert queued.status == SubmitStatus.QUEUED
    assert queued.wait_ms <= meetable


async def test_without_a_deadline_or_a_shedding_setting_nothing_is_refused(any_redis: Redis) -> None:
    h, _ = await backlog(any_redis, 0.1)
    assert (await h.send())[1].status == SubmitStatus.QUEUED


async def test_a_model_may_shed_load_without_a_deadline(any_redis: Redis) -> None:
    h, _ = await backlog(any_redis, 0.1, refuse_predicted_over_ms=150)
    assert (await h.send())[1].status == SubmitStatus.DEADLINE_UNMEETABLE
    # A caller's deadline counts where it is shorter, never where it is longer.
    assert (await h.send(deadline_ms=10_000))[1].status == SubmitStatus.DEADLINE_UNMEETABLE


async def test_refused_submits_are_counted_for_the_learned_limit(any_redis: Redis) -> None:
    # Load shedding keeps the queue short; the refusals are demand a learned limit reads as a
    # backlog (workers/capacity_control.py), counted per queue (keys.shed_field).
    h, _ = await backlog(any_redis, 0.1, refuse_predicted_over_ms=150)
    queue = h.calls.plans.main_lane("m").queue
    assert await any_redis.hget(keys.QUEUE_RATES, keys.shed_field(queue)) is None
    for _ in range(3):
        assert (await h.send())[1].status == SubmitStatus.DEADLINE_UNMEETABLE
    assert await any_redis.hget(keys.QUEUE_RATES, keys.shed_field(queue)) == b"3"
    assert await h.interval() is not None  # the drain rate's own field is untouched


async def test_a_fresh_queue_is_predicted_from_its_providers_service_times(any_redis: Redis) -> None:
    # Issue 30: before any backlog was measured, the providers' published service times and
    # limits (lua/capacity.lua) predict the wait: one slot, 3 s per call, nine waiting: the
    # tenth waits about 30 s, and a 500 ms deadline is refused at once, not after 500 ms.
    h = DeadlineHarness(any_redis, make_config({"p": 1}, {"m": ["p"]}))
    await h.up("p")
    jobs = [(await h.send())[0] for _ in range(10)]
    assert await h.interval() is None  # nothing drained yet
    _, unmeasured = await h.send(deadline_ms=500)
    assert unmeasured.status == SubmitStatus.QUEUED  # no service time published: nothing predicted
    await h.node.publish_capacity("p", wire.CapacityReport(capacity=1, mode="auto", service_ms=3000.0))
    _, refused = await h.send(deadline_ms=500)
    assert refused.status == SubmitStatus.DEADLINE_UNMEETABLE
    assert int(refused.why) > 20_000
    _, queued = await h.send(deadline_ms=120_000)
    assert queued.status == SubmitStatus.QUEUED
    assert len(jobs) == 10
