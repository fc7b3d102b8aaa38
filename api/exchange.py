"""One request's exchange: :class:`Exchange` owns what a request holds from its start to
the last byte of its answer -- its clock (the request counted exactly once), its stream
slot, its job's wait and the watch for a caller who hangs up -- and ends them together,
in one place, whatever the answer: a JSON body, an error, or a stream, which takes the
exchange over and ends it when it ends (``api/answers.py``). Its state changes only through
its methods."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from litestar import Request

from api.metrics import RequestClock
from api.stream_slots import StreamSlots, no_slot
from api.waiting import HangUpWatch, JobWait
from dispatcher.events import Usage


class Exchange:
    __slots__ = ("_ended", "_hang_up", "_release", "_streaming", "_usage", "clock", "wait")

    def __init__(self, clock: RequestClock) -> None:
        self.clock = clock
        self.wait: JobWait | None = None
        self._hang_up: HangUpWatch | None = None
        self._release: Callable[[], None] = no_slot
        # A stream answers: it ends the exchange when its last event is relayed.
        self._streaming = False
        # The tokens of a JSON answer, counted with it.
        self._usage: Usage | None = None
        self._ended = False

    def take_stream_slot(self, slots: StreamSlots) -> None:
        """One of the process's stream slots, given back when the exchange ends; beyond the
        cap, 503 server_overloaded (``api/stream_slots.py``)."""
        self._release = slots.acquire()

    def wait_for(self, request: Request[Any, Any, Any], wait: JobWait) -> JobWait:
        """Wait for ``wait``'s job, watching the caller until its first event came."""
        self.wait = wait
        self._hang_up = HangUpWatch(request, wait.waiter)
        return wait

    def continues_with(self, wait: JobWait) -> JobWait:
        """A cut stream goes on as another job (api/continuation.py): that job's wait is the
        exchange's now (the cut one ended with its failure)."""
        if self.wait is not None:
            self.wait.close()
        self.wait = wait
        return wait

    def stream_takes_over(self) -> None:
        """A stream answers: it ends the exchange when its last event is relayed, not the handler."""
        self._streaming = True

    def answer_carries(self, usage: Usage | None) -> None:
        """The tokens of the JSON answer, counted with the request when it ends."""
        self._usage = usage

    def first_event_came(self) -> None:
        # From here a stream response listens for the caller's hang-up itself (Litestar).
        if self._hang_up is not None:
            self._hang_up.stop()

    def answered(self, status: int) -> None:
        """The handler is done with the request (an answer, or an error with ``status``):
        the exchange ends now, unless a stream answers it and ends it later."""
        if not self._streaming:
            self.end(status, self._usage)

    def end(self, status: int, usage: Usage | None = None) -> None:
        """Count the request, give its slot back, stop listening for its job -- and cancel the
        job unless it is over (in the background: the answer does not wait for Redis)."""
        if self._ended:
            return
        self._ended = True
        self.first_event_came()
        self._release()
        if self.wait is not None:
            self.wait.close()
        self.clock.done(status, usage)
