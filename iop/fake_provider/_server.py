"""The fake provider's server: the request pipeline, chat/completions/embeddings, probes, test hooks."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import itertools
import secrets
import signal
import struct
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Final

import msgspec
from aiohttp import web
from multidict import CIMultiDict

from . import _anthropic, _media, _pooling
from ._common import (
    _BODY_FORM,
    _BODY_JSON,
    _BODY_NONE,
    _DONE,
    _JSON,
    _JSON_V1,
    _PROCESSING_MS,
    _SSE_V1,
    _X_REQUEST_ID,
    FakeOptions,
    _Call,
    _ClientGone,
    _Endpoint,
    _error,
    _error_body,
    _Execution,
    _given,
    _groups,
    _Hooks,
    _HooksPatch,
    _OptionsPatch,
    _Overrides,
    _Recorded,
    _recorded_headers,
    _Stats,
    _stream,
    _words,
)
from ._lifecycle import Lifecycle, is_on
from ._ollama import OllamaAPI
from ._responses import ResponsesAPI

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_HANG_POLL_S: Final = 0.05
_EMBEDDING_DIMS: Final = 8
_MAX_RECORDED: Final = 1000
_MAX_EXECUTIONS: Final = 100_000

_BAD_JSON_MESSAGE: Final = (
    "We could not parse the JSON body of your request. (HINT: This likely means you aren't using your "
    "HTTP library correctly. The OpenAI API expects a JSON payload.)"
)
_BAD_KEY: Final = _error_body("Incorrect API key provided.", "invalid_request_error", None, "invalid_api_key")
_UNHEALTHY: Final = _error_body("fake provider is unhealthy", "server_error", None, "service_unavailable")
_BAD_OVERRIDES_MESSAGE: Final = ("'fake' must be an object of non-negative integers delay_ms, tokens, "
                                  "token_interval_ms, cut_after, and an HTTP status fail_status")

_GARBAGE_JSON: Final = b'{"id":"chatcmpl-garbage","object":"chat.completion","choices":[{"message":{"rol'
# A stream that starts fine, then carries a data line that is not JSON, then ends normally.
_GARBAGE_STREAM: Final = (
    b'data: {"id":"chatcmpl-garbage","object":"chat.completion.chunk","created":0,"model":"garbage",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
    b'data: {"id":"chatcmpl-garbage","choices":[{"delta":{"content":"tok0\n\n' + _DONE
)

_CHAT, _TEXT = 0, 1
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


# The same answers ended by max_tokens.
_LENGTH_SHAPES: Final = {
    kind: msgspec.structs.replace(
        shape,
        message_close=shape.message_close.replace(b'"stop"', b'"length"'),
        finish=shape.finish.replace(b'"stop"', b'"length"'),
    )
    for kind, shape in _SHAPES.items()
}


def _content_text(content: Any) -> str:
    """The text of a message's content: a string, or the ``text`` of its parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _max_tokens(body: dict[str, Any]) -> int | None:
    """The most words the request lets the answer have (``max_tokens``, ``max_completion_tokens``:
    the smaller positive one); None: no limit."""
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        return None
    limit = None
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if type(value) is int and value > 0 and (limit is None or value < limit):
            limit = value
    return limit


def _continued_prompt(body: dict[str, Any], given: int, field: str, before: Any) -> int:
    """A continuation's prompt tokens: those of the request it continues -- this body with ``field``
    (``messages``, ``prompt``) as it was before the answer so far was added, without the continuation
    flags, ``max_tokens`` as it was before the ``given`` words were used, encoded compact -- plus the
    ``given`` words. So the prompt of a continued answer, less the words it was given, is the
    uninterrupted one's (for a body sent as compact JSON)."""
    original = dict(body)
    original[field] = before
    original.pop("continue_final_message", None)
    original.pop("add_generation_prompt", None)
    for name in ("max_tokens", "max_completion_tokens"):
        value = original.get(name)
        if type(value) is int:
            original[name] = value + given
    return max(1, len(msgspec.json.encode(original)) // 4) + given


def _usage(prompt: int, completion: int) -> bytes:
    total = prompt + completion
    return b'{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}' % (prompt, completion, total)


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


def _request_id_prefix() -> str:
    """The first 24 characters of a UUID-4-shaped id; a per-request counter supplies the last 12."""
    digits = secrets.token_hex(10)
    return f"{digits[:8]}-{digits[8:12]}-4{digits[12:15]}-8{digits[15:18]}-"


# --------------------------------------------------------------------------- the server


class _FakeProvider:
    def __init__(self, options: FakeOptions) -> None:
        self.options = options
        self.stats = _Stats()
        self.requests: deque[_Recorded] = deque(maxlen=_MAX_RECORDED)
        self.hooks = _Hooks()
        self.executions: deque[_Execution] = deque(maxlen=_MAX_EXECUTIONS)
        self.closing = False
        self._parallel: tuple[int, asyncio.Semaphore] | None = None
        self._ids = itertools.count(1)
        self._request_ids = itertools.count(1)
        self._request_id_prefix = _request_id_prefix()
        # Transports that answered while close_idle_keepalive was on.
        self._served: weakref.WeakSet[Any] = weakref.WeakSet()
        self.fallback_resource: web.AbstractResource | None = None
        responses = ResponsesAPI()
        self.responses = responses
        self.lifecycle = Lifecycle(options)
        self.ollama = ollama = OllamaAPI(options, self.lifecycle)
        chat = {"POST": _Endpoint(self._chat, streams=True)}
        rerank = {"POST": _Endpoint(_pooling.rerank)}
        score = {"POST": _Endpoint(_pooling.score)}
        tokenize = {"POST": _Endpoint(_pooling.tokenize, needs_model=False)}
        detokenize = {"POST": _Endpoint(_pooling.detokenize, needs_model=False)}
        self.endpoints: dict[str, dict[str, _Endpoint]] = {
            "/v1/chat/completions": chat,
            "/v1/completions": {"POST": _Endpoint(self._completions, streams=True)},
            "/v1/embeddings": {"POST": _Endpoint(self._embeddings)},
            "/v1/responses": {"POST": _Endpoint(responses.create, streams=True)},
            "/v1/responses/{response_id}": {
                "GET": _Endpoint(responses.retrieve, body=_BODY_NONE, needs_model=False),
                "DELETE": _Endpoint(responses.delete, body=_BODY_NONE, needs_model=False),
            },
            "/v1/responses/{response_id}/cancel": {
                "POST": _Endpoint(responses.cancel, body=_BODY_NONE, needs_model=False)
            },
            "/v1/responses/{response_id}/input_items": {
                "GET": _Endpoint(responses.input_items, body=_BODY_NONE, needs_model=False)
            },
            "/v1/messages": {"POST": _Endpoint(_anthropic.messages, streams=True, anthropic=True)},
            "/v1/messages/count_tokens": {"POST": _Endpoint(_anthropic.count_tokens, anthropic=True)},
            "/v1/rerank": rerank,
            "/rerank": rerank,
            "/v2/rerank": rerank,
            "/v1/score": score,
            "/score": score,
            "/tokenize": tokenize,
            "/v1/tokenize": tokenize,
            "/detokenize": detokenize,
            "/v1/detokenize": detokenize,
            "/v1/audio/transcriptions": {"POST": _Endpoint(_media.transcription, body=_BODY_FORM, streams=True)},
            "/v1/audio/translations": {"POST": _Endpoint(_media.translation, body=_BODY_FORM)},
            "/v1/audio/speech": {"POST": _Endpoint(_media.speech)},
            "/v1/images/generations": {"POST": _Endpoint(_media.images)},
            "/api/generate": {"POST": _Endpoint(ollama.generate, streams=True, needs_model=False, ollama=True)},
            "/api/chat": {"POST": _Endpoint(ollama.chat, streams=True, needs_model=False, ollama=True)},
        }
        self.routes: dict[str, dict[str, _Handler]] = {
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
            "/_fake/lifecycle": {"GET": self.get_lifecycle},
            "/_fake/lifecycle/reset": {"POST": self.reset_lifecycle},
        }
        for path, methods in self.endpoints.items():
            self.routes[path] = {method: self._handler(endpoint) for method, endpoint in methods.items()}

    def _handler(self, endpoint: _Endpoint) -> _Handler:
        # A partial, not a closure: one coroutine frame less per request.
        return functools.partial(self._post, endpoint=endpoint)

    # ---------------------------------------------------------------- the request pipeline

    async def _post(self, request: web.Request, *, endpoint: _Endpoint) -> web.StreamResponse:
        if self.options.close_idle_keepalive and self._drop_reused(request):
            return web.Response(status=499)  # nobody reads it: the connection is closed
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
        call = _Call(request, endpoint, f"{self._request_id_prefix}{next(self._request_ids):012x}")
        try:
            response = await self._answer(call, execution)
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
                execution.end("cut" if call.cut else "completed")
            if not call.decorated and not response.prepared:
                call.decorate(response)
            if self.options.close_idle_keepalive and request.transport is not None:
                self._served.add(request.transport)
            return response
        finally:
            stats.in_flight -= 1

    def _drop_reused(self, request: web.Request) -> bool:
        """Close the connection, unanswered, when it already answered a request (``close_idle_keepalive``)."""
        transport = request.transport
        if transport is None or transport not in self._served:
            return False
        request.protocol.force_close()
        return True

    async def _answer(self, call: _Call, execution: _Execution | None = None) -> web.StreamResponse:
        options = self.options
        request = call.request
        endpoint = call.endpoint
        authorization = request.headers.get("Authorization")
        body: Any
        problem: str | None = None
        kind = endpoint.body
        if kind == _BODY_JSON:
            raw = await request.read()
            try:
                body = msgspec.json.decode(raw)
            except msgspec.DecodeError:
                body = None
                problem = _BAD_JSON_MESSAGE
            call.raw = raw
        elif kind == _BODY_FORM:
            body, call.file, problem = await _media.read_form(request)
        else:
            body = None
        is_object = isinstance(body, dict)
        model = body.get("model") if is_object else None
        if not isinstance(model, str) or not model:
            model = None
        stream = False
        if endpoint.streams and is_object:
            flag = body.get("stream")
            stream = (
                flag is True
                or (flag is None and endpoint.ollama)  # Ollama streams unless told not to
                or (kind == _BODY_FORM and flag in ("true", "True"))
            )
        method = None if request.method == "POST" else request.method
        headers = _recorded_headers(request.headers)
        recorded = _Recorded(request.path, model, stream, authorization, body, method, headers)
        self.requests.append(recorded)
        if execution is not None and is_object:
            marker = body.get("user")
            if marker is None and endpoint.anthropic and isinstance(body.get("metadata"), dict):
                marker = body["metadata"].get("user_id")
            execution.marker = marker if isinstance(marker, str) else None
            execution.stream = stream
        api_key = options.api_key
        if (
            api_key is not None
            and authorization != "Bearer " + api_key
            and not (endpoint.anthropic and request.headers.get("x-api-key") == api_key)
        ):
            if endpoint.anthropic:
                return call.fail(401, "invalid x-api-key")
            return web.Response(status=401, body=_BAD_KEY, headers=call.headers())
        delay_ms, n, interval_ms = options.delay_ms, options.tokens, options.token_interval_ms
        status = options.fail_status
        cut_after = options.cut_after
        if self.hooks.body_overrides and is_object and "fake" in body:
            try:
                overrides = msgspec.convert(body["fake"], type=_Overrides)
            except msgspec.ValidationError:
                return call.fail(400, _BAD_OVERRIDES_MESSAGE, param="fake")
            delay_ms = delay_ms if overrides.delay_ms is None else overrides.delay_ms
            n = n if overrides.tokens is None else overrides.tokens
            interval_ms = interval_ms if overrides.token_interval_ms is None else overrides.token_interval_ms
            status = status if overrides.fail_status is None else overrides.fail_status
            cut_after = cut_after if overrides.cut_after is None else overrides.cut_after

        if options.hang and not await self._hang(request):
            return call.fail(503, "fake provider is shutting down", "server_error")
        # At most `parallel` answers generate at once (a server's slots); the rest wait here.
        slots = self._slots()
        if slots is not None:
            await slots.acquire()
        try:
            if delay_ms > 0:
                await self._sleep(request, delay_ms / 1000)
            if status is not None:
                type_ = "server_error" if status >= 500 else "invalid_request_error"
                return call.fail(status, f"fake provider failure (status {status})", type_)
            if options.fail_with is not None:
                return call.canned(options.fail_with)
            if options.garbage:
                if stream:
                    return web.Response(body=_GARBAGE_STREAM, headers=call.headers(_SSE_V1))
                return web.Response(body=_GARBAGE_JSON, headers=call.headers())
            if options.empty_200:
                return web.Response(headers=call.headers(_SSE_V1 if stream else _JSON_V1))
            if problem is not None:
                return call.fail(400, problem)
            if kind == _BODY_JSON and not is_object:
                return call.fail(400, "The request body must be a JSON object.")
            if model is None and endpoint.needs_model:
                if endpoint.anthropic:
                    return call.fail(400, "model: Field required")
                return call.fail(400, "you must provide a model parameter", param="model")
            call.body = body
            call.model = model or ""
            call.stream = stream
            call.tokens = n
            call.interval_ms = interval_ms
            call.cut_after = cut_after
            # Ollama's lifecycle: the model is loaded first (the native endpoints see to it themselves).
            if model is not None and not endpoint.ollama and is_on(options) and model in options.models:
                runner = await self.lifecycle.acquire(model, msgspec.UNSET, "request")
                try:
                    return await endpoint.answer(call)
                finally:
                    self.lifecycle.release(runner)
            return await endpoint.answer(call)
        finally:
            if slots is not None:
                slots.release()

    def _slots(self) -> asyncio.Semaphore | None:
        """The semaphore of ``parallel`` slots (made anew when the option changes); None: unlimited."""
        n = self.options.parallel
        if n <= 0:
            return None
        if self._parallel is None or self._parallel[0] != n:
            self._parallel = (n, asyncio.Semaphore(n))
        return self._parallel[1]

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

    # ---------------------------------------------------------------- chat, completions, embeddings

    # Plain functions handing over the coroutine: one frame less per request.
    def _chat(self, call: _Call) -> Awaitable[web.StreamResponse]:
        return self._complete(call, _CHAT)

    def _completions(self, call: _Call) -> Awaitable[web.StreamResponse]:
        return self._complete(call, _TEXT)

    async def _complete(self, call: _Call, kind: int) -> web.StreamResponse:
        body = call.body
        model_json = msgspec.json.encode(call.model)
        n = call.tokens
        stem = self.options.word
        # A continuation: the answer so far given back -- chat: a trailing assistant message; completions:
        # the prompt's last words -- goes on where it stopped.
        start, lead, prompt_tokens = 0, False, 0
        if kind == _CHAT:
            messages = body.get("messages")
            if isinstance(messages, list) and messages:
                last = messages[-1]
                if isinstance(last, dict) and last.get("role") == "assistant":
                    text = _content_text(last.get("content"))
                    if text:
                        start, _ = _given(text, stem, n)
                        if start:
                            lead = not text[-1].isspace()
                            prompt_tokens = _continued_prompt(body, start, "messages", messages[:-1])
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, str) and prompt:
                start, at = _given(prompt, stem, n)
                if start:
                    lead = not prompt[-1].isspace()
                    prompt_tokens = _continued_prompt(body, start, "prompt", prompt[:at])
        end = n
        limit = _max_tokens(body)
        capped = False
        if limit is not None and start + limit < n:
            end, capped = start + limit, True
        words = _words(end, stem, start, lead) if start else _words(end, stem)
        usage = _usage(prompt_tokens or max(1, len(call.raw) // 4), end - start)
        shape = _SHAPES[kind] if not capped else _LENGTH_SHAPES[kind]
        # '{"id":"chatcmpl-fake1","object":"chat.completion","created":1700000000,"model":"m",...,"choices":'
        created_model = b"%d" % int(time.time()) + _MODEL + model_json + _FINGERPRINT
        rid = shape.id_prefix + b"%x" % next(self._ids)
        if not call.stream:
            body_parts = (b'{"id":"', rid, shape.object, created_model, shape.message_open, words.content)
            answer = b"".join((*body_parts, shape.message_close, usage, b"}"))
            return web.Response(body=answer, headers=call.headers())
        top = b'data: {"id":"' + rid + shape.chunk_object + created_model
        head = top + shape.delta_open
        first = head + shape.first + _NOT_FINISHED if shape.first else b""
        pieces = words.deltas if kind == _CHAT else words.pieces
        contents = [head + piece + _NOT_FINISHED for piece in pieces]
        cut = call.cut_after
        if cut is not None and cut <= len(contents):
            return await _stream(call, _groups(first, contents[:cut], b""), call.interval_ms, cut=True)
        tail = head + shape.finish
        stream_options = body.get("stream_options")
        if isinstance(stream_options, dict) and stream_options.get("include_usage") is True:
            tail += top + b'[],"usage":' + usage + b"}\n\n"
        if not self.options.stream_no_done:
            tail += _DONE
        return await _stream(call, _groups(first, contents, tail), call.interval_ms)

    async def _embeddings(self, call: _Call) -> web.StreamResponse:
        items = _embedding_inputs(call.body.get("input"))
        if items is None:
            message = "'input' must be a string, a list of strings, a list of integers or a list of lists of integers"
            return call.fail(400, message, param="input")
        as_base64 = call.body.get("encoding_format") == "base64"
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
            body=b'{"object":"list","data":' + msgspec.json.encode(data)
            + b',"model":' + msgspec.json.encode(call.model)
            + b',"usage":{"prompt_tokens":%d,"total_tokens":%d}}' % (tokens, tokens),
            headers=call.headers(),
        )

    # ---------------------------------------------------------------- GET endpoints

    def _unhealthy(self) -> web.Response | None:
        return None if self.options.healthy else _error(503, _UNHEALTHY)

    def _model_list(self) -> bytes:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "fake"} for m in self.options.models]
        return msgspec.json.encode({"object": "list", "data": data})

    def _v1_headers(self) -> CIMultiDict[str]:
        """The headers of a /v1 answer outside the pipeline."""
        headers = _JSON_V1.copy()
        headers[_X_REQUEST_ID] = f"{self._request_id_prefix}{next(self._request_ids):012x}"
        headers[_PROCESSING_MS] = "0"
        return headers

    async def v1_models(self, request: web.Request) -> web.Response:
        api_key = self.options.api_key
        if api_key is not None and request.headers.get("Authorization") != "Bearer " + api_key:
            return web.Response(status=401, body=_BAD_KEY, headers=self._v1_headers())
        if not self.options.healthy:
            return web.Response(status=503, body=_UNHEALTHY, headers=self._v1_headers())
        return web.Response(body=self._model_list(), headers=self._v1_headers())

    async def health(self, request: web.Request) -> web.Response:
        return self._unhealthy() or web.Response()

    async def ollama_tags(self, request: web.Request) -> web.Response:
        return self._unhealthy() or web.Response(body=self.ollama.tags(), content_type=_JSON)

    async def ollama_ps(self, request: web.Request) -> web.Response:
        return self._unhealthy() or web.Response(body=self.ollama.ps(), content_type=_JSON)

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
        response = await _patch(request, self.options, _OptionsPatch, "options")
        self.lifecycle.notify()  # a load waiting for room may have more now
        return response

    async def get_lifecycle(self, request: web.Request) -> web.Response:
        return web.Response(body=msgspec.json.encode(self.lifecycle.counts()), content_type=_JSON)

    async def reset_lifecycle(self, request: web.Request) -> web.Response:
        self.lifecycle.reset_counts()
        return web.Response(body=msgspec.json.encode(self.lifecycle.counts()), content_type=_JSON)

    # ---------------------------------------------------------------- anything else

    async def fallback(self, request: web.Request) -> web.Response:
        allowed: set[str] = set()
        for resource in request.app.router.resources():
            if resource is not self.fallback_resource:
                _, methods = await resource.resolve(request)
                allowed |= methods
        headers = self._v1_headers() if request.path.startswith("/v1/") else CIMultiDict({"Content-Type": _JSON})
        if not allowed:
            message = f"Invalid URL ({request.method} {request.path})"
            return web.Response(status=404, body=_error_body(message, "invalid_request_error"), headers=headers)
        message = f"Method {request.method} not allowed for {request.path}"
        headers["Allow"] = ", ".join(sorted(allowed))
        return web.Response(status=405, body=_error_body(message, "invalid_request_error"), headers=headers)

    async def on_shutdown(self, app: web.Application) -> None:
        self.closing = True


def create_app(options: FakeOptions) -> web.Application:
    """The fake provider as an aiohttp application; ``options`` is read on every request."""
    provider = _FakeProvider(options)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    for path, methods in provider.routes.items():
        for method, handler in methods.items():
            app.router.add_route(method, path, handler)
    provider.fallback_resource = app.router.add_resource("/{tail:.*}")
    provider.fallback_resource.add_route("*", provider.fallback)
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
        return _error(400, _error_body(_BAD_JSON_MESSAGE, "invalid_request_error"))
    for name in patch.__struct_fields__:
        value = getattr(patch, name)
        if value is not msgspec.UNSET:
            setattr(target, name, value)
    return web.Response(body=msgspec.json.encode(target), content_type=_JSON)
