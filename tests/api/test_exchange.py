"""``api/exchange.py`` on its own: an exchange ends once -- counted once, its stream slot
given back, its job's wait closed (and the job cancelled unless it is over) -- and a
stream that takes it over ends it, not the handler."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest

from api.exchange import Exchange
from api.metrics import RequestClock, RequestMetrics
from api.stream_slots import StreamSlots
from api.waiting import JobWait, ReplyReader, WaitRules
from dispatcher import events
from dispatcher.events import Done, Meta
from dispatcher.script_calls import Cancelled, CancelOutcome, CancelReason

pytestmark = pytest.mark.anyio


class Jobs:
    def __init__(self) -> None:
        self.cancels: list[tuple[str, CancelReason]] = []

    async def cancel(self, job_id: str, queue_key: str, reason: CancelReason) -> Cancelled:
        self.cancels.append((job_id, reason))
        return Cancelled(CancelOutcome.REMOVED, 0)

    async def states(self, job_ids: list[str]) -> list[bytes | None]:
        return [None]


class Request:
    """Enough of a request for the hang-up watch: a caller who never hangs up."""

    async def receive(self) -> dict[str, str]:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}


class Setup:
    def __init__(self) -> None:
        self.metrics = RequestMetrics()
        self.slots = StreamSlots(2)
        self.replies = ReplyReader(None, "reply")  # type: ignore[arg-type]  # never run here
        self.jobs = Jobs()
        self.spawned: list[asyncio.Task[Any]] = []

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        self.spawned.append(asyncio.get_running_loop().create_task(coro))

    def exchange(self, job_id: str = "j1") -> tuple[Exchange, JobWait]:
        exchange = Exchange(RequestClock(self.metrics))
        exchange.take_stream_slot(self.slots)
        wait = JobWait(job_id, "m", "q", replies=self.replies, jobs=self.jobs, spawn=self.spawn,
                       rules=WaitRules(watch_s=1.0, hold_s=1.0, queue_timeout_ms=lambda _: 1000))
        exchange.wait_for(Request(), wait)  # type: ignore[arg-type]
        return exchange, wait

    def counted(self) -> list[str]:
        text = self.metrics.render(None).decode()
        return [line.split('status="')[1].split('"')[0] for line in text.splitlines()
                if line.startswith("iop_requests_total{") and not line.endswith(" 0.0")]


async def test_an_answer_ends_the_exchange_once_and_cancels_an_unfinished_job() -> None:
    s = Setup()
    exchange, _wait = s.exchange()
    assert s.slots.in_use == 1
    assert "j1" in s.replies.waiters
    exchange.answered(503)
    exchange.answered(200)  # a second end changes nothing
    exchange.end(500)
    await asyncio.gather(*s.spawned)
    assert s.slots.in_use == 0
    assert "j1" not in s.replies.waiters
    assert s.jobs.cancels == [("j1", CancelReason.CLIENT)]
    assert s.counted() == ["503"]


async def test_a_settled_job_is_not_cancelled() -> None:
    s = Setup()
    exchange, wait = s.exchange()
    wait.waiter.push(events.encode(Done(Meta("p", "n1", "served", 0), 200, b"{}")))
    await wait.next_event()  # its final event came
    exchange.answered(200)
    await asyncio.gather(*s.spawned)
    assert s.jobs.cancels == []
    assert s.slots.in_use == 0


async def test_a_stream_that_took_the_exchange_over_ends_it_itself() -> None:
    s = Setup()
    exchange, _wait = s.exchange()
    exchange.stream_takes_over()
    exchange.answered(200)  # the handler returns the stream: nothing ends yet
    assert s.slots.in_use == 1
    assert "j1" in s.replies.waiters
    assert s.counted() == []
    exchange.end(499)  # the stream ended (its caller went away)
    assert s.slots.in_use == 0
    assert "j1" not in s.replies.waiters
    assert s.counted() == ["499"]


async def test_without_a_job_an_exchange_still_counts_and_frees_its_slot() -> None:
    s = Setup()
    exchange = Exchange(RequestClock(s.metrics))
    exchange.take_stream_slot(s.slots)
    exchange.answered(400)  # refused before its job existed
    assert s.slots.in_use == 0
    assert s.counted() == ["400"]
