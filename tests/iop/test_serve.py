"""``iop api`` and ``iop worker`` (``iop/serve.py``): each says at start which Redis it uses.

A process that finds no ``redis.url`` and no ``IOP_REDIS_URL`` uses ``redis://127.0.0.1:6379/0``,
which may be some other program's Redis: it says so, as a warning. No test here starts one
that way (it would write to whatever listens on 6379): the default is checked in-process,
the start-up line of each process kind against a private Redis.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import pytest
import yaml

from dispatcher import config as cfg
from iop.processes import Child
from iop.redis_server import RedisServer, free_port
from iop.serve import log_redis
from tests.dispatcher.config.one_model import ONE_MODEL

ROOT = Path(__file__).resolve().parents[2]


def test_the_default_redis_is_named_in_a_warning(caplog: pytest.LogCaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("IOP_REDIS_URL", raising=False)
    with caplog.at_level(logging.INFO):
        log_redis(logging.getLogger("iop.worker"), cfg.parse(ONE_MODEL).config.redis)
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage() == ("Redis: redis://127.0.0.1:6379/0, the default: neither IOP_REDIS_URL nor "
                                   "redis.url is set")


def test_a_configured_redis_is_named_without_its_password(caplog: pytest.LogCaptureFixture,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IOP_REDIS_URL", "redis://iop:hunter2@10.0.0.9:6379/4")
    with caplog.at_level(logging.INFO):
        log_redis(logging.getLogger("iop.api"), cfg.parse(ONE_MODEL).config.redis)
    [record] = caplog.records
    assert record.levelno == logging.INFO
    assert record.getMessage() == "Redis: redis://iop:***@10.0.0.9:6379/4 (IOP_REDIS_URL)"


def _start_and_read(name: str, args: list[str], env: dict[str, str], log: Path, needle: str) -> str:
    """The line of the process's log holding ``needle``, once it is there; the process is stopped."""
    child = Child(name, [sys.executable, "-m", "iop", *args], env, log_path=log).start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            found = [line for line in child.log().splitlines() if needle in line]
            if found:
                return found[0]
            assert child.alive(), child.log()
            time.sleep(0.05)
        pytest.fail(f"{name} said nothing about {needle!r}:\n{child.log()}")
    finally:
        child.stop(timeout=30)


@pytest.mark.parametrize("where", ["env", "file"])
def test_api_and_worker_say_at_start_which_redis_they_use(tmp_path: Path, redis_server: RedisServer,
                                                          where: str) -> None:
    path = tmp_path / "iop.yaml"
    path.write_text(yaml.safe_dump({**ONE_MODEL, **({"redis": {"url": redis_server.url}} if where == "file" else {})}))
    env = {k: v for k, v in os.environ.items() if k != "IOP_REDIS_URL"}
    if where == "env":
        env["IOP_REDIS_URL"] = redis_server.url
    source = "IOP_REDIS_URL" if where == "env" else "redis.url"
    worker = _start_and_read("worker", ["worker", "--config", str(path), "--node", "n"], env, tmp_path / "w.log",
                             "Redis:")
    assert worker.endswith(f"Redis: {redis_server.url} ({source})"), worker
    assert "iop.worker" in worker
    api = _start_and_read("api", ["api", "--config", str(path), "--port", str(free_port())], env,
                          tmp_path / "a.log", "Redis:")
    assert api.endswith(f"Redis: {redis_server.url} ({source})"), api
    assert "iop.api" in api


def test_the_api_server_keeps_idle_connections_for_keep_alive_s(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """uvicorn's own idle limit (5 s) equals httpx's, so a client could reuse a connection in
    the instant the server closes it; the server is given ``api.keep_alive_s`` instead."""
    import iop.serve

    path = tmp_path / "iop.yaml"
    path.write_text(yaml.safe_dump({**ONE_MODEL, "api": {"keep_alive_s": 42.5}}))
    given: dict[str, object] = {}
    monkeypatch.setattr(iop.serve.uvicorn, "run", lambda app, **options: given.update(options))
    monkeypatch.setattr(iop.serve.logs, "configure", lambda *args, **kwargs: None)
    monkeypatch.setenv("IOP_REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("IOP_CONFIG", "")  # serve_api sets it for its server processes; restored after
    config = cfg.parse(yaml.safe_load(path.read_text())).config
    iop.serve.serve_api(config, str(path), host="127.0.0.1", port=1, workers=1, log_level="warning")
    assert given["timeout_keep_alive"] == 42.5
    assert cfg.parse(ONE_MODEL).config.api.keep_alive_s > 60  # past nginx's and cloud balancers' 60 s
