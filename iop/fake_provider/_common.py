"""What every endpoint of the fake provider shares: options, the per-request ``_Call``, errors, streams."""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Annotated, Any, Final, NamedTuple

import msgspec
from aiohttp import web
from multidict import CIMultiDict, istr


def _default_models() -> list[str]:
    return ["fake-model"]


_Status = Annotated[int, msgspec.Meta(ge=100, le=599)]


class FakeError(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """An answer given as it is (``fail_with``): what a server in front of the runtime, or a
    runtime with its own error shape, answers -- an HTML page, FastAPI's ``{"detail": ...}``,
    a provider's own error JSON with its ``retry-after``."""

    status: _Status
    body: str = ""
    content_type: str = "application/json"
    headers: dict[str, str] = {}
    """Set on top of the pipeline's usual headers (``x-request-id``...), replacing any of the same name."""


class FakeOptions(msgspec.Struct, kw_only=True):
    """Behaviour of a fake provider; mutable, ``POST /_fake/control`` changes it at run time."""

    delay_ms: int = 0
    """Wait before answering (JSON) / before the first chunk (stream)."""
    tokens: int = 16
    """Tokens per answer: content words in JSON, content chunks in a stream (pieces of a speech body)."""
    token_interval_ms: int = 0
    """Pause between stream content chunks (between the writes of a speech body)."""
    models: list[str] = msgspec.field(default_factory=_default_models)
    """Names reported by the model-listing endpoints."""
    api_key: str | None = None
    """When set, the pipeline endpoints and ``/v1/models`` require ``Authorization: Bearer <api_key>``
    (the Anthropic ones also take ``x-api-key: <api_key>``); 401 otherwise."""
    fail_status: int | None = None
    """When set, every pipeline request answers this status with an error body."""
    fail_with: FakeError | None = None
    """When set (and ``fail_status`` is not), every pipeline request gets this answer."""
    hang: bool = False
    """Accept requests and never answer (until the client goes away)."""
    garbage: bool = False
    """Answer 200 with invalid JSON (non-stream) / a broken SSE line (stream)."""
    healthy: bool = True
    """When False, the health/probe endpoints and ``/v1/models`` answer 503."""
    stream_no_done: bool = False
    """Chat/completions streams end without the final ``data: [DONE]``."""
    empty_200: bool = False
    """Every pipeline request answers 200 with an empty body."""
    close_idle_keepalive: bool = False
    """A connection that answered a pipeline request is closed, unanswered, when the next request
    arrives on it: the client's pooled connection is dead on next use ("Server disconnected")."""
    parallel: int = 0
    """At most this many pipeline answers at once (a server's slots); the others wait for one
    (0: no limit). ``delay_ms`` and the stream's pauses run inside the slot."""
    word: str = "tok"
    """The stem of the generated words, ``<word>0 <word>1 ...``: another stem is another word list,
    a fake that serves another model under the same id."""
    max_loaded: int | None = None
    """Ollama's model lifecycle (on when this, ``load_ms`` or ``keep_alive_s`` is set): at most this
    many of ``models`` loaded at once (``OLLAMA_MAX_LOADED_MODELS``); None: no limit."""
    load_ms: int | None = None
    """How long loading a model takes (with the lifecycle on; None: as 0)."""
    keep_alive_s: float | None = None
    """Ollama's default keep-alive (``OLLAMA_KEEP_ALIVE``, 300 in Ollama): an idle model is unloaded
    after this many seconds; None: never."""
    cut_after: int | None = None
    """A chat/completions stream writes this many content chunks, then the server closes the connection
    (no finish chunk, no ``[DONE]``, no end of the chunked body): a provider dying mid-stream. None: off."""


_NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class _OptionsPatch(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Body of ``POST /_fake/control``: any subset of the ``FakeOptions`` fields."""

    delay_ms: _NonNegative | msgspec.UnsetType = msgspec.UNSET
    tokens: _NonNegative | msgspec.UnsetType = msgspec.UNSET
    token_interval_ms: _NonNegative | msgspec.UnsetType = msgspec.UNSET
    models: list[str] | msgspec.UnsetType = msgspec.UNSET
    api_key: str | msgspec.UnsetType | None = msgspec.UNSET
    fail_status: _Status | msgspec.UnsetType | None = msgspec.UNSET
    fail_with: FakeError | msgspec.UnsetType | None = msgspec.UNSET
    hang: bool | msgspec.UnsetType = msgspec.UNSET
    garbage: bool | msgspec.UnsetType = msgspec.UNSET
    healthy: bool | msgspec.UnsetType = msgspec.UNSET
    stream_no_done: bool | msgspec.UnsetType = msgspec.UNSET
    empty_200: bool | msgspec.UnsetType = msgspec.UNSET
    close_idle_keepalive: bool | msgspec.UnsetType = msgspec.UNSET
    parallel: _NonNegative | msgspec.UnsetType = msgspec.UNSET
    word: str | msgspec.UnsetType = msgspec.UNSET
    max_loaded: Annotated[int, msgspec.Meta(ge=1)] | msgspec.UnsetType | None = msgspec.UNSET
    load_ms: _NonNegative | msgspec.UnsetType | None = msgspec.UNSET
    keep_alive_s: Annotated[float, msgspec.Meta(ge=0)] | msgspec.UnsetType | None = msgspec.UNSET
    cut_after: _NonNegative | msgspec.UnsetType | None = msgspec.UNSET


class _Recorded(msgspec.Struct, omit_defaults=True):
    """One request, as ``/_fake/requests`` lists it (``method`` and ``headers`` only when not default)."""

    path: str
    model: str | None
    stream: bool
    authorization: str | None
    body: Any
    method: str | None = None
    """None for a POST."""
    headers: dict[str, str] | None = None


# Request headers a gateway passes on (or must not), recorded when present.
_RECORDED_HEADERS: Final = ("anthropic-version", "anthropic-beta", "x-api-key", "openai-beta", "idempotency-key")


def _recorded_headers(headers: Any) -> dict[str, str] | None:
    found: dict[str, str] | None = None
    for name in _RECORDED_HEADERS:
        value = headers.get(name)
        if value is not None:
            if found is None:
                found = {}
            found[name] = value
    return found


class _Stats(msgspec.Struct):
    in_flight: int = 0
    max_in_flight: int = 0
    total: int = 0
    completed: int = 0
    disconnected: int = 0


class _Hooks(msgspec.Struct, kw_only=True):
    """Test hooks outside ``FakeOptions``; ``POST /_fake/hooks`` changes them."""

    track_executions: bool = False
    body_overrides: bool = False


class _HooksPatch(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    track_executions: bool | msgspec.UnsetType = msgspec.UNSET
    body_overrides: bool | msgspec.UnsetType = msgspec.UNSET


class _Overrides(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A request's ``fake`` object (with ``body_overrides`` on)."""

    delay_ms: _NonNegative | None = None
    tokens: _NonNegative | None = None
    token_interval_ms: _NonNegative | None = None
    # This request alone answers this status (a request a runtime fails by what it carries).
    fail_status: _Status | None = None
    # This request's stream is cut after this many content chunks.
    cut_after: _NonNegative | None = None


class _Execution(msgspec.Struct, kw_only=True):
    """One pipeline request, as ``/_fake/executions`` lists it."""

    path: str
    started: float
    client_port: int | None = None
    """The caller's TCP port: which of several callers (worker processes) ran it."""
    marker: str | None = None
    stream: bool = False
    ended: float | None = None
    outcome: str = "running"

    def end(self, outcome: str) -> None:
        self.ended = time.time()
        self.outcome = outcome


class _ClientGone(Exception):
    """The client went away before the answer was complete (seen without handler cancellation)."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("client disconnected")
        self.response = response


# --------------------------------------------------------------------------- constants and errors

_JSON: Final = "application/json"
_SSE_HEADERS: Final = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_DONE: Final = b"data: [DONE]\n\n"


def _error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> bytes:
    return msgspec.json.encode({"error": {"message": message, "type": type_, "param": param, "code": code}})


def _error(status: int, body: bytes) -> web.Response:
    return web.Response(status=status, body=body, content_type=_JSON)


# Every pipeline answer carries these, and per request x-request-id and openai-processing-ms.
_V1_CONSTANT_HEADERS: Final = (
    (istr("x-ratelimit-remaining-requests"), "99"),
    (istr("Keep-Alive"), "timeout=5"),  # hop-by-hop: a gateway must not relay it
)
_X_REQUEST_ID: Final = istr("x-request-id")
_PROCESSING_MS: Final = istr("openai-processing-ms")


def _v1_headers(headers: dict[str, str]) -> CIMultiDict[str]:
    """``headers`` plus the constant headers of a pipeline answer, to copy for each answer."""
    result = CIMultiDict(headers)
    result.extend(_V1_CONSTANT_HEADERS)
    return result


_JSON_V1: Final = _v1_headers({"Content-Type": _JSON})
_SSE_V1: Final = _v1_headers(_SSE_HEADERS)
_NONE_V1: Final = _v1_headers({})


_ANTHROPIC_ERROR_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def _anthropic_error_type(status: int) -> str:
    return _ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


# --------------------------------------------------------------------------- endpoints and calls

_BODY_JSON, _BODY_FORM, _BODY_NONE = 0, 1, 2


class _Endpoint(NamedTuple):
    """One route of the request pipeline."""

    answer: Callable[[_Call], Awaitable[web.StreamResponse]]
    body: int = _BODY_JSON
    """How the request body is read: JSON, multipart form, or not at all."""
    streams: bool = False
    """Whether ``stream: true`` means a stream."""
    needs_model: bool = True
    anthropic: bool = False
    """Anthropic-shaped errors and Anthropic response headers."""
    ollama: bool = False
    """Ollama's native API: streams unless ``stream: false``, and loads its model itself (it may not)."""


class _Call:
    """One request in the pipeline: what was received and how to answer it."""

    __slots__ = (
        "body",
        "cut",
        "cut_after",
        "decorated",
        "endpoint",
        "file",
        "interval_ms",
        "model",
        "raw",
        "request",
        "request_id",
        "started",
        "stream",
        "tokens",
    )

    def __init__(self, request: web.Request, endpoint: _Endpoint, request_id: str) -> None:
        self.request = request
        self.endpoint = endpoint
        self.request_id = request_id
        self.started = time.monotonic()
        self.raw = b""
        self.body: Any = None
        self.file: bytes | None = None
        self.model = ""
        self.stream = False
        self.tokens = 0
        self.interval_ms = 0
        self.cut_after: int | None = None
        self.cut = False  # the stream was cut (cut_after)
        self.decorated = False

    @property
    def anthropic_request_id(self) -> str:
        return "req_fake" + self.request_id.replace("-", "")

    def fail(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> web.Response:
        """An error answer in the endpoint's shape (OpenAI or Anthropic)."""
        if self.endpoint.anthropic:
            error = {"type": _anthropic_error_type(status), "message": message}
            body = msgspec.json.encode({"type": "error", "error": error, "request_id": self.anthropic_request_id})
        else:
            body = _error_body(message, type_, param, code)
        return web.Response(status=status, body=body, headers=self.headers())

    def canned(self, answer: FakeError) -> web.Response:
        """``answer`` as it is, with this call's usual headers under its own."""
        headers = self.headers()
        headers["Content-Type"] = answer.content_type
        for name, value in answer.headers.items():
            headers[name] = value
        return web.Response(status=answer.status, body=answer.body.encode(), headers=headers)

    def json(self, value: Any) -> web.Response:
        """A 200 JSON answer of ``value``."""
        return web.Response(body=msgspec.json.encode(value), headers=self.headers())

    def headers(self, base: CIMultiDict[str] = _JSON_V1) -> CIMultiDict[str]:
        """The headers of this call's answer: ``base`` (one of the ``_*_V1`` or from ``_v1_headers``)
        plus the per-request ones. Building them before the response is cheaper than adding them to it."""
        headers = base.copy()
        headers[_X_REQUEST_ID] = self.request_id
        headers[_PROCESSING_MS] = str(int((time.monotonic() - self.started) * 1000))
        if self.endpoint.anthropic:
            headers["request-id"] = self.anthropic_request_id
            headers["anthropic-ratelimit-requests-remaining"] = "99"
            received = self.request.headers
            for name in ("anthropic-version", "anthropic-beta"):
                values = received.getall(name, None)
                if values:
                    headers["x-fake-" + name] = ",".join(values)
        self.decorated = True
        return headers

    def decorate(self, response: web.StreamResponse) -> None:
        """Add the headers of ``headers()`` to an answer built without them (before it is prepared)."""
        if not self.decorated:
            response.headers.extend(self.headers(_NONE_V1))


# --------------------------------------------------------------------------- words and streams


class _Words(msgspec.Struct, frozen=True):
    content: bytes  # JSON string "tok0 tok1 ... tokN-1"
    pieces: tuple[bytes, ...]  # JSON strings "tok0 ", "tok1 ", ..., "tokN-1"
    deltas: tuple[bytes, ...]  # {"content":"tok0 "} ...


@functools.lru_cache(maxsize=64)
def _words(n: int, stem: str = "tok", start: int = 0, lead: bool = False) -> _Words:
    """Words ``start`` to ``n - 1`` of the answer (all of it from 0): each piece but the last with its
    trailing space; ``lead``: a space before the first one (a continuation of text that ends in a word)."""
    texts = [f"{stem}{i} " if i < n - 1 else f"{stem}{i}" for i in range(start, n)]
    if lead and texts:
        texts[0] = " " + texts[0]
    pieces = tuple(msgspec.json.encode(t) for t in texts)
    return _Words(
        content=msgspec.json.encode("".join(texts)),
        pieces=pieces,
        deltas=tuple(b'{"content":' + p + b"}" for p in pieces),
    )


def _given(text: str, stem: str, most: int) -> tuple[int, int]:
    """How many words of the answer ``text`` ends with -- the run ``<stem>0 <stem>1 ... <stem>k-1``
    (single spaces between them, maybe trailing whitespace, the first word maybe glued to what comes
    before it) -- and where that run starts in ``text``: (k, start); (0, len(text)) when it ends with
    none, or with more than ``most``. Cheap when it does not: a look at the last characters."""
    end = len(text)
    while end and text[end - 1].isspace():
        end -= 1
    digits = end
    while digits and text[digits - 1].isdigit():
        digits -= 1
    if digits == end or end - digits > 9 or digits < len(stem) or not text.startswith(stem, digits - len(stem)):
        return 0, len(text)
    k = int(text[digits:end]) + 1
    if k > most:
        return 0, len(text)
    run = " ".join(f"{stem}{i}" for i in range(k))
    start = end - len(run)
    if start < 0 or not text.startswith(run, start):
        return 0, len(text)
    return k, start


@functools.lru_cache(maxsize=64)
def _text(n: int) -> tuple[str, tuple[str, ...]]:
    """The answer text of ``n`` tokens, ``"tok0 tok1 ... tokN-1"``, and its stream pieces."""
    return _split(" ".join(f"tok{i}" for i in range(n)))


def _split(text: str) -> tuple[str, tuple[str, ...]]:
    """``text`` and its words as stream pieces, each but the last with its trailing space."""
    words = text.split(" ")
    if not text:
        return text, ()
    return text, (*(w + " " for w in words[:-1]), words[-1])


def _count_words(value: Any) -> int:
    """Whitespace-separated words in the text of a string, a list, or content blocks / messages."""
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        return sum(_count_words(v) for v in value)
    if isinstance(value, dict):
        text = value.get("text")
        if isinstance(text, str):
            return len(text.split())
        return _count_words(value.get("content"))
    return 0


def _groups(first: bytes, contents: Sequence[bytes], tail: bytes) -> list[bytes]:
    """What to write between the pauses: ``first`` with the first content chunk, each next one, ``tail``
    glued to the last."""
    if not contents:
        return [first + tail]
    groups = [first + contents[0], *contents[1:]]
    groups[-1] += tail
    return groups


def _event(name: str, data: dict[str, Any]) -> bytes:
    """One SSE event with an ``event:`` line; ``data`` carries ``"type": name``."""
    return b"event: " + name.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"


class _Sequenced:
    """Builds the typed events of a Responses API stream, numbering them."""

    def __init__(self) -> None:
        self._numbers = itertools.count()

    def __call__(self, name: str, **fields: Any) -> bytes:
        return _event(name, {"type": name, "sequence_number": next(self._numbers), **fields})


async def _stream(
    call: _Call,
    groups: list[bytes],
    interval_ms: int,
    headers: CIMultiDict[str] = _SSE_V1,
    *,
    chunked: bool = False,
    cut: bool = False,
) -> web.StreamResponse:
    """Write ``groups`` with ``interval_ms`` between them; one piece with a Content-Length when there is
    nothing to wait for, unless ``chunked``. ``headers``: one of the ``_*_V1`` or from ``_v1_headers``.
    ``cut``: after the last group, close the connection instead of ending the (chunked) body."""
    if not (chunked or cut) and (interval_ms <= 0 or len(groups) == 1):
        return web.Response(body=b"".join(groups), headers=call.headers(headers))
    interval = interval_ms / 1000
    response = web.StreamResponse(headers=call.headers(headers))
    try:
        await response.prepare(call.request)
        await response.write(groups[0])
        for group in itertools.islice(groups, 1, None):
            if interval > 0:
                await asyncio.sleep(interval)
            await response.write(group)
        if cut:
            # The cut comes where the next chunk would, after the pause (so that the client has read
            # what was written: aiohttp drops what it holds unread when the connection breaks), as a
            # FIN where the chunked body should go on: the client reads a payload that is not
            # complete (aiohttp: ClientPayloadError).
            if interval > 0:
                await asyncio.sleep(interval)
            call.cut = True
            call.request.protocol.force_close()
            return response
        await response.write_eof()
    except ConnectionResetError as exc:
        raise _ClientGone(response) from exc
    return response
