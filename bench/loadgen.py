"""A closed-loop HTTP/1.1 load generator that costs its host little CPU.

The throughput benchmark's load generator shares the machine's two cores with every process
it measures, so whatever it spends per request is taken from them. aiohttp's client spends
about 0.14 ms per JSON request here; this one sends a pre-built request on a kept-alive
connection and parses the answer with httptools (llhttp, in C: the parser uvicorn uses),
which costs several times less. It checks what a client must: the status, the whole body
(``Content-Length`` or chunked, a stream's chunks included), and a connection kept alive.
"""

from __future__ import annotations

import asyncio
import time
from typing import cast
from urllib.parse import urlsplit

import httptools


class _Connection(asyncio.Protocol):
    """One kept-alive connection: a request at a time, its answer read to the end."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.answered: asyncio.Future[int] | None = None
        self.lost: BaseException | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport instances, but have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(exc)

    def on_message_complete(self) -> None:
        if self.answered is not None and not self.answered.done():
            self.answered.set_result(self.parser.get_status_code())

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc or ConnectionError("the server closed the connection")
        self._fail(self.lost)

    def _fail(self, exc: BaseException) -> None:
        if self.answered is not None and not self.answered.done():
            self.answered.set_exception(exc)

    async def request(self, data: bytes) -> int:
        if self.lost is not None or self.transport is None:
            raise ConnectionError("the connection is closed")
        self.answered = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return await self.answered


def request_bytes(url: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    """A POST of ``body`` (JSON) to ``url``, as it goes on the wire."""
    parts = urlsplit(url)
    head = [f"POST {parts.path or '/'} HTTP/1.1", f"Host: {parts.netloc}", "Content-Type: application/json",
            f"Content-Length: {len(body)}"]
    head += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def closed_loop(url: str, body: bytes, clients: int, seconds: float) -> tuple[int, float]:
    """``clients`` connections, each sending its next request as soon as the last is answered,
    for ``seconds``: the requests answered (each a 200) and the seconds they took."""
    parts = urlsplit(url)
    loop = asyncio.get_running_loop()
    data = request_bytes(url, body)
    connections = [
        (await loop.create_connection(_Connection, parts.hostname or "127.0.0.1", parts.port or 80))[1]
        for _ in range(clients)
    ]
    done = 0
    stop_at = 0.0

    async def client(connection: _Connection) -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            status = await connection.request(data)
            if status != 200:
                raise RuntimeError(f"status {status}")
            done += 1

    try:
        stop_at = time.perf_counter() + seconds
        started = time.perf_counter()
        await asyncio.gather(*(client(c) for c in connections))
        return done, time.perf_counter() - started
    finally:
        for connection in connections:
            if connection.transport is not None:
                connection.transport.close()
