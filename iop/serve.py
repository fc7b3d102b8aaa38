"""Run the long-lived processes: API servers and node workers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import cast

import anyio
import uvicorn
from uvicorn.config import LOGGING_CONFIG

from api.http_protocol import limited_protocol
from dispatcher.config import Config
from iop import logs


def serve_api(
    config: Config, config_path: str, *, host: str, port: int, workers: int, log_level: str,
    log_format: str | None = None,
) -> None:
    logs.configure(log_level, log_format, role="api")
    # Server processes (one or many) build the app from this file.
    os.environ["IOP_CONFIG"] = os.path.abspath(config_path)
    # uvicorn only calls what `http` names, so a factory serves, though its type asks for a class.
    http = cast("type[asyncio.Protocol]", limited_protocol(config.api))

    with _metrics_dir(workers):
        uvicorn.run(
            "api.app:create_app",
            factory=True,
            host=host,
            port=port,
            workers=workers if workers > 1 else None,
            loop="uvloop",
            http=http,
            log_level=log_level,
            log_config=logs.uvicorn_config(log_level) or LOGGING_CONFIG,
            access_log=False,
            timeout_graceful_shutdown=10,
        )


@contextlib.contextmanager
def _metrics_dir(workers: int) -> Iterator[None]:
    """Several server processes on one port: their counters go to files in one directory
    (prometheus_client's multiprocess mode), so a scrape of any of them sees them all."""
    if workers <= 1 or os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        yield
        return
    with tempfile.TemporaryDirectory(prefix="iop-metrics-") as path:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
        try:
            yield
        finally:
            del os.environ["PROMETHEUS_MULTIPROC_DIR"]


def serve_worker(config: Config, node_id: str, *, log_level: str, log_format: str | None = None) -> None:
    from workers.worker import Worker

    logs.configure(log_level, log_format, role="worker")
    anyio.run(Worker(config, node_id).run, backend_options={"use_uvloop": True})
