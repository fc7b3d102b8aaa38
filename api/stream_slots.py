"""The streamed answers one API process relays at once, capped by ``api.max_streams``."""

from __future__ import annotations

from collections.abc import Callable

from dispatcher.exceptions import Overloaded


class StreamSlots:
    """A counter with one owner: ``acquire`` takes a slot and returns its release."""

    __slots__ = ("in_use", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0

    def acquire(self) -> Callable[[], None]:
        """A slot, or Overloaded (503 server_overloaded) when all are taken."""
        if self.in_use >= self.limit:
            raise Overloaded(f"This API process already relays {self.in_use} streams; retry later")
        self.in_use += 1
        released = False

        def release() -> None:
            # Once only: a second call would free a slot another stream holds.
            nonlocal released
            if not released:
                released = True
                self.in_use -= 1

        return release


def no_slot() -> None:
    """The release of an answer that took no slot (a JSON answer)."""
