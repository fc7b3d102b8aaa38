"""A worker's runs and their leases (workers/leases.py): the (job, fence) registry, cancels
that come before their job, what a shutdown waits for, and the renewal loop.

The renewal loop runs against a recording stand-in for ``WorkerSide.renew`` (the script
call itself is tested in tests/dispatcher): what is tested here is what the loop renews,
when it does it again, and what it does with the aborts it is told of.
"""

from __future__ import annotations

from collections.abc import Iterable

import anyio
import pytest
from anyio import wait_all_tasks_blocked
from redis.exceptions import ConnectionError as RedisConnectionError

from dispatcher.events import Assignment
from dispatcher.script_calls import Abort, AbortReason
from tests.waiting import EVENTUALLY_S
from workers.leases import CANCELLED, SHUTDOWN, STALE, Leases, Running, Runs

pytestmark = pytest.mark.anyio

# A bound for "this happens eventually" (never a performance threshold).
# Leases this long are never renewed on their own schedule within a test.
LONG_LEASE_MS = 600_000


def job(name: str = "j1", fence: int = 1, provider: str = "p", entry: str = "1-0") -> Assignment:
    return Assignment(entry_id=entry, job=name, fence=fence, provider=provider, target="t", model="m", lane="",
                      replica="r1", endpoint="chat/completions", stream=False, attempt=1, submitted_ms=0,
                      dispatched_ms=0, body=b"")


# --------------------------------------------------------------------------- Runs


async def test_a_new_run_of_a_running_job_fences_the_old_one_off() -> None:
    runs = Runs(keep_s=60)
    old = runs.start(job(fence=1))
    other = runs.start(job("j2", fence=1))
    new = runs.start(job(fence=2))
    assert old.abort_reason == STALE
    assert old.scope.cancel_called
    assert new.abort_reason is None
    assert not new.scope.cancel_called
    assert other.abort_reason is None  # another job's run is left alone
    assert runs.get(("j1", 1)) is old
    assert runs.get(("j1", 2)) is new


async def test_a_cancel_aborts_the_runs_of_its_job_only() -> None:
    runs = Runs(keep_s=60)
    mine, other = runs.start(job("j1")), runs.start(job("j2"))
    runs.cancel("j1")
    assert mine.abort_reason == CANCELLED
    assert mine.scope.cancel_called
    assert other.abort_reason is None
    assert not other.scope.cancel_called
    assert runs.early_cancels == {}  # it found its run: nothing to remember


async def test_a_cancel_that_comes_before_its_job_aborts_the_job_when_it_starts() -> None:
    runs = Runs(keep_s=60)
    runs.cancel("j1")
    first = runs.start(job("j1"))
    assert first.abort_reason == CANCELLED
    runs.end(first)
    # Used up: the next dispatch of the job runs.
    assert runs.start(job("j1", fence=2)).abort_reason is None
    assert runs.start(job("j2")).abort_reason is None


async def test_early_cancels_are_forgotten_once_they_expire() -> None:
    runs = Runs(keep_s=-1)  # expired as soon as kept
    runs.cancel("j1")
    runs.cancel("j2")  # each new one sweeps the expired ones
    assert runs.early_cancels == {}
    assert runs.start(job("j1")).abort_reason is None

    kept = Runs(keep_s=60)
    kept.cancel("j1")
    kept.cancel("j2")
    assert set(kept.early_cancels) == {"j1", "j2"}


async def test_idle_waits_until_the_last_run_ended() -> None:
    runs = Runs(keep_s=60)
    await runs.idle()  # nothing runs: at once
    a, b = runs.start(job("a")), runs.start(job("b"))
    done = anyio.Event()

    async def wait() -> None:
        await runs.idle()
        done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        await wait_all_tasks_blocked()
        runs.end(a)
        await wait_all_tasks_blocked()
        assert not done.is_set(), "idle with a job still running"
        runs.end(b)
        with anyio.fail_after(EVENTUALLY_S):
            await done.wait()
    assert len(runs) == 0


async def test_abort_all_and_what_the_runs_tell() -> None:
    runs = Runs(keep_s=60)
    a = runs.start(job("a", provider="p1", entry="1-1"))
    b = runs.start(job("b", provider="p2", entry="1-2"))
    assert runs.on_provider("p1")
    assert runs.on_provider("p2")
    assert not runs.on_provider("p3")
    assert runs.entry_ids() == {"1-1", "1-2"}
    runs.abort_all(SHUTDOWN)
    assert (a.abort_reason, b.abort_reason) == (SHUTDOWN, SHUTDOWN)
    assert a.scope.cancel_called
    assert b.scope.cancel_called
    runs.end(a)
    assert not runs.on_provider("p1")
    assert runs.entry_ids() == {"1-2"}


async def test_a_run_keeps_its_first_abort_reason() -> None:
    running = Running(job())
    running.abort(CANCELLED)
    running.abort(SHUTDOWN)
    assert running.abort_reason == CANCELLED


# --------------------------------------------------------------------------- Leases


class RecordingSide:
    """Stands in for ``WorkerSide.renew``: records each renewal, answers from a script."""

    def __init__(self) -> None:
        self.renewed: list[list[tuple[str, int]]] = []
        self.answers: list[list[Abort] | Exception] = []
        self.called = anyio.Event()

    async def renew(self, runs: Iterable[tuple[str, int]], reply_within: float | None = None) -> list[Abort]:
        self.renewed.append(list(runs))
        self.called.set()
        self.called = anyio.Event()
        answer = self.answers.pop(0) if self.answers else []
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def renewals(self, count: int) -> None:
        with anyio.fail_after(EVENTUALLY_S):
            while len(self.renewed) < count:
                await self.called.wait()


def renewing() -> tuple[Runs, RecordingSide, Leases, list[int]]:
    """Runs, the side that records renewals, their Leases, and the number of renewals seen
    by each call of the after-renewal hook."""
    runs = Runs(keep_s=60)
    side = RecordingSide()
    settled: list[int] = []

    async def after_renewal() -> None:
        settled.append(len(side.renewed))

    return runs, side, Leases(runs, side, LONG_LEASE_MS, after_renewal), settled  # type: ignore[arg-type]


async def test_renew_now_renews_every_running_job_and_aborts_what_it_is_told() -> None:
    runs, side, leases, settled = renewing()
    a, b, c = runs.start(job("a", fence=1)), runs.start(job("b", fence=4)), runs.start(job("c", fence=2))
    side.answers.append([Abort("a", 1, AbortReason.CANCELLED), Abort("b", 3, AbortReason.STALE),
                         Abort("gone", 1, AbortReason.STALE)])
    async with anyio.create_task_group() as tg:
        tg.start_soon(leases.run)
        leases.renew_now()
        await side.renewals(1)
        await wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    assert sorted(side.renewed[0]) == [("a", 1), ("b", 4), ("c", 2)]
    assert a.abort_reason == CANCELLED
    assert a.scope.cancel_called
    assert b.abort_reason is None  # the abort named an older fence: not this run
    assert c.abort_reason is None
    assert settled == [1]


async def test_a_failed_renewal_is_tried_again_without_being_asked() -> None:
    runs, side, leases, settled = renewing()
    runs.start(job("a"))
    side.answers.append(RedisConnectionError("gone"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(leases.run)
        leases.renew_now()
        await side.renewals(2)  # the second one on its own: the lease period is far off
        await wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    assert side.renewed[1] == [("a", 1)]
    assert settled == [2]  # only after the renewal that succeeded


async def test_renew_now_asked_before_the_loop_runs_is_kept() -> None:
    side = RecordingSide()

    async def nothing() -> None:
        pass

    leases = Leases(Runs(keep_s=60), side, LONG_LEASE_MS, nothing)  # type: ignore[arg-type]
    leases.renew_now()
    async with anyio.create_task_group() as tg:
        tg.start_soon(leases.run)
        await side.renewals(1)
        tg.cancel_scope.cancel()
    assert side.renewed == [[]]
