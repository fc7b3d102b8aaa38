"""The read-only operator surfaces: ``/catalog`` (JSON), ``/ui`` (a page over it) and
``/metrics`` (Prometheus). Nothing here changes any state: runtime
control belongs elsewhere, so a read-only key can be handed out safely."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
from litestar import Request, Response, Router, route
from litestar.di import NamedDependency
from redis.exceptions import RedisError

from api.gateway import Gateway
from api.head import GET_AND_HEAD, page
from api.metrics import CONTENT_TYPE
from dispatcher.catalog import read_catalog
from dispatcher.exceptions import RedisUnavailable

_UI = (Path(__file__).resolve().parent / "ui.html").read_bytes()


@route("/catalog", http_method=GET_AND_HEAD,
       summary="Providers, their health and load, the model groups and the tenants (read-only)")
async def catalog(request: Request[Any, Any, Any], gw: NamedDependency[Gateway]) -> Response[bytes]:
    try:
        doc = await read_catalog(gw.redis, gw.config)
    except RedisError as exc:
        raise RedisUnavailable(f"Redis is unavailable: {exc}") from None
    return page(request, msgspec.json.encode(doc), "application/json")


@route("/metrics", http_method=GET_AND_HEAD, summary="Prometheus metrics")
async def metrics(request: Request[Any, Any, Any], gw: NamedDependency[Gateway]) -> Response[bytes]:
    try:
        doc = await read_catalog(gw.redis, gw.config)
    except RedisError:
        doc = None  # the per-process series are still worth a scrape
    return page(request, gw.metrics.render(doc), CONTENT_TYPE)


@route("/ui", http_method=GET_AND_HEAD, summary="The catalog as a page that refreshes itself", include_in_schema=False)
async def ui(request: Request[Any, Any, Any]) -> Response[bytes]:
    return page(request, _UI, "text/html; charset=utf-8")


def operator_router(guards: list[Any]) -> Router:
    return Router(path="/", route_handlers=[catalog, metrics], guards=guards)


OPEN_HANDLERS = [ui]
