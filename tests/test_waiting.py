"""tests/waiting.py: the suite's one helper for waiting on what happens eventually."""

from __future__ import annotations

import itertools

import pytest

from tests.waiting import eventually, eventually_sync

pytestmark = pytest.mark.anyio


async def test_the_first_value_that_holds_is_returned_from_a_coroutine_function() -> None:
    counter = itertools.count()

    async def read() -> int:
        return next(counter)

    assert await eventually(read, lambda n: n >= 3, every=0) == 3


async def test_a_plain_function_and_truthiness_by_default() -> None:
    values = iter([0, "", None, {"a": "1"}])
    assert await eventually(lambda: next(values), every=0) == {"a": "1"}


async def test_never_holding_fails_naming_what_and_the_last_value() -> None:
    with pytest.raises(AssertionError, match=r"the hash did not hold within 0.05s \(last: \{'health': 'down'\}\)"):
        await eventually(lambda: {"health": "down"}, lambda h: h["health"] == "up", what="the hash", within=0.05)


async def test_errors_it_is_told_to_retry_count_as_not_yet_and_others_fail_at_once() -> None:
    calls = itertools.count()

    def flaky() -> int:
        n = next(calls)
        if n < 2:
            raise ConnectionError("not yet")
        return n

    assert await eventually(flaky, every=0, retrying=(ConnectionError,)) == 2

    def down() -> int:
        raise ConnectionError("down")

    with pytest.raises(ConnectionError):
        await eventually(down, every=0)


def test_the_sync_twin_waits_the_same_way() -> None:
    counter = itertools.count()
    assert eventually_sync(lambda: next(counter), lambda n: n == 2, every=0) == 2
    with pytest.raises(AssertionError, match="a zero did not hold"):
        eventually_sync(lambda: 0, what="a zero", within=0.05, every=0.01)
