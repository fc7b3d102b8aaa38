"""Redis URLs with a user and password (ACL) and with TLS work for both clients iop
uses: redis-py (everything off the request path) and ``dispatcher.fastredis``."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.exceptions import AuthenticationError, ConnectionError, ResponseError

from dispatcher.redis_conn import connect, connect_fast
from iop.redis_server import RedisServer, find_redis_server

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def acl_server() -> Iterator[RedisServer]:
    args = ["--user", "default", "off", "--user", "iop", "on", ">s3cret-pass", "~*", "&*", "+@all"]
    with RedisServer(extra_args=args) as server:
        yield server


def url_with(server: RedisServer, userinfo: str) -> str:
    return f"redis://{userinfo}@{server.host}:{server.port}/0"


@pytest.mark.parametrize("client", ["redis-py", "fastredis"])
async def test_user_and_password_in_the_url(acl_server: RedisServer, client: str) -> None:
    url = url_with(acl_server, "iop:s3cret-pass")
    if client == "redis-py":
        redis = connect(url)
        assert await redis.set("{iop}:auth-check", "1")
        assert await redis.get("{iop}:auth-check") == b"1"
        await redis.aclose()
    else:
        fast = connect_fast(url)
        assert await fast.execute("SET", "{iop}:auth-check", "2") == b"OK"
        assert await fast.execute("GET", "{iop}:auth-check") == b"2"
        await fast.close()


async def test_wrong_password_is_refused_by_both_clients(acl_server: RedisServer) -> None:
    url = url_with(acl_server, "iop:wrong")
    fast = connect_fast(url)
    with pytest.raises(AuthenticationError):
        await fast.execute("PING")
    redis = connect(url)
    with pytest.raises((AuthenticationError, ResponseError)):
        await redis.ping()
    await redis.aclose()


async def test_no_password_is_refused(acl_server: RedisServer) -> None:
    fast = connect_fast(acl_server.url)
    with pytest.raises(ResponseError, match="NOAUTH"):
        await fast.execute("PING")
    await fast.close()


def _tls_supported() -> bool:
    try:
        out = subprocess.run([find_redis_server(), "--tls-port", "1", "--port", "0", "--test-memory"],
                             capture_output=True, text=True, timeout=10)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return False
    return "not supported" not in out.stdout + out.stderr


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, Path]]:
    if shutil.which("openssl") is None or not _tls_supported():
        pytest.skip("no openssl, or this redis-server was built without TLS")
    tmp = tmp_path_factory.mktemp("tls")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )
    with RedisServer(tls=(str(cert), str(key))) as server:
        yield server, cert


@pytest.mark.parametrize("client", ["redis-py", "fastredis"])
async def test_tls_with_the_server_certificate_verified(tls_server: tuple[RedisServer, Path], client: str) -> None:
    server, cert = tls_server
    url = f"{server.url}?ssl_ca_certs={cert}"
    assert url.startswith("rediss://")
    if client == "redis-py":
        redis = connect(url)
        assert await redis.ping()
        await redis.aclose()
    else:
        fast = connect_fast(url)
        assert await fast.execute("PING") == b"PONG"
        await fast.close()


async def test_tls_refuses_an_unknown_certificate(tls_server: tuple[RedisServer, Path]) -> None:
    server, _ = tls_server
    fast = connect_fast(server.url)  # the system's CAs do not know this self-signed one
    with pytest.raises(ConnectionError):
        await fast.execute("PING")
    insecure = connect_fast(f"{server.url}?ssl_cert_reqs=none")
    assert await insecure.execute("PING") == b"PONG"
    await insecure.close()
