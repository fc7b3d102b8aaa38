"""Fixtures of the benchmark helpers' tests: simulated servers in the test's event loop."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from bench.fleet_sim import SimConfig, start
from iop.redis_server import free_port

Serve = Callable[[SimConfig], Awaitable[str]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """Start ``bench.fleet_sim`` servers with a given config, on free ports; each call gives
    the base URL of one."""
    runners = []

    async def one(config: SimConfig) -> str:
        port = free_port()
        runners.append(await start(config, "127.0.0.1", port))
        return f"http://127.0.0.1:{port}"

    yield one
    for runner in runners:
        await runner.cleanup()
