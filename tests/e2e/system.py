"""A whole iop system made of real processes, for end-to-end and fault tests.

Fake providers, node workers and API servers run as ``python -m iop ...`` child
processes against a private redis-server; each can be stopped, killed or restarted.
Their output goes to log files under the test's tmp dir (printed when a test fails).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from redis import Redis

from dispatcher import keys
from iop.processes import START_TIMEOUT_S, Child, wait_http, wait_port
from iop.redis_server import RedisServer, free_port
from tests.waiting import eventually_sync


def fast_dispatch(lease_ms: int = 1500, **overrides: Any) -> dict[str, Any]:
    """Dispatch timings short enough that leases expire, heartbeats land and reaper rounds
    run within a test, ``overrides`` on top."""
    return {
        "lease_ms": lease_ms,
        "heartbeat_interval_ms": 200,
        "heartbeat_ttl_ms": 1000,
        "probe_interval_ms": 300,
        "probe_timeout_ms": 500,
        "reap_interval_ms": 200,
        "replica_ttl_ms": 1500,
        "drain_grace_s": 3,
        "max_attempts": 2,
        **overrides,
    }


class Proc(Child):
    """A process of the system, its output in ``<log_dir>/<name>.log``.

    Started without PR_SET_PDEATHSIG: a test may start one from a thread that ends before
    the process should."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> None:
        super().__init__(name, argv, env, log_path=log_dir / f"{name}.log", die_with_parent=False)


class Fake:
    """A fake provider process and a handle on its test hooks."""

    def __init__(self, proc: Proc, port: int) -> None:
        self.proc = proc
        self.port = port
        self.url = f"http://127.0.0.1:{port}"

    def control(self, **options: Any) -> dict[str, Any]:
        resp = httpx.post(f"{self.url}/_fake/control", json=options, timeout=5)
        resp.raise_for_status()
        result: dict[str, Any] = resp.json()
        return result

    def requests(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = httpx.get(f"{self.url}/_fake/requests", timeout=5).json()
        return result

    def stats(self) -> dict[str, int]:
        result: dict[str, int] = httpx.get(f"{self.url}/_fake/stats", timeout=5).json()
        return result

    def hooks(self, **hooks: bool) -> dict[str, bool]:
        """Switch the fake's test hooks (``track_executions``, ``body_overrides``)."""
        resp = httpx.post(f"{self.url}/_fake/hooks", json=hooks, timeout=5)
        resp.raise_for_status()
        result: dict[str, bool] = resp.json()
        return result

    def executions(self) -> list[dict[str, Any]]:
        """Every /v1 POST since ``track_executions`` was switched on: marker, stream, started,
        ended, outcome."""
        result: list[dict[str, Any]] = httpx.get(f"{self.url}/_fake/executions", timeout=5).json()
        return result


class System:
    def __init__(self, tmp_path: Path, redis_server: RedisServer) -> None:
        self.dir = tmp_path
        self.redis_server = redis_server
        self.redis = Redis.from_url(redis_server.url)
        self.redis.flushall()
        self.env = {**os.environ, "IOP_REDIS_URL": redis_server.url, "PYTHONUNBUFFERED": "1"}
        self.procs: list[Proc] = []
        self.fakes: dict[str, Fake] = {}
        self.ports: dict[str, int] = {}
        self.config_path = tmp_path / "iop.yaml"
        self.api_url = ""

    # --- configuration ---------------------------------------------------------------------

    def port(self, name: str) -> int:
        if name not in self.ports:
            # A port is free only until someone binds it: the OS may hand the same one out
            # twice before the first process binds it, and two fakes on one port would
            # look like one provider over its capacity.
            port = free_port()
            while port in self.ports.values() or port == self.redis_server.port:
                port = free_port()
            self.ports[name] = port
        return self.ports[name]

    def write_config(self, config: dict[str, Any]) -> Path:
        self.config = config
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        return self.config_path

    # --- processes -----------------------------------------------------------------------------

    def _spawn(self, name: str, args: list[str]) -> Proc:
        proc = Proc(name, [sys.executable, "-m", "iop", *args], self.env, self.dir).start()
        self.procs.append(proc)
        return proc

    def fake(self, name: str, *args: str) -> Fake:
        port = self.port(name)
        proc = self._spawn(f"fake-{name}", ["fake-provider", "--port", str(port), *args])
        wait_port(proc, "127.0.0.1", port)
        fake = Fake(proc, port)
        self.fakes[name] = fake
        return fake

    def worker(self, node: str, name: str | None = None) -> Proc:
        return self._spawn(name or f"worker-{node}", ["worker", "--config", str(self.config_path), "--node", node])

    def api(self, name: str = "api", workers: int = 1) -> Proc:
        port = self.port(name)
        proc = self._spawn(name, ["api", "--config", str(self.config_path), "--port", str(port),
                                  "--workers", str(workers)])
        url = f"http://127.0.0.1:{port}"
        wait_http(proc, f"{url}/readyz")
        if not self.api_url:
            self.api_url = url
        return proc

    def restart(self, proc: Proc) -> Proc:
        proc.stop()
        return proc.start()

    def api_url_of(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port(name)}"

    def wait_api_ready(self, proc: Proc, timeout: float = START_TIMEOUT_S) -> None:
        """Until an API process (started again after a stop or a kill) answers /readyz."""
        wait_http(proc, f"{self.api_url_of(proc.name)}/readyz", timeout=timeout)

    @staticmethod
    def worker_id(proc: Proc) -> str:
        """The consumer name the worker process last started with (from its log)."""
        found = re.findall(r"worker (\S+) serving node", proc.log())
        if not found:
            raise LookupError(f"{proc.name} has not started serving:\n{proc.log()}")
        return str(found[-1])

    # --- Redis state ---------------------------------------------------------------------------

    def provider(self, pid: str) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.redis.hgetall(keys.provider(pid)).items()}

    def in_flight(self, pid: str) -> int:
        return int(self.redis.hget(keys.provider(pid), "in_flight") or 0)

    def wait_available(self, *pids: str, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self.provider(p).get("health") == "available" for p in pids):
                return
            time.sleep(0.05)
        states = {p: self.provider(p) for p in pids}
        raise TimeoutError(f"providers not available within {timeout}s: {json.dumps(states)}\n{self.logs()}")

    def wait_serving(self, worker: Proc) -> None:
        """Until a worker process has started reading its node's stream."""
        self.wait_until(f"{worker.name} serving", lambda: "serving node" in worker.log())

    def wait_until(self, what: str, predicate: Any, timeout: float = START_TIMEOUT_S) -> None:
        try:
            eventually_sync(predicate, what=what, within=timeout, every=0.05)
        except AssertionError as exc:
            raise TimeoutError(f"{exc}\n{self.logs()}") from None

    # --- teardown --------------------------------------------------------------------------------

    def logs(self) -> str:
        return "\n".join(f"----- {p.name} -----\n{p.log()[-4000:]}" for p in self.procs)

    def __enter__(self) -> System:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            proc.stop(timeout=15)
        self.redis.close()


class InFlightSampler(threading.Thread):
    """Reads the in_flight of some providers from Redis in a tight loop; one script per
    sample, so every sample is one instant."""

    def __init__(self, system: System, providers: list[str], pause_s: float = 0.001) -> None:
        super().__init__(daemon=True)
        self.redis = system.redis
        self.providers = providers
        self.pause_s = pause_s
        self.samples: list[dict[str, int]] = []
        self.stop_flag = threading.Event()

    def run(self) -> None:
        script = "local out = {} for i, k in ipairs(KEYS) do out[i] = redis.call('HGET', k, 'in_flight') end return out"
        provider_keys = [keys.provider(p) for p in self.providers]
        while not self.stop_flag.is_set():
            values = self.redis.eval(script, len(provider_keys), *provider_keys)
            self.samples.append({p: int(v or 0) for p, v in zip(self.providers, values, strict=True)})
            time.sleep(self.pause_s)


def sse_payloads(text: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def redis_outage(system: System, seconds: float) -> None:
    """SIGKILL Redis, keep it away ``seconds``, start it again on the same port and data dir
    (with ``appendonly`` it comes back with what it held)."""
    system.redis_server.stop(kill=True)
    time.sleep(seconds)
    system.redis_server.start()
    system.redis.close()
    system.redis = Redis.from_url(system.redis_server.url)


def leftovers(system: System, providers: list[str], models: list[str]) -> dict[str, int]:
    """Everything that should be zero once no request is open."""
    state = {f"in_flight {p}": system.in_flight(p) for p in providers}
    state |= {f"queued {m}": int(system.redis.zcard(keys.queue(m))) for m in models}
    state |= {
        "leases": int(system.redis.zcard(keys.LEASES)),
        "jobs": int(system.redis.hlen(keys.JOBS)),
        "bodies": int(system.redis.hlen(keys.BODIES)),
        "deadlines": int(system.redis.zcard(keys.DEADLINES)),
    }
    return state


def expected_pieces(tokens: int) -> list[str]:
    return [f"tok{i} " if i < tokens - 1 else f"tok{i}" for i in range(tokens)]


@dataclass
class Planned:
    """One chat request: its marker (the ``user`` field, which a fake provider with
    ``track_executions`` logs), its API, whether it streams, and the provider's timings for
    it alone (a fake provider with ``body_overrides``)."""

    marker: str
    api: str
    stream: bool
    delay_ms: int
    tokens: int
    interval_ms: int = 0
    model: str = "m"

    def body(self) -> dict[str, Any]:
        return {
            "model": self.model, "stream": self.stream, "user": self.marker,
            "messages": [{"role": "user", "content": self.marker}],
            "fake": {"delay_ms": self.delay_ms, "tokens": self.tokens, "token_interval_ms": self.interval_ms},
        }

    def send(self, timeout: float = 60) -> tuple[int, str]:
        """Status and body text (a stream read to its end)."""
        url = f"{self.api}/v1/chat/completions"
        if not self.stream:
            resp = httpx.post(url, json=self.body(), timeout=timeout)
            return resp.status_code, resp.text
        with httpx.stream("POST", url, json=self.body(), timeout=timeout) as resp:
            return resp.status_code, resp.read().decode()


def answer_problem(planned: Planned, result: Any) -> str | None:
    """None when ``result`` is exactly the complete answer to ``planned``, else what is wrong."""
    if not isinstance(result, tuple):
        return f"no answer: {result!r}"
    status, text = result
    if status != 200:
        return f"status {status}: {text[:300]}"
    pieces = expected_pieces(planned.tokens)
    if not planned.stream:
        answer = json.loads(text)
        if answer.get("model") != planned.model or answer["choices"][0]["message"]["content"] != "".join(pieces):
            return f"wrong JSON answer: {text[:300]}"
        return None
    payloads = sse_payloads(text)
    if not payloads or payloads[-1] != "[DONE]" or payloads.count("[DONE]") != 1:
        return f"stream does not end with one [DONE]: {payloads[-3:]}"
    chunks = [json.loads(p) for p in payloads[:-1]]
    errors = [c for c in chunks if "error" in c]
    if errors:
        return f"stream carries an error: {errors}"
    contents = [c["choices"][0]["delta"].get("content") for c in chunks]
    # The role chunk, every content chunk in order and once, the finish chunk.
    if contents != ["", *pieces, None] or chunks[-1]["choices"][0]["finish_reason"] != "stop":
        return f"stream chunks wrong: got {contents}, expected {['', *pieces, None]}"
    if any(c.get("model") != planned.model for c in chunks):
        return "stream chunk with a wrong model"
    return None


def http_provider(pid: str, ptype: str, port: int, capacity: int, models: list[str], **extra: Any) -> dict[str, Any]:
    return {"id": pid, "type": ptype, "base_url": f"http://127.0.0.1:{port}", "capacity": capacity,
            "models": models, **extra}


def api_with_config(system: System, name: str, config: dict[str, Any]) -> tuple[Proc, str]:
    """Another API process on the system's Redis, with a config of its own (written next to the
    system's: say, the system's config without some provider); its process and URL, once ready."""
    path = system.dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    port = system.port(name)
    proc = system._spawn(name, ["api", "--config", str(path), "--port", str(port), "--workers", "1"])
    url = f"http://127.0.0.1:{port}"
    wait_http(proc, f"{url}/readyz")
    return proc, url
