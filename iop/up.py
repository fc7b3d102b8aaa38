"""``iop up``: the whole system on one machine, started and stopped in order.

Redis first (embedded unless a URL is configured), then the fake providers the config
asks for, the node workers, and the API. Ctrl-C (or SIGTERM) stops them in reverse
order, so workers drain while Redis is still there. Children run in their own
process groups: the terminal's Ctrl-C reaches only this supervisor, which decides
the order.

``SIGHUP`` (what ``iop reload`` sends, finding this process by its pid file) reads the
config file again: a node added gets a worker, a removed node's worker drains and
exits, and every other worker and the API get ``SIGHUP`` to apply the file themselves.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from urllib.parse import urlsplit

from dispatcher.config import Config, NodeConfig, load
from dispatcher.exceptions import ConfigError
from dispatcher.redis_topology import described
from iop.processes import Child, stop_all, wait_http, wait_port
from iop.redis_reach import unreachable
from iop.redis_server import RedisServer, free_port

# A draining worker may finish its running jobs first.
STOP_TIMEOUT_S = 40.0


class Interrupted(Exception):
    """Ctrl-C or SIGTERM arrived while starting up."""


class Supervisor:
    def __init__(self, config_path: str) -> None:
        self.config_path = config_path
        # By role, in the order they start; "leaving": workers of removed nodes, draining.
        self.children: dict[str, list[Child]] = {"fake": [], "worker": [], "api": [], "leaving": []}
        self.workers: dict[str, Child] = {}  # by node id
        self.redis: RedisServer | None = None
        self.stopping = False
        self.reload_asked = False

    def spawn(self, role: str, what: str, argv: list[str], env: dict[str, str]) -> Child:
        child = Child(f"{role} {what}", argv, env, own_session=True).start()
        self.children[role].append(child)
        return child

    def checkpoint(self) -> None:
        if self.stopping:
            raise Interrupted

    def start_worker(self, node: NodeConfig, env: dict[str, str]) -> Child:
        child = self.spawn("worker", node.id, [sys.executable, "-m", "iop", "worker", "--config", self.config_path,
                                               "--node", node.id], env)
        self.workers[node.id] = child
        return child

    def dead_child(self) -> Child | None:
        running = (c for role, group in self.children.items() if role != "leaving" for c in group)
        return next((c for c in running if not c.alive()), None)

    def reload(self, env: dict[str, str]) -> None:
        """Apply the config file again (see the module's docstring); an invalid file changes nothing."""
        try:
            config = load(self.config_path).config
        except ConfigError as exc:
            print(f"reload: {self.config_path}: {len(exc.problems)} problem(s); nothing changed", file=sys.stderr)
            for problem in exc.problems:
                print(f"  {problem}", file=sys.stderr)
            return
        nodes = {node.id: node for node in config.nodes}
        for node_id in [n for n in self.workers if n not in nodes]:
            child = self.workers.pop(node_id)
            self.children["worker"].remove(child)
            self.children["leaving"].append(child)
            child.signal(signal.SIGTERM)  # it drains: running jobs finish
            print(f"reload: node {node_id} removed; its worker drains and exits", flush=True)
        for child in [*self.workers.values(), *self.children["api"]]:
            child.signal(signal.SIGHUP)
        for node_id, node in nodes.items():
            if node_id not in self.workers:
                child = self.start_worker(node, env)
                print(f"reload: node {node_id} added; worker pid {child.pid}", flush=True)
        print(f"reload: {self.config_path} sent to {len(self.workers)} worker(s) and the API", flush=True)

    def stop(self) -> None:
        # API first (no new requests), then workers (they drain), then the fakes, Redis last.
        for role in ("api", "worker", "leaving", "fake"):
            stop_all(self.children[role], timeout=STOP_TIMEOUT_S)
        if self.redis is not None:
            self.redis.close()


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _fake_models(config: Config, host: str, port: int) -> list[str]:
    """Served names of the providers a fake on host:port stands in for."""
    names: list[str] = []
    for _, prov in config.providers():
        if prov.base_url:
            parts = urlsplit(prov.base_url)
            if parts.port == port and parts.hostname in (host, "localhost", "127.0.0.1"):
                names += [m for m in prov.models if m not in names]
    return names


def pid_file(port: int) -> Path:
    """Where ``iop up`` serving on ``port`` leaves its pid, for ``iop reload``."""
    return Path(tempfile.gettempdir()) / f"iop-up-{port}.pid"


def run_up(config: Config, config_path: str, *, host: str, port: int, api_workers: int) -> int:
    config_path = os.path.abspath(config_path)
    sup = Supervisor(config_path)
    py = sys.executable

    def on_signal(signum: int, frame: FrameType | None) -> None:
        sup.stopping = True

    def on_hangup(signum: int, frame: FrameType | None) -> None:
        sup.reload_asked = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_hangup)
    pid_path = pid_file(port)
    pid_path.write_text(f"{os.getpid()}\n")
    lines: list[str] = []
    try:
        redis_url = config.redis.url
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if config.redis.sentinel is not None or redis_url:
            redis_line = described(config.redis)
        else:
            sup.redis = RedisServer(port=free_port())
            sup.redis.start()
            redis_url = sup.redis.url
            redis_line = f"{redis_url} (embedded {sup.redis.binary}, v{sup.redis.version()})"
        print(f"redis: {redis_line}", flush=True)  # now: before anything that uses it can fail
        lines.append(f"  redis    {redis_line}")
        if sup.redis is None and (problem := unreachable(config.redis)) is not None:
            raise RuntimeError(problem)  # one line now, not every child retrying it
        if redis_url:
            env["IOP_REDIS_URL"] = redis_url

        for fake in config.demo.fake_providers:
            if not _port_free(fake.host, fake.port):
                raise RuntimeError(f"port {fake.host}:{fake.port} for a fake provider is already in use")
            models = _fake_models(config, fake.host, fake.port)
            argv = [py, "-m", "iop", "fake-provider", "--host", fake.host, "--port", str(fake.port),
                    "--delay-ms", str(fake.delay_ms), "--tokens", str(fake.tokens),
                    "--token-interval-ms", str(fake.token_interval_ms), "--models", ",".join(models)]
            for flag, value in (("--max-loaded", fake.max_loaded), ("--load-ms", fake.load_ms),
                                ("--keep-alive-s", fake.keep_alive_s)):
                if value is not None:  # absent: the fake's own default, no lifecycle
                    argv += [flag, str(value)]
            child = sup.spawn("fake", f"http://{fake.host}:{fake.port}", argv, env)
            wait_port(child, fake.host, fake.port, checkpoint=sup.checkpoint)
            lines.append(f"  fake     http://{fake.host}:{fake.port} serving {', '.join(models) or '-'}")

        for node in config.nodes:
            sup.checkpoint()
            child = sup.start_worker(node, env)
            lines.append(f"  worker   node {node.id} (pid {child.pid}): "
                         + ", ".join(f"{p.id} [{p.type}, capacity {p.capacity}]" for p in node.providers))

        if not _port_free(host, port):
            raise RuntimeError(f"port {host}:{port} for the API is already in use (use --port)")
        api = sup.spawn("api", f"http://{host}:{port}", [py, "-m", "iop", "api", "--config", config_path,
                                                         "--host", host, "--port", str(port),
                                                         "--workers", str(api_workers)], env)
        wait_http(api, f"http://{host}:{port}/readyz", checkpoint=sup.checkpoint)
        lines.insert(0, f"  api      http://{host}:{port}/v1 ({api_workers} process(es), pid {api.pid})")

        model = config.models[0].id if config.models else "MODEL"
        print("iop is up", *lines, sep="\n")
        print(f"\nmodels: {', '.join(m.id for m in config.models)}")
        print(f"try:    curl -s http://{host}:{port}/v1/chat/completions -H 'content-type: application/json' "
              f"-d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"hi\"}}]}}'")
        print(f"`iop reload --port {port}` applies a changed config file.")
        # The client commands find this iop through IOP_URL (their --url): said here, since
        # with another port they would otherwise ask :8080.
        print(f"`export IOP_URL=http://{host}:{port}` points `iop catalog`, `iop provider`, `iop model`, "
              "`iop overrides`, `iop audit` and `iop qualify` at it (else give them --url).")
        print("Ctrl-C stops everything.", flush=True)

        while not sup.stopping:
            if sup.reload_asked:
                sup.reload_asked = False
                sup.reload(env)
            dead = sup.dead_child()
            if dead is not None:
                print(f"{dead.name} exited with status {dead.returncode}; stopping",
                      file=sys.stderr, flush=True)
                return 1
            time.sleep(0.2)
        print("stopping...", flush=True)
        return 0
    except Interrupted:
        print("interrupted during start-up; stopping...", flush=True)
        return 0
    except (RuntimeError, TimeoutError, FileNotFoundError) as exc:
        print(f"iop up failed: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        pid_path.unlink(missing_ok=True)
        sup.stop()
        print("stopped.", flush=True)
