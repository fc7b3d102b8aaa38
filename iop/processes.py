"""Child processes started, waited for until they serve, and stopped.

``iop up``, the benchmarks' stack and the end-to-end tests all run iop as a set of
such processes (fake providers, node workers, API servers).
"""

from __future__ import annotations

import http.client
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Self

from iop.redis_server import die_with_parent

START_TIMEOUT_S = 30.0


class Child:
    """One process run from a fixed command line, which can be started again once it has ended.

    ``env`` is kept by reference: a change to the caller's dict reaches the next start.
    With ``log_path`` its stdout and stderr are appended to that file (kept across
    restarts), else they are ours. ``own_session`` puts it in a process group of its own,
    out of reach of the terminal's Ctrl-C. ``die_with_parent`` has Linux send it SIGTERM
    when the *thread* that started it ends, so that a parent killed with SIGKILL leaves no
    orphans; leave it off for children started from a thread that ends first.
    """

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        *,
        log_path: Path | None = None,
        own_session: bool = False,
        die_with_parent: bool = True,
    ) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.own_session = own_session
        self.die_with_parent = die_with_parent
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Self:
        log = self.log_path.open("ab") if self.log_path is not None else None
        try:
            self.proc = subprocess.Popen(
                self.argv,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT if log is not None else None,
                start_new_session=self.own_session,
                preexec_fn=die_with_parent if self.die_with_parent else None,
            )
        finally:
            # The child holds its own copy of the descriptor.
            if log is not None:
                log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, signum: int) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signum)

    def wait(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to clean up."""
        if self.alive():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, and SIGKILL if it has not ended within ``timeout``; its exit status."""
        self.signal(signal.SIGTERM)
        return self.wait_or_kill(timeout)

    def wait_or_kill(self, timeout: float) -> int | None:
        """Its exit status once it ends, SIGKILLed if that takes longer than ``timeout``."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def log(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")


def stop_all(children: Iterable[Child], timeout: float) -> None:
    """SIGTERM to all at once, so they wind down side by side, then each is waited for in turn.

    One SIGTERM each: a second one may cut short the drain the first one started.
    """
    group = list(children)
    for child in group:
        child.signal(signal.SIGTERM)
    for child in group:
        child.wait_or_kill(timeout)


def wait_port(
    child: Child,
    host: str,
    port: int,
    *,
    timeout: float = START_TIMEOUT_S,
    checkpoint: Callable[[], None] | None = None,
) -> None:
    """Until ``host:port`` accepts a connection; RuntimeError if the child exits first.
    ``checkpoint`` runs on every round: it may raise to give up early."""

    def listening() -> bool:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return True
        except OSError:
            return False

    _wait(child, listening, 0.05, timeout, checkpoint, f"did not listen on {host}:{port}")


def wait_http(
    child: Child,
    url: str,
    *,
    timeout: float = START_TIMEOUT_S,
    checkpoint: Callable[[], None] | None = None,
) -> None:
    """Until a GET of ``url`` answers 200; RuntimeError if the child exits first."""

    def ready() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, http.client.HTTPException, OSError):
            return False

    _wait(child, ready, 0.1, timeout, checkpoint, f"did not answer 200 on {url}")


def _wait(
    child: Child,
    done: Callable[[], bool],
    pause_s: float,
    timeout: float,
    checkpoint: Callable[[], None] | None,
    failure: str,
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if checkpoint is not None:
            checkpoint()
        if not child.alive():
            raise RuntimeError(f"{child.name} exited with status {child.returncode}{_log_of(child)}")
        if done():
            return
        time.sleep(pause_s)
    raise TimeoutError(f"{child.name} {failure} within {timeout:g}s{_log_of(child)}")


def _log_of(child: Child) -> str:
    # A child with a log file says why it failed there; one without wrote to our own output.
    return f":\n{child.log()}" if child.log_path is not None else ""
