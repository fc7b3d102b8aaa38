"""The API's waiting for a job, with a stand-in for Redis: the watchdog's rule for calling a
job lost, the cancel retried through an outage, and the queue deadline's check held through
one (``redis.failover_hold_ms``). The e2e tests run the same code against real processes
and a real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from api.waiting import ClientGone, JobWait, ReplyReader, Waiter, WaitRules
from dispatcher import events
from dispatcher.events import Chunks, End, Meta, Requeued, Start
from dispatcher.exceptions import QueueTimeout, RedisUnavailable, WorkerLost
from dispatcher.script_calls import Cancelled, CancelOutcome, CancelReason, SubmitStatus, Submitted

pytestmark = pytest.mark.anyio


class FakeJobs:
    """Job records that are gone; a cancel that fails ``failing`` times (with ``error``)
    before it answers ``outcome``."""

    def __init__(self, replies: ReplyReader, failing: int = 0) -> None:
        self.replies = replies
        self.failing = failing
        self.error: Exception = RedisConnectionError("Redis is away")
        self.outcome = CancelOutcome.GONE
        self.cancels: list[str] = []
        self.state_calls = 0
        self.reads_between_ticks = 1

    async def cancel(self, job_id: str, queue_key: str, reason: CancelReason) -> Cancelled:
        self.cancels.append(reason)
        if self.failing:
            self.failing -= 1
            raise self.error
        return Cancelled(self.outcome, 0)

    async def states(self, job_ids: list[str]) -> list[bytes | None]:
        self.state_calls += 1
        self.replies.reads += self.reads_between_ticks  # the reader reads between two ticks
        return [None]


def job_wait(lease_ms: int, failing: int = 0, hold_ms: int = 5000) -> tuple[JobWait, FakeJobs]:
    replies = ReplyReader(None, "reply")  # type: ignore[arg-type]  # never run here
    jobs = FakeJobs(replies, failing)
    rules = WaitRules(watch_s=lease_ms / 1000, hold_s=hold_ms / 1000, queue_timeout_ms=lambda model_id: 30_000)

    def spawn(coro: Coroutine[Any, Any, Any]) -> None:
        asyncio.get_running_loop().create_task(coro)

    return JobWait("job-1", "m", "q:m", replies=replies, jobs=jobs, rules=rules, spawn=spawn), jobs


async def test_a_waiter_hands_over_events_in_order_and_says_when_none_came() -> None:
    waiter = Waiter()
    waiter.push(events.encode(Chunks([b"a"], seq=1)))
    waiter.push(events.encode(End()))
    assert await waiter.next(wait_s=0.01) == Chunks([b"a"], seq=1)
    assert await waiter.next(wait_s=0.01) == End()
    assert await waiter.next(wait_s=0.01) is None
    waiter.client_gone()
    with pytest.raises(ClientGone):
        await waiter.next(wait_s=0.01)


async def test_a_vanished_job_is_lost_only_after_two_reads_since_it_was_seen_gone() -> None:
    wait, jobs = job_wait(lease_ms=20)
    with pytest.raises(WorkerLost):
        await wait.next_event()
    # Seen gone at the first tick (one read later); the third tick is two reads after it.
    assert jobs.state_calls == 3
    assert wait.settled


async def test_a_vanished_job_is_not_called_lost_while_the_reader_reads_nothing() -> None:
    wait, jobs = job_wait(lease_ms=20)
    jobs.reads_between_ticks = 0  # the reader is stuck (Redis away): answers may sit unread
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            await wait.next_event()
    assert jobs.state_calls >= 3
    assert not wait.settled


async def test_the_cancel_is_retried_through_a_short_outage() -> None:
    wait, jobs = job_wait(lease_ms=1000, failing=3)
    await wait.cancel()
    assert jobs.cancels == ["client"] * 4
    assert wait.settled
    await wait.cancel()  # settled: nothing more to stop
    assert len(jobs.cancels) == 4


async def test_the_cancel_gives_up_after_two_lease_periods() -> None:
    wait, jobs = job_wait(lease_ms=50, failing=1_000)
    async with asyncio.timeout(2):
        await wait.cancel()
    assert 2 <= len(jobs.cancels) < 10


async def test_a_requeue_after_output_started_ends_the_wait_instead_of_splicing() -> None:
    wait, _ = job_wait(lease_ms=1000)
    wait.output_began()
    wait.waiter.push(events.encode(Requeued()))
    with pytest.raises(WorkerLost):
        await wait.next_event()
    assert not wait.settled  # the requeued job is cancelled when the wait closes


async def test_a_dispatched_job_is_no_longer_held_to_its_queue_deadline() -> None:
    wait, jobs = job_wait(lease_ms=10_000)
    wait.waiting(Submitted(SubmitStatus.QUEUED, 1, 50))  # queued, deadline in 50 ms
    wait.waiter.push(events.encode(Start(Meta("p", "n1", "served", 10), 200, [b"{}"])))
    assert isinstance(await wait.next_event(), Start)  # dispatched and running
    jobs.failing = 1  # Redis is away: a deadline check now would answer 503
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.3):
            await wait.next_event()
    assert jobs.cancels == []  # no deadline check: the stream just waits for its worker


# --- the queue deadline's check, held through an outage --------------------------------------


async def test_a_deadline_passing_while_redis_is_away_is_decided_when_it_is_back() -> None:
    wait, jobs = job_wait(lease_ms=10_000, failing=4)
    jobs.outcome = CancelOutcome.REMOVED  # still waiting when Redis answers: its deadline has passed
    wait.waiting(Submitted(SubmitStatus.QUEUED, 1, 10))
    with pytest.raises(QueueTimeout):
        await wait.next_event()
    assert jobs.cancels == ["timeout"] * 5
    assert wait.settled


async def test_a_job_dispatched_during_the_outage_keeps_waiting_for_its_worker() -> None:
    wait, jobs = job_wait(lease_ms=10_000, failing=3)
    jobs.outcome = CancelOutcome.RUNNING
    wait.waiting(Submitted(SubmitStatus.QUEUED, 1, 10))
    # Its worker's answer comes while the deadline's check waits for Redis.
    asyncio.get_running_loop().call_later(0.03, wait.waiter.push, events.encode(End()))
    assert await wait.next_event() == End()
    assert jobs.cancels == ["timeout"] * 4


async def test_past_the_hold_a_queued_request_is_answered_redis_unavailable() -> None:
    wait, _ = job_wait(lease_ms=10_000, failing=1_000, hold_ms=200)
    wait.waiting(Submitted(SubmitStatus.QUEUED, 1, 0))
    started = asyncio.get_running_loop().time()
    with pytest.raises(RedisUnavailable):
        await wait.next_event()
    assert asyncio.get_running_loop().time() - started >= 0.2
    assert not wait.settled  # the job may still be in Redis: closing the wait cancels it


@pytest.mark.parametrize(("hold_ms", "error"), [(0, RedisConnectionError("Redis is away")),
                                                (5000, ResponseError("ERR Error running script"))],
                         ids=["no-hold", "script-error"])
async def test_a_deadline_check_fails_at_once_without_a_hold_or_on_a_script_error(
    hold_ms: int, error: Exception
) -> None:
    wait, jobs = job_wait(lease_ms=10_000, failing=1_000, hold_ms=hold_ms)
    jobs.error = error
    wait.waiting(Submitted(SubmitStatus.QUEUED, 1, 0))
    with pytest.raises(RedisUnavailable):
        await wait.next_event()
    assert jobs.cancels == ["timeout"]
