"""A fake OpenAI-compatible upstream: the provider of the tests, the demo (``iop up``) and the benchmarks.

``iop fake-provider`` runs it from the command line; tests start it in-process with ``start``.

It answers ``/v1/chat/completions``, ``/v1/completions`` (JSON and SSE streams),
``/v1/embeddings`` and ``/v1/models`` the way an OpenAI-compatible server does, imitates
the health/probe endpoints of vLLM, SGLang, Ollama and Lemonade, and can be told at run
time (``POST /_fake/control``) to be slow, to fail, to hang, to answer garbage or to
look unhealthy. ``/_fake/requests`` and ``/_fake/stats`` let tests see what it received
and how many requests were in flight at once.

It is built to be cheap per request, so that benchmarks measure the gateway and not
the fake: constant byte strings are encoded once, answers are assembled by byte
concatenation around the JSON-encoded ``model`` echo, nothing is logged per request,
and a stream with no ``token_interval_ms`` pause is written in one piece.

Order of the checks on a ``/v1`` POST: the request is recorded (even a malformed one,
with ``body: null``), then ``api_key`` (401), the ``fake`` overrides when enabled (400),
``hang``, ``delay_ms``, ``fail_status``, ``garbage``, and only then the body itself is
validated (400).

``hang`` holds a request until the client goes away, the server shuts down (503), or
``hang`` is switched off again, after which the request is answered normally.

Counters of ``/_fake/stats``: ``total`` POSTs received, ``completed`` ones answered
(whatever the status), ``disconnected`` ones whose client went away first (also a request
still held when the server stops); ``total == completed + disconnected + in_flight``.
``POST /_fake/stats/reset`` zeroes them, except ``in_flight`` (``max_in_flight`` restarts from it).

Two more test hooks, both off until ``POST /_fake/hooks`` switches them on (so they cost
nothing otherwise): ``track_executions`` logs every ``/v1`` POST in ``/_fake/executions``
with its marker (the body's ``user`` string), the caller's TCP port, its start and end
(wall-clock seconds) and its outcome (``running``, ``completed``, ``disconnected`` or ``failed``), so a test can
count how often the provider ran each request; ``body_overrides`` lets a request carry a
``fake`` object (``delay_ms``, ``tokens``, ``token_interval_ms``) that replaces those
options for that request alone.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import itertools
import signal
import struct
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Annotated, Any, Final

import msgspec
from aiohttp import web

__all__ = ["FakeOptions", "create_app", "run", "start"]


def _default_models() -> list[str]:
    return ["fake-model"]


class FakeOptions(msgspec.Struct, kw_only=True):
    """Behaviour of a fake provider; mutable, ``POST /_fake/control`` changes it at run time."""

    delay_ms: int = 0
    """Wait before answering (JSON) / before the first chunk (stream)."""
    tokens: int = 16
    """Tokens per answer: content words in JSON, content chunks in a stream."""
    token_interval_ms: int = 0
    """Pause between stream content chunks."""
    models: list[str] = msgspec.field(default_factory=_default_models)
    """Names reported by the model-listing endpoints."""
    api_key: str | None = None
    """When set, ``/v1/*`` requires ``Authorization: Bearer <api_key>`` (401 otherwise)."""
    fail_status: int | None = None
    """When set, every ``/v1`` POST answers this status with an OpenAI-style error body."""
    hang: bool = False
    """Accept POSTs and never answer (until the client goes away)."""
    garbage: bool = False
    """Answer 200 with invalid JSON (non-stream) / a broken SSE line (stream)."""
    healthy: bool = True
    """When False, the health/probe endpoints and ``/v1/models`` answer 503."""


_NonNegative = Annotated[int, msgspec.Meta(ge=0)]
_Status = Annotated[int, msgspec.Meta(ge=100, le=599)]


class _OptionsPatch(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Body of ``POST /_fake/control``: any subset of the ``FakeOptions`` fields."""

    delay_ms: _NonNegative | msgspec.UnsetType = msgspec.UNSET
    tokens: _NonNegative | msgspec.UnsetType = msgspec.UNSET
    token_interval_ms: _NonNegative | msgspec.UnsetType = msgspec.UNSET
    models: list[str] | msgspec.UnsetType = msgspec.UNSET
    api_key: str | msgspec.UnsetType | None = msgspec.UNSET
    fail_status: _Status | msgspec.UnsetType | None = msgspec.UNSET
    hang: bool | msgspec.UnsetType = msgspec.UNSET
    garbage: bool | msgspec.UnsetType = msgspec.UNSET
    healthy: bool | msgspec.UnsetType = msgspec.UNSET


class _Recorded(msgspec.Struct):
    path: str
    model: str | None
    stream: bool
    authorization: str | None
    body: Any


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


class _Execution(msgspec.Struct, kw_only=True):
    """One ``/v1`` POST, as ``/_fake/executions`` lists it."""

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


# --------------------------------------------------------------------------- constant bytes

_JSON: Final = "application/json"
_SSE_HEADERS: Final = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_DONE: Final = b"data: [DONE]\n\n"
_HANG_POLL_S: Final = 0.05
_EMBEDDING_DIMS: Final = 8
_MAX_RECORDED: Final = 1000
_MAX_EXECUTIONS: Final = 100_000


def _error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> bytes:
    return msgspec.json.encode({"error": {"message": message, "type": type_, "param": param, "code": code}})


def _error(status: int, body: bytes) -> web.Response:
    return web.Response(status=status, body=body, content_type=_JSON)


_BAD_JSON: Final = _error_body(
    "We could not parse the JSON body of your request. (HINT: This likely means you aren't using your "
    "HTTP library correctly. The OpenAI API expects a JSON payload.)",
    "invalid_request_error",
)
_NOT_OBJECT: Final = _error_body("The request body must be a JSON object.", "invalid_request_error")
_NO_MODEL: Final = _error_body("you must provide a model parameter", "invalid_request_error", "model")
_BAD_KEY: Final = _error_body(
    "Incorrect API key provided.", "invalid_request_error", None, "invalid_api_key"
)
_BAD_INPUT: Final = _error_body(
    "'input' must be a string, a list of strings, a list of integers or a list of lists of integers",
    "invalid_request_error",
    "input",
)
_UNHEALTHY: Final = _error_body("fake provider is unhealthy", "server_error", None, "service_unavailable")
_SHUTTING_DOWN: Final = _error_body("fake provider is shutting down", "server_error")
_BAD_OVERRIDES: Final = _error_body(
    "'fake' must be an object of non-negative integers delay_ms, tokens, token_interval_ms",
    "invalid_request_error",
    "fake",
)

_GARBAGE_JSON: Final = b'{"id":"chatcmpl-garbage","object":"chat.completion","choices":[{"message":{"rol'
# A stream that starts fine, then carries a data line that is not JSON, then ends normally.
_GARBAGE_STREAM: Final = (
    b'data: {"id":"chatcmpl-garbage","object":"chat.completion.chunk","created":0,"model":"garbage",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
    b'data: {"id":"chatcmpl-garbage","choices":[{"delta":{"content":"tok0\n\n' + _DONE
)

_CHAT, _TEXT, _EMBED = 0, 1, 2
_MODEL: Final = b',"model":'
_FINGERPRINT: Final = b',"system_fingerprint":null,"choices":'
_NOT_FINISHED: Final = b',"logprobs":null,"finish_reason":null}]}\n\n'


class _Shape(msgspec.Struct, frozen=True):
    """The constant parts of the answers of one endpoint."""

    id_prefix: bytes
    object: bytes
    chunk_object: bytes
    message_open: bytes
    message_close: bytes  # closes the message/choice list, opens "usage"
    delta_open: bytes
    first: bytes  # delta of the chunk before the content chunks (empty: none)
    finish: bytes  # rest of the final chunk, from its delta/text on


_SHAPES: Final = {
    _CHAT: _Shape(
        id_prefix=b"chatcmpl-fake",
        object=b'","object":"chat.completion","created":',
        chunk_object=b'","object":"chat.completion.chunk","created":',
        message_open=b'[{"index":0,"message":{"role":"assistant","content":',
        message_close=b'},"logprobs":null,"finish_reason":"stop"}],"usage":',
        delta_open=b'[{"index":0,"delta":',
        first=b'{"role":"assistant","content":""}',
        finish=b'{},"logprobs":null,"finish_reason":"stop"}]}\n\n',
    ),
    _TEXT: _Shape(
        id_prefix=b"cmpl-fake",
        object=b'","object":"text_completion","created":',
        chunk_object=b'","object":"text_completion","created":',
        message_open=b'[{"index":0,"text":',
        message_close=b',"logprobs":null,"finish_reason":"stop"}],"usage":',
        delta_open=b'[{"index":0,"text":',
        first=b"",
        finish=b'"","logprobs":null,"finish_reason":"stop"}]}\n\n',
    ),
}


class _Words(msgspec.Struct, frozen=True):
    content: bytes  # JSON string "tok0 tok1 ... tokN-1"
    pieces: tuple[bytes, ...]  # JSON strings "tok0 ", "tok1 ", ..., "tokN-1"
    deltas: tuple[bytes, ...]  # {"content":"tok0 "} ...


@functools.lru_cache(maxsize=64)
def _words(n: int) -> _Words:
    words = [f"tok{i}" for i in range(n)]
    pieces = tuple(msgspec.json.encode(w + " " if i < n - 1 else w) for i, w in enumerate(words))
    return _Words(
        content=msgspec.json.encode(" ".join(words)),
        pieces=pieces,
        deltas=tuple(b'{"content":' + p + b"}" for p in pieces),
    )


def _usage(prompt: int, completion: int) -> bytes:
    total = prompt + completion
    return b'{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}' % (prompt, completion, total)


def _groups(first: bytes, contents: Sequence[bytes], tail: bytes) -> list[bytes]:
    """What to write between the pauses: ``first`` with the first content chunk, each next one, ``tail``
    glued to the last."""
    if not contents:
        return [first + tail]
    groups = [first + contents[0], *contents[1:]]
    groups[-1] += tail
    return groups


def _embedding(item: str | list[int]) -> list[float]:
    data = item.encode() if isinstance(item, str) else msgspec.json.encode(item)
    digest = hashlib.blake2b(data, digest_size=_EMBEDDING_DIMS).digest()
    return [round(b / 127.5 - 1.0, 6) for b in digest]


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _embedding_inputs(value: Any) -> list[str | list[int]] | None:
    """The items of an embeddings ``input``, or None when it has no valid shape."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        return None
    if _is_token_list(value):
        return [value]
    if all(isinstance(v, str) or _is_token_list(v) for v in value):
        return list(value)
    return None


# --------------------------------------------------------------------------- the server


class _FakeProvider:
    def __init__(self, options: FakeOptions) -> None:
        self.options = options
        self.stats = _Stats()
        self.requests: deque[_Recorded] = deque(maxlen=_MAX_RECORDED)
        self.hooks = _Hooks()
        self.executions: deque[_Execution] = deque(maxlen=_MAX_EXECUTIONS)
        self.closing = False
        self._ids = itertools.count(1)
        self.routes: dict[str, dict[str, Callable[[web.Request], Awaitable[web.StreamResponse]]]] = {
            "/v1/chat/completions": {"POST": self.chat},
            "/v1/completions": {"POST": self.completions},
            "/v1/embeddings": {"POST": self.embeddings},
            "/v1/models": {"GET": self.v1_models},
            "/health": {"GET": self.health},
            "/health_generate": {"GET": self.health},
            "/api/tags": {"GET": self.ollama_tags},
            "/api/ps": {"GET": self.ollama_ps},
            "/api/version": {"GET": self.ollama_version},
            "/api/v1/health": {"GET": self.lemonade_health},
            "/api/v1/models": {"GET": self.lemonade_models},
            "/_fake/requests": {"GET": self.get_requests, "DELETE": self.clear_requests},
            "/_fake/stats": {"GET": self.get_stats},
            "/_fake/stats/reset": {"POST": self.reset_stats},
            "/_fake/control": {"POST": self.control},
            "/_fake/hooks": {"GET": self.get_hooks, "POST": self.set_hooks},
            "/_fake/executions": {"GET": self.get_executions, "DELETE": self.clear_executions},
        }

    # ---------------------------------------------------------------- /v1 POSTs

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._post(request, _CHAT)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._post(request, _TEXT)

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        return await self._post(request, _EMBED)

    async def _post(self, request: web.Request, kind: int) -> web.StreamResponse:
        stats = self.stats
        stats.total += 1
        stats.in_flight += 1
        if stats.in_flight > stats.max_in_flight:
            stats.max_in_flight = stats.in_flight
        execution: _Execution | None = None
        if self.hooks.track_executions:
            peer = request.transport.get_extra_info("peername") if request.transport is not None else None
            port = peer[1] if isinstance(peer, tuple) and len(peer) >= 2 else None
            execution = _Execution(path=request.path, started=time.time(), client_port=port)
            self.executions.append(execution)
        try:
            response = await self._answer(request, kind, execution)
        except asyncio.CancelledError:
            stats.disconnected += 1
            if execution is not None:
                execution.end("disconnected")
            raise
        except _ClientGone as gone:
            stats.disconnected += 1
            if execution is not None:
                execution.end("disconnected")
            return gone.response
        except Exception:
            stats.completed += 1  # aiohttp answers 500
            if execution is not None:
                execution.end("failed")
            raise
        else:
            stats.completed += 1
            if execution is not None:
                execution.end("completed")
            return response
        finally:
            stats.in_flight -= 1

    async def _answer(
        self, request: web.Request, kind: int, execution: _Execution | None = None
    ) -> web.StreamResponse:
        options = self.options
        raw = await request.read()
        authorization = request.headers.get("Authorization")
        body: Any
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            body = None
            parsed = False
        else:
            parsed = True
        is_object = isinstance(body, dict)
        model = body.get("model") if is_object else None
        if not isinstance(model, str) or not model:
            model = None
        stream = is_object and kind != _EMBED and body.get("stream") is True
        self.requests.append(_Recorded(request.path, model, stream, authorization, body))
        if execution is not None:
            user = body.get("user") if is_object else None
            execution.marker = user if isinstance(user, str) else None
            execution.stream = stream
        api_key = options.api_key
        if api_key is not None and authorization != "Bearer " + api_key:
            return _error(401, _BAD_KEY)
        delay_ms, n, interval_ms = options.delay_ms, options.tokens, options.token_interval_ms
        if self.hooks.body_overrides and is_object and "fake" in body:
            try:
                overrides = msgspec.convert(body["fake"], type=_Overrides)
            except msgspec.ValidationError:
                return _error(400, _BAD_OVERRIDES)
            delay_ms = delay_ms if overrides.delay_ms is None else overrides.delay_ms
            n = n if overrides.tokens is None else overrides.tokens
            interval_ms = interval_ms if overrides.token_interval_ms is None else overrides.token_interval_ms

        if options.hang and not await self._hang(request):
            return _error(503, _SHUTTING_DOWN)
        if delay_ms > 0:
            await self._sleep(request, delay_ms / 1000)
        status = options.fail_status
        if status is not None:
            type_ = "server_error" if status >= 500 else "invalid_request_error"
            return _error(status, _error_body(f"fake provider failure (status {status})", type_))
        if options.garbage:
            if stream:
                return web.Response(body=_GARBAGE_STREAM, headers=_SSE_HEADERS)
            return web.Response(body=_GARBAGE_JSON, content_type=_JSON)
        if not parsed:
            return _error(400, _BAD_JSON)
        if not is_object:
            return _error(400, _NOT_OBJECT)
        if model is None:
            return _error(400, _NO_MODEL)

        model_json = msgspec.json.encode(model)
        prompt_tokens = max(1, len(raw) // 4)
        if kind == _EMBED:
            return self._embeddings(body, model_json)
        words = _words(n)
        usage = _usage(prompt_tokens, n)
        shape = _SHAPES[kind]
        # '{"id":"chatcmpl-fake1","object":"chat.completion","created":1700000000,"model":"m",...,"choices":'
        created_model = b"%d" % int(time.time()) + _MODEL + model_json + _FINGERPRINT
        rid = shape.id_prefix + b"%x" % next(self._ids)
        if not stream:
            body_parts = (b'{"id":"', rid, shape.object, created_model, shape.message_open, words.content)
            answer = b"".join((*body_parts, shape.message_close, usage, b"}"))
            return web.Response(body=answer, content_type=_JSON)
        top = b'data: {"id":"' + rid + shape.chunk_object + created_model
        head = top + shape.delta_open
        first = head + shape.first + _NOT_FINISHED if shape.first else b""
        pieces = words.deltas if kind == _CHAT else words.pieces
        contents = [head + piece + _NOT_FINISHED for piece in pieces]
        tail = head + shape.finish
        stream_options = body.get("stream_options")
        if isinstance(stream_options, dict) and stream_options.get("include_usage") is True:
            tail += top + b'[],"usage":' + usage + b"}\n\n"
        tail += _DONE
        return await self._stream(request, _groups(first, contents, tail), interval_ms)

    def _embeddings(self, body: dict[str, Any], model_json: bytes) -> web.Response:
        items = _embedding_inputs(body.get("input"))
        if items is None:
            return _error(400, _BAD_INPUT)
        as_base64 = body.get("encoding_format") == "base64"
        data: list[dict[str, Any]] = []
        tokens = 0
        for index, item in enumerate(items):
            vector = _embedding(item)
            tokens += max(1, len(item.split())) if isinstance(item, str) else len(item)
            embedding: list[float] | str = (
                base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode() if as_base64 else vector
            )
            data.append({"object": "embedding", "index": index, "embedding": embedding})
        return web.Response(
            body=b'{"object":"list","data":' + msgspec.json.encode(data) + b',"model":' + model_json
            + b',"usage":{"prompt_tokens":%d,"total_tokens":%d}}' % (tokens, tokens),
            content_type=_JSON,
        )

    async def _stream(
        self, request: web.Request, groups: list[bytes], interval_ms: int
    ) -> web.StreamResponse:
        if interval_ms <= 0 or len(groups) == 1:
            # Nothing to wait for between the chunks: one write, with a Content-Length.
            return web.Response(body=b"".join(groups), headers=_SSE_HEADERS)
        interval = interval_ms / 1000
        response = web.StreamResponse(headers=_SSE_HEADERS)
        try:
            await response.prepare(request)
            await response.write(groups[0])
            for group in itertools.islice(groups, 1, None):
                await asyncio.sleep(interval)
                await response.write(group)
            await response.write_eof()
        except ConnectionResetError as exc:
            raise _ClientGone(response) from exc
        return response

    async def _sleep(self, request: web.Request, seconds: float) -> None:
        await asyncio.sleep(seconds)
        # With handler cancellation (``start()``) a disconnect cancels the sleep; without it, look.
        if request.transport is None:
            raise _ClientGone(web.Response(status=499))

    async def _hang(self, request: web.Request) -> bool:
        """Hold the request until the client goes away, the server stops (False), or ``hang`` is
        switched off (True)."""
        while self.options.hang:
            if self.closing:
                return False
            transport = request.transport
            if transport is None or transport.is_closing():
                raise _ClientGone(web.Response(status=499))
            await asyncio.sleep(_HANG_POLL_S)
        return True

    # ---------------------------------------------------------------- GET endpoints

    def _unhealthy(self) -> web.Response | None:
        return None if self.options.healthy else _error(503, _UNHEALTHY)

    def _model_list(self) -> bytes:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "fake"} for m in self.options.models]
        return msgspec.json.encode({"object": "list", "data": data})

    async def v1_models(self, request: web.Request) -> web.Response:
        api_key = self.options.api_key
        if api_key is not None and request.headers.get("Authorization") != "Bearer " + api_key:
            return _error(401, _BAD_KEY)
        return self._unhealthy() or web.Response(body=self._model_list(), content_type=_JSON)

    async def health(self, request: web.Request) -> web.Response:
        return self._unhealthy() or web.Response()

    def _ollama_models(self, loaded: bool) -> bytes:
        models: list[dict[str, Any]] = []
        for name in self.options.models:
            entry: dict[str, Any] = {
                "name": name,
                "model": name,
                "size": 0,
                "digest": hashlib.sha256(name.encode()).hexdigest(),
                "details": {
                    "parent_model": "",
                    "format": "gguf",
                    "family": "fake",
                    "families": ["fake"],
                    "parameter_size": "0B",
                    "quantization_level": "F16",
                },
            }
            if loaded:
                entry["expires_at"] = "2999-01-01T00:00:00Z"
                entry["size_vram"] = 0
            else:
                entry["modified_at"] = "2024-01-01T00:00:00Z"
            models.append(entry)
        return msgspec.json.encode({"models": models})

    async def ollama_tags(self, request: web.Request) -> web.Response:
        return self._unhealthy() or web.Response(body=self._ollama_models(False), content_type=_JSON)

    async def ollama_ps(self, request: web.Request) -> web.Response:
        return self._unhealthy() or web.Response(body=self._ollama_models(True), content_type=_JSON)

    async def ollama_version(self, request: web.Request) -> web.Response:
        return self._unhealthy() or web.Response(body=b'{"version":"0.0.0-fake"}', content_type=_JSON)

    async def lemonade_health(self, request: web.Request) -> web.Response:
        models = self.options.models
        body = msgspec.json.encode({"status": "ok", "model_loaded": models[0] if models else None})
        return self._unhealthy() or web.Response(body=body, content_type=_JSON)

    async def lemonade_models(self, request: web.Request) -> web.Response:
        return self._unhealthy() or web.Response(body=self._model_list(), content_type=_JSON)

    # ---------------------------------------------------------------- /_fake test hooks

    async def get_requests(self, request: web.Request) -> web.Response:
        return web.Response(body=msgspec.json.encode(list(self.requests)), content_type=_JSON)

    async def clear_requests(self, request: web.Request) -> web.Response:
        self.requests.clear()
        return web.Response(body=b"[]", content_type=_JSON)

    async def get_stats(self, request: web.Request) -> web.Response:
        return web.Response(body=msgspec.json.encode(self.stats), content_type=_JSON)

    async def reset_stats(self, request: web.Request) -> web.Response:
        # In place (handlers hold the object); requests still in flight stay counted in in_flight.
        stats = self.stats
        stats.total = stats.completed = stats.disconnected = 0
        stats.max_in_flight = stats.in_flight
        return web.Response(body=msgspec.json.encode(self.stats), content_type=_JSON)

    async def get_hooks(self, request: web.Request) -> web.Response:
        return web.Response(body=msgspec.json.encode(self.hooks), content_type=_JSON)

    async def set_hooks(self, request: web.Request) -> web.Response:
        return await _patch(request, self.hooks, _HooksPatch, "hooks")

    async def get_executions(self, request: web.Request) -> web.Response:
        return web.Response(body=msgspec.json.encode(list(self.executions)), content_type=_JSON)

    async def clear_executions(self, request: web.Request) -> web.Response:
        self.executions.clear()
        return web.Response(body=b"[]", content_type=_JSON)

    async def control(self, request: web.Request) -> web.Response:
        return await _patch(request, self.options, _OptionsPatch, "options")

    # ---------------------------------------------------------------- anything else

    async def fallback(self, request: web.Request) -> web.Response:
        methods = self.routes.get(request.path)
        if methods is None:
            message = f"Invalid URL ({request.method} {request.path})"
            return _error(404, _error_body(message, "invalid_request_error"))
        message = f"Method {request.method} not allowed for {request.path}"
        response = _error(405, _error_body(message, "invalid_request_error"))
        response.headers["Allow"] = ", ".join(sorted(methods))
        return response

    async def on_shutdown(self, app: web.Application) -> None:
        self.closing = True


def create_app(options: FakeOptions) -> web.Application:
    """The fake provider as an aiohttp application; ``options`` is read on every request."""
    provider = _FakeProvider(options)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    for path, methods in provider.routes.items():
        for method, handler in methods.items():
            app.router.add_route(method, path, handler)
    app.router.add_route("*", "/{tail:.*}", provider.fallback)
    app.on_shutdown.append(provider.on_shutdown)
    return app


async def start(host: str, port: int, options: FakeOptions) -> web.AppRunner:
    """Start a fake provider listening on ``host:port``; the caller awaits ``runner.cleanup()``."""
    # handler_cancellation: a client that goes away cancels its handler, which counts it as disconnected.
    runner = web.AppRunner(
        create_app(options), access_log=None, handler_cancellation=True, shutdown_timeout=2.0
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner


async def _serve(host: str, port: int, options: FakeOptions) -> None:
    runner = await start(host, port, options)
    try:
        if port == 0 and runner.addresses:
            port = int(runner.addresses[0][1])
        print(f"fake provider listening on http://{host}:{port}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.remove_signal_handler(sig)
    finally:
        await runner.cleanup()


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop comes with uvicorn[standard]
        return None
    return uvloop.new_event_loop


def run(host: str, port: int, options: FakeOptions) -> None:
    """Serve until SIGINT/SIGTERM (blocking); prints one line once listening."""
    with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(_serve(host, port, options))


async def _patch(request: web.Request, target: Any, patch_type: type[msgspec.Struct], what: str) -> web.Response:
    """Apply a JSON patch (the fields it sets) to ``target``; answer with the result."""
    try:
        patch = msgspec.json.decode(await request.read(), type=patch_type)
    except msgspec.ValidationError as exc:
        return _error(400, _error_body(f"invalid {what}: {exc}", "invalid_request_error"))
    except msgspec.DecodeError:
        return _error(400, _BAD_JSON)
    for name in patch.__struct_fields__:
        value = getattr(patch, name)
        if value is not msgspec.UNSET:
            setattr(target, name, value)
    return web.Response(body=msgspec.json.encode(target), content_type=_JSON)
