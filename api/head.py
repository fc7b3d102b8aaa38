"""``HEAD`` on the pages a ``GET`` reads (``/ui``, ``/catalog``, ``/metrics``, ``/healthz``,
``/readyz``): what a monitor or a load balancer's health check may send instead. It gets the
``GET``'s status and headers, ``Content-Length`` included, and no body (RFC 9110, 9.3.2).
Litestar answers ``HEAD`` on a ``GET`` route 405 unless the route takes it too."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response
from litestar.enums import HttpMethod

GET_AND_HEAD = [HttpMethod.GET, HttpMethod.HEAD]


def page(request: Request[Any, Any, Any], body: bytes, media_type: str, status_code: int = 200) -> Response[bytes]:
    """The answer to a ``GET`` of ``body``, or to a ``HEAD`` of it."""
    if request.method == HttpMethod.HEAD:
        return Response(b"", status_code=status_code, media_type=media_type,
                        headers={"content-length": str(len(body))})
    return Response(body, status_code=status_code, media_type=media_type)
