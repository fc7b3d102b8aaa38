"""Where an adapter's output goes: events on the waiting API process's reply stream."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

import msgspec
from redis.exceptions import RedisError

from dispatcher import events
from dispatcher.events import Assignment, Chunks, Done, End, Meta, Start, Usage
from dispatcher.script_calls import EmitOutcome
from dispatcher.worker_side import WorkerSide

log = logging.getLogger("iop.worker")

# While Redis cannot be written, a stream's output is held in memory, up to this much per
# job: a caller sees a pause, not an error. Past it (or past the time bound the worker
# gives) the job ends with worker_lost instead of growing without limit.
HOLD_BYTES = 8 * 1024 * 1024
# Between two write attempts while Redis is away: chunks keep coming from the provider,
# and each must not cost a connection attempt.
RETRY_EVERY_S = 0.2


class _Choice(msgspec.Struct):
    delta: dict[str, object] | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []


_CHUNK = msgspec.json.Decoder(_Chunk)


def announces_only(payload: bytes) -> bool:
    """A chat chunk that only names the role, with no token: vLLM and SGLang send it with the
    first token, other servers at once, before the prompt is even read. It is not output, so
    the time to first token (live figures, capacity: auto's FirstTokens) does not start there."""
    if b'"role"' not in payload:
        return False
    try:
        chunk = _CHUNK.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
    return bool(chunk.choices) and all(
        c.delta is not None and not any(v for k, v in c.delta.items() if k != "role") for c in chunk.choices)


class JobAborted(Exception):
    """The job must stop: its client left ('cancelled') or it was taken over ('stale')."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class RedisSink:
    """Implements ``workers.adapters.base.Sink`` for one job.

    The first output of a stream goes through the ``emit`` script, which checks that the
    job is still this worker's and marks it as having reached its client; later
    chunks are plain appends, numbered so that the API drops a batch written twice (a
    retry after a reply lost with the connection). The final event is written by
    ``finish`` together with the release, so a client never sees an answer whose slot was
    not given back.

    When Redis cannot be written, output is held (``HOLD_BYTES``, ``hold_s``) and written
    in order once it can: a batch once tried keeps its number and its content, so a
    retry is either a duplicate the API drops or the first copy.
    """

    def __init__(self, side: WorkerSide, job: Assignment, node_id: str, hold_s: float = 0.0) -> None:
        self.side = side
        self.job = job
        self.meta = Meta(job.provider, node_id, job.target, job.queue_ms, job.attempt)
        self.status = 200
        self.content_type = "text/event-stream"
        self.headers: dict[str, str] = {}
        self.upstream_done = True
        self.started = False  # emit succeeded: output may have reached the client
        # When the provider's first output came (time.monotonic()): its time to first token;
        # ``on_first_output`` is told at that moment (workers/capacity_control.py).
        self.first_output_at: float | None = None
        self.on_first_output: Callable[[], None] | None = None
        self.hold_s = hold_s
        self._final: events.Event | None = None
        self._usage: Usage | None = None
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._unacked: tuple[int, list[bytes]] | None = None  # tried, not known written
        self._seq = 0  # of the next batch: 0 is the start event
        self._failing_since: float | None = None
        self._retry_at = 0.0

    async def start(
        self, status: int, content_type: str = "text/event-stream", headers: Mapping[str, str] | None = None
    ) -> None:
        self.status = status
        self.content_type = content_type
        self.headers = dict(headers or {})

    def ended(self, upstream_done: bool) -> None:
        self.upstream_done = upstream_done

    def usage(self, usage: Usage) -> None:
        self._usage = usage

    async def chunks(self, payloads: list[bytes]) -> None:
        if self.first_output_at is None and not all(announces_only(p) for p in payloads):
            self.first_output_at = time.monotonic()
            if self.on_first_output is not None:
                self.on_first_output()
        self._pending.extend(payloads)
        self._pending_bytes += sum(len(p) for p in payloads)
        if self._failing_since is not None and time.monotonic() < self._retry_at:
            self._check_bounds()
            return
        try:
            await self.flush()
        except RedisError as exc:
            now = time.monotonic()
            if self._failing_since is None:
                self._failing_since = now
                log.warning("job %s: Redis away (%s); holding its output", self.job.job, exc,
                            extra=self.job.log_context())
            self._retry_at = now + RETRY_EVERY_S
            self._check_bounds()

    def _check_bounds(self) -> None:
        assert self._failing_since is not None
        held = self._pending_bytes + sum(len(p) for p in (self._unacked or (0, []))[1])
        if held > HOLD_BYTES or time.monotonic() - self._failing_since > self.hold_s:
            raise RedisError(f"output held for {time.monotonic() - self._failing_since:.1f} s ({held} bytes); "
                             "giving up on this stream")

    async def flush(self) -> None:
        """Write what is held, in order; RedisError leaves it held."""
        while True:
            if self._unacked is None:
                if not self._pending:
                    break
                self._unacked = (self._seq, self._pending)
                self._seq += 1
                self._pending, self._pending_bytes = [], 0
            seq, batch = self._unacked
            if seq == 0:
                start = Start(self.meta, self.status, batch, self.content_type, self.headers)
                outcome = await self.side.emit(self.job, events.encode(start))
                if outcome != EmitOutcome.OK:
                    raise JobAborted(outcome)
                self.started = True
            else:
                await self.side.chunks(self.job, events.encode(Chunks(batch, seq)))
            self._unacked = None
        if self._failing_since is not None:
            log.info("job %s: Redis is back after %.1f s; held output written", self.job.job,
                     time.monotonic() - self._failing_since)
            self._failing_since = None

    def discard(self) -> None:
        """Forget held output (the job ends with an error instead)."""
        self._pending, self._pending_bytes, self._unacked = [], 0, None

    async def done(
        self, status: int, body: bytes, content_type: str, headers: Mapping[str, str] | None = None
    ) -> None:
        self._final = Done(self.meta, status, body, content_type, dict(headers or {}))

    def final_event(self) -> events.Event:
        """What ``finish`` writes after a successful call (once ``flush`` wrote the rest)."""
        if isinstance(self._final, Done):
            self._final.usage = self._usage
            return self._final
        return End(None if self._seq > 0 else self.meta, self.upstream_done, self._usage)
