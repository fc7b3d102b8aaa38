"""A running iop for benchmarks: a private redis-server, fake providers, node workers and
API processes, started as real processes, plus CPU, memory and Redis counters to read."""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from redis import Redis

from iop.processes import Child, stop_all, wait_port
from iop.redis_server import RedisServer, free_port

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its live descendants, from /proc."""
    total = 0.0
    for p in [pid, *descendants(pid)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return total


def descendants(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue
        for child in children:
            found += [child, *descendants(child)]
    return found


def machine() -> str:
    """The machine a benchmark ran on, for its report."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    return (f"{os.cpu_count()} vCPUs ({cpu}), Linux {platform.release()}, Redis {redis_version()}, "
            f"Python {platform.python_version()}")


def load_average() -> str:
    return " / ".join(Path("/proc/loadavg").read_text().split()[:3]) + " (1 / 5 / 15 min)"


def redis_version() -> str:
    return RedisServer(data_dir=tempfile.gettempdir()).version()  # no server started, no directory made


def rss_mib(pid: int) -> float:
    pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    return pages * PAGE_SIZE / 2**20


@dataclass
class Stack:
    """``with Stack(...) as s:`` starts everything; leaving stops it."""

    fakes: dict[str, list[str]]  # fake name -> extra `iop fake-provider` args
    capacity: int = 64
    api_workers: int = 1
    procs: list[Child] = field(default_factory=list)
    dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="iop-bench-")))

    def __post_init__(self) -> None:
        self.redis_server = RedisServer()
        self.ports = {name: free_port() for name in self.fakes}
        self.api_port = free_port()
        self.api_url = f"http://127.0.0.1:{self.api_port}"

    def fake_url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def config(self) -> dict[str, Any]:
        return {
            "queue": {"max_queue": 100_000, "queue_timeout_ms": 120_000},
            "models": [{"id": "bench", "providers": {f"p-{name}": f"served-{name}" for name in self.fakes}}],
            "nodes": [{"id": "n1", "providers": [
                {"id": f"p-{name}", "type": "vllm", "base_url": self.fake_url(name), "capacity": self.capacity,
                 "models": [f"served-{name}"]}
                for name in self.fakes
            ]}],
        }

    def __enter__(self) -> Stack:
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self) -> None:
        self.redis_server.start()
        self.redis = Redis.from_url(self.redis_server.url)
        config_path = self.dir / "iop.yaml"
        config_path.write_text(yaml.safe_dump(self.config()))
        env = {**os.environ, "IOP_REDIS_URL": self.redis_server.url}
        for name, args in self.fakes.items():
            fake = self._spawn(f"fake-{name}", ["fake-provider", "--port", str(self.ports[name]),
                                                "--models", f"served-{name}", *args], env)
            wait_port(fake, "127.0.0.1", self.ports[name])
        self._start_iop(config_path, env)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            states = [self.redis.hget(f"{{iop}}:p:p-{name}", "health") for name in self.fakes]
            if all(s == b"available" for s in states):
                return
            time.sleep(0.05)
        raise TimeoutError("providers did not become available")

    def _start_iop(self, config_path: Path, env: dict[str, str]) -> None:
        """The worker and the API processes, once the fakes listen."""
        self._spawn("worker", ["worker", "--config", str(config_path), "--node", "n1", "--log-level", "warning"], env)
        api = self._spawn("api", ["api", "--config", str(config_path), "--port", str(self.api_port),
                                  "--workers", str(self.api_workers), "--log-level", "warning"], env)
        wait_port(api, "127.0.0.1", self.api_port)

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> Child:
        child = Child(name, [sys.executable, "-m", "iop", *args], env, log_path=self.dir / f"{name}.log").start()
        self.procs.append(child)
        return child

    def __exit__(self, *exc: object) -> None:
        stop_all(reversed(self.procs), timeout=20)
        if hasattr(self, "redis"):
            self.redis.close()
        self.redis_server.close()

    def pid(self, name: str) -> int:
        return next(p.pid for p in self.procs if p.name == name)

    def iop_pids(self) -> dict[str, int]:
        """The processes that are iop itself (not the fakes): API, worker, Redis."""
        assert self.redis_server.proc is not None
        return {"api": self.pid("api"), "worker": self.pid("worker"), "redis": self.redis_server.proc.pid}

    def cpu(self) -> dict[str, float]:
        pids = {**self.iop_pids(), **{p.name: p.pid for p in self.procs if p.name.startswith("fake")}}
        return {name: cpu_seconds(pid) for name, pid in pids.items()}

    def commandstats(self) -> dict[str, int]:
        info = self.redis.info("commandstats")
        return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in info.items()}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def write_section(name: str, command: str, table: str, notes: str = "", heading: str = "") -> None:
    """Replace the section ``name`` of docs/BENCHMARKS.md with fresh figures; ``heading``
    goes before it the first time, when the section is added at the end."""
    path = Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if heading and begin not in text:
        text = text.rstrip() + "\n\n" + heading
    stamp = time.strftime("%Y-%m-%d")
    body = f"{begin}\nMeasured {stamp} with `{command}`:\n\n{table}\n{notes}{end}"
    if begin in text:
        head, rest = text.split(begin, 1)
        text = head + body + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + f"\n\n{body}\n"
    path.write_text(text)


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def command_line(command: str, args: Any, defaults: dict[str, Any]) -> str:
    """``command`` with the flags of ``args`` that differ from ``defaults`` (the way a
    benchmark states, next to its figures, how it was run)."""
    def shown(value: Any) -> str:
        if isinstance(value, dict):
            return "'" + json.dumps(value) + "'"
        if isinstance(value, list):
            return " ".join(shown(v) for v in value)
        return f"{value:g}" if isinstance(value, float) else str(value)

    flags = [f"--{name.replace('_', '-')} {shown(getattr(args, name))}"
             for name, default in defaults.items() if getattr(args, name) != default]
    return " ".join([command, *flags])
