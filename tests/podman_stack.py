"""compose.yaml run for real, in podman containers, through ``./dev compose up`` and ``down``.

A :class:`Stack` is one compose project on this machine, with its load balancer on a free
port of 127.0.0.1; its containers are found by the labels podman-compose gives them, and
killed, stopped, started and exec'd into with plain ``podman``. :func:`unavailable` says in
one line why containers cannot run here, if they cannot.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from iop.redis_server import free_port
from tests.waiting import eventually_sync

ROOT = Path(__file__).resolve().parents[1]
DEV = ROOT / "dev"
CONTAINERS_CONF = ROOT / "deploy" / "podman" / "containers.conf"
# Where ./dev installs podman-compose (its setup_compose).
PODMAN_COMPOSE = ROOT / ".venv-servers" / "podman-compose" / "bin" / "podman-compose"
PROJECT_LABEL = "io.podman.compose.project"
SERVICE_LABEL = "io.podman.compose.service"
# A cold `up` makes the stand-in images with debootstrap and builds iop:local: minutes.
UP_TIMEOUT_S = 1500

ENV = {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}


def podman(*args: str, check: bool = True, timeout: float = 120) -> str:
    done = subprocess.run(["podman", *args], env=ENV, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def _probe_rootfs(into: Path) -> None:
    """The smallest container root: the host's /bin/true and the libraries it loads."""
    true = Path(shutil.which("true") or "/bin/true").resolve()
    files = [true]
    ldd = subprocess.run(["ldd", str(true)], capture_output=True, text=True)
    files += [Path(word) for line in ldd.stdout.splitlines() for word in line.split() if word.startswith("/")]
    for path in files:
        target = into / path.relative_to("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    (into / "bin").mkdir(exist_ok=True)
    shutil.copy2(true, into / "bin" / "true")


def unavailable() -> str | None:
    """Why podman cannot run the stack here, in one line; None when it can."""
    if shutil.which("podman") is None:
        return "no podman on this machine (Debian packages podman, runc, netavark, debootstrap)"
    if not PODMAN_COMPOSE.exists():
        return f"no podman-compose at {PODMAN_COMPOSE.relative_to(ROOT)} (./dev test installs it)"
    with tempfile.TemporaryDirectory() as tmp:
        _probe_rootfs(Path(tmp))
        try:
            done = subprocess.run(["podman", "run", "--rm", "--network", "none", "--rootfs", tmp, "/bin/true"],
                                  env=ENV, capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            return "podman cannot run a container here: `podman run` did not return within 120 s"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return f"podman cannot run a container here: {last}"
    if shutil.which("debootstrap") is None:
        return "no debootstrap to make the stand-in base images (Debian package debootstrap)"
    return None


class Stack:
    def __init__(self, project: str, port: int, log_dir: Path) -> None:
        self.project = project
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_dir = log_dir
        self.env = {**ENV, "IOP_COMPOSE_PROJECT": project, "IOP_COMPOSE_PORT": str(port),
                    "IOP_COMPOSE_PROMETHEUS_PORT": str(free_port())}

    # ------------------------------------------------------------------ ./dev compose

    def dev_compose(self, *args: str, timeout: float = UP_TIMEOUT_S, **env: str) -> None:
        """``./dev compose ARGS``, its output in the log directory."""
        log = self.log_dir / f"compose-{args[0]}.log"
        with log.open("a") as out:
            done = subprocess.run([str(DEV), "compose", *args], env={**self.env, **env}, stdout=out,
                                  stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT)
        assert done.returncode == 0, f"./dev compose {' '.join(args)} exited {done.returncode}:\n{log.read_text()}"

    def up(self, *args: str, profiles: str = "") -> None:
        """``./dev compose up ARGS``; ``profiles`` as COMPOSE_PROFILES."""
        self.dev_compose("up", *args, COMPOSE_PROFILES=profiles)

    def down(self) -> None:
        self.dev_compose("down", timeout=600)

    # ------------------------------------------------------------------ containers

    def containers(self, service: str | None = None, running: bool = False) -> list[str]:
        """Names of the project's containers (of one service), sorted."""
        args = ["ps", "--format", "json", "--filter", f"label={PROJECT_LABEL}={self.project}"]
        if service is not None:
            args += ["--filter", f"label={SERVICE_LABEL}={service}"]
        if not running:
            args.append("--all")
        return sorted(name for c in json.loads(podman(*args) or "[]") for name in c["Names"])

    def container(self, service: str, index: int = 0) -> str:
        names = self.containers(service)
        assert len(names) > index, f"service {service}: containers {names}"
        return names[index]

    def state(self, name: str) -> dict[str, Any]:
        found: list[dict[str, Any]] = json.loads(podman("inspect", "--type", "container", name))
        state: dict[str, Any] = found[0]["State"]
        return state

    def exec(self, name: str, *argv: str, timeout: float = 60) -> str:
        return podman("exec", name, *argv, timeout=timeout)

    def resolves(self, name: str, host: str) -> bool:
        """Whether ``host`` resolves inside container ``name`` now (podman's aardvark-dns can
        answer a name with a temporary failure for a moment)."""
        self.exec(name, "python", "-c", f"import socket; socket.getaddrinfo({host!r}, None)", timeout=30)
        return True

    def healthcheck(self, name: str) -> str:
        """Run the container's compose healthcheck once: '' when healthy, else what it said.

        podman 4.3 runs healthchecks from systemd timers, and nothing runs them where there
        is no systemd: this runs the check itself."""
        done = subprocess.run(["podman", "healthcheck", "run", name], env=ENV, capture_output=True, text=True,
                              timeout=60)
        return "" if done.returncode == 0 else (done.stdout + done.stderr).strip() or f"exit {done.returncode}"

    def wait_healthy(self, name: str, timeout: float = 120) -> None:
        self.wait_until(f"{name} healthy", lambda: self.healthcheck(name) == "", timeout)

    def leftovers(self) -> dict[str, list[str]]:
        """What of the project is still on the machine: containers, pods, networks, volumes."""
        label = f"label={PROJECT_LABEL}={self.project}"
        found = {
            "containers": podman("ps", "--all", "--quiet", "--filter", label).split(),
            "pods": podman("pod", "ps", "--quiet", "--filter", f"name=^pod_{self.project}$").split(),
            "networks": podman("network", "ls", "--quiet", "--filter", label).split(),
            "volumes": podman("volume", "ls", "--quiet", "--filter", label).split(),
        }
        return {kind: ids for kind, ids in found.items() if ids}

    def logs(self, tail: int = 40, timestamps: bool = False) -> str:
        out = []
        for name in self.containers():
            done = subprocess.run(["podman", "logs", "--tail", str(tail), *(["--timestamps"] if timestamps else []),
                                   name], env=ENV, capture_output=True, text=True, timeout=60)
            out.append(f"----- {name}\n{done.stdout}{done.stderr}")
        return "\n".join(out)

    # ------------------------------------------------------------------ through the load balancer

    def client(self, timeout: float = 60) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    @staticmethod
    def wait_until(what: str, predicate: Callable[[], bool], timeout: float = 120, pause: float = 0.5) -> None:
        eventually_sync(predicate, what=what, within=timeout, every=pause,
                        retrying=(httpx.HTTPError, AssertionError, subprocess.SubprocessError))
