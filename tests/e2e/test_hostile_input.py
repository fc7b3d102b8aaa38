"""Hostile callers against real processes: oversized and slow headers, slow bodies,
deep nesting, too many streams, and keys that must neither leak to providers nor
reach the logs."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from iop.redis_server import RedisServer
from tests.e2e.system import System, http_provider

CALLER_KEYS = "caller-secret-one,caller-secret-two"
PROVIDER_KEY = "provider-secret-xyz"


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[System]:
    sys_ = System(tmp_path_factory.mktemp("hostile"), redis_server)
    sys_.env.update({"IOP_TEST_CALLER_KEYS": CALLER_KEYS, "IOP_TEST_PROVIDER_KEY": PROVIDER_KEY})
    sys_.write_config({
        "api": {"api_keys_env": "IOP_TEST_CALLER_KEYS", "max_header_bytes": 8192, "header_timeout_s": 1.0,
                "body_timeout_s": 1.0, "max_streams": 1},
        "models": [{"id": "m", "providers": {"p": "served"}}],
        "nodes": [{"id": "n1", "providers": [
            http_provider("p", "openai_api", sys_.port("f"), 4, ["served"], api_key_env="IOP_TEST_PROVIDER_KEY")]}],
    })
    with sys_:
        sys_.fake("f", "--models", "served", "--api-key-env", "IOP_TEST_PROVIDER_KEY",
                  "--tokens", "10", "--token-interval-ms", "200")
        sys_.worker("n1")
        sys_.api()
        sys_.wait_available("p")
        yield sys_


def headers(key: str = "caller-secret-two") -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def raw(system: System, data: bytes) -> socket.socket:
    port = int(system.api_url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(data)
    return sock


def read_all(sock: socket.socket) -> bytes:
    chunks = []
    while True:
        try:
            data = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            break
        if not data:
            break
        chunks.append(data)
    sock.close()
    return b"".join(chunks)


def test_oversized_headers_are_431(system: System) -> None:
    sock = raw(system, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 20_000 + b"\r\n\r\n")
    answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 431")
    assert b"headers_too_large" in answer
    # Headers within the limit are fine.
    assert httpx.get(f"{system.api_url}/healthz", headers={"x-pad": "a" * 4000}).status_code == 200


def test_slow_headers_are_cut_off(system: System) -> None:
    sock = raw(system, b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # never finishes its headers
    started = time.monotonic()
    answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 408")
    assert time.monotonic() - started < 10  # generous: it does not hang


def test_slow_body_is_408(system: System) -> None:
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer caller-secret-one\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n")
    sock = raw(system, head + b'{"model": "m"')  # 13 of the 100 bytes it announced
    answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"request_timeout" in answer


def test_deep_nesting_is_400(system: System) -> None:
    body = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    resp = httpx.post(f"{system.api_url}/v1/chat/completions", content=body, headers=headers())
    assert resp.status_code == 400
    assert "nested too deeply" in resp.json()["error"]["message"]


def test_streams_beyond_the_limit_are_503(system: System) -> None:
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    first_chunk = threading.Event()

    def hold_a_stream() -> None:
        with httpx.stream("POST", f"{system.api_url}/v1/chat/completions", json=body, headers=headers(),
                          timeout=30) as resp:
            for _ in resp.iter_bytes():
                first_chunk.set()

    holder = threading.Thread(target=hold_a_stream)
    holder.start()
    assert first_chunk.wait(timeout=20)
    resp = httpx.post(f"{system.api_url}/v1/chat/completions", json=body, headers=headers(), timeout=30)
    assert resp.status_code == 503
    assert resp.json()["error"]["code"] == "server_overloaded"
    assert int(resp.headers["retry-after"]) >= 1
    # JSON answers are not streams: they still go through.
    assert httpx.post(f"{system.api_url}/v1/chat/completions", json={**body, "stream": False},
                      headers=headers(), timeout=30).status_code == 200
    holder.join(timeout=30)
    # The slot is free again once the stream ended.
    assert httpx.post(f"{system.api_url}/v1/chat/completions", json=body, headers=headers(),
                      timeout=30).status_code == 200


def test_caller_keys_gate_the_api_and_never_reach_the_provider(system: System) -> None:
    fake = system.fakes["f"]
    for key in ("caller-secret-one", "caller-secret-two"):
        resp = httpx.post(f"{system.api_url}/v1/chat/completions", headers=headers(key),
                          json={"model": "m", "messages": [{"role": "user", "content": "x"}]}, timeout=30)
        assert resp.status_code == 200
    for bad in ({}, headers("wrong-secret-abc"), {"authorization": "caller-secret-one"}):
        resp = httpx.post(f"{system.api_url}/v1/chat/completions", headers=bad, json={"model": "m"}, timeout=30)
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == "invalid_api_key"
    # The provider saw its own key, never a caller's.
    seen = {r["authorization"] for r in fake.requests()}
    assert seen == {f"Bearer {PROVIDER_KEY}"}


def test_no_key_reaches_any_log(system: System) -> None:
    # Every key in play here, whatever ran before: both caller keys answered (the provider's
    # own key then sent upstream), and a wrong one refused.
    for key in ("caller-secret-one", "caller-secret-two"):
        ok = httpx.post(f"{system.api_url}/v1/chat/completions", headers=headers(key), timeout=30,
                        json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
        assert ok.status_code == 200
    httpx.post(f"{system.api_url}/v1/chat/completions", headers=headers("wrong-secret-abc"), json={"model": "m"})
    logs = system.logs() + "".join(Path(p.log_path).read_text(errors="replace") for p in system.procs)
    for secret in ("caller-secret-one", "caller-secret-two", "wrong-secret-abc", PROVIDER_KEY):
        assert secret not in logs
