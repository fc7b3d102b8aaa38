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
    """One entry of a node stream (field names as ``lua/lib/pump.lua`` writes them)."""

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
            job=f[b"j"].decode(),
            fence=int(f[b"f"]),
            provider=f[b"p"].decode(),
            target=f[b"t"].decode(),
            model=f[b"m"].decode(),
            lane=f.get(b"l", b"").decode(),
            replica=f[b"rep"].decode(),
            endpoint=f[b"ep"].decode(),
            stream=f[b"s"] == b"1",
            attempt=int(f[b"a"]),
            submitted_ms=int(f[b"t0"]),
            dispatched_ms=int(f[b"t1"]),
            body=f[b"b"],
        )


class JobRecord(msgspec.Struct, frozen=True):
    """A job's record in the ``{iop}:jobs`` hash (see ``lua/lib/jobs.lua``)."""

    model: str = msgspec.field(name="m")
    replica: str = msgspec.field(name="rep")
    state: str = msgspec.field(name="st")
    lane: str = msgspec.field(name="ln", default="")
    seq: int = 0
    deadline_ms: int = msgspec.field(name="d", default=0)
    attempt: int = msgspec.field(name="a", default=1)
    provider: str | None = msgspec.field(name="p", default=None)
    node: str | None = msgspec.field(name="n", default=None)
    fence: int | None = msgspec.field(name="f", default=None)
    entry_id: str | None = msgspec.field(name="ne", default=None)
    output_started: int = msgspec.field(name="o", default=0)
    endpoint: str = msgspec.field(name="ep", default="")
    # The provider a pinned job must go to (its stored Response is there).
    pin: str | None = None


_record_decoder = msgspec.json.Decoder(JobRecord)


def decode_record(data: bytes) -> JobRecord:
    return _record_decoder.decode(data)
