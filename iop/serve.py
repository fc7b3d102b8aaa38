"""Run the long-lived processes: API servers and node workers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import tempfile
from collections.abc import Iterator
from typing import Any, cast

import anyio
import uvicorn
from uvicorn.config import LOGGING_CONFIG
from uvicorn.supervisors import Multiprocess

from api.auth import exposure_notes
from api.http_protocol import limited_protocol
from dispatcher import tracing
from dispatcher.config import Config, RedisConfig
from dispatcher.redis_topology import described
from iop import logs

log = logging.getLogger("iop.api")


def log_redis(logger: logging.Logger, redis: RedisConfig) -> None:
    """Say at start which Redis this process uses; a warning when it is the default, which
    may well be some other program's Redis on this machine."""
    default = redis.url is None and redis.sentinel is None
    logger.log(logging.WARNING if default else logging.INFO, "Redis: %s", described(redis))


def serve_api(
    config: Config, config_path: str, *, host: str, port: int, workers: int, log_level: str,
    log_format: str | None = None,
) -> None:
    logs.configure(log_level, log_format, role="api")
    # Here, in the one process that binds the port, rather than in each server process.
    log_redis(log, config.redis)
    for level, note in exposure_notes(config.api, host):
        log.log(level, "%s", note)
    # Server processes (one or many) build the app from this file.
    os.environ["IOP_CONFIG"] = os.path.abspath(config_path)
    # uvicorn only calls what `http` names, so a factory serves, though its type asks for a class.
    http = cast("type[asyncio.Protocol]", limited_protocol(config.api))

    options: dict[str, Any] = {
        "factory": True, "host": host, "port": port, "loop": "uvloop", "http": http, "log_level": log_level,
        "log_config": logs.uvicorn_config(log_level) or LOGGING_CONFIG, "access_log": False,
        "timeout_graceful_shutdown": 10, "timeout_keep_alive": config.api.keep_alive_s,
        # The client address stays the socket's peer: uvicorn would otherwise take it from
        # X-Forwarded-For (from any peer, with FORWARDED_ALLOW_IPS=*), and runtime control
        # trusts a loopback peer (api/auth.py).
        "proxy_headers": False,
    }
    with _metrics_dir(workers):
        if workers > 1:
            server = uvicorn.Config("api.app:create_app", workers=workers, **options)
            _ReloadingMultiprocess(server, sockets=[server.bind_socket()]).run()
        else:
            uvicorn.run("api.app:create_app", **options)


class _ReloadingMultiprocess(Multiprocess):
    """uvicorn's supervisor of several server processes, except that ``SIGHUP`` reaches
    each of them (they reload their config, ``api/gateway.py``): uvicorn's own answer to it
    is to replace them, which cuts every stream they relay."""

    def handle_hup(self) -> None:
        for process in self.processes:
            if process.pid is not None:
                os.kill(process.pid, signal.SIGHUP)


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


def serve_worker(
    config: Config, node_id: str, *, log_level: str, log_format: str | None = None, config_path: str | None = None,
) -> None:
    from workers.worker import Worker

    logs.configure(log_level, log_format, role="worker")
    log_redis(logging.getLogger("iop.worker"), config.redis)
    tracing.setup(config, "worker", node_id)
    try:
        anyio.run(Worker(config, node_id, config_path).run, backend_options={"use_uvloop": True})
    finally:
        tracing.shutdown()
