"""One place that turns every failure into an error answer: OpenAI's shape, or Anthropic's
where the endpoint table says so (``dispatcher/endpoints.py`` ``errors``: ``/v1/messages``
and its count_tokens), whose clients parse only that."""

from __future__ import annotations

import logging
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException
from redis.exceptions import RedisError

from dispatcher.endpoints import ENDPOINTS
from dispatcher.exceptions import (
    ProviderRejected,
    RedisUnavailable,
    RequestError,
    anthropic_error_body,
    error_body,
    openai_error_type,
)

log = logging.getLogger("iop.api")

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def anthropic(request: Request[Any, Any, Any]) -> bool:
    """Whether the request's endpoint answers errors in Anthropic's shape: the endpoint table
    says (``dispatcher/endpoints.py`` ``errors``), for ``/v1/<endpoint>`` paths."""
    spec = ENDPOINTS.get(request.url.path.removeprefix("/v1/"))
    return spec is not None and spec.errors == "anthropic"


def _answer(request: Request[Any, Any, Any], exc: RequestError) -> Response[object]:
    headers = dict(exc.headers)
    if exc.retry_after is not None:
        headers["Retry-After"] = str(exc.retry_after)
    if isinstance(exc, ProviderRejected):
        # Already in the endpoint's shape: the worker shaped it, knowing the provider.
        return Response(exc.raw_body, status_code=exc.status, media_type=exc.content_type, headers=headers)
    body = anthropic_error_body(exc.status, exc.message) if anthropic(request) else exc.body()
    return Response(body, status_code=exc.status, headers=headers)


def request_error(request: Request[Any, Any, Any], exc: RequestError) -> Response[object]:
    return _answer(request, exc)


def redis_error(request: Request[Any, Any, Any], exc: RedisError) -> Response[object]:
    return _answer(request, RedisUnavailable(f"Redis is unavailable: {exc}"))


def http_error(request: Request[Any, Any, Any], exc: HTTPException) -> Response[object]:
    status = exc.status_code
    if anthropic(request):
        body = anthropic_error_body(status, exc.detail)
    else:
        body = error_body(exc.detail, openai_error_type(status), code=_HTTP_CODES.get(status))
    return Response(body, status_code=status, headers=dict(exc.headers or {}))


def unexpected_error(request: Request[Any, Any, Any], exc: Exception) -> Response[object]:
    log.exception("unhandled error", exc_info=exc)
    if anthropic(request):
        return Response(anthropic_error_body(500, "Internal server error"), status_code=500)
    return Response(error_body("Internal server error", "server_error", code="internal_error"), status_code=500)


HANDLERS = {
    RequestError: request_error,
    RedisError: redis_error,
    HTTPException: http_error,
    Exception: unexpected_error,
}
