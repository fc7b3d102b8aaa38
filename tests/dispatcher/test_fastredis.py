"""The lean client's behaviour when Redis goes away, against stand-in servers that misbehave
on purpose: a connection dropped under a pipeline leaves no failure unretrieved (asyncio
would log "Future exception was never retrieved" for each), concurrent callers share one
reconnection attempt, and a Redis still loading its data is a connection-level failure."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from redis.exceptions import BusyLoadingError, ConnectionError

from dispatcher.fastredis import FastRedis
from iop.redis_server import free_port

pytestmark = pytest.mark.anyio


async def stand_in(answer: Callable[[bytes], bytes | None]) -> AsyncIterator[int]:
    """A TCP server on a free port: each chunk received gets ``answer(chunk)`` back, or the
    connection is closed when that is None."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            reply = answer(data)
            if reply is None:
                break
            writer.write(reply)
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    async with server:
        yield server.sockets[0].getsockname()[1]


@pytest.fixture
async def hangs_up() -> AsyncIterator[int]:
    """Reads the commands, answers nothing, closes the connection."""
    async for port in stand_in(lambda data: None):
        yield port


@pytest.fixture
async def loading() -> AsyncIterator[int]:
    """A Redis reading its AOF after a restart."""
    async for port in stand_in(lambda data: b"-LOADING Redis is loading the dataset in memory\r\n"):
        yield port


async def test_a_pipeline_whose_connection_drops_leaves_no_failure_unretrieved(hangs_up: int) -> None:
    loop = asyncio.get_running_loop()
    logged: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: logged.append(context))
    client = FastRedis(f"redis://127.0.0.1:{hangs_up}/0")
    try:
        with pytest.raises(ConnectionError):
            await client.execute_many([("GET", "a"), ("GET", "b"), ("GET", "c")])
        with pytest.raises(ConnectionError):
            await client.execute("GET", "d")
        gc.collect()  # a future's unretrieved failure is reported when it is collected
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
        await client.close()
    assert [c.get("message") for c in logged] == []


async def test_concurrent_callers_share_one_reconnection_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    client = FastRedis(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens: refused
    opened: list[Any] = []
    real_open = client._open

    async def counting_open(address: Any) -> Any:
        opened.append(address)
        await asyncio.sleep(0.05)  # as a connect timeout or a discovery would take a while
        return await real_open(address)

    monkeypatch.setattr(client, "_open", counting_open)
    results = await asyncio.gather(*(client.execute("PING") for _ in range(10)), return_exceptions=True)
    assert all(isinstance(r, ConnectionError) for r in results), results
    assert len(opened) == 1
    # The next call, after that attempt failed, tries again.
    with pytest.raises(ConnectionError):
        await client.execute("PING")
    assert len(opened) == 2


async def test_a_redis_loading_its_data_is_a_connection_failure(loading: int) -> None:
    client = FastRedis(f"redis://127.0.0.1:{loading}/0")
    try:
        with pytest.raises(BusyLoadingError):
            await client.execute("EVALSHA", "0" * 40, 0)
    finally:
        await client.close()
