"""Whether the Redis of a config answers, asked once as ``iop up``, ``iop api`` or ``iop worker``
starts: a Redis that is not there at start is a mistake in the URL or a server not started,
which one line says better than the retries and warnings a process makes of a Redis that went
away while it ran (those stay as they are: this check runs at start only)."""

from __future__ import annotations

import asyncio

from redis.exceptions import AuthenticationError, RedisError, ResponseError

from dispatcher.config import RedisConfig
from dispatcher.redis_conn import connect
from dispatcher.redis_topology import DEFAULT_URL, described, shown_url

# A Redis started at the same moment as iop (a script, a unit file) has this long to answer.
START_WAIT_S = 3.0
RETRY_S = 0.2


def where(redis: RedisConfig) -> str:
    """The Redis ``redis`` names, for a message: its URL (no password), or its sentinels."""
    return described(redis) if redis.sentinel is not None else shown_url(redis.url or DEFAULT_URL)


def unreachable(redis: RedisConfig, within_s: float = START_WAIT_S) -> str | None:
    """None when the Redis of ``redis`` answers a PING within ``within_s``; else the line to
    print: ``cannot reach Redis at <url>: <why>``."""
    why = asyncio.run(_ping(redis, within_s))
    return None if why is None else f"cannot reach Redis at {where(redis)}: {why}"


async def _ping(redis: RedisConfig, within_s: float) -> str | None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    try:
        client = connect(redis, max_connections=1)
    except (RedisError, ValueError) as exc:  # a URL redis-py cannot parse, a cluster over a socket
        return str(exc) or type(exc).__name__
    try:
        while True:
            try:
                await client.ping()
                return None
            except (AuthenticationError, ResponseError) as exc:
                return str(exc) or type(exc).__name__  # it answered: asking again changes nothing
            except (RedisError, OSError) as exc:
                if loop.time() >= deadline:
                    return str(exc) or type(exc).__name__
            await asyncio.sleep(RETRY_S)
    finally:
        await client.aclose()
