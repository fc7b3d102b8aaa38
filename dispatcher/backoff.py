"""The delays of a retry loop: short at first, doubling up to a cap, short again after a
success. One helper so that every loop that waits for Redis (or anything else) to come
back behaves, and is tuned, the same way."""

from __future__ import annotations

import anyio


class Backoff:
    """``first``, ``2 * first``, ... up to ``cap`` seconds; ``reset()`` after a success."""

    __slots__ = ("_next", "cap", "first")

    def __init__(self, first: float = 0.05, cap: float = 0.5) -> None:
        self.first = first
        self.cap = cap
        self._next = first

    def reset(self) -> None:
        self._next = self.first

    def next(self) -> float:
        """The delay to wait now; the one after it doubles."""
        delay = self._next
        self._next = min(self._next * 2, self.cap)
        return delay

    async def sleep(self) -> None:
        await anyio.sleep(self.next())
