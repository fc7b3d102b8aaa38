"""Redis clients with timeouts and retries suited to a request path.

Both take a URL (standalone Redis) or the ``redis`` section of the config, which may
name a Redis Cluster or Sentinel: then they connect to wherever the locator of
``dispatcher.redis_topology`` says the primary serving ``{iop}`` is, and ask again when
Redis says it moved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.connection import Connection, SSLConnection, parse_url
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ConnectionError,
    MasterDownError,
    MovedError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    TryAgainError,
)

from dispatcher.config import RedisConfig
from dispatcher.fastredis import FastRedis
from dispatcher.redis_topology import DEFAULT_URL, Locator, data_url, locator_for

# How Redis 6.2 reports a script's write on a replica, inside "ERR Error running script".
SCRIPT_READONLY = "-READONLY "

# Longest server-side block of an XREAD/XREADGROUP; must stay below SOCKET_TIMEOUT_S.
BLOCK_MS = 2_000
SOCKET_TIMEOUT_S = 5.0

__all__ = ["BLOCK_MS", "DEFAULT_URL", "SOCKET_TIMEOUT_S", "LocatedConnection", "LocatedSSLConnection",
           "blocking_timeout", "connect", "connect_fast", "server_warnings"]


@dataclass(frozen=True, slots=True)
class Clients:
    """The three clients of an iop process, made alike by the API and the worker."""

    control: Redis  # redis-py: everything off the request path (pub/sub included)
    fast: FastRedis  # the request path's scripts and appends
    blocking: FastRedis  # XREAD/XREADGROUP BLOCK holds its connection until entries come

    @classmethod
    def open(cls, redis: RedisConfig) -> Clients:
        # One locator for the three: a failover one of them notices moves them all, and a
        # process discovers its primary once, not once per client.
        locator = locator_for(redis) if redis.cluster or redis.sentinel else None
        return cls(connect(redis, locator=locator), connect_fast(redis, locator=locator),
                   connect_fast(redis, locator=locator))

    async def aclose(self) -> None:
        await self.blocking.close()
        await self.fast.close()
        await self.control.aclose()


def connect(redis: str | RedisConfig | None, *, max_connections: int = 256, locator: Locator | None = None) -> Redis:
    """A client that fails fast when Redis is away and retries briefly on a dropped connection.

    Every script iop calls is safe to run twice (``submit`` answers 'duplicate' for a
    job id it has seen, the others are idempotent), so a retry after a lost reply
    cannot double a decision.
    """
    config = _config(redis)
    common: dict[str, Any] = {
        "socket_connect_timeout": 1.0,
        "socket_timeout": SOCKET_TIMEOUT_S,
        "socket_keepalive": True,
        "max_connections": max_connections,
        # Under a burst, wait for a free connection instead of failing the request.
        "timeout": SOCKET_TIMEOUT_S,
    }
    if not (config.cluster or config.sentinel):
        pool = BlockingConnectionPool.from_url(
            config.url or DEFAULT_URL, retry=Retry(ExponentialBackoff(cap=0.2, base=0.01), retries=2), **common
        )
        return Redis.from_pool(pool)
    options: dict[str, Any] = dict(parse_url(data_url(config)))
    options.pop("host", None)
    options.pop("port", None)
    tls = options.pop("connection_class", None) is SSLConnection
    pool = BlockingConnectionPool(
        connection_class=LocatedSSLConnection if tls else LocatedConnection,
        locator=locator or locator_for(config),
        # A moved primary costs a rediscovery and a reconnection; a failover or a busy slot
        # (TRYAGAIN, CLUSTERDOWN) takes longer, so back off a little further than standalone.
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=4),
        **common,
        **options,
    )
    return Redis.from_pool(pool)


def connect_fast(redis: str | RedisConfig | None, *, locator: Locator | None = None) -> FastRedis:
    """The lean client of the request path (``dispatcher.fastredis``)."""
    config = _config(redis)
    if not (config.cluster or config.sentinel):
        return FastRedis(config.url or DEFAULT_URL, connect_timeout=1.0, command_timeout=SOCKET_TIMEOUT_S)
    return FastRedis(data_url(config), connect_timeout=1.0, command_timeout=SOCKET_TIMEOUT_S,
                     locator=locator or locator_for(config))


def _config(redis: str | RedisConfig | None) -> RedisConfig:
    return redis if isinstance(redis, RedisConfig) else RedisConfig(url=redis)


class LocatedConnection(Connection):
    """A pooled redis-py connection to the primary the locator names.

    A reply saying the primary is elsewhere becomes a ConnectionError: the command did not
    run, the client's Retry reconnects (asking the locator again) and sends it once more,
    and callers that give up see the same error class as for a Redis that is down.
    """

    def __init__(self, *, locator: Locator, **kwargs: Any) -> None:
        self.locator = locator
        # The locator's generation this connection's address came from.
        self.located_generation = -1
        super().__init__(**kwargs)

    async def connect(self) -> None:
        # The pool hands out idle connections as they are: drop one made before the primary moved.
        if self.is_connected and self.located_generation != self.locator.generation:
            await self.disconnect()
        await super().connect()  # type: ignore[no-untyped-call]

    async def _connect(self) -> None:
        address = await self.locator.primary()
        self.host, self.port = address
        self.located_generation = self.locator.generation
        try:
            await super()._connect()  # type: ignore[no-untyped-call]
        except (OSError, TimeoutError):
            self.locator.invalidate(address)
            raise

    async def read_response(
        self,
        disable_decoding: bool = False,
        timeout: float | None = None,  # noqa: ASYNC109  # redis-py's signature
        *,
        disconnect_on_error: bool = True,
        push_request: bool | None = False,
    ) -> Any:
        try:
            return await super().read_response(
                disable_decoding, timeout, disconnect_on_error=disconnect_on_error, push_request=push_request
            )
        except ResponseError as exc:
            moved = await self._moved(exc)
            if moved is None:
                raise
            raise moved from exc

    async def _moved(self, exc: ResponseError) -> ConnectionError | None:
        """The error to retry on when ``exc`` means the command did not run because of the
        topology (after forgetting the primary if it moved), else None."""
        where = f"{self.host}:{self.port}"
        # MovedError before AskError, its base; Redis 6.2 reports a script's READONLY inside its error.
        if isinstance(exc, MovedError | ReadOnlyError | MasterDownError) or SCRIPT_READONLY in str(exc):
            moved_to = (exc.host, int(exc.port)) if isinstance(exc, MovedError) and exc.host else None
            self.locator.invalidate((self.host, self.port), moved_to=moved_to)
            await self.disconnect(nowait=True)
            return ConnectionError(f"Redis at {where} no longer serves iop's keys: {exc}")
        if isinstance(exc, AskError | TryAgainError | ClusterDownError):
            # The slot is migrating or the cluster is electing a master: try again shortly.
            await self.disconnect(nowait=True)
            return ConnectionError(f"Redis Cluster at {where} is busy: {exc}")
        return None


class LocatedSSLConnection(LocatedConnection, SSLConnection):
    pass


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
