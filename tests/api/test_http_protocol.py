"""api/http_protocol.py: uvicorn's httptools protocol with a bound on a request's head (431)
and on the time its head may take (408), against a real uvicorn server and raw sockets."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, cast

import pytest
import uvicorn

from api.http_protocol import limited_protocol
from dispatcher.config import ApiConfig
from iop.redis_server import free_port
from tests.waiting import eventually_sync

HOST = "127.0.0.1"
MAX_HEAD = 2_000
HEAD_TIMEOUT_S = 0.3  # short, so the test is quick; the client waits up to READ_S for the answer
READ_S = 20.0


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers 200 with the size of the body it read."""
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = str(size).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    chosen = free_port()
    api = ApiConfig(max_header_bytes=MAX_HEAD, header_timeout_s=HEAD_TIMEOUT_S)
    config = uvicorn.Config(app, host=HOST, port=chosen, http=cast(Any, limited_protocol(api)), lifespan="off",
                            log_level="warning", timeout_keep_alive=READ_S)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    eventually_sync(lambda: server.started, what="uvicorn started")
    yield chosen
    server.should_exit = True
    thread.join(10)


def connect(port: int) -> socket.socket:
    sock = socket.create_connection((HOST, port), timeout=READ_S)
    return sock


def request(path: str = "/", headers: dict[str, str] | None = None, body: bytes = b"") -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"host: {HOST}", f"content-length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 answer (status, headers, body by its content-length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in header_lines)}
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "closed inside the body"
        body += chunk
    return int(status_line.split()[1]), headers, body


def closed(sock: socket.socket) -> bool:
    """The server closed its end (everything it sent already read)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_request_within_the_limits_is_served_and_the_connection_kept(port: int) -> None:
    with connect(port) as sock:
        for _ in range(2):
            sock.sendall(request(body=b"hello"))
            status, headers, body = read_answer(sock)
            assert (status, body) == (200, b"5")
            assert headers.get("connection") != "close"


def test_a_body_larger_than_the_head_limit_is_not_counted_as_head(port: int) -> None:
    big = b"x" * (MAX_HEAD * 5)
    with connect(port) as sock:
        sock.sendall(request(body=big))
        status, _, body = read_answer(sock)
    assert (status, body) == (200, str(len(big)).encode())


def test_headers_over_the_limit_get_431_and_the_connection_closes(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(request(headers={"x-padding": "p" * (MAX_HEAD + 1)}))
        status, headers, body = read_answer(sock)
        assert status == 431
        assert headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "headers_too_large"
        assert closed(sock)


def test_headers_over_the_limit_in_pieces_get_431_too(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nhost: x\r\n")
        for _ in range(MAX_HEAD // 100 + 1):
            sock.sendall(b"x-piece: " + b"p" * 90 + b"\r\n")
        status, _, body = read_answer(sock)
        assert status == 431
        assert json.loads(body)["error"]["code"] == "headers_too_large"


def test_a_head_that_never_completes_gets_408_and_the_connection_closes(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nhost: x\r\n")  # and nothing more
        status, headers, body = read_answer(sock)
        assert status == 408
        assert headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert closed(sock)


def test_a_connection_that_sends_nothing_is_closed_without_an_answer(port: int) -> None:
    with connect(port) as sock:
        assert closed(sock)


def test_the_next_request_on_a_kept_connection_has_its_own_head_timer(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(request())
        assert read_answer(sock)[0] == 200
        sock.sendall(b"POST / HTTP/1.1\r\n")  # the second request's head stalls
        status, _, body = read_answer(sock)
        assert status == 408
        assert json.loads(body)["error"]["code"] == "request_timeout"


def test_an_idle_kept_connection_outlives_the_head_timeout(port: int) -> None:
    """Idle time between requests is the keep-alive limit's to bound, not the head timer's:
    a client reusing the connection after a pause longer than the head timeout is served."""
    with connect(port) as sock:
        sock.sendall(request())
        assert read_answer(sock)[0] == 200
        time.sleep(HEAD_TIMEOUT_S * 4)
        sock.sendall(request(body=b"again"))
        status, _, body = read_answer(sock)
        assert (status, body) == (200, b"5")
