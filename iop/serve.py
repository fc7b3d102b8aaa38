"""Run the long-lived processes: API servers and node workers."""

from __future__ import annotations

import logging
import os

import anyio
import uvicorn

from dispatcher.config import Config


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def serve_api(config_path: str, *, host: str, port: int, workers: int, log_level: str) -> None:
    configure_logging(log_level)
    # Server processes (one or many) build the app from this file.
    os.environ["IOP_CONFIG"] = os.path.abspath(config_path)
    uvicorn.run(
        "api.app:create_app",
        factory=True,
        host=host,
        port=port,
        workers=workers if workers > 1 else None,
        loop="uvloop",
        http="httptools",
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=10,
    )


def serve_worker(config: Config, node_id: str, *, log_level: str) -> None:
    from workers.worker import Worker

    configure_logging(log_level)
    anyio.run(Worker(config, node_id).run, backend_options={"use_uvloop": True})
