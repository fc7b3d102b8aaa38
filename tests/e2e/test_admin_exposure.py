"""Runtime control of a real ``iop api`` that listens beyond loopback, reached through real
sockets: from loopback, and from this machine's own non-loopback address -- the peer the
server then sees is that address, exactly as another machine's would be.

Without admin keys only loopback may drain (``api/auth.py``), whatever ``X-Forwarded-For``
claims, even with uvicorn told to trust it from anyone (``FORWARDED_ALLOW_IPS=*``); with
admin keys, the key decides from anywhere. Skipped where the machine has no usable
non-loopback IPv4 address."""

from __future__ import annotations

import contextlib
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from iop.processes import wait_http
from iop.redis_server import RedisServer, free_port
from tests.e2e.system import Proc, System, http_provider

DRAIN = "/admin/providers/p/drain"
RESUME = "/admin/providers/p/resume"
NO_KEYS_WARNING = "beyond loopback, with no keys"
LOOPBACK_NOTE = "answer loopback clients only"


def _reachable(address: str) -> bool:
    """Whether a listener here on ``address`` sees a connection from here as coming from it."""
    try:
        with socket.create_server((address, 0)) as server, \
                socket.create_connection(server.getsockname()[:2], timeout=2):
            peer, _ = server.accept()
            with peer:
                return str(peer.getpeername()[0]) == address
    except OSError:
        return False


def own_address() -> str | None:
    """A non-loopback IPv4 address of this machine, usable for both ends of a connection."""
    candidates: list[str] = []
    # The source address of the default route, then whatever the host name resolves to.
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("10.254.254.254", 9))  # UDP: nothing is sent
        candidates.append(str(probe.getsockname()[0]))
    with contextlib.suppress(OSError):
        candidates += socket.gethostbyname_ex(socket.gethostname())[2]
    for address in candidates:
        if not address.startswith("127.") and address != "0.0.0.0" and _reachable(address):
            return address
    return None


@pytest.fixture(scope="module")
def address() -> str:
    found = own_address()
    if found is None:
        pytest.skip("no non-loopback IPv4 address to reach this machine's API from")
    return found


@pytest.fixture
def system(tmp_path: Path, redis_server: RedisServer) -> Iterator[System]:
    with System(tmp_path, redis_server) as sys_:
        yield sys_


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    # No proxy from the environment between the test and the API: the peer must be this machine.
    with httpx.Client(timeout=10, trust_env=False) as client:
        yield client


def api(system: System, name: str, host: str, *args: str, api_config: dict[str, Any] | None = None,
        **env: str) -> tuple[Proc, int]:
    """An ``iop api`` on ``host`` serving provider p, with ``api_config`` as its ``api:``; its
    process and port, once it answers on loopback."""
    config = {"models": [{"id": "m", "providers": {"p": "served"}}],
              "nodes": [{"id": "n", "providers": [http_provider("p", "vllm", 9, 1, ["served"])]}],
              "api": api_config or {}}
    path = system.dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    port = free_port("0.0.0.0")
    argv = [sys.executable, "-m", "iop", "api", "--config", str(path), "--host", host, "--port", str(port), *args]
    proc = Proc(name, argv, {**system.env, **env}, system.dir).start()
    system.procs.append(proc)
    wait_http(proc, f"http://{'[::1]' if ':' in host else '127.0.0.1'}:{port}/readyz")
    return proc, port


def test_remote_control_needs_admin_keys(system: System, address: str, http: httpx.Client) -> None:
    # No keys at all, on every interface, uvicorn asked to believe X-Forwarded-For from anyone.
    proc, port = api(system, "api-open", "0.0.0.0", FORWARDED_ALLOW_IPS="*")
    remote, local = f"http://{address}:{port}", f"http://127.0.0.1:{port}"
    for path in (DRAIN, RESUME):
        for headers in ({}, {"x-forwarded-for": "127.0.0.1"}, {"forwarded": "for=127.0.0.1"}):
            resp = http.post(remote + path, headers=headers)
            assert resp.status_code == 403, (path, headers, resp.text)
            error = resp.json()["error"]
            assert error["code"] == "admin_key_required"
            assert f"from {address} needs an admin key" in error["message"]
            assert "api.admin_keys_env" in error["message"]
    assert not system.provider("p").get("drain")
    # The read is open, like /catalog on an open API.
    assert http.get(f"{remote}/admin/providers/p").json() == {"provider": "p", "drain": None, "in_flight": 0}
    # From this machine's loopback: allowed without a key.
    assert http.post(local + DRAIN).json()["drain"] == "drained"
    assert system.provider("p").get("drain")
    assert http.post(local + RESUME).json()["drain"] is None
    # It said so when it started, once: an open API on the network, control on loopback only.
    log = proc.log()
    assert log.count(NO_KEYS_WARNING) == 1, log
    assert log.count(LOOPBACK_NOTE) == 1, log

    # With admin keys the key decides, from anywhere.
    _, port = api(system, "api-keyed", "0.0.0.0", api_config={"admin_keys_env": "IOP_ADMIN_KEYS"},
                  IOP_ADMIN_KEYS="k1,k2")
    keyed = f"http://{address}:{port}"
    assert http.post(keyed + DRAIN).status_code == 401
    assert http.post(keyed + DRAIN, headers={"authorization": "Bearer k3"}).status_code == 401
    assert not system.provider("p").get("drain")
    assert http.post(keyed + DRAIN, headers={"authorization": "Bearer k2"}).json()["drain"] == "drained"
    assert http.post(keyed + RESUME, headers={"x-api-key": "k1"}).json()["drain"] is None


def test_dual_stack_sees_ipv4_clients_as_mapped(system: System, address: str, http: httpx.Client) -> None:
    """``--host ::`` with several processes binds one IPv6 socket that takes IPv4 too (uvicorn
    leaves IPV6_V6ONLY off): an IPv4 client is ``::ffff:a.b.c.d`` to the app, loopback included."""
    try:
        socket.create_server(("::", 0), family=socket.AF_INET6).close()
    except OSError as exc:
        pytest.skip(f"cannot listen on [::]: {exc}")
    proc, port = api(system, "api-dual", "::", "--workers", "2")
    try:
        resp = http.post(f"http://{address}:{port}{DRAIN}")
    except httpx.ConnectError:
        pytest.skip("[::] does not take IPv4 here (net.ipv6.bindv6only)")
    assert resp.status_code == 403
    assert f"from ::ffff:{address} needs an admin key" in resp.json()["error"]["message"]
    assert http.post(f"http://127.0.0.1:{port}{DRAIN}").json()["drain"] == "drained"
    assert http.post(f"http://[::1]:{port}{RESUME}").json()["drain"] is None
    assert proc.log().count(NO_KEYS_WARNING) == 1
