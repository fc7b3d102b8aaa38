"""Where an adapter's output goes: events on the waiting API process's reply stream."""

from __future__ import annotations

from dispatcher import events
from dispatcher.events import Assignment, Chunks, Done, End, Meta, Start
from dispatcher.slots import NodeSlots


class JobAborted(Exception):
    """The job must stop: its client left ('cancelled') or it was taken over ('stale')."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class RedisSink:
    """Implements ``workers.adapters.base.Sink`` for one job.

    The first output of a stream goes through the ``emit`` script, which checks that the
    job is still this worker's and marks it as having reached its client; later
    chunks are plain appends. The final event is written by ``finish`` together with
    the release, so a client never sees an answer whose slot was not given back.
    """

    def __init__(self, slots: NodeSlots, job: Assignment, node_id: str) -> None:
        self.slots = slots
        self.job = job
        self.meta = Meta(job.provider, node_id, job.target, job.queue_ms, job.attempt)
        self.status = 200
        self.started = False  # emit succeeded: output may have reached the client
        self._final: events.Event | None = None

    async def start(self, status: int) -> None:
        self.status = status

    async def chunks(self, payloads: list[bytes]) -> None:
        if self.started:
            await self.slots.chunks(self.job, events.encode(Chunks(payloads)))
            return
        outcome = await self.slots.emit(self.job, events.encode(Start(self.meta, self.status, payloads)))
        if outcome != "ok":
            raise JobAborted(outcome)
        self.started = True

    async def done(self, status: int, body: bytes, content_type: str) -> None:
        self._final = Done(self.meta, status, body, content_type)

    def final_event(self) -> events.Event:
        """What ``finish`` writes after a successful call."""
        if self._final is not None:
            return self._final
        return End(None if self.started else self.meta)
