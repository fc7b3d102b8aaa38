"""The one owner of what an error answer looks like: OpenAI's shape, or Anthropic's where the
endpoint table says so (``dispatcher/endpoints.py`` ``errors``: ``/v1/messages`` and its
count_tokens), whose clients parse only that -- in a JSON answer, in a stream's error event,
and around a provider's own error answer (which the worker shapes with
:func:`provider_error_body` before it crosses Redis).

Which shape a request gets is decided here (:func:`shape_of`, :func:`endpoint_shape`); the
Litestar handlers that answer every exception with these bodies are ``api/error_handlers.py``.
Nothing here imports Litestar: the workers use it too.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from dispatcher.endpoints import ENDPOINTS, Endpoint, ErrorShape
from dispatcher.exceptions import RequestError


def shape_of(path: str) -> ErrorShape:
    """The error shape of a request to ``path``: its endpoint's (``/v1/<endpoint>``), else OpenAI's."""
    spec = ENDPOINTS.get(path.removeprefix("/v1/"))
    return "openai" if spec is None else spec.errors


def error_body(message: str, error_type: str, *, code: str | None, param: str | None = None) -> dict[str, object]:
    """OpenAI's error answer: ``{"error": {"message", "type", "param", "code"}}``, all four always present."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


# Anthropic's error types, by HTTP status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict[str, object]:
    """Anthropic's error answer: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def openai_error_type(status: int) -> str:
    """The ``type`` of an OpenAI-style error iop words itself, by HTTP status."""
    if status == 429:
        return "rate_limit_error"
    return "invalid_request_error" if status < 500 else "server_error"


def body_of(exc: RequestError, shape: ErrorShape) -> dict[str, object]:
    """The answer to one of iop's own errors, in ``shape``."""
    if shape == "anthropic":
        return anthropic_error_body(exc.status, exc.message)
    return error_body(exc.message, exc.type, code=exc.code, param=exc.param)


def worded_body(status: int, message: str, shape: ErrorShape, code: str | None) -> dict[str, object]:
    """An error that is not one of iop's classes (an HTTP error of the framework, a crash),
    answered in ``shape``; ``code``: OpenAI's ``code`` for it."""
    if shape == "anthropic":
        return anthropic_error_body(status, message)
    return error_body(message, openai_error_type(status), code=code)


def stream_error(exc: RequestError, spec: Endpoint, provider_body: bytes | None = None) -> bytes:
    """The event that ends a stream of ``spec`` with ``exc`` (a ``bytes`` stream has none: its
    caller's connection is cut instead). ``provider_body``: the provider's own error answer,
    already in the endpoint's shape (:func:`provider_error_body`)."""
    kind = spec.stream
    if provider_body is not None:
        data = provider_body
    elif spec.errors == "anthropic":
        data = msgspec.json.encode(anthropic_error_body(exc.status, exc.message))
    elif kind == "typed_sse":
        # The Responses stream's own error event.
        data = msgspec.json.encode({"type": "error", "code": exc.code, "message": exc.message, "param": None})
    else:
        data = msgspec.json.encode(body_of(exc, "openai"))
    return (b"event: error\n" if kind == "typed_sse" else b"") + b"data: " + data + b"\n\n"


# The two error shapes, only as far as a client reads them: a body that decodes into its
# endpoint's one is relayed as the provider wrote it.
class _OpenAIErrorDetail(msgspec.Struct):
    message: str


class _OpenAIError(msgspec.Struct):
    error: _OpenAIErrorDetail


class _AnthropicErrorDetail(msgspec.Struct):
    type: str
    message: str


class _AnthropicError(msgspec.Struct):
    type: Literal["error"]
    error: _AnthropicErrorDetail


_SHAPE_DECODERS: dict[ErrorShape, msgspec.json.Decoder[Any]] = {
    "openai": msgspec.json.Decoder(_OpenAIError),
    "anthropic": msgspec.json.Decoder(_AnthropicError),
}
# Of a body that is not in shape, this much is quoted in the message that wraps it.
QUOTED_CHARS = 1000
# The code of an OpenAI-shaped error that wraps a provider's answer.
WRAPPED_CODE = "upstream_error"


def in_error_shape(body: bytes, shape: ErrorShape) -> bool:
    """Is ``body`` an error answer that the clients of an endpoint with this ``shape`` read?"""
    try:
        _SHAPE_DECODERS[shape].decode(body)
    except msgspec.DecodeError:
        return False
    return True


def provider_said(provider: str, status: int, body: bytes, cut: bool = False) -> str:
    """``provider p answered 404: <its body>`` in words: the body's whitespace folded, at most
    ``QUOTED_CHARS`` of it (``cut``: the body was longer than what was read of it)."""
    # Four bytes per character at most: enough to fill the quote, never the whole body.
    text = " ".join(body[: QUOTED_CHARS * 4].decode(errors="replace").split())
    if not text:
        return f"provider {provider} answered {status} with an empty body"
    if cut or len(text) > QUOTED_CHARS or len(body) > QUOTED_CHARS * 4:
        text = text[:QUOTED_CHARS] + "…"
    return f"provider {provider} answered {status}: {text}"


def provider_error_body(shape: ErrorShape, status: int, body: bytes, provider: str, cut: bool = False) -> bytes:
    """What the caller gets of a provider's error answer: ``body`` itself, byte for byte, when
    it is an error of the endpoint's ``shape`` and whole; otherwise (another shape, HTML, text,
    nothing, or ``cut`` -- longer than iop reads, so no longer JSON) an error of that shape
    that names the provider and quotes the body, for the SDKs to parse."""
    if not cut and in_error_shape(body, shape):
        return body
    return msgspec.json.encode(worded_body(status, provider_said(provider, status, body, cut), shape, WRAPPED_CODE))
