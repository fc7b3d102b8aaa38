"""The Litestar application: ``create_app(config)``, or ``create_app()`` reading the
config file named by ``IOP_CONFIG`` (what ``iop api`` uses for its server processes)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from litestar import Litestar
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.di import Provide
from litestar.handlers.base import BaseRouteHandler
from litestar.openapi import OpenAPIConfig

from api.control import control_routers
from api.error_handlers import HANDLERS
from api.gateway import Gateway, reload_on_hangup
from api.openapi import document_requests
from api.operator import OPEN_HANDLERS, operator_router
from api.qualify import OPEN_HANDLERS as QUALIFY_OPEN
from api.qualify import qualify_routers
from api.routes import healthz, readyz, v1_router
from api.runtime import Runtime
from dispatcher import config as cfg


def create_app(config: cfg.Config | None = None) -> Litestar:
    if config is None:
        config = cfg.load(os.environ["IOP_CONFIG"]).logged()
        gateway = Gateway(config, os.environ["IOP_CONFIG"])
    else:
        gateway = Gateway(config)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        await gateway.start()
        try:
            with reload_on_hangup(gateway):
                yield
        finally:
            await gateway.close()

    # Asks the current runtime each time: a reload may change the keys.
    async def guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        gateway.runtime.admin.check(connection.headers)

    # The socket's peer: iop/serve.py keeps uvicorn from rewriting it from X-Forwarded-For.
    async def control_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        client = connection.scope.get("client")
        gateway.runtime.admin.check_control(connection.headers, client[0] if client else None)

    # What handlers take: the process's gateway, and the runtime of the config it runs now
    # (read once per request: a reload swaps it, a request keeps the one it started with).
    def provide_gateway() -> Gateway:
        return gateway

    def provide_runtime() -> Runtime:
        return gateway.runtime

    app = Litestar(
        route_handlers=[v1_router(), operator_router([guard]), *control_routers([guard], [control_guard]),
                        *qualify_routers([guard], [control_guard]),
                        *OPEN_HANDLERS, *QUALIFY_OPEN, healthz, readyz],
        lifespan=[lifespan],
        state=State({"gateway": gateway}),
        dependencies={"gw": Provide(provide_gateway, sync_to_thread=False),
                      "rt": Provide(provide_runtime, sync_to_thread=False)},
        exception_handlers=HANDLERS,  # type: ignore[arg-type]
        request_max_body_size=config.api.max_body_bytes,
        openapi_config=OpenAPIConfig(title="iop", version="0.1.0"),
        logging_config=None,
    )
    document_requests(app, [m.id for m in config.models])
    return app
