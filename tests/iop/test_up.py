"""``iop up`` end to end: the real supervisor process, its children, and its shutdown.

Each test runs ``python -m iop up`` on a copy of the bundled demo config whose fake provider
ports are rewritten to free ones. Every process it starts inherits a marker environment
variable, so the test can find all of them in ``/proc`` (even ones reparented after a crash)
and kill any that are left over, whatever happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
import yaml
from redis import Redis

from dispatcher import keys
from iop.cli import DEMO_CONFIG
from iop.redis_server import RedisServer, free_port

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")

ROOT = Path(__file__).resolve().parents[2]
UP_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 120.0
MARKER_VAR = "IOP_TEST_UP_MARKER"

# --- /proc helpers ----------------------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of ``pid``, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()  # the comm in parentheses may hold spaces
    return fields[0], int(fields[1])


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def children_of(ppid: int) -> list[int]:
    return [pid for pid in _pids() if (st := _stat(pid)) is not None and st[1] == ppid and st[0] != "Z"]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def marked(marker: str) -> list[int]:
    """Live processes whose environment carries ``marker`` (iop up and everything under it)."""
    needle = f"{MARKER_VAR}={marker}".encode()
    found = []
    for pid in _pids():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0") and alive(pid):
            found.append(pid)
    return found


def alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


# --- the iop up process -------------------------------------------------------------------------


def demo_copy(tmp_path: Path, **extra: Any) -> tuple[Path, dict[str, Any]]:
    """The demo config with every fake port (and the base_urls pointing at them) made free."""
    raw: dict[str, Any] = yaml.safe_load(DEMO_CONFIG.read_text())
    ports = {fake["port"]: free_port() for fake in raw["demo"]["fake_providers"]}
    assert len(set(ports.values())) == len(ports)
    for fake in raw["demo"]["fake_providers"]:
        fake["port"] = ports[fake["port"]]
    for node in raw["nodes"]:
        for prov in node["providers"]:
            parts = urlsplit(prov["base_url"])
            assert parts.port in ports, f"{prov['id']}: {prov['base_url']} is not one of the demo fakes"
            netloc = f"{parts.hostname}:{ports[parts.port]}"
            prov["base_url"] = urlunsplit(parts._replace(netloc=netloc))
    raw.update(extra)
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path, raw


class Up:
    """``python -m iop up`` with stdout read by a thread and stderr in a log file."""

    def __init__(
        self, tmp_path: Path, config: Path, port: int, env: dict[str, str] | None = None, args: tuple[str, ...] = ()
    ) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.marker = uuid.uuid4().hex
        base = {k: v for k, v in os.environ.items() if k != "IOP_REDIS_URL"}
        self.env = {**base, **(env or {}), MARKER_VAR: self.marker}
        self.stderr_path = tmp_path / "iop-up.stderr"
        self.lines: list[str] = []
        self.up = threading.Event()
        with self.stderr_path.open("wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "iop", "up", "--config", str(config), "--port", str(port), *args],
                stdout=subprocess.PIPE, stderr=err, env=self.env, cwd=ROOT, start_new_session=True,
            )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append(line)
            if line == "iop is up":
                self.up.set()
        self.proc.stdout.close()

    @property
    def stdout(self) -> str:
        return "\n".join(self.lines)

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""

    def report(self) -> str:
        return f"----- stdout -----\n{self.stdout}\n----- stderr -----\n{self.stderr[-6000:]}"

    def wait_up(self, timeout: float = UP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not self.up.wait(0.1):
            if self.proc.poll() is not None:
                self.reader.join(10)
                pytest.fail(f"iop up exited with {self.proc.returncode} before it was up\n{self.report()}")
            if time.monotonic() > deadline:
                pytest.fail(f"iop up not up within {timeout}s\n{self.report()}")
        # The summary follows "iop is up"; its last line is flushed with it.
        self.wait_line("Ctrl-C stops everything.")

    def wait_line(self, text: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.lines:
            if time.monotonic() > deadline:
                pytest.fail(f"no line {text!r} within {timeout}s\n{self.report()}")
            time.sleep(0.05)

    def descendants(self) -> list[int]:
        """Live processes under iop up: its process tree, plus anything carrying the marker
        (which survives reparenting; redis-server overwrites its environ, the tree finds it)."""
        found = set(marked(self.marker))
        # Once iop up has exited its pid may be reused: only the marker is trusted then.
        todo = [self.proc.pid] if self.proc.poll() is None else []
        while todo:
            for child in children_of(todo.pop()):
                if child not in found:
                    found.add(child)
                todo.append(child)
        found.discard(self.proc.pid)
        return sorted(found)

    def interrupt(self, signum: int = signal.SIGINT, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGINT to the supervisor only (not its group), as a terminal's Ctrl-C would reach it."""
        self.proc.send_signal(signum)
        return self.wait_exit(timeout)

    def wait_exit(self, timeout: float = STOP_TIMEOUT_S) -> int:
        try:
            status = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"iop up still running after {timeout}s\n{self.report()}")
        # EOF on stdout: no child holds the pipe any more either.
        self.reader.join(30)
        assert not self.reader.is_alive(), f"stdout still open after iop up exited\n{self.report()}"
        return status

    def embedded_redis(self) -> list[int]:
        """The embedded redis-server named in the summary, wherever it is now (it clobbers its
        environ, so the marker cannot find it once it has been reparented)."""
        found = re.search(r"redis    redis://127\.0\.0\.1:(\d+)/0 \(embedded ", self.stdout)
        if found is None:
            return []
        title = f"redis-server 127.0.0.1:{found.group(1)}"
        return [pid for pid in _pids() if title in cmdline(pid) and alive(pid)]

    def kill_all(self) -> None:
        victims = [*self.descendants(), *self.embedded_redis()]
        if self.proc.poll() is None:
            victims.append(self.proc.pid)
        for pid in victims:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


@pytest.fixture
def start_up(tmp_path: Path) -> Iterator[Any]:
    started: list[Up] = []

    def start(
        config: Path, port: int | None = None, env: dict[str, str] | None = None, args: tuple[str, ...] = ()
    ) -> Up:
        up = Up(tmp_path, config, port or free_port(), env, args)
        started.append(up)
        return up

    yield start
    for up in started:
        up.kill_all()


def chat(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


def served_names(raw: dict[str, Any]) -> dict[str, set[str]]:
    return {m["id"]: set(m["providers"].values()) for m in raw["models"]}


# --- tests --------------------------------------------------------------------------------------


def test_up_serves_the_demo_and_stops_everything_on_sigint(tmp_path: Path, start_up: Any) -> None:
    config, raw = demo_copy(tmp_path)
    up: Up = start_up(config)
    up.wait_up()

    out = up.stdout
    assert f"  api      {up.url}/v1" in out
    assert "(embedded " in out  # no IOP_REDIS_URL, no redis.url: its own redis-server
    said = re.fullmatch(r"redis: (redis://127\.0\.0\.1:[0-9]+/0) \(embedded .*\)", up.lines[0])
    assert said is not None, up.report()  # the first thing it says
    # Its workers and API say which Redis they were given.
    assert f"Redis: {said[1]} (IOP_REDIS_URL)" in up.stderr, up.report()
    for fake in raw["demo"]["fake_providers"]:
        assert f"  fake     http://127.0.0.1:{fake['port']} serving " in out
    for node in raw["nodes"]:
        assert f"  worker   node {node['id']} " in out
    assert f"models: {', '.join(served_names(raw))}" in out

    with httpx.Client(base_url=up.url, timeout=60) as client:
        resp = client.get("/v1/models")
        assert resp.status_code == 200, resp.text
        assert {m["id"] for m in resp.json()["data"]} == set(served_names(raw))

        for model, names in served_names(raw).items():
            resp = client.post("/v1/chat/completions", json=chat(model))
            assert resp.status_code == 200, f"{model}: {resp.status_code} {resp.text}\n{up.report()}"
            assert resp.json()["model"] == model
            assert resp.headers["x-iop-served-model"] in names, resp.headers

        model = next(iter(served_names(raw)))
        with client.stream("POST", "/v1/chat/completions", json=chat(model, stream=True)) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            body = resp.read().decode()
        events = [line for line in body.splitlines() if line.strip()]
        assert len(events) > 2, body
        assert events[-1] == "data: [DONE]", body

    # The client commands find it through IOP_URL, as its banner says.
    assert (f"`export IOP_URL={up.url}` points `iop catalog`, `iop provider`, `iop model`, `iop overrides`, "
            "`iop audit` and `iop qualify` at it (else give them --url).") in up.lines, up.report()
    done = subprocess.run([sys.executable, "-m", "iop", "catalog", "--json"], capture_output=True, text=True,
                          timeout=60, env={**up.env, "IOP_URL": up.url}, cwd=ROOT)
    assert done.returncode == 0, done.stderr + up.report()
    assert {m["id"] for m in json.loads(done.stdout)["models"]} == set(served_names(raw))

    # Everything the supervisor started, before it is told to stop.
    children = children_of(up.proc.pid)
    everything = up.descendants()
    assert set(children) <= set(everything)
    roles = [cmdline(pid) for pid in children]
    assert sum("redis-server" in c for c in roles) == 1, roles
    redis_pids = up.embedded_redis()
    assert len(redis_pids) == 1
    assert set(redis_pids) <= set(children)
    assert sum(" fake-provider " in c for c in roles) == len(raw["demo"]["fake_providers"]), roles
    assert sum(" worker " in c for c in roles) == len(raw["nodes"]), roles
    assert sum(" api " in c for c in roles) == 1, roles

    status = up.interrupt()
    assert status == 0, up.report()
    assert "stopping..." in up.lines, up.report()
    assert up.lines[-1] == "stopped.", up.report()
    left = [(pid, cmdline(pid)) for pid in everything if alive(pid)]
    assert not left, f"still running after iop up exited: {left}"
    assert not up.descendants()
    assert not up.embedded_redis()
    assert not accepts(up.port)
    for fake in raw["demo"]["fake_providers"]:
        assert not accepts(fake["port"]), f"fake on {fake['port']} still listening"
    assert "Traceback" not in up.stderr, up.stderr[-6000:]
    # Reverse order: the API has finished before the workers are told to drain.
    err = up.stderr
    assert err.index("Finished server process") < err.index("got SIGTERM"), err[-6000:]


def test_up_sigterm_stops_every_api_process(tmp_path: Path, start_up: Any) -> None:
    """SIGTERM works like Ctrl-C; with --api-workers 2 the API's own children go too."""
    config, _ = demo_copy(tmp_path)
    up: Up = start_up(config, args=("--api-workers", "2"))
    up.wait_up()
    assert f"  api      {up.url}/v1 (2 process(es)" in up.stdout
    resp = httpx.get(f"{up.url}/v1/models", timeout=30)
    assert resp.status_code == 200
    everything = up.descendants()
    assert len(everything) > len(children_of(up.proc.pid)), "no grandchildren: uvicorn runs one process?"

    assert up.interrupt(signal.SIGTERM) == 0, up.report()
    assert up.lines[-1] == "stopped.", up.report()
    assert not [(pid, cmdline(pid)) for pid in everything if alive(pid)]
    assert not accepts(up.port)


def test_up_stops_everything_when_a_child_dies(tmp_path: Path, start_up: Any) -> None:
    config, raw = demo_copy(tmp_path)
    up: Up = start_up(config)
    up.wait_up()
    everything = up.descendants()
    fake_port = raw["demo"]["fake_providers"][0]["port"]
    fakes = [pid for pid in children_of(up.proc.pid) if f" --port {fake_port} " in cmdline(pid)]
    assert len(fakes) == 1, [cmdline(pid) for pid in children_of(up.proc.pid)]
    os.kill(fakes[0], signal.SIGKILL)

    assert up.wait_exit() == 1, up.report()
    assert f"fake http://127.0.0.1:{fake_port} exited with status -9; stopping" in up.stderr, up.report()
    assert up.lines[-1] == "stopped.", up.report()
    assert not [(pid, cmdline(pid)) for pid in everything if alive(pid)]
    assert not accepts(up.port)


def _interrupt_during_startup(tmp_path: Path, start_up: Any) -> tuple[Up, list[int], int]:
    """SIGINT as soon as the first fake provider listens, while iop up is still starting."""
    config, _ = demo_copy(tmp_path)
    up: Up = start_up(config)
    deadline = time.monotonic() + UP_TIMEOUT_S
    while not any(line.startswith("fake provider listening") for line in up.lines):
        if up.proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no fake provider started\n{up.report()}")
        time.sleep(0.01)
    everything = up.descendants()
    up.proc.send_signal(signal.SIGINT)
    status = up.wait_exit()
    # Whatever it started later is gone too: it was in iop up's tree, and the pipe is closed.
    return up, everything, status


def test_up_sigint_during_startup_still_stops_everything(tmp_path: Path, start_up: Any) -> None:
    up, everything, status = _interrupt_during_startup(tmp_path, start_up)
    assert status == 0, up.report()
    assert up.lines[-1] == "stopped.", up.report()
    assert everything, "nothing was running yet"
    assert not [(pid, cmdline(pid)) for pid in everything if alive(pid)]
    assert not up.descendants()
    assert not accepts(up.port)


def test_up_sigint_during_startup_does_not_announce_up(tmp_path: Path, start_up: Any) -> None:
    up, _, status = _interrupt_during_startup(tmp_path, start_up)
    assert status == 0, up.report()
    assert "iop is up" not in up.lines, up.report()


@pytest.mark.parametrize("where", ["env", "config"])
def test_up_uses_a_configured_redis(tmp_path: Path, start_up: Any, where: str) -> None:
    with RedisServer() as server:
        extra = {"redis": {"url": server.url}} if where == "config" else {}
        config, raw = demo_copy(tmp_path, **extra)
        env = {"IOP_REDIS_URL": server.url} if where == "env" else {}
        up: Up = start_up(config, env=env)
        up.wait_up()
        source = "IOP_REDIS_URL" if where == "env" else "redis.url"
        assert f"  redis    {server.url} ({source})" in up.lines, up.report()
        assert up.lines[0] == f"redis: {server.url} ({source})", up.report()  # said before anything starts
        assert "(embedded " not in up.stdout

        everything = up.descendants()
        redises = [pid for pid in everything if "redis-server" in cmdline(pid)]
        assert not redises, [cmdline(pid) for pid in redises]
        roles = [cmdline(pid) for pid in children_of(up.proc.pid)]
        assert not any("redis-server" in c for c in roles), roles

        provider_ids = [p["id"] for node in raw["nodes"] for p in node["providers"]]
        with Redis.from_url(server.url) as client:
            deadline = time.monotonic() + 30
            while True:
                missing = [pid for pid in provider_ids if not client.exists(keys.provider(pid))]
                if not missing:
                    break
                if time.monotonic() > deadline:
                    pytest.fail(f"no provider hash for {missing} in the configured Redis\n{up.report()}")
                time.sleep(0.1)
            for node in raw["nodes"]:
                for prov in node["providers"]:
                    fields = {k.decode(): v.decode() for k, v in client.hgetall(keys.provider(prov["id"])).items()}
                    assert fields.get("node") == node["id"], fields

            assert up.interrupt() == 0, up.report()
            assert "stopped." in up.lines
            assert not [pid for pid in everything if alive(pid)]
            # iop up does not own a configured Redis: it is still there.
            assert client.ping()


def test_up_fails_fast_on_a_configured_redis_that_cannot_be_reached(tmp_path: Path, start_up: Any) -> None:
    config, raw = demo_copy(tmp_path)
    nowhere = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    up: Up = start_up(config, env={"IOP_REDIS_URL": nowhere})
    try:
        status = up.proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"iop up did not exit\n{up.report()}")
    up.reader.join(30)
    assert status == 1, up.report()
    assert up.lines[0] == f"redis: {nowhere} (IOP_REDIS_URL)", up.report()
    failed = [line for line in up.stderr.splitlines() if line.startswith("iop up failed: ")]
    assert len(failed) == 1, up.report()
    assert failed[0].startswith(f"iop up failed: cannot reach Redis at {nowhere}: "), up.report()
    assert "Traceback" not in up.stderr
    # Nothing was started before it: no fake provider listens.
    assert not any(accepts(fake["port"]) for fake in raw["demo"]["fake_providers"])
    assert not any(line.startswith("  fake ") for line in up.lines), up.report()


def test_the_demo_qualifies_out_of_the_box(tmp_path: Path, start_up: Any) -> None:
    """`iop qualify --model qwen3.6:35b` against `iop up`'s demo, found through IOP_URL: the
    demo allows runs, and its fakes (every call at once) grow up to each provider's capacity,
    which the report names instead of a knee it did not find."""
    config, _ = demo_copy(tmp_path)
    up: Up = start_up(config)
    up.wait_up()
    done = subprocess.run([sys.executable, "-m", "iop", "qualify", "--model", "qwen3.6:35b", "--json",
                           "--requests", "2"], capture_output=True, text=True, timeout=300,
                          env={**up.env, "IOP_URL": up.url}, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["cancelled"] is False, report["notes"]
    providers = {p["provider"]: p for p in report["providers"]}
    assert set(providers) == {"gpu-a-vllm", "gpu-b-ollama"}
    for pid, capacity in (("gpu-a-vllm", 4), ("gpu-b-ollama", 3)):
        p = providers[pid]
        assert p["errors"] == 0, p
        assert p["suggested_capacity"] is None, p  # never 8 (a step past its capacity), never a bound
        assert p["sweep_cut_by"] == ["capacity"], p
        assert max(int(c) for c in p["throughput"]) <= capacity, p["throughput"]
        assert any(n.startswith(f"{pid}: no knee found") for n in report["notes"]), report["notes"]
    assert up.interrupt() == 0, up.report()


@pytest.mark.parametrize("taken", ["fake", "api"])
def test_up_fails_cleanly_when_a_port_is_taken(tmp_path: Path, start_up: Any, taken: str) -> None:
    config, raw = demo_copy(tmp_path)
    api_port = free_port()
    # The last fake, so that Redis and the earlier fakes are running when the clash is found.
    port = raw["demo"]["fake_providers"][-1]["port"] if taken == "fake" else api_port
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", port))
        blocker.listen()
        up: Up = start_up(config, port=api_port)

        # Watch what it starts while it runs, to check afterwards that all of it is gone.
        seen: set[int] = set()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while up.proc.poll() is None and not up.up.is_set():
            if time.monotonic() > deadline:
                pytest.fail(f"iop up did not exit\n{up.report()}")
            seen.update(up.descendants())
            time.sleep(0.02)
        try:
            status = up.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"iop up did not exit\n{up.report()}")
        up.reader.join(30)

    assert status == 1, up.report()
    assert not up.up.is_set(), up.report()
    err = up.stderr
    assert f"iop up failed: port 127.0.0.1:{port}" in err, up.report()
    assert "already in use" in err
    assert "Traceback" not in err
    assert "stopped." in up.lines
    left = [(pid, cmdline(pid)) for pid in seen | set(up.descendants()) if alive(pid)]
    assert not left, f"left behind: {left}"
    assert not up.reader.is_alive()


def test_iop_reload_adds_and_removes_nodes_and_reaches_every_api_process(tmp_path: Path, start_up: Any) -> None:
    """`iop reload` finds iop up by its pid file: a new node gets a worker, a removed node's
    worker drains and exits, and both API processes (uvicorn's supervisor would restart
    them on SIGHUP) apply the file themselves."""
    config, raw = demo_copy(tmp_path)
    up: Up = start_up(config, args=("--api-workers", "2"))
    up.wait_up()
    gone = next(n for n in raw["nodes"] if n["id"] == "gpu-b")
    gone_ids = {p["id"] for p in gone["providers"]}
    raw["nodes"].remove(gone)
    vllm = raw["nodes"][0]["providers"][0]
    raw["nodes"].append({"id": "gpu-c", "providers": [{**vllm, "id": "gpu-c-extra", "capacity": 2}]})
    for model in raw["models"]:
        model["providers"] = {pid: name for pid, name in model["providers"].items() if pid not in gone_ids}
    raw["models"][0]["providers"]["gpu-c-extra"] = vllm["models"][0]
    config.write_text(yaml.safe_dump(raw, sort_keys=False))

    done = subprocess.run([sys.executable, "-m", "iop", "reload", "--port", str(up.port)], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    up.wait_line("reload: node gpu-b removed; its worker drains and exits")
    expected = {"gpu-a-vllm", "gpu-a-sglang", "gpu-c-extra"}

    def every_process_reloaded() -> bool:
        # Two API processes share the port: several reads in a row must all agree.
        for _ in range(8):
            providers = httpx.get(f"{up.url}/catalog", timeout=10).json()["providers"]
            if {p["id"] for p in providers} != expected or any(p["health"] != "available" for p in providers):
                return False
        return True

    deadline = time.monotonic() + UP_TIMEOUT_S
    while not every_process_reloaded():
        assert time.monotonic() < deadline, f"not every API process reloaded\n{up.report()}"
        time.sleep(0.2)
    while sum(" worker " in cmdline(pid) for pid in children_of(up.proc.pid)) != 2:
        assert time.monotonic() < deadline, f"the removed node's worker did not exit\n{up.report()}"
        time.sleep(0.2)
    model = raw["models"][0]["id"]
    with httpx.Client(base_url=up.url, timeout=60) as client, ThreadPoolExecutor(8) as pool:
        # At once: ties go to the same provider, a busy pool spreads.
        answers = list(pool.map(lambda _: client.post("/v1/chat/completions", json=chat(model)), range(8)))
    assert [r.status_code for r in answers] == [200] * 8
    seen = {r.headers["x-iop-provider"] for r in answers}
    assert seen <= {"gpu-a-vllm", "gpu-c-extra"}
    assert "gpu-c-extra" in seen

    missing = subprocess.run([sys.executable, "-m", "iop", "reload", "--port", str(free_port())],
                             capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert missing.returncode == 2
    assert "no `iop up` on port" in missing.stderr
    assert up.interrupt() == 0, up.report()
    assert not up.descendants()
