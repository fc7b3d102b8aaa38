"""Waiting for what happens eventually: the one polling helper of the suite.

A test that waits for a condition polls it here, never sleeps a guessed time. The bound is
how long "eventually" may take before the test fails, never a performance threshold (timing
claims belong in bench/).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

T = TypeVar("T")

EVENTUALLY_S = 10.0  # a bound for "this happens eventually" (never a performance threshold)


def _holds(value: object) -> bool:
    return bool(value)


def _failure(what: str, within: float, last: object) -> AssertionError:
    return AssertionError(f"{what or 'the condition'} did not hold within {within}s (last: {last!r})")


async def eventually(
    read: Callable[[], Awaitable[T]] | Callable[[], T],
    holds: Callable[[T], bool] = _holds,
    *,
    what: str = "",
    within: float = EVENTUALLY_S,
    every: float = 0.01,
    retrying: tuple[type[BaseException], ...] = (),
) -> T:
    """The first value of ``read()`` (a function or a coroutine function) that ``holds``
    (by default: is truthy). An exception of a type in ``retrying`` counts as not yet.
    Fails the test with an AssertionError naming ``what`` and the last value read if none
    holds within ``within`` seconds."""
    last: Any = None
    try:
        with anyio.fail_after(within):
            while True:
                try:
                    value = read()
                    if inspect.isawaitable(value):
                        value = await value
                    last = value
                    if holds(value):  # type: ignore[arg-type]
                        return value  # type: ignore[return-value]
                except retrying as exc:
                    last = exc
                await anyio.sleep(every)
    except TimeoutError:
        raise _failure(what, within, last) from None


def eventually_sync(
    read: Callable[[], T],
    holds: Callable[[T], bool] = _holds,
    *,
    what: str = "",
    within: float = EVENTUALLY_S,
    every: float = 0.05,
    retrying: tuple[type[BaseException], ...] = (),
) -> T:
    """``eventually`` for a test without an event loop (one that drives processes or
    threads): polls ``read`` between sleeps of ``every`` seconds."""
    deadline = time.monotonic() + within
    last: Any = None
    while True:
        try:
            last = read()
            if holds(last):
                return last
        except retrying as exc:
            last = exc
        if time.monotonic() > deadline:
            raise _failure(what, within, last)
        time.sleep(every)
