"""What travels through Redis between the API and the workers.

* :class:`Assignment` -- a node stream entry: one dispatched job, its rewritten target
  and its body, as ``lua/lib/pump.lua`` writes it.
* :class:`Event` -- what a worker tells the waiting API process about a job, on that
  process's reply stream, msgpack-encoded: a streamed answer is ``Start`` (with the
  first chunks), ``Chunks``..., then ``End`` or ``Failed``; a JSON answer is one
  ``Done`` or ``Failed``. ``Requeued`` may come first, any number of times: the job lost
  its worker before any output and waits in its queue again, with a fresh deadline.
"""

from __future__ import annotations

import msgspec

from dispatcher.exceptions import ProviderRejected, RequestError


class Meta(msgspec.Struct, frozen=True, array_like=True):
    """Where the job ran; the API turns it into ``x-iop-*`` headers."""

    provider: str
    node: str
    target: str
    queue_ms: int
    attempt: int = 1


class Usage(msgspec.Struct, frozen=True, array_like=True):
    """The tokens of one answer as its provider reported them (``workers/usage.py``)."""

    prompt: int
    completion: int
    # Of the prompt tokens, those the provider served from its prefix cache, where it says
    # (workers/usage.py; 0 otherwise). Last, so that older readers ignore it.
    cached: int = 0


class Start(msgspec.Struct, tag="start", array_like=True):
    meta: Meta
    status: int
    chunks: list[bytes] = []
    content_type: str = "text/event-stream"
    # The provider's headers that pass on to the caller (workers/adapters/base.py).
    headers: dict[str, str] = {}


class Chunks(msgspec.Struct, tag="chunks", array_like=True):
    chunks: list[bytes]
    # 1, 2, ... per job (the Start event is 0): a batch written twice -- a retry after its
    # reply was lost -- is dropped by the API.
    seq: int = 0


class End(msgspec.Struct, tag="end", array_like=True):
    # Set only when the stream produced no chunk at all (no Start event carried it).
    meta: Meta | None = None
    # The provider ended it with ``data: [DONE]`` (relayed only then).
    done: bool = True
    # Last: events written before it existed still decode.
    usage: Usage | None = None


class Done(msgspec.Struct, tag="done", array_like=True):
    meta: Meta
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: dict[str, str] = {}
    usage: Usage | None = None


class Failed(msgspec.Struct, tag="failed", array_like=True):
    status: int
    code: str
    message: str
    meta: Meta | None = None
    # A provider's own error answer, passed through (in the endpoint's error shape).
    body: bytes | None = None
    content_type: str = "application/json"
    headers: dict[str, str] = {}

    @classmethod
    def from_error(cls, exc: RequestError, meta: Meta | None = None) -> Failed:
        if isinstance(exc, ProviderRejected):
            return cls(exc.status, exc.code or "", exc.message, meta, exc.raw_body, exc.content_type, exc.headers)
        return cls(exc.status, exc.code or "", exc.message, meta)


class Requeued(msgspec.Struct, tag="requeued", array_like=True):
    pass


Event = Start | Chunks | End | Done | Failed | Requeued

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Event)


def encode(event: Event) -> bytes:
    return _encoder.encode(event)


def decode(data: bytes) -> Event:
    return _decoder.decode(data)


REQUEUED = encode(Requeued())


class Assignment(msgspec.Struct, frozen=True):
    """One entry of a node stream: ``lua/lib/pump.lua`` writes these fields, by these names
    (``entry_id`` is the entry's own id)."""

    entry_id: str
    job: str
    fence: int
    provider: str
    target: str
    model: str
    lane: str
    replica: str
    endpoint: str
    stream: bool
    attempt: int
    submitted_ms: int
    dispatched_ms: int
    body: bytes
    # It must go to this provider (a stored Response lives there): a retry or a requeue
    # after a reload goes back to the provider's own lane, not to an endpoint's.
    pinned: bool = False
    # Sent past the provider's capacity, to wait in its engine's queue as a hit of its home
    # queue (lua/lib/home_room.lua): its latency says nothing of the limit it was sent over.
    queued: bool = False

    @property
    def queue_ms(self) -> int:
        return self.dispatched_ms - self.submitted_ms

    def log_context(self) -> dict[str, str]:
        """The job's fields for a log record (``iop/logs.py`` puts them in JSON lines)."""
        return {"job": self.job, "model": self.model, "provider": self.provider}

    @classmethod
    def from_entry(cls, entry_id: bytes | str, fields: dict[bytes, bytes] | list[bytes]) -> Assignment:
        """From a node stream entry, its fields as a mapping or as the flat list Redis sends."""
        f = fields if isinstance(fields, dict) else dict(zip(fields[::2], fields[1::2], strict=True))
        return cls(
            entry_id=entry_id.decode() if isinstance(entry_id, bytes) else entry_id,
            job=f[b"job"].decode(),
            fence=int(f[b"fence"]),
            provider=f[b"provider"].decode(),
            target=f[b"target"].decode(),
            model=f[b"model"].decode(),
            lane=f.get(b"lane", b"").decode(),
            replica=f[b"replica"].decode(),
            endpoint=f[b"endpoint"].decode(),
            stream=f[b"stream"] == b"1",
            attempt=int(f[b"attempt"]),
            submitted_ms=int(f[b"submitted_ms"]),
            dispatched_ms=int(f[b"dispatched_ms"]),
            body=f[b"body"],
            pinned=f.get(b"pinned") == b"1",
            queued=f.get(b"queued") == b"1",
        )


class RecordLimits(msgspec.Struct, frozen=True):
    """``rec.limits``: what a limited tenant's job reserved (``lua/submit.lua``)."""

    tenant: str
    tokens_per_minute: int
    tokens_per_day: int
    tokens: int
    day: int


class JobRecord(msgspec.Struct, frozen=True):
    """A job's record in the ``{iop}:jobs`` hash, as the scripts write it (``lua/submit.lua``
    creates it, ``lua/lib/*.lua`` move it on; Lua uses these names: ``rec.<field>``,
    ``tests/dispatcher/test_wire.py``). A field Lua has not set is absent."""

    model: str
    replica: str
    state: str  # 'q' waiting, 'd' dispatched, 'c' dispatched and cancel asked, 'x' expired waiting
    seq: int = 0  # global submit order (FIFO across lanes)
    deadline_ms: int = 0  # of its wait in a queue
    timeout_ms: int = 0  # the queue timeout it was given (a requeue gets it afresh)
    submitted_ms: int = 0
    attempt: int = 1
    endpoint: str = ""
    stream: int = 0
    lane: str = ""  # its lane's name ('' the lane of all the model's providers)
    tenant: str | None = None  # flow control only
    tag: float | None = None  # its fair-queuing tag (flow control)
    # The provider a pinned job must go to (its stored Response is there).
    pin: str | None = None
    # Set by a dispatch:
    provider: str | None = None
    node: str | None = None
    target: str | None = None  # the model's name on that provider
    fence: int | None = None
    entry_id: str | None = None  # its node stream entry
    dispatched_ms: int | None = None
    output_started: int = 0  # 1 once output reached its client: it is never dispatched again
    # Providers that failed it (finish in mode 'retry'). (cjson writes an empty table as {}.)
    excluded: list[str] | dict[str, str] = []
    # Providers it must never go to, whatever else is down: a continuation's, whose type
    # cannot continue an answer (api/continuation.py; lua/submit.lua).
    never: list[str] | dict[str, str] = []
    # The '<provider>|<status>' of each 5xx it got, whose blame waits for its end: another
    # provider answering it blames them, another's 5xx excuses them (lua/lib/blame.lua).
    failed_5xx: list[str] | dict[str, str] = []
    hold_until_ms: int | None = None  # refused if still no provider by then (hold_when_unavailable_ms)
    queue: str | None = None  # the queue it waits in, when not its lane's (moved since its submit)
    # Cache-aware dispatch: its prompt's block hashes (or its conversation's), for the prefix
    # index (dispatcher/affinity.py); absent without affinity.
    blocks: list[str] | dict[str, str] = []
    passed_ms: int | None = None  # when it was first passed over for, or held for, its home
    # The wait it was admitted for (submit's predict_ms: the caller's deadline, or the
    # model's refuse_predicted_over_ms): a home's queue takes it only if it starts there
    # within it (lua/lib/home_room.lua).
    predict_ms: int | None = None
    # 1: dispatched to a provider whose models iop manages, where it counts in its model's
    # running jobs until released (lua/lib/assign.lua, lua/lib/jobs.lua release_slot).
    managed: int | None = None
    # A limited tenant's token reservation, settled by finish (lua/lib/limits.lua).
    limits: RecordLimits | None = None


_record_decoder = msgspec.json.Decoder(JobRecord)


def decode_record(data: bytes) -> JobRecord:
    return _record_decoder.decode(data)
