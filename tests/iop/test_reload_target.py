"""``iop reload --pid``: SIGHUP only to a process that reads its config file again on it
(``iop/reload_target.py``), checked against real processes: a ``sleep`` is refused and lives
on; an ``iop worker`` (started either way), and a server process of ``iop api --workers 2``,
are sent it and reload."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from iop.processes import Child
from iop.redis_server import RedisServer, free_port
from iop.reload_target import Target, iop_command, parent_of, process_at
from iop.reload_target import config_file as config_file_of
from iop.up import pid_file
from tests.dispatcher.config.one_model import ONE_MODEL
from tests.waiting import eventually_sync

ROOT = Path(__file__).resolve().parents[2]
CONSOLE_SCRIPT = Path(sys.executable).parent / "iop"


@pytest.mark.parametrize(("argv", "command"), [
    (["/srv/.venv/bin/python3", "/srv/.venv/bin/iop", "up", "--port", "8080"], "up"),  # the console script
    (["python3", "-m", "iop", "worker", "--node", "n"], "worker"),
    (["python3.11", "-u", "-X", "dev", "-W", "ignore", "-m", "iop", "api"], "api"),
    (["python", "-miop", "api"], "api"),
    (["iop", "fake-provider", "--port", "1"], "fake-provider"),
    (["sleep", "600"], None),
    (["python3", "-m", "uvicorn", "iop"], None),
    (["python3", "-c", "import iop; iop.main()", "up"], None),
    (["python3", "/srv/other.py", "iop", "up"], None),
    (["bash", "/srv/.venv/bin/iop", "up"], None),
    (["/srv/.venv/bin/python3", "/srv/.venv/bin/iop"], None),
    ([], None),
])
def test_the_iop_command_of_a_command_line(argv: list[str], command: str | None) -> None:
    assert iop_command(argv) == command


def reload(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "iop", "reload", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "600"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_process_that_is_not_iop_is_not_sent_sighup(sleeper: subprocess.Popen[bytes]) -> None:
    result = reload("--pid", str(sleeper.pid))
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.strip() == (f"process {sleeper.pid} is not an `iop up`, `iop api` or `iop worker`: "
                                     "sleep 600; nothing sent")
    time.sleep(0.5)  # a SIGHUP would have ended it by now
    assert sleeper.poll() is None


def test_a_pid_file_left_with_another_process_is_not_trusted(sleeper: subprocess.Popen[bytes]) -> None:
    port = free_port()
    path = pid_file(port)
    path.write_text(f"{sleeper.pid}\n")
    try:
        result = reload("--port", str(port))
    finally:
        path.unlink()
    assert result.returncode == 2
    assert f"({path} is left from an `iop up` that is gone?)" in result.stderr
    time.sleep(0.5)
    assert sleeper.poll() is None


def test_a_process_that_is_gone_is_said_so() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()  # reaped: no such pid (unless reused at once, which the kernel avoids)
    result = reload("--pid", str(proc.pid))
    assert result.returncode == 2
    assert result.stderr.strip() == f"no process {proc.pid}; nothing sent"


@pytest.fixture
def config_file(tmp_path: Path, redis_server: RedisServer) -> Path:
    path = tmp_path / "iop.yaml"
    path.write_text(yaml.safe_dump({**ONE_MODEL, "redis": {"url": redis_server.url}}))
    return path


def wait_for(child: Child, what: str, seen: int = 0) -> None:
    """Until ``what`` is in the child's log ``seen + 1`` times."""

    def logged() -> bool:
        assert child.alive(), child.log()
        return child.log().count(what) > seen

    try:
        eventually_sync(logged, within=30)
    except AssertionError as exc:
        if not child.alive():
            raise
        raise AssertionError(f"no {what!r} in the log of {child.name}:\n{child.log()}") from exc


def env_without_redis() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "IOP_REDIS_URL"}


@pytest.mark.parametrize("started", ["python -m iop", "console script"])
def test_an_iop_worker_is_sent_sighup_and_reloads(tmp_path: Path, config_file: Path, started: str) -> None:
    if started == "console script" and not CONSOLE_SCRIPT.exists():
        pytest.skip(f"no console script at {CONSOLE_SCRIPT}")
    entry = [sys.executable, "-m", "iop"] if started == "python -m iop" else [str(CONSOLE_SCRIPT)]
    worker = Child("worker", [*entry, "worker", "--config", str(config_file), "--node", "n"], env_without_redis(),
                   log_path=tmp_path / "worker.log").start()
    try:
        wait_for(worker, "serving node n")
        result = reload("--pid", str(worker.pid))
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"sent SIGHUP to {worker.pid} (iop worker)")
        wait_for(worker, f"reload: {config_file} applied")
    finally:
        worker.stop()


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if parent_of(int(entry.name)) == pid:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _servers_of(api: Child) -> Callable[[], list[int]]:
    def servers() -> list[int]:
        return [pid for pid in _children(api.pid) if "--multiprocessing-fork" in " ".join(process_at(pid).argv)]
    return servers


def test_a_server_process_of_iop_api_is_sent_sighup_and_reloads(tmp_path: Path, config_file: Path) -> None:
    api = Child("api", [sys.executable, "-m", "iop", "api", "--config", str(config_file), "--port", str(free_port()),
                        "--workers", "2"], env_without_redis(), log_path=tmp_path / "api.log").start()
    try:
        wait_for(api, "Application startup complete", seen=1)  # both server processes
        servers = _servers_of(api)()
        assert len(servers) == 2, api.log()
        one = servers[0]
        assert process_at(one).command == "api"
        # A change a reload cannot apply: the process that reloads says so in a warning.
        config = yaml.safe_load(config_file.read_text())
        config_file.write_text(yaml.safe_dump({**config, "api": {"max_body_bytes": 1000}}))
        result = reload("--pid", str(one))
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"sent SIGHUP to {one} (iop api)")
        said = "reload: $.api.max_body_bytes changed"
        wait_for(api, said)
        time.sleep(0.5)
        assert api.log().count(said) == 1  # that one process, not its sibling
        assert sorted(_servers_of(api)()) == sorted(servers)  # none replaced, as uvicorn's own SIGHUP would
    finally:
        api.stop()


def test_the_config_file_of_a_process_is_its_config_option_from_its_working_directory(tmp_path: Path) -> None:
    here = Path(os.getcwd())
    default = tmp_path / "demo.yaml"
    relative = Target(["iop", "api", "--config", "rel.yaml"], "api")
    assert config_file_of(os.getpid(), relative, default) == here / "rel.yaml"
    assert config_file_of(os.getpid(), Target(["iop", "worker", "--config=/etc/iop.yaml"], "worker"),
                       default) == Path("/etc/iop.yaml")
    assert config_file_of(os.getpid(), Target(["iop", "up", "--port", "1"], "up"), default) == default
    assert config_file_of(os.getpid(), Target(["iop", "worker", "--node", "n"], "worker"), default) is None


def test_a_file_with_problems_is_reported_and_not_sent(tmp_path: Path, config_file: Path) -> None:
    worker = Child("worker", [sys.executable, "-m", "iop", "worker", "--config", str(config_file), "--node", "n"],
                   env_without_redis(), log_path=tmp_path / "worker.log").start()
    try:
        wait_for(worker, "serving node n")
        config = yaml.safe_load(config_file.read_text())
        config_file.write_text(yaml.safe_dump({**config, "queue": {"max_queue": -1}, "bogus": 1}))
        result = reload("--pid", str(worker.pid))
        assert result.returncode == 2
        assert result.stdout == ""
        lines = result.stderr.splitlines()
        assert lines[0] == f"{config_file}: 2 problem(s); nothing sent (process {worker.pid} keeps its config)"
        assert any(line.startswith("  $.queue.max_queue") for line in lines), result.stderr
        assert any(line.startswith("  $.bogus") for line in lines), result.stderr
        # Fixed, the same command sends it, and the worker applies the file.
        config_file.write_text(yaml.safe_dump(config))
        result = reload("--pid", str(worker.pid))
        assert result.returncode == 0, result.stderr
        wait_for(worker, f"reload: {config_file} applied")
        assert "nothing changed" not in worker.log()  # the broken file never reached it
    finally:
        worker.stop()
