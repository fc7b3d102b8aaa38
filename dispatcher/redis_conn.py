"""Redis clients with timeouts and retries suited to a request path."""

from __future__ import annotations

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisError

from dispatcher.fastredis import FastRedis

DEFAULT_URL = "redis://127.0.0.1:6379/0"

# Longest server-side block of an XREAD/XREADGROUP; must stay below SOCKET_TIMEOUT_S.
BLOCK_MS = 2_000
SOCKET_TIMEOUT_S = 5.0


def connect(url: str | None, *, max_connections: int = 256) -> Redis:
    """A client that fails fast when Redis is away and retries briefly on a dropped connection.

    Every script iop calls is safe to run twice (``submit`` answers 'duplicate' for a
    job id it has seen, the others are idempotent), so a retry after a lost reply
    cannot double a decision.
    """
    pool = BlockingConnectionPool.from_url(
        url or DEFAULT_URL,
        socket_connect_timeout=1.0,
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_keepalive=True,
        retry=Retry(ExponentialBackoff(cap=0.2, base=0.01), retries=2),
        max_connections=max_connections,
        # Under a burst, wait for a free connection instead of failing the request.
        timeout=SOCKET_TIMEOUT_S,
    )
    return Redis.from_pool(pool)


def connect_fast(url: str | None) -> FastRedis:
    """The lean client of the request path (``dispatcher.fastredis``)."""
    return FastRedis(url or DEFAULT_URL, connect_timeout=1.0, command_timeout=SOCKET_TIMEOUT_S)


def blocking_timeout(block_ms: int) -> float:
    """How long to wait for a reply to a command that blocks ``block_ms`` on the server."""
    return block_ms / 1000 + SOCKET_TIMEOUT_S


async def server_warnings(redis: Redis) -> list[str]:
    """What an operator should fix on the Redis server iop uses (empty when all is well)."""
    warnings: list[str] = []
    try:
        info = await redis.info("server")
        version = tuple(int(x) for x in str(info.get("redis_version", "0")).split(".")[:2])
        if version < (6, 2):
            warnings.append(f"Redis {info.get('redis_version')} is too old: iop needs 6.2 or newer")
    except (RedisError, ValueError):
        pass
    try:
        policy = (await redis.config_get("maxmemory-policy")).get("maxmemory-policy")
    except RedisError:
        return warnings  # CONFIG is often disabled on managed Redis: nothing to say
    if policy not in (None, "noeviction"):
        warnings.append(
            f"Redis maxmemory-policy is {policy!r}: under memory pressure it may evict queued jobs, "
            "leases or provider state; set it to 'noeviction'"
        )
    return warnings
