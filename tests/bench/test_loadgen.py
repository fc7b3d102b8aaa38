"""bench/loadgen.py: the throughput benchmark's load generator, against a real aiohttp server.
What it counts must be whole answers (a JSON body by its length, a stream to its last chunk),
and a failed request must stop the run rather than be counted or lost."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from bench.loadgen import closed_loop, request_bytes
from iop.redis_server import free_port

pytestmark = pytest.mark.anyio

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Serve = Callable[[Handler], Awaitable[str]]


class Server:
    def __init__(self) -> None:
        self.received: list[bytes] = []
        self.answered = 0


async def started(handler: Handler) -> tuple[web.AppRunner, str]:
    """An aiohttp server answering POST /v1/chat/completions with ``handler``, and its URL."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}/v1/chat/completions"


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    runners: list[web.AppRunner] = []

    async def start(handler: Handler) -> str:
        runner, url = await started(handler)
        runners.append(runner)
        return url

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_json_answers_are_counted_once_each_over_kept_alive_connections(serve: Serve) -> None:
    server = Server()
    peers: set[int] = set()

    async def handler(request: web.Request) -> web.StreamResponse:
        server.received.append(await request.read())
        transport = request.transport
        assert transport is not None
        peers.add(transport.get_extra_info("peername")[1])
        server.answered += 1
        return web.json_response({"id": "x", "choices": []})

    url = await serve(handler)
    done, elapsed = await closed_loop(url, b'{"model": "m"}', clients=3, seconds=0.3)
    assert done == server.answered > 3
    assert set(server.received) == {b'{"model": "m"}'}
    assert len(peers) == 3  # one connection per client, kept alive
    assert elapsed >= 0.3


async def test_a_chunked_stream_counts_once_it_has_ended(serve: Serve) -> None:
    server = Server()

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(20):
            await response.write(b"data: {\"i\": %d}\n\n" % i)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        server.answered += 1
        return response

    url = await serve(handler)
    done, _ = await closed_loop(url, b"{}", clients=2, seconds=0.3)
    assert done == server.answered > 2


async def test_an_error_status_stops_the_run(serve: Serve) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.json_response({"error": {"message": "no"}}, status=503)

    url = await serve(handler)
    with pytest.raises(RuntimeError, match="status 503"):
        await closed_loop(url, b"{}", clients=2, seconds=0.3)


async def test_a_connection_the_server_closes_stops_the_run(serve: Serve) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        transport = request.transport
        assert transport is not None
        transport.close()
        return web.Response()

    url = await serve(handler)
    with pytest.raises(ConnectionError):
        await closed_loop(url, b"{}", clients=1, seconds=0.3)


def test_the_request_names_its_length_and_host() -> None:
    data = request_bytes("http://127.0.0.1:8123/v1/chat/completions", b'{"a": 1}', {"Authorization": "Bearer k"})
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.split(b"\r\n") == [b"POST /v1/chat/completions HTTP/1.1", b"Host: 127.0.0.1:8123",
                                   b"Content-Type: application/json", b"Content-Length: 8",
                                   b"Authorization: Bearer k"]
    assert body == b'{"a": 1}'


def test_it_runs_on_uvloop_as_the_benchmark_does() -> None:
    # bench/throughput.py installs uvloop, whose transports are not asyncio.Transport instances.
    import uvloop

    async def run() -> tuple[int, int]:
        answered = 0

        async def handler(request: web.Request) -> web.StreamResponse:
            nonlocal answered
            await request.read()
            answered += 1
            return web.json_response({})

        runner, url = await started(handler)
        try:
            done, _ = await closed_loop(url, b"{}", 2, 0.2)
        finally:
            await runner.cleanup()
        return done, answered

    done, answered = uvloop.run(run())
    assert done == answered > 2
