"""A lean Redis client for the request path.

Measured with ``bench/redis_client.py`` (docs/BENCHMARKS.md, "Redis client"): an EVALSHA
of a script that returns at once costs 162 µs of client CPU through redis-py's asyncio
client one call at a time, and 149 µs per call with 32 callers at once; through this
client 85 µs and 16 µs (the 32 callers share writes, see auto-pipelining below). Every
request makes several Redis calls on its path, so that difference is a large part of the
CPU the API and the workers spend per request.

What it does, and nothing more:

* one TCP (or TLS, or unix) connection, opened on first use and again after a loss;
* replies parsed by hiredis and matched to requests in order;
* **auto-pipelining**: every command issued during one turn of the event loop goes out
  in a single write, so concurrent requests share round trips and syscalls;
* errors are redis-py's exception classes (``ConnectionError``, ``TimeoutError``,
  ``ResponseError``, ``NoScriptError``), so callers handle both clients alike;
* a command that times out, or a lost connection, fails every command in flight on that
  connection (a reply can no longer be matched to its request); the next call reconnects,
  and callers that come while it does share its outcome rather than each trying in turn;
* ``LOADING`` (a restarted Redis reading its data) is ``BusyLoadingError``, a
  ``ConnectionError``, as in redis-py: the command did not run;
* with a locator (``dispatcher.redis_topology``: Redis Cluster or Sentinel) it connects to
  the primary the locator names, and a command Redis refuses because the primary is
  elsewhere (``MOVED``, ``READONLY``, ``ASK``) or busy (``TRYAGAIN``, ``CLUSTERDOWN``) did
  not run, so it is sent again where and when it can run. Only error replies are looked at:
  the common path is the same as without a locator.

Blocking reads (``XREAD BLOCK``) hold a connection until they return: give them a client
of their own. Everything that is not on the request path keeps using redis-py.
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import ssl
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import hiredis
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection, parse_url
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    ConnectionError,
    NoScriptError,
    ResponseError,
    TimeoutError,
)

if TYPE_CHECKING:
    from dispatcher.redis_topology import Address, Locator

Arg = bytes | str | int | float

# Error replies meaning the command did not run because of the topology (see _follow).
_ELSEWHERE = ("MOVED ", "READONLY", "MASTERDOWN")
_ASK = "ASK "
_BUSY = ("TRYAGAIN", "CLUSTERDOWN")
_TOPOLOGY = (*_ELSEWHERE, _ASK, *_BUSY)
# Redis 6.2 wraps a script's first failed write: "ERR Error running script ...: -READONLY ...".
_SCRIPT_READONLY = "-READONLY "
# Redirections one command follows before the topology is taken to be broken.
MAX_REDIRECTS = 3


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self._reader = hiredis.Reader(replyError=ResponseError)
        self._waiters: collections.deque[asyncio.Future[Any]] = collections.deque()
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self._transport: asyncio.Transport | None = None
        self.lost: BaseException | None = None
        self._loop = asyncio.get_running_loop()
        self.address: Address | None = None  # None: a unix socket

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, though they are one.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        waiters = self._waiters
        while True:
            try:
                reply = self._reader.gets()
            except hiredis.ProtocolError as exc:
                self.fail(ConnectionError(f"Redis protocol error: {exc}"))
                return
            if reply is False:
                return
            if not waiters:
                self.fail(ConnectionError("Redis sent a reply nobody asked for"))
                return
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail_waiters(ConnectionError(f"Connection to Redis lost: {exc or 'closed by the server'}"))

    def send(self, args: Sequence[Arg]) -> asyncio.Future[Any]:
        if self.lost is not None:
            raise ConnectionError(f"Connection to Redis lost: {self.lost}")
        waiter = self._loop.create_future()
        self._waiters.append(waiter)
        self._out.append(hiredis.pack_command(tuple(args)))  # type: ignore[arg-type]  # stub: 1-tuple
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)
        return waiter

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._out and self._transport is not None and self.lost is None:
            self._transport.write(b"".join(self._out))
        self._out.clear()

    def retire(self, grace: float) -> None:
        """Send nothing more here, but let the replies already asked for arrive (within ``grace``)."""
        exc = ConnectionError("Redis said the primary is elsewhere")
        if self._waiters:
            self._loop.call_later(grace, self.fail, exc)
        else:
            self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        """Give up on this connection: close it and fail what waits on it."""
        self._fail_waiters(exc)
        if self._transport is not None:
            self._transport.abort()

    def _fail_waiters(self, exc: BaseException) -> None:
        if self.lost is None:
            self.lost = exc
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(exc)
                # Marked as seen: a caller may no longer be listening (the rest of a pipeline
                # after its first failure, a command sent after ASKING), and asyncio would log
                # "Future exception was never retrieved" for each. One that awaits still gets it.
                waiter.exception()


class FastRedis:
    def __init__(
        self, url: str, *, connect_timeout: float = 1.0, command_timeout: float = 5.0, locator: Locator | None = None
    ) -> None:
        """``url`` gives the address (unless a locator does), TLS, credentials and db."""
        self.url = url
        self.connect_timeout = connect_timeout
        self.command_timeout = command_timeout
        self._options = parse_url(url)
        self._home: Address | None = (
            None if self._options.get("connection_class") is UnixDomainSocketConnection
            else (self._options.get("host", "localhost"), self._options.get("port", 6379))
        )
        # None when the address never changes: then nothing is ever asked of it.
        self._locator = locator if locator is not None and locator.dynamic else None
        self._proto: _Protocol | None = None
        # The connection attempt under way, which every caller arriving meanwhile awaits.
        self._connecting: asyncio.Future[_Protocol] | None = None

    async def _connection(self) -> _Protocol:
        proto = self._proto
        if proto is not None and proto.lost is None:
            return proto
        # Shared, failure included: while Redis is away, callers queued one behind the other
        # would each wait out a connect timeout (or a discovery) of their own.
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._reconnect())
            self._connecting.add_done_callback(_retrieve)
        return await asyncio.shield(self._connecting)

    async def _reconnect(self) -> _Protocol:
        try:
            if self._locator is not None and self._proto is not None:
                # A lost connection may be a failover: the primary may be elsewhere now.
                self._locator.invalidate(self._proto.address)
            self._proto = await self._connect()
            return self._proto
        finally:
            self._connecting = None

    async def _connect(self) -> _Protocol:
        if self._locator is None:
            return await self._open(self._home)
        address = await self._locator.primary()
        try:
            return await self._open(address)
        except (ConnectionError, TimeoutError):
            self._locator.invalidate(address)
            raise

    async def _open(self, address: Address | None) -> _Protocol:
        """A connection to ``address`` (None: the URL's unix socket), authenticated, its db selected."""
        opts: dict[str, Any] = dict(self._options)
        loop = asyncio.get_running_loop()
        where = opts.get("path") if address is None else f"{address[0]}:{address[1]}"
        try:
            async with asyncio.timeout(self.connect_timeout):
                if address is None:
                    _, proto = await loop.create_unix_connection(_Protocol, opts["path"])
                else:
                    context = _ssl_context(opts) if opts.get("connection_class") is SSLConnection else None
                    _, proto = await loop.create_connection(_Protocol, address[0], address[1], ssl=context)
                    proto.address = address
                if opts.get("password"):
                    auth = [opts["username"], opts["password"]] if opts.get("username") else [opts["password"]]
                    reply = await proto.send(["AUTH", *auth])
                    if isinstance(reply, ResponseError):
                        proto.fail(AuthenticationError(str(reply)))
                        raise AuthenticationError(str(reply))
                if opts.get("db"):
                    reply = await proto.send(["SELECT", opts["db"]])
                    if isinstance(reply, ResponseError):
                        proto.fail(ConnectionError(str(reply)))
                        raise ResponseError(str(reply))
        except builtins.TimeoutError:
            raise TimeoutError(f"Timeout connecting to Redis at {where}") from None
        except OSError as exc:
            raise ConnectionError(f"Error connecting to Redis at {where}: {exc}") from None
        return proto

    async def execute(self, *args: Arg, reply_within: float | None = None) -> Any:
        proto = await self._connection()
        waiter = proto.send(args)
        try:
            async with asyncio.timeout(reply_within if reply_within is not None else self.command_timeout):
                reply = await waiter
        except builtins.TimeoutError:
            # The reply may still come; it could no longer be told apart from the next one.
            proto.fail(TimeoutError("Timeout reading from Redis"))
            raise TimeoutError(f"Timeout waiting for Redis to answer {args[0]!r}") from None
        if isinstance(reply, ResponseError):
            if self._locator is not None and _refusal(reply):
                reply = await self._follow(proto, args, reply, reply_within)
                if not isinstance(reply, ResponseError):
                    return reply
            if str(reply).startswith("NOSCRIPT"):
                raise NoScriptError(str(reply))
            if str(reply).startswith("LOADING"):
                raise BusyLoadingError(str(reply))
            raise reply
        return reply

    async def execute_many(self, commands: Sequence[Sequence[Arg]], reply_within: float | None = None) -> list[Any]:
        """Several commands in one write (one round trip); their replies, errors included as values."""
        proto = await self._connection()
        waiters = [proto.send(args) for args in commands]
        try:
            async with asyncio.timeout(reply_within if reply_within is not None else self.command_timeout):
                replies = [await waiter for waiter in waiters]
        except builtins.TimeoutError:
            proto.fail(TimeoutError("Timeout reading from Redis"))
            raise TimeoutError("Timeout waiting for Redis to answer a pipeline") from None
        if self._locator is not None:
            for i, reply in enumerate(replies):
                if isinstance(reply, ResponseError) and _refusal(reply):
                    replies[i] = await self._follow(proto, commands[i], reply, reply_within)
        return replies

    async def _follow(self, proto: _Protocol, args: Sequence[Arg], reply: ResponseError,
                      reply_within: float | None) -> Any:
        """Send again a command Redis refused because of the topology (so it did not run): to
        the new primary after MOVED or READONLY, to the importing node once after ASK, after a
        short pause for TRYAGAIN or CLUSTERDOWN. Returns the first reply that is not such a
        refusal; raises ConnectionError when redirections go on or the time is up."""
        assert self._locator is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (reply_within if reply_within is not None else self.command_timeout)
        redirects, pause = 0, 0.02
        while True:
            kind, message = _refusal(reply), str(reply)
            if kind == "busy":
                if loop.time() + pause > deadline:
                    raise ConnectionError(f"Redis Cluster stayed busy: {message}")
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.5)
            elif kind == "ask" and (target := _address_in(message)) is not None:
                # Not counted: the importing node serves it or answers TRYAGAIN, which pauses.
                reply = await self._asking(target, args, deadline - loop.time())
                continue
            elif kind is not None:
                redirects += 1
                if redirects > MAX_REDIRECTS:
                    raise ConnectionError(f"Redis redirected {args[0]!r} {MAX_REDIRECTS} times, last: {message}")
                self._locator.invalidate(proto.address, moved_to=_address_in(message) if kind == "moved" else None)
                if self._proto is proto:
                    self._proto = None
                proto.retire(self.command_timeout)
            else:
                return reply
            proto = await self._connection()
            waiter = proto.send(args)
            try:
                async with asyncio.timeout(max(deadline - loop.time(), 0.001)):
                    reply = await waiter
            except builtins.TimeoutError:
                proto.fail(TimeoutError("Timeout reading from Redis"))
                raise TimeoutError(f"Timeout waiting for Redis to answer {args[0]!r}") from None
            if not isinstance(reply, ResponseError):
                return reply

    async def _asking(self, target: Address, args: Sequence[Arg], within: float) -> Any:
        """ASK: the slot is being migrated and the key is already at ``target``. A connection
        of its own, since ASKING holds for the next command only; this lasts as long as a
        resharding of the one slot iop uses."""
        proto = await self._open(target)
        try:
            asking, waiter = proto.send(["ASKING"]), proto.send(args)
            async with asyncio.timeout(max(within, 0.001)):
                await asking
                return await waiter
        except builtins.TimeoutError:
            raise TimeoutError(f"Timeout waiting for Redis to answer {args[0]!r}") from None
        finally:
            proto.fail(ConnectionError("closed after ASK"))

    async def evalsha(
        self, sha: str, source: str, keys: Sequence[Arg], args: Sequence[Arg], reply_within: float | None = None
    ) -> Any:
        """Run a script by SHA, sending its source once if the server does not have it."""
        try:
            return await self.execute("EVALSHA", sha, len(keys), *keys, *args, reply_within=reply_within)
        except NoScriptError:
            return await self.execute("EVAL", source, len(keys), *keys, *args, reply_within=reply_within)

    async def close(self) -> None:
        if self._proto is not None:
            self._proto.fail(ConnectionError("client closed"))
            self._proto = None


def _retrieve(future: asyncio.Future[_Protocol]) -> None:
    # Its callers may all have been cancelled: a failure nobody awaits is not worth a log line.
    if not future.cancelled():
        future.exception()


def _refusal(reply: BaseException) -> str | None:
    """Which refusal by the topology an error reply is: moved, ask, elsewhere (this node is
    no longer the primary), busy; None for any other error."""
    message = str(reply)
    if message.startswith(_TOPOLOGY):
        if message.startswith("MOVED "):
            return "moved"
        if message.startswith(_ASK):
            return "ask"
        return "busy" if message.startswith(_BUSY) else "elsewhere"
    return "elsewhere" if _SCRIPT_READONLY in message else None


def _address_in(message: str) -> Address | None:
    """The ``host:port`` ending a MOVED or ASK reply (None if it names no host)."""
    host, _, port = message.rpartition(" ")[2].rpartition(":")
    return (host, int(port)) if host and port.isdigit() else None


def _ssl_context(opts: dict[str, Any]) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=opts.get("ssl_ca_certs"))
    reqs = str(opts.get("ssl_cert_reqs", "required")).lower()
    if reqs in ("none", "optional"):
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE if reqs == "none" else ssl.CERT_OPTIONAL
    if opts.get("ssl_certfile"):
        context.load_cert_chain(opts["ssl_certfile"], opts.get("ssl_keyfile"))
    return context
