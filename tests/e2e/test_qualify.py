"""Qualification runs and live figures through real processes (issue 32): an API, a worker and
three fake providers of model m -- a (4 slots, fast), b (4 slots, slower to start), c (between them, serves
other words under the same id). ``iop qualify`` finds a's knee at 4, ranks a before b by the
TTFT a client measures, flags c and passes a and b; the report is stored and read back (JSON,
Markdown, the runs list); its requests count as tenant iop-qualify in /metrics and never in
the live figures, which count callers' requests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from dispatcher import keys
from dispatcher.live import FLUSH_S
from iop.redis_server import RedisServer
from tests.e2e.system import System, http_provider
from tests.waiting import eventually_sync

TOKENS = 8


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[System]:
    sys_ = System(tmp_path_factory.mktemp("qualify"), redis_server)
    sys_.write_config({
        "dispatch": {"heartbeat_interval_ms": 200, "probe_interval_ms": 300},
        "queue": {"max_queue": 200, "queue_timeout_ms": 60_000},
        "qualify": {"share": 1.0, "max_seconds": 300},
        "models": [{"id": "m", "providers": {"a": "served", "b": "served", "c": "served"}}],
        "nodes": [{"id": "n1", "providers": [http_provider("a", "vllm", sys_.port("fa"), 16, ["served"]),
                                             http_provider("b", "vllm", sys_.port("fb"), 16, ["served"]),
                                             http_provider("c", "vllm", sys_.port("fc"), 16, ["served"])]}],
    })
    with sys_:
        common = ["--models", "served", "--tokens", str(TOKENS), "--token-interval-ms", "40"]
        sys_.fake("fa", *common, "--delay-ms", "150", "--parallel", "4")
        sys_.fake("fb", *common, "--delay-ms", "400", "--parallel", "4")
        sys_.fake("fc", *common, "--delay-ms", "250", "--word", "alt")
        sys_.worker("n1")
        sys_.api()
        sys_.wait_available("a", "b", "c")
        yield sys_


@pytest.fixture(scope="module")
def report(system: System) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "iop", "qualify", "--url", system.api_url, "--model", "m", "--json",
         "--max-concurrency", "16", "--requests", "8", "--max-tokens", str(TOKENS)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "NO_COLOR": "1"})
    assert done.returncode == 2, done.stderr  # 2: a provider diverges
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


def by_provider(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["provider"]: p for p in doc["providers"]}


def test_the_knee_of_a_server_of_four_slots_is_four(report: dict[str, Any]) -> None:
    ps = by_provider(report)
    assert ps["a"]["suggested_capacity"] == 4, ps["a"]
    assert ps["b"]["suggested_capacity"] == 4
    assert set(ps["a"]["ttft_ms"]) >= {"1", "2", "4", "8"}
    assert ps["a"]["throughput"]["4"] > 3 * ps["a"]["throughput"]["1"]


def test_a_sweep_cut_short_by_a_bound_claims_no_knee(report: dict[str, Any]) -> None:
    # c runs every call at once (no --parallel): its throughput grew up to 16, where both its
    # capacity and --max-concurrency stop the sweep. That is no knee, and the report says so.
    c = by_provider(report)["c"]
    assert c["suggested_capacity"] is None, c
    assert c["sweep_cut_by"] == ["max_concurrency", "capacity"]
    assert "16" in c["throughput"]
    (note,) = [n for n in report["notes"] if n.startswith("c: ")]
    assert note.startswith("c: no knee found, so no suggested_capacity: throughput still grew at concurrency 16"), note
    assert by_provider(report)["a"]["sweep_cut_by"] == []


def test_providers_are_ranked_by_the_ttft_a_client_measures(report: dict[str, Any]) -> None:
    ps = by_provider(report)
    assert ps["a"]["ttft_ms"]["1"]["p50"] < ps["b"]["ttft_ms"]["1"]["p50"]
    assert ps["a"]["rank"] < ps["b"]["rank"]
    assert ps["b"]["ttft_ms"]["1"]["p50"] >= 400


def test_a_provider_serving_another_model_is_flagged_and_the_others_pass(report: dict[str, Any]) -> None:
    ps = by_provider(report)
    assert "diverges" in ps["c"]["flags"]
    assert ps["c"]["agreement"] < 0.5
    for pid in ("a", "b"):
        assert ps[pid]["flags"] == []
        assert ps[pid]["agreement"] == 1.0
    assert sorted(report["config"]["agreeing_group"]) == ["a", "b"]


def test_lifecycle_is_declared_against_verified(report: dict[str, Any]) -> None:
    life = by_provider(report)["a"]["lifecycle"]
    assert life["list"] == {"declared": True, "verified": True, "how": "GET /v1/models -> 200"}
    assert life["load"]["declared"] is False
    assert life["load"]["verified"] is False  # the fake has no such route: 404
    assert life["delete"]["verified"] is None


def test_the_report_is_stored_and_read_back(system: System, report: dict[str, Any]) -> None:
    latest = httpx.get(f"{system.api_url}/qualifications/m", timeout=10).json()
    assert latest == report
    runs = httpx.get(f"{system.api_url}/qualifications/m/runs", timeout=10).json()
    assert runs[0]["run"] == report["run"]
    assert runs[0]["flagged"] == ["c"]
    md = httpx.get(f"{system.api_url}/qualifications/m/markdown", timeout=10)
    assert md.headers["content-type"].startswith("text/markdown")
    assert "# Qualification of `m`" in md.text
    assert "| 1 | a | vllm |" in md.text, md.text
    # The report's place in the kept runs comes from the query string (0: the newest).
    assert httpx.get(f"{system.api_url}/qualifications/m?index=0", timeout=10).json() == report
    for path in ("/qualifications/m?index=1", "/qualifications/m/markdown?index=0&against=1"):
        gone = httpx.get(f"{system.api_url}{path}", timeout=10)
        assert gone.status_code == 404, (path, gone.text)
        assert gone.json()["error"]["code"] == "qualification_not_found"
        assert "No qualification report 1 of 'm' is kept" in gone.text, (path, gone.text)
    assert httpx.get(f"{system.api_url}/qualifications/m?index=first", timeout=10).status_code == 400
    page = httpx.get(f"{system.api_url}/ui/qualifications", timeout=10)
    assert page.status_code == 200
    assert "Providers side by side" in page.text


def test_its_requests_are_marked_and_kept_out_of_the_live_figures(system: System, report: dict[str, Any]) -> None:
    metrics = httpx.get(f"{system.api_url}/metrics", timeout=10).text
    qualified = [line for line in metrics.splitlines()
                 if line.startswith("iop_requests_total") and 'tenant="iop-qualify"' in line]
    assert qualified
    assert sum(float(line.rsplit(" ", 1)[1]) for line in qualified) >= 40
    time.sleep(2 * FLUSH_S)  # the worker writes what it tallied about once a second
    cat = httpx.get(f"{system.api_url}/catalog", timeout=10).json()
    assert all(p["live"]["5m"]["requests"] == 0 for p in cat["providers"])


def test_callers_requests_make_the_live_figures(system: System, report: dict[str, Any]) -> None:
    for _ in range(12):
        with httpx.stream("POST", f"{system.api_url}/v1/chat/completions", timeout=30,
                          json={"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}) as r:
            assert r.status_code == 200
            r.read()

    def live_now() -> dict[str, Any]:
        cat = httpx.get(f"{system.api_url}/catalog", timeout=10).json()
        return {p["id"]: p["live"]["5m"] for p in cat["providers"]}

    # The worker writes the calls it tallied about once a second (dispatcher/live.py FLUSH_S).
    live = eventually_sync(live_now, lambda v: sum(p["requests"] for p in v.values()) >= 12,
                           what="the 12 calls in the live figures")
    assert sum(v["requests"] for v in live.values()) == 12
    served = [v for v in live.values() if v["requests"]]
    # The fakes wait 150 ms at least before their first token; a live percentile is read from
    # 5%-wide bins, so it may show up to 5% under the samples it counts.
    assert all(v["ttft_ms"]["p50"] >= 150 * 0.95 and v["e2e_ms"]["p50"] > v["ttft_ms"]["p50"] for v in served), live
    assert all(v["uptime"] is not None and v["uptime"] > 0.9 for v in live.values())
    metrics = httpx.get(f"{system.api_url}/metrics", timeout=10).text
    assert 'iop_live_requests{model="m",provider="a",window="5m"}' in metrics


def test_a_cancelled_run_refuses_its_requests(system: System) -> None:
    run = httpx.post(f"{system.api_url}/admin/qualifications/m/runs", json={"providers": ["a"]}, timeout=30)
    assert run.status_code == 201
    run_id = run.json()["run"]
    assert httpx.delete(f"{system.api_url}/admin/qualifications/runs/{run_id}", timeout=10).status_code == 200
    refused = httpx.post(f"{system.api_url}/v1/chat/completions", timeout=10,
                         headers={"x-iop-qualify": run_id, "x-iop-provider": "a"},
                         json={"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
    assert refused.status_code == 409
    assert "cancelled" in refused.text


def test_a_run_is_refused_a_provider_the_model_lacks(system: System) -> None:
    run = httpx.post(f"{system.api_url}/admin/qualifications/m/runs", json={"providers": ["zz"]}, timeout=30)
    assert run.status_code == 400
    assert "not a provider of 'm'" in run.text


def test_a_node_without_a_gpu_reports_cpu_memory_and_no_gpus(system: System) -> None:
    system.wait_until("telemetry reported", lambda: httpx.get(f"{system.api_url}/catalog", timeout=10)
                      .json()["nodes"][0].get("telemetry") is not None)
    node = httpx.get(f"{system.api_url}/catalog", timeout=10).json()["nodes"][0]
    assert len(node["workers"]) == 1
    t = node["telemetry"]
    assert t["cpu"]["cores"] >= 1
    assert t["memory"]["total_bytes"] > t["memory"]["used_bytes"] > 0
    assert t["gpus"] == []


def test_the_knees_seed_capacity_auto(system: System, report: dict[str, Any]) -> None:
    seeds = {k.decode(): json.loads(v) for k, v in system.redis.hgetall(keys.CAPACITY_SEEDS).items()}
    assert {p: s["capacity"] for p, s in seeds.items()} == {
        p["provider"]: p["suggested_capacity"] for p in report["providers"] if p["suggested_capacity"] is not None}
    assert seeds["a"] == {"capacity": 4, "model": "m", "run": report["run"], "started": report["started"]}
