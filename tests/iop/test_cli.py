"""The ``iop`` command line: ``config check``, argument errors, ``worker``, ``fake-provider``,
``catalog`` (its table, against a stand-in ``/catalog``).

Most cases call :func:`iop.cli.main` in-process (capsys); the ones that are about the real
console script (exit status of ``python -m iop``, a long-running server and its signals)
run it as a subprocess.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from dispatcher.config import ProviderConfig
from dispatcher.config.validation import NO_MODELS
from dispatcher.endpoints import DEFAULT_ENDPOINTS
from iop.catalog_cli import SHORT_ENDPOINTS, WIDTH, render
from iop.cli import DEMO_CONFIG, build_parser, main
from iop.redis_server import free_port
from iop.up import _fake_models

ROOT = Path(__file__).resolve().parents[2]

VALID = """
models:
  - id: m1
    providers: {p1: served-1, p2: served-2}
  - id: m2
    providers: {p2: served-3}
nodes:
  - id: n1
    providers:
      - {id: p1, type: vllm, base_url: "http://127.0.0.1:9", capacity: 3, models: [served-1]}
  - id: n2
    providers:
      - {id: p2, type: ollama, base_url: "http://127.0.0.1:10/v1", capacity: 5, models: [served-2, served-3]}
      - {id: p3, type: openai_api, base_url: "http://127.0.0.1:11", models: [x]}
"""

# Several independent problems, all of which the validator must list at once.
BROKEN = """
models:
  - id: m1
    providers: {p1: not-served, ghost: whatever}
  - id: m1
    providers: {p1: served-1}
nodes:
  - id: n1
    providers:
      - {id: p1, type: vllm, base_url: "http://127.0.0.1:9", capacity: -1, models: [served-1]}
      - {id: p2, type: nonsense, base_url: "ftp://x"}
queue:
  max_queue: -5
"""

BROKEN_PATHS = {
    "$.models[0].providers.p1": "not-served",
    "$.models[0].providers.ghost": "ghost",
    "$.models[1].id": "duplicate model id",
    "$.nodes[0].providers[0].capacity": "must be >= 0",
    "$.nodes[0].providers[1].type": "unknown type",
    "$.nodes[0].providers[1].base_url": "http://",
    "$.queue.max_queue": "must be >= 0",
}


def run_iop(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "IOP_REDIS_URL"}
    return subprocess.run([sys.executable, "-m", "iop", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def call_main(*args: str) -> int:
    """``main(args)``'s status, whether it returns it or raises SystemExit (argparse, _load)."""
    try:
        return main(list(args))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1


# --- config check ---------------------------------------------------------------------------


def test_config_check_valid_file_prints_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text(VALID)
    assert call_main("config", "check", str(path)) == 0
    out, err = capsys.readouterr()
    first = out.splitlines()[0]
    assert first.startswith(f"{path}: OK")
    assert "2 model(s)" in first
    assert "2 node(s)" in first
    assert "3 provider(s)" in first
    assert "total capacity 9" in first  # 3 + 5 + the default 1
    # One line per model, naming its pool with the served names.
    assert "m1: p1 -> served-1, p2 -> served-2" in out
    assert "m2: p2 -> served-3" in out
    assert err == ""


def test_config_check_lists_every_problem_with_its_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(BROKEN)
    assert call_main("config", "check", str(path)) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert lines[0].startswith(f"{path}: ")
    assert "problem(s)" in lines[0]
    count = int(lines[0].split(": ")[1].split()[0])
    assert count == len(lines) - 1 >= len(BROKEN_PATHS)
    for where, words in BROKEN_PATHS.items():
        matching = [line for line in lines[1:] if line.strip().startswith(f"{where}: ")]
        assert matching, f"no problem reported at {where}:\n{err}"
        assert any(words in line for line in matching), f"{where}: expected {words!r} in {matching}"


def test_config_check_reports_type_errors_and_unknown_fields_with_everything_else(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    # Before, the first of them was all it said: each fix showed the next problem.
    path = tmp_path / "broken.yaml"
    path.write_text(BROKEN.replace("max_queue: -5", "max_queue: -5\n  queue_timeout_ms: soon\n  max_qeue: 3")
                    .replace("capacity: -1,", "capacity: -1, capcity: 3,"))
    assert call_main("config", "check", str(path)) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"{path}: {len(BROKEN_PATHS) + 3} problem(s)"
    assert [line.split(": ")[0].strip() for line in lines[1:]] == [  # in the order of the file
        "$.models[0].providers.p1", "$.models[0].providers.ghost", "$.models[1].id",
        "$.nodes[0].providers[0].capacity", "$.nodes[0].providers[0].capcity",
        "$.nodes[0].providers[1].type", "$.nodes[0].providers[1].base_url",
        "$.queue.max_queue", "$.queue.queue_timeout_ms", "$.queue.max_qeue",
    ]
    assert "  $.queue.queue_timeout_ms: Expected `int`, got `str`" in lines
    assert "  $.queue.max_qeue: unknown field `max_qeue`" in lines


def test_config_check_refuses_a_config_without_a_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing yet\n")
    assert call_main("config", "check", str(path)) == 2
    out, err = capsys.readouterr()
    assert out == ""  # not "OK - 0 model(s)"
    assert err.splitlines() == [f"{path}: 1 problem(s)", f"  $.models: {NO_MODELS}"]


def test_config_check_unknown_field_names_its_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text("queue:\n  max_qeue: 3\n")
    assert call_main("config", "check", str(path)) == 2
    err = capsys.readouterr().err
    assert "$.queue.max_qeue: unknown field" in err


def test_config_check_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "nope.yaml"
    assert call_main("config", "check", str(path)) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert str(path) in err
    assert "cannot read" in err
    assert "No such file" in err
    assert "Traceback" not in err


def test_config_check_subprocess_exit_statuses(tmp_path: Path) -> None:
    """The console script itself: 0 on the demo config, 2 on a broken or missing file."""
    demo = run_iop("config", "check", str(DEMO_CONFIG))
    assert demo.returncode == 0, demo.stderr
    assert "OK - 2 model(s), 2 node(s), 4 provider(s)" in demo.stdout

    broken = tmp_path / "broken.yaml"
    broken.write_text(BROKEN)
    bad = run_iop("config", "check", str(broken))
    assert bad.returncode == 2
    assert bad.stdout == ""
    for where in BROKEN_PATHS:
        assert f"{where}: " in bad.stderr

    missing = run_iop("config", "check", str(tmp_path / "missing.yaml"))
    assert missing.returncode == 2
    assert "cannot read" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_config_check_demo_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert call_main("config", "check", str(DEMO_CONFIG)) == 0
    out = capsys.readouterr().out
    demo = yaml.safe_load(DEMO_CONFIG.read_text())
    for model in demo["models"]:
        assert f"  {model['id']}: " in out


def test_config_check_ignores_redis_url_env(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IOP_REDIS_URL", "redis://127.0.0.1:1/0")
    assert call_main("config", "check", str(DEMO_CONFIG)) == 0
    assert "OK" in capsys.readouterr().out


# --- argument errors and worker ---------------------------------------------------------------


def test_no_subcommand_prints_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert call_main() == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: iop")
    assert "required" in err


def test_no_subcommand_subprocess() -> None:
    result = run_iop()
    assert result.returncode == 2
    assert "usage: iop" in result.stderr
    for command in ("up", "api", "worker", "config", "fake-provider"):
        assert command in result.stderr


def test_config_without_check_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert call_main("config") == 2
    assert "usage: iop config" in capsys.readouterr().err


def test_worker_unknown_node_names_known_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    assert call_main("worker", "--config", str(DEMO_CONFIG), "--node", "unknown") == 2
    err = capsys.readouterr().err
    assert "'unknown'" in err
    assert "gpu-a" in err
    assert "gpu-b" in err


def test_worker_unknown_node_subprocess() -> None:
    result = run_iop("worker", "--config", str(DEMO_CONFIG), "--node", "unknown")
    assert result.returncode == 2
    assert "no node 'unknown' (nodes: gpu-a, gpu-b)" in result.stderr


def test_worker_of_a_config_without_a_model_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("queue: {max_queue: 1}\n")
    assert call_main("worker", "--config", str(path), "--node", "n1") == 2
    assert f"$.models: {NO_MODELS}" in capsys.readouterr().err


def test_worker_with_broken_config_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(BROKEN)
    assert call_main("worker", "--config", str(path), "--node", "n1") == 2
    assert "$.queue.max_queue" in capsys.readouterr().err


@pytest.mark.parametrize("command", [("api", "--port", "0"), ("worker", "--node", "n1")], ids=["api", "worker"])
def test_a_redis_that_cannot_be_reached_at_start_is_one_line_and_exit_1(
    tmp_path: Path, command: tuple[str, ...]
) -> None:
    nowhere = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    path = tmp_path / "iop.yaml"
    path.write_text(VALID + f"redis:\n  url: {nowhere}\n")
    result = run_iop(command[0], "--config", str(path), *command[1:])
    assert result.returncode == 1, result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith(f"cannot reach Redis at {nowhere}: "), result.stderr
    assert "Traceback" not in result.stderr
    assert "Redis is unavailable" not in result.stderr  # no retry loop's warnings: it never started


def test_up_with_missing_config_exits_2_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert call_main("up", "--config", str(tmp_path / "missing.yaml"), "--port", str(free_port())) == 2
    out, err = capsys.readouterr()
    assert "cannot read" in err
    assert "iop is up" not in out


# --- fake-provider ----------------------------------------------------------------------------


def _wait_port(port: int, proc: subprocess.Popen[Any], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"fake-provider exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"fake-provider did not listen on {port} within {timeout}s")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_fake_provider_serves_models_and_stops_on_signal(tmp_path: Path, signum: int) -> None:
    port = free_port()
    log = tmp_path / "fake.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "iop", "fake-provider", "--port", str(port),
                                 "--models", "a,b"], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        _wait_port(port, proc)
        resp = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10)
        assert resp.status_code == 200
        body = resp.json()
        assert body["object"] == "list"
        assert sorted(m["id"] for m in body["data"]) == ["a", "b"]
        proc.send_signal(signum)
        status = proc.wait(timeout=30)
        assert status in (0, -signum), log.read_text()
        assert f"listening on http://127.0.0.1:{port}" in log.read_text()
        assert "Traceback" not in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # The port is released.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


# --- the demo config's promise ----------------------------------------------------------------


def test_demo_config_pools_and_fakes() -> None:
    """Every demo model has >= 2 providers with different served names and capacities, and every
    provider's base_url is one of the fakes ``iop up`` starts, which reports the served names."""
    from dispatcher import config as cfg

    raw = yaml.safe_load(DEMO_CONFIG.read_text())
    config = cfg.load(DEMO_CONFIG).config
    providers = {p.id: p for _, p in config.providers()}
    fakes = {(f.host, f.port) for f in config.demo.fake_providers}
    assert len(fakes) == len(config.demo.fake_providers), "two fakes on one port"

    assert [m.id for m in config.models] == [m["id"] for m in raw["models"]]
    for model in config.models:
        assert len(model.providers) >= 2, f"{model.id} has a pool of one"
        served = list(model.providers.values())
        assert len(set(served)) == len(served), f"{model.id}: served names repeat: {served}"
        capacities = [providers[pid].capacity for pid in model.providers]
        assert len(set(capacities)) > 1, f"{model.id}: every provider has capacity {capacities[0]}"

    for prov in providers.values():
        assert prov.base_url is not None
        parts = urlsplit(prov.base_url)
        assert parts.port is not None
        host = "127.0.0.1" if parts.hostname == "localhost" else parts.hostname
        assert (host, parts.port) in fakes, f"{prov.id}: {prov.base_url} is served by no demo fake"
        # The fake on that port reports every name this provider serves.
        assert set(prov.models) <= set(_fake_models(config, host, parts.port))


# --- iop catalog ----------------------------------------------------------------------------------


def _catalog_provider(pid: str, ptype: str, capacity: int, in_flight: int = 0, **extra: Any) -> dict[str, Any]:
    """One ``providers[]`` entry of ``GET /catalog`` (dispatcher/catalog.py ``ProviderView``)."""
    endpoints = list(ProviderConfig(id=pid, type=ptype).served_endpoints)
    return {
        "id": pid, "node_id": "n", "type": ptype, "category": "local_inference", "health": "available",
        "reason": "", "capacity": capacity, "in_flight": in_flight,
        "load_ratio": round(in_flight / capacity, 4) if capacity else None, "models": ["m"],
        "reported_models": ["m"], "missing_models": [], "loaded_models": None, "queued": 0,
        "lifecycle_capabilities": {}, "heartbeat_age_ms": 100, "model_groups": ["g"],
        "endpoints": endpoints, "slots": None, **extra,
    }


def _catalog_doc(*providers: dict[str, Any]) -> dict[str, Any]:
    return {"server_time_ms": 0, "providers": list(providers),
            "models": [{"id": "g", "display_name": "G", "queued": 0, "oldest_wait_ms": None, "available_slots": 1,
                        "candidates": [{"provider": p["id"], "served_name": "m", "node_id": "n",
                                        "health": p["health"], "capacity": p["capacity"],
                                        "in_flight": p["in_flight"], "load_ratio": p["load_ratio"]}
                                       for p in providers]}],
            "nodes": [{"id": "n", "providers": [p["id"] for p in providers]}]}


CATALOG_DOC = _catalog_doc(
    _catalog_provider("llama-wide", "llamacpp", 4, 1, slots=8),
    _catalog_provider("llama-same", "llamacpp", 2, 0, slots=2),
    _catalog_provider("llama-loading", "llamacpp", 2, 0, health="unavailable", reason="loading model"),
    _catalog_provider("vllm-a", "vllm", 4, 2),
    _catalog_provider("picky", "vllm", 1, 0, endpoints=["chat/completions", "audio/speech", "images/generations"]),
    _catalog_provider("mute", "vllm", 1, 0, endpoints=[]),
)


def _row(text: str, pid: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("  ") and line.split()[0] == pid)


def _detail(text: str, pid: str) -> list[str]:
    """The lines under a provider's row, up to the next row or node."""
    lines = text.splitlines()
    start = lines.index(_row(text, pid)) + 1
    end = start
    while end < len(lines) and lines[end].startswith("    "):
        end += 1
    return lines[start:end]


def test_catalog_table_shows_the_slots_hint_beside_the_capacity() -> None:
    text = render(CATALOG_DOC, colour=False)
    assert "░ 1/4 (slots 8) 0.25" in _row(text, "llama-wide")
    # Known and the same as the capacity, or unknown: no hint.
    assert "░ 0/2 0.00" in _row(text, "llama-same")
    assert "slots" not in _row(text, "llama-same")
    assert "slots" not in _row(text, "vllm-a")
    assert "░ 2/4 0.50" in _row(text, "vllm-a")


def test_catalog_table_lists_endpoints_under_each_provider() -> None:
    text = render(CATALOG_DOC, colour=False)
    assert max(len(line) for line in text.splitlines()) <= WIDTH == 120
    assert _detail(text, "llama-wide") == [
        "    endpoints: chat, completions, embeddings, messages, count_tokens, rerank, tokenize, detokenize"]
    assert _detail(text, "picky") == ["    endpoints: chat, speech, images"]
    assert _detail(text, "mute") == ["    endpoints: none"]
    # The probe's reason first, then the endpoints.
    assert _detail(text, "llama-loading")[0] == "    loading model"
    assert _detail(text, "llama-loading")[1].startswith("    endpoints: chat, ")
    # A long list wraps, indented under its label, and names every endpoint once.
    vllm = _detail(text, "vllm-a")
    assert len(vllm) == 2
    assert vllm[1].startswith("      ")
    listed = " ".join(vllm).removeprefix("    endpoints: ").replace(",", " ").split()
    assert listed == [SHORT_ENDPOINTS.get(e, e) for e in DEFAULT_ENDPOINTS["vllm"]]
    # The endpoint lines are dimmed, like the reasons, indentation left plain.
    coloured = render(CATALOG_DOC, colour=True)
    assert "    \033[2mendpoints: chat, speech, images\033[0m" in coloured.splitlines()


def test_catalog_table_of_an_older_iop_without_the_fields() -> None:
    old = _catalog_provider("old", "vllm", 4, 1)
    del old["endpoints"], old["slots"]
    text = render(_catalog_doc(old), colour=False)
    assert "░ 1/4 0.25" in _row(text, "old")
    assert _detail(text, "old") == []


def _affinity(mode: str, load_bound: float, blocks: int, hit: int, miss: int, spill: int) -> dict[str, Any]:
    """One ``models[].affinity`` of ``GET /catalog`` (dispatcher/catalog.py ``AffinityView``)."""
    return {"mode": mode, "load_bound": load_bound, "index_blocks": blocks, "index_max_blocks": 10000,
            "decisions": {"hit": hit, "miss": miss, "spill": spill}}


def test_catalog_table_shows_cache_hit_rates_and_model_affinity() -> None:
    doc = _catalog_doc(_catalog_provider("warm", "vllm", 4, 1, prompt_tokens=1000, cached_tokens=623,
                                         cache_hit_rate=0.623),
                       _catalog_provider("cold", "vllm", 2, 0, prompt_tokens=500, cached_tokens=0,
                                         cache_hit_rate=None))
    group = doc["models"][0]
    doc["models"] = [{**group, "id": "pre", "display_name": "Prefix",
                      "affinity": {**_affinity("prefix", 1.25, 120, 30, 8, 2), "home_queue": 1.0, "home_queued": 5}},
                     {**group, "id": "ses", "display_name": "Session",
                      "affinity": _affinity("session", 2.0, 0, 0, 0, 0)},
                     {**group, "id": "plain", "display_name": "Plain", "affinity": None},
                     {**group, "id": "old", "display_name": "Old"}]  # an older iop's catalog: no affinity
    text = render(doc, colour=False)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= WIDTH
    # The CACHE column: the hit rate under its header, "-" while the provider reported no cached token.
    header = next(line for line in lines if line.lstrip().startswith("PROVIDER"))
    at = header.index("CACHE")
    assert {pid: _row(text, pid)[at:].split()[0] for pid in ("warm", "cold")} == {"warm": "62%", "cold": "-"}

    def under(group_id: str) -> str:
        """The line right under a model group's line."""
        return lines[next(i for i, line in enumerate(lines) if line.startswith(f"  {group_id} (")) + 1]

    assert under("pre") == ("    affinity prefix: bound 1.25, index 120/10000 blocks, hit 30, miss 8, spill 2 "
                            "(75% hits), home queue 1x: 5 past cap")
    # No decision yet: no hit share.
    assert under("ses") == "    affinity session: bound 2, index 0/10000 blocks, hit 0, miss 0, spill 0 (- hits)"
    # Affinity off (null) or unknown to the iop: straight to the candidates.
    assert under("plain") == under("old") == "    warm -> m  available  1/4"
    assert sum("affinity" in line for line in lines) == 2


def _tenant(name: str, band: str, weight: float, queued: int, in_flight: int, max_queued: int | None = None,
            max_in_flight: int | None = None, limits: dict[str, Any] | None = None) -> dict[str, Any]:
    """One ``tenants[]`` entry of ``GET /catalog`` (dispatcher/catalog.py ``TenantView``)."""
    return {"name": name, "band": band, "weight": weight, "models": None, "max_queued": max_queued,
            "max_in_flight": max_in_flight, "queued": queued, "in_flight": in_flight, "limits": limits}


def _limits(rpm: int | None, requests_used: int, tpm: int | None, tokens_used: int, tpd: int | None,
            tokens_used_today: int, requests: int = 0, tokens: int = 0, budget: int = 0) -> dict[str, Any]:
    """One ``tenants[].limits`` of ``GET /catalog`` (dispatcher/catalog.py ``TenantLimitsView``)."""
    return {"requests_per_minute": rpm, "requests_used": requests_used, "tokens_per_minute": tpm,
            "tokens_used": tokens_used, "tokens_per_day": tpd, "tokens_used_today": tokens_used_today,
            "refused": {"requests": requests, "tokens": tokens, "budget": budget}}


def test_catalog_table_of_tenants_with_rate_limits_and_budgets() -> None:
    doc = _catalog_doc(_catalog_provider("vllm-a", "vllm", 4, 3))
    doc["tenants"] = [
        _tenant("web", "interactive", 3, 2, 1, max_in_flight=4,
                limits=_limits(60, 12, None, 0, 1_000_000, 51_200, requests=3, budget=1)),
        _tenant("eval", "batch", 1, 0, 0),  # no limits: nothing under its row
        _tenant("bulk", "batch", 0.5, 0, 0, limits=_limits(None, 0, 100_000, 100_000, None, 7, tokens=2)),
        # Limits no terminal line holds at once: wrapped between items, never inside one.
        _tenant("huge", "batch", 1, 0, 0, limits=_limits(
            10**12, 10**12 - 1, 10**12, 10**12 - 1, 10**12, 10**12 - 1, requests=10**9, tokens=10**9, budget=10**9)),
    ]
    lines = render(doc, colour=False).splitlines()
    start = lines.index("tenants")
    end = lines.index("model groups")
    assert lines[start:end] == [
        "tenants",
        "  TENANT  BAND         WEIGHT  QUEUED  IN FLIGHT  LIMITS        ",  # padded to the widest limits
        "  web     interactive  3       2       1          in flight <= 4",
        "    rate limits: requests/min 12/60, tokens/min -, tokens/day 51200/1000000; "
        "refused 3 requests, 0 tokens, 1 budget",
        "  eval    batch        1       0       0          -",
        "  bulk    batch        0.5     0       0          -",
        "    rate limits: requests/min -, tokens/min 100000/100000, tokens/day -; "
        "refused 0 requests, 2 tokens, 0 budget",
        "  huge    batch        1       0       0          -",
        "    rate limits: requests/min 999999999999/1000000000000, tokens/min 999999999999/1000000000000,",
        "      tokens/day 999999999999/1000000000000; "
        "refused 1000000000 requests, 1000000000 tokens, 1000000000 budget",
        "",
    ]
    assert max(len(line) for line in lines) <= WIDTH
    # Colour changes nothing of it but the headers.
    coloured = render(doc, colour=True).splitlines()
    assert lines[start + 3] in coloured
    assert lines[start + 6] in coloured


def test_catalog_table_of_a_default_tenant_with_rate_limits_alone() -> None:
    doc = _catalog_doc(_catalog_provider("vllm-a", "vllm", 4, 3))
    doc["tenants"] = [_tenant("default", "standard", 1, 0, 0, limits=_limits(10, 1, None, 0, None, 0))]
    lines = render(doc, colour=False).splitlines()
    start = lines.index("tenants")
    assert lines[start + 2:start + 4] == [
        "  default  standard  1       0       0          -",
        "    rate limits: requests/min 1/10, tokens/min -, tokens/day -; refused 0 requests, 0 tokens, 0 budget"]


def test_catalog_table_of_tenants_below_the_providers() -> None:
    doc = _catalog_doc(_catalog_provider("vllm-a", "vllm", 4, 3))
    doc["tenants"] = [_tenant("web", "interactive", 3, 2, 1, max_in_flight=4),
                      _tenant("eval-nightly", "batch", 0.5, 40, 2, max_queued=100, max_in_flight=2),
                      _tenant("default", "standard", 1, 0, 0)]
    doc["models"][0]["tenants"] = [{"tenant": "web", "queued": 2, "in_flight": 1},
                                   {"tenant": "eval-nightly", "queued": 40, "in_flight": 2}]
    lines = render(doc, colour=False).splitlines()
    start = lines.index("tenants")
    assert lines.index(_row("\n".join(lines), "vllm-a")) < start < lines.index("model groups")
    assert [" ".join(line.split()) for line in lines[start + 1:start + 5]] == [
        "TENANT BAND WEIGHT QUEUED IN FLIGHT LIMITS",
        "web interactive 3 2 1 in flight <= 4",
        "eval-nightly batch 0.5 40 2 queued <= 100, in flight <= 2",
        "default standard 1 0 0 -",
    ]
    # Columns line up under their headers.
    header = lines[start + 1]
    for row in lines[start + 2:start + 5]:
        for col in ("BAND", "WEIGHT", "QUEUED", "IN FLIGHT", "LIMITS"):
            at = header.index(col)
            assert row[at - 1] == " ", (col, row)
            assert row[at] != " ", (col, row)
    assert lines[start + 5] == ""
    # Under its model group, each tenant with jobs there.
    assert "    tenant web: queued 2, in flight 1" in lines
    assert "    tenant eval-nightly: queued 40, in flight 2" in lines
    coloured = render(doc, colour=True)
    assert "\033[1mtenants\033[0m" in coloured


def test_catalog_table_without_tenants_beyond_default() -> None:
    doc = _catalog_doc(_catalog_provider("vllm-a", "vllm", 4, 3))
    for tenants in ([], [_tenant("default", "standard", 1, 5, 1)]):
        doc["tenants"] = tenants
        assert "tenants" not in render(doc, colour=False).splitlines()
    del doc["tenants"]  # an older iop's catalog
    assert "tenants" not in render(doc, colour=False).splitlines()


@pytest.fixture
def catalog_server() -> Iterator[str]:
    """A stand-in for a running iop's ``GET /catalog``."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(CATALOG_DOC).encode()
            self.send_response(200 if self.path == "/catalog" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_catalog_command_prints_the_table(catalog_server: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert call_main("catalog", "--url", catalog_server, "--no-colour") == 0
    out = capsys.readouterr().out
    assert "1/4 (slots 8)" in _row(out, "llama-wide")
    assert "    endpoints: chat, speech, images" in out.splitlines()
    assert "\033[" not in out


def test_catalog_command_json_keeps_the_fields(catalog_server: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert call_main("catalog", "--url", catalog_server, "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    wide = next(p for p in doc["providers"] if p["id"] == "llama-wide")
    assert (wide["capacity"], wide["slots"]) == (4, 8)
    assert wide["endpoints"] == CATALOG_DOC["providers"][0]["endpoints"]


def test_the_client_commands_take_iop_url_when_no_url_is_given(
    catalog_server: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IOP_URL", catalog_server)
    assert call_main("catalog", "--json") == 0
    assert json.loads(capsys.readouterr().out)["providers"][0]["id"] == "llama-wide"
    # --url still wins; the default without either is :8080.
    parser = build_parser()
    assert parser.parse_args(["catalog", "--url", "http://x:1"]).url == "http://x:1"
    for argv in (["provider", "drain", "p"], ["provider", "resume", "p"], ["qualify", "--model", "m"]):
        assert parser.parse_args(argv).url == catalog_server, argv
    monkeypatch.delenv("IOP_URL")
    assert build_parser().parse_args(["catalog"]).url == "http://127.0.0.1:8080"


def test_catalog_table_shows_what_a_managed_provider_holds() -> None:
    state = {"since": 1, "last_used": None, "running": 0, "failed_until": None, "unloads": {}, "load_failures": 0}
    doc = _catalog_doc(
        _catalog_provider("swap", "ollama", 2, 1, lifecycle="managed", max_loaded=1, loading="y",
                          models_state={"x": {**state, "state": "unloading", "load_s": 1.5, "failure": "",
                                              "loads": {"demand": 2}},
                                        "y": {**state, "state": "loading", "load_s": None,
                                              "failure": "out of memory", "loads": {}}}),
        _catalog_provider("plain", "vllm", 4))
    text = render(doc, colour=False)
    assert _detail(text, "swap")[:3] == ["    models held: 1 of 1; loading y",
                                         "    x: unloading; loads take 1.5 s; loaded 2x by demand",
                                         "    y: loading; last load failed: out of memory"]
    assert not any("models held" in line for line in _detail(text, "plain"))
