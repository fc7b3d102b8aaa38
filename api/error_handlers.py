"""The app's exception handlers: every failure becomes an error answer, in its endpoint's
shape (``api/errors.py``)."""

from __future__ import annotations

import logging
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException
from redis.exceptions import RedisError

from api.errors import body_of, shape_of, worded_body
from dispatcher.exceptions import ProviderRejected, RedisUnavailable, RequestError

log = logging.getLogger("iop.api")

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def request_error(request: Request[Any, Any, Any], exc: RequestError) -> Response[object]:
    headers = dict(exc.headers)
    if exc.retry_after is not None:
        headers["Retry-After"] = str(exc.retry_after)
    if isinstance(exc, ProviderRejected) and exc.raw_body is not None:
        # Already in the endpoint's shape: the worker shaped it, knowing the provider.
        return Response(exc.raw_body, status_code=exc.status, media_type=exc.content_type, headers=headers)
    return Response(body_of(exc, shape_of(request.url.path)), status_code=exc.status, headers=headers)


def redis_error(request: Request[Any, Any, Any], exc: RedisError) -> Response[object]:
    return request_error(request, RedisUnavailable(f"Redis is unavailable: {exc}"))


def http_error(request: Request[Any, Any, Any], exc: HTTPException) -> Response[object]:
    status = exc.status_code
    body = worded_body(status, exc.detail, shape_of(request.url.path), _HTTP_CODES.get(status))
    return Response(body, status_code=status, headers=dict(exc.headers or {}))


def unexpected_error(request: Request[Any, Any, Any], exc: Exception) -> Response[object]:
    log.exception("unhandled error", exc_info=exc)
    body = worded_body(500, "Internal server error", shape_of(request.url.path), "internal_error")
    return Response(body, status_code=500)


HANDLERS = {
    RequestError: request_error,
    RedisError: redis_error,
    HTTPException: http_error,
    Exception: unexpected_error,
}
