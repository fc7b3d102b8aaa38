"""Start-up checks of the Redis server iop uses."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from dispatcher.redis_conn import connect, server_warnings
from iop.redis_server import RedisServer

pytestmark = pytest.mark.anyio


async def test_noeviction_is_quiet(any_redis: Redis) -> None:
    assert await server_warnings(any_redis) == []


async def test_an_evicting_policy_is_reported(any_redis_server: RedisServer, any_redis: Redis) -> None:
    await any_redis.config_set("maxmemory-policy", "allkeys-lru")
    try:
        client = connect(any_redis_server.url)
        (warning,) = await server_warnings(client)
        await client.aclose()
    finally:
        await any_redis.config_set("maxmemory-policy", "noeviction")
    assert "allkeys-lru" in warning
    assert "noeviction" in warning
