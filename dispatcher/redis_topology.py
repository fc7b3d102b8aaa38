"""Where the Redis primary serving iop's keys is: standalone, Redis Cluster or Sentinel.

Every iop key carries the hash tag ``{iop}`` (``dispatcher.keys``), so in a Redis Cluster
iop only ever talks to the one master serving that slot, and under Sentinel to the one
master of the group. A cluster-aware client would add a slot lookup to every command;
instead both clients connect to the address a *locator* gives them and ask it again
(``invalidate``) when Redis says the primary moved: a connection refused or lost,
``MOVED``, ``READONLY`` (a demoted master).

Discovery opens short-lived connections with short timeouts and the data connection's
TLS settings and credentials (sentinels have their own password, if any).
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
import re
from typing import Any, ClassVar
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from redis.asyncio.connection import Connection, parse_url
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import ConnectionError, NoPermissionError, RedisError

from dispatcher import keys
from dispatcher.config import RedisConfig, host_port

log = logging.getLogger("iop.redis")

Address = tuple[str, int]

DEFAULT_URL = "redis://127.0.0.1:6379/0"
# The Redis Cluster slot of every iop key.
IOP_SLOT = key_slot(keys.PREFIX.encode())
# Per discovery connection: connect, and then each reply.
DISCOVERY_TIMEOUT_S = 0.5


class Locator(abc.ABC):
    """The address of the primary, discovered on first use and cached until ``invalidate``."""

    # False: the address never changes, so clients need not ask again (standalone).
    dynamic: ClassVar[bool] = True

    def __init__(self) -> None:
        # Bumped by every invalidation: a pooled connection made before it is stale.
        self.generation = 0
        self._address: Address | None = None
        self._discovery: asyncio.Future[Address] | None = None

    async def primary(self) -> Address:
        if self._address is not None:
            return self._address
        # Callers arriving during a discovery share it rather than each asking every node.
        if self._discovery is None:
            self._discovery = asyncio.ensure_future(self._discover_and_keep())
            self._discovery.add_done_callback(_retrieve)
        return await asyncio.shield(self._discovery)

    async def _discover_and_keep(self) -> Address:
        try:
            address = await self._discover()
        finally:
            self._discovery = None
        self._address = address
        return address

    def invalidate(self, failed: Address | None = None, *, moved_to: Address | None = None) -> None:
        """Forget the primary. With ``failed``, only if that is still the one believed in, so a
        burst of failures of one old connection costs one discovery; ``moved_to`` is where a
        Redis Cluster node said the slot went (``MOVED``), taken without asking again."""
        if failed is not None and failed != self._address:
            return
        self._address = moved_to
        self.generation += 1

    @abc.abstractmethod
    async def _discover(self) -> Address: ...


def _retrieve(future: asyncio.Future[Address]) -> None:
    # Every caller may have been cancelled: mark a failure as seen so asyncio does not log it.
    if not future.cancelled():
        future.exception()


class StaticLocator(Locator):
    """A standalone Redis: the address of the URL, always."""

    dynamic = False

    def __init__(self, address: Address) -> None:
        super().__init__()
        self._address = self._static = address

    def invalidate(self, failed: Address | None = None, *, moved_to: Address | None = None) -> None:
        pass

    async def _discover(self) -> Address:
        return self._static


class ClusterLocator(Locator):
    """The master serving slot ``IOP_SLOT``, from ``CLUSTER SLOTS`` of the seed or of any node
    learnt from an earlier answer (so the seed itself may be gone later)."""

    def __init__(self, seed: Address, probe: Probe) -> None:
        super().__init__()
        # Insertion order is asking order; a node that does not answer moves to the back.
        self._nodes: dict[Address, None] = {seed: None}
        self._probe = probe

    @property
    def nodes(self) -> list[Address]:
        return list(self._nodes)

    async def _discover(self) -> Address:
        tried: list[str] = []
        for node in list(self._nodes):
            try:
                slots = await self._probe.run(node, "CLUSTER", "SLOTS")
            except RedisError as exc:
                self._nodes.pop(node)
                self._nodes[node] = None
                tried.append(f"{_fmt(node)}: {exc}")
                continue
            owner = self._learn(node, slots)
            if owner is not None:
                return owner
            tried.append(f"{_fmt(node)}: no master serves the slot")
        raise ConnectionError(
            f"no Redis Cluster node says which master serves {keys.PREFIX} (slot {IOP_SLOT}); "
            f"asked {'; '.join(tried)}"
        )

    def _learn(self, asked: Address, slots: list[Any]) -> Address | None:
        owner: Address | None = None
        for start, end, *nodes in slots:
            addresses = [a for a in (_node_address(n, asked) for n in nodes) if a is not None]
            for address in addresses:
                self._nodes.setdefault(address, None)
            if int(start) <= IOP_SLOT <= int(end) and addresses:
                owner = addresses[0]  # the master comes first, then its replicas
        return owner


def _node_address(node: list[Any], asked: Address) -> Address | None:
    host = node[0].decode() if isinstance(node[0], bytes) else str(node[0])
    if host == "?":  # Redis 7: the node does not know its endpoint
        return None
    # An empty host means "the one you asked" (a node that does not know its own address).
    return (host or asked[0], int(node[1]))


class SentinelLocator(Locator):
    """The master Sentinel names for ``master``, asking each sentinel in turn; ``ROLE`` on
    that address confirms it is still a master (not one demoted since the sentinel looked)."""

    def __init__(self, master: str, sentinels: list[Address], sentinel_probe: Probe, data_probe: Probe) -> None:
        super().__init__()
        self.master = master
        self._sentinels = list(sentinels)
        self._sentinel_probe = sentinel_probe
        self._data_probe = data_probe

    async def _discover(self) -> Address:
        tried: list[str] = []
        for sentinel in list(self._sentinels):
            where = f"sentinel {_fmt(sentinel)}"
            try:
                reply = await self._sentinel_probe.run(sentinel, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.master)
            except RedisError as exc:
                tried.append(f"{where}: {exc}")
                continue
            if not reply:
                tried.append(f"{where}: does not know master {self.master!r}")
                continue
            address = (reply[0].decode(), int(reply[1]))
            problem = await self._not_a_master(address)
            if problem:
                tried.append(f"{where}: named {_fmt(address)}, which {problem}")
                continue
            # Ask the one that answered first next time.
            self._sentinels.remove(sentinel)
            self._sentinels.insert(0, sentinel)
            return address
        raise ConnectionError(f"no sentinel names a reachable master {self.master!r}; asked {'; '.join(tried)}")

    async def _not_a_master(self, address: Address) -> str | None:
        try:
            role = await self._data_probe.run(address, "ROLE")
        except NoPermissionError:
            return None  # an ACL user without ROLE: take the sentinel's word
        except RedisError as exc:
            return f"did not answer ({exc})"
        return None if role[0] == b"master" else f"is a {role[0].decode()}"


class Probe:
    """Runs one command on one node over a connection of its own, with short timeouts."""

    def __init__(self, options: dict[str, Any]) -> None:
        self._options = dict(options)
        self._class: type[Connection] = self._options.pop("connection_class", Connection)
        for name in ("host", "port", "db", "path"):
            self._options.pop(name, None)

    async def run(self, address: Address, *args: str) -> Any:
        conn = self._class(
            **self._options,
            host=address[0],
            port=address[1],
            socket_connect_timeout=DISCOVERY_TIMEOUT_S,
            socket_timeout=DISCOVERY_TIMEOUT_S,
            retry=Retry(NoBackoff(), 0),
            driver_info=None,  # no CLIENT SETINFO: discovery is a round trip shorter
        )
        try:
            await conn.connect()  # type: ignore[no-untyped-call]
            await conn.send_command(*args)
            return await conn.read_response()
        finally:
            await conn.disconnect()


def data_url(config: RedisConfig) -> str:
    """The URL data connections use: TLS, credentials and db. Under Sentinel its host is a
    placeholder, and ``sentinel.username`` / ``sentinel.password_env`` give the credentials."""
    url = config.url or DEFAULT_URL
    sentinel = config.sentinel
    if sentinel is None:
        return url
    parts = urlsplit(url)
    username = sentinel.username or unquote(parts.username or "")
    password = _env(sentinel.password_env, "password_env") if sentinel.password_env else unquote(parts.password or "")
    userinfo = quote(username, safe="")
    if password:
        userinfo += ":" + quote(password, safe="")
    # The host is a placeholder: the locator says where the master is.
    netloc = f"{userinfo}@localhost" if userinfo else "localhost"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def described(config: RedisConfig) -> str:
    """Which Redis ``config`` names, and where its URL comes from, for a line of a process's
    log at start: never a password (the URL's, or one in its query, shows as ``***``)."""
    env = os.environ.get("IOP_REDIS_URL")
    source = "IOP_REDIS_URL" if env and env == config.url else "redis.url"
    url = shown_url(config.url) if config.url else None
    if config.sentinel is not None:
        sentinel = config.sentinel
        where = f"the master {sentinel.master!r} of the sentinels {', '.join(sentinel.nodes)} (redis.sentinel)"
        return where + (f", with the db, TLS and credentials of {url} ({source})" if url else "")
    if url is None:
        return f"{DEFAULT_URL}, the default: neither IOP_REDIS_URL nor redis.url is set"
    return f"the Redis Cluster of {url} ({source}, redis.cluster)" if config.cluster else f"{url} ({source})"


def shown_url(url: str) -> str:
    """``url`` with its password, if any, as ``***``."""
    parts = urlsplit(url)
    if parts.password is not None:
        userinfo, _, host = parts.netloc.rpartition("@")
        url = url.replace(parts.netloc, f"{userinfo.partition(':')[0]}:***@{host}", 1)
    return re.sub(r"(?i)([?&]password=)[^&#]*", r"\1***", url)


def locator_for(config: RedisConfig) -> Locator:
    options: dict[str, Any] = dict(parse_url(data_url(config)))
    if config.sentinel is not None:
        sentinel = config.sentinel
        sentinel_options = {k: v for k, v in options.items() if k not in ("username", "password")}
        if sentinel.sentinel_password_env:
            sentinel_options["password"] = _env(sentinel.sentinel_password_env, "sentinel_password_env")
        return SentinelLocator(sentinel.master, [host_port(n) for n in sentinel.nodes],
                               Probe(sentinel_options), Probe(options))
    if options.get("path"):
        if config.cluster:
            raise ValueError("a Redis Cluster is reached over TCP: redis.url must be redis:// or rediss://")
        return StaticLocator((str(options["path"]), 0))
    address = (str(options.get("host", "localhost")), int(options.get("port", 6379)))
    return ClusterLocator(address, Probe(options)) if config.cluster else StaticLocator(address)


def _env(name: str, field: str) -> str:
    value = os.environ.get(name)
    if value is None:
        log.warning("redis.sentinel.%s names %s, which is not set: connecting without a password", field, name)
        return ""
    return value


def _fmt(address: Address) -> str:
    return f"{address[0]}:{address[1]}"

