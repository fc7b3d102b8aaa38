"""``--log-format json``: one JSON object per line, from every process of a role."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import yaml

from iop.logs import JsonFormatter
from iop.redis_server import RedisServer, free_port


def record(msg: str, *args: object, exc: bool = False, **extra: str) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            exc_info = sys.exc_info()
    rec = logging.LogRecord("iop.worker", logging.WARNING, __file__, 1, msg, args, exc_info)
    for name, value in extra.items():
        setattr(rec, name, value)
    return rec


def test_a_line_holds_time_level_role_event_and_the_jobs_fields() -> None:
    line = json.loads(JsonFormatter("worker").format(
        record("job %s: %s", "j1", "connection reset", job="j1", model="qwen", provider="gpu-a")))
    assert line["level"] == "warning"
    assert line["role"] == "worker"
    assert line["logger"] == "iop.worker"
    assert line["event"] == "job j1: connection reset"
    assert (line["job"], line["model"], line["provider"]) == ("j1", "qwen", "gpu-a")
    assert line["time"].endswith("Z")
    assert "node" not in line


def test_an_exception_goes_in_the_same_line() -> None:
    text = JsonFormatter("api").format(record("failed", exc=True))
    assert "\n" not in text
    assert "ValueError: boom" in json.loads(text)["error"]


def lines_of(proc: subprocess.Popen[str], until: str, timeout: float = 60) -> list[str]:
    assert proc.stderr is not None
    out: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        out.append(line)
        if until in line:
            return out
    raise AssertionError(f"{until!r} not logged; got:\n{''.join(out)}")


def test_api_and_worker_processes_log_json(tmp_path: Path, redis_server: RedisServer) -> None:
    config = tmp_path / "iop.yaml"
    config.write_text(yaml.safe_dump({
        "redis": {"url": redis_server.url},
        "models": [{"id": "m", "providers": {"p": "served"}}],
        "nodes": [{"id": "n1", "providers": [
            {"id": "p", "type": "vllm", "base_url": f"http://127.0.0.1:{free_port()}", "models": ["served"]}]}],
    }))
    procs = [
        # Two server processes: uvicorn's children set their logging up themselves.
        subprocess.Popen([sys.executable, "-m", "iop", "api", "--config", str(config), "--port", str(free_port()),
                          "--workers", "2", "--log-format", "json"], stderr=subprocess.PIPE, text=True),
        subprocess.Popen([sys.executable, "-m", "iop", "worker", "--config", str(config), "--node", "n1",
                          "--log-format", "json"], stderr=subprocess.PIPE, text=True),
    ]
    try:
        api_lines = lines_of(procs[0], "API replica")
        worker_lines = lines_of(procs[1], "serving node n1")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
    for lines, role in ((api_lines, "api"), (worker_lines, "worker")):
        parsed = [json.loads(line) for line in lines]  # every line is one JSON object
        assert {p["role"] for p in parsed} == {role}, parsed
        assert all({"time", "level", "logger", "event"} <= p.keys() for p in parsed)
    assert any(p["logger"].startswith("uvicorn") for p in map(json.loads, api_lines))
