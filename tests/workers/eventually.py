"""Waiting in the worker's part tests for what happens eventually (never a timing claim)."""

from __future__ import annotations

from collections.abc import Callable

import anyio

EVENTUALLY_S = 10.0  # a bound for "this happens eventually" (never a performance threshold)


async def until(check: Callable[[], bool]) -> None:
    """Return once ``check()`` holds; fail the test if it never does."""
    with anyio.fail_after(EVENTUALLY_S):
        while True:
            if check():
                return
            await anyio.sleep(0.01)
