"""The catalog as operators see it, from real processes: the CLI table and the /ui page
(headless Chromium), for a known mix of healthy, failing, unknown and saturated providers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from iop.redis_server import RedisServer
from tests.e2e.system import System, http_provider

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
EXPECTED_HEALTH = {"up": "available", "sick": "unavailable", "tool": "available", "hosted": "available",
                   "ghost": "unknown"}
EXPECTED_CATEGORY = {"up": "local_inference", "sick": "local_inference", "tool": "cli", "hosted": "api",
                     "ghost": "local_inference"}


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[System]:
    sys_ = System(tmp_path_factory.mktemp("catalog"), redis_server)
    sys_.write_config({
        "dispatch": {"heartbeat_interval_ms": 200, "probe_interval_ms": 300},
        "models": [
            {"id": "pool", "display_name": "The pool", "providers": {"up": "m-up", "sick": "m-sick", "tool": "m-tool"}},
            {"id": "busy", "providers": {"hosted": "m-hosted"}},
            {"id": "nowhere", "providers": {"ghost": "m-ghost"}},
        ],
        "nodes": [
            {"id": "n1", "providers": [
                http_provider("up", "vllm", sys_.port("up"), 2, ["m-up"]),
                http_provider("sick", "ollama", sys_.port("sick"), 2, ["m-sick"]),
                {"id": "tool", "type": "cli", "capacity": 1, "models": ["m-tool"],
                 "command": [sys.executable, "-c", "import sys; sys.stdout.write(sys.stdin.read()[::-1])"]},
            ]},
            {"id": "n2", "providers": [http_provider("hosted", "openai_api", sys_.port("hosted"), 1, ["m-hosted"])]},
            # No worker ever runs for n3: its provider stays unknown.
            {"id": "n3", "providers": [http_provider("ghost", "lemonade", sys_.port("ghost"), 1, ["m-ghost"])]},
        ],
    })
    background: list[threading.Thread] = []
    try:
        sys_.fake("up", "--models", "m-up")
        sys_.fake("sick", "--models", "m-sick").control(healthy=False)
        hosted = sys_.fake("hosted", "--models", "m-hosted")
        sys_.worker("n1")
        sys_.worker("n2")
        sys_.api()
        sys_.wait_available("up", "tool", "hosted")
        sys_.wait_until("sick marked unavailable", lambda: sys_.provider("sick").get("health") == "unavailable")
        # Saturate 'busy': one request runs (the provider holds it), two wait.
        hosted.control(hang=True)
        for _ in range(3):
            thread = threading.Thread(target=lambda: httpx.post(
                f"{sys_.api_url}/v1/chat/completions", json={"model": "busy", "messages": []}, timeout=60))
            thread.start()
            background.append(thread)
        sys_.wait_until("two jobs waiting", lambda: sys_.redis.zcard("{iop}:q:busy") == 2)
        yield sys_
    finally:
        sys_.fakes["hosted"].control(hang=False)
        for thread in background:
            thread.join(timeout=30)
        sys_.close()


def run_catalog(system: System, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "iop", "catalog", "--url", system.api_url, *args],
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout


def test_cli_table_groups_providers_by_node(system: System) -> None:
    text = run_catalog(system, "--no-colour")
    lines = text.split("model groups")[0].splitlines()
    nodes = [i for i, line in enumerate(lines) if line.startswith("node ")]
    assert [lines[i] for i in nodes] == ["node n1", "node n2", "node n3"]
    rows = {line.split()[0]: line for line in lines if line.startswith("  ") and line.split()[0] in EXPECTED_HEALTH}
    for pid, row in rows.items():
        assert EXPECTED_HEALTH[pid] in row.split(), row
        assert EXPECTED_CATEGORY[pid] in row.split(), row
    assert set(rows) == set(EXPECTED_HEALTH)
    # hosted is full (1/1) and its group has two waiting: a full bar and the queued count.
    assert "██████████ 1/1 1.00  2" in rows["hosted"]
    assert "░░░░░░░░░░ 0/2 0.00" in rows["up"]
    assert "503" in text  # sick's probe reason is printed under it
    assert "never seen" in text
    assert "busy (busy): queued 2" in text


def test_cli_table_colours_health_and_prints_json(system: System) -> None:
    coloured = run_catalog(system, "--colour")
    assert "\033[32mavailable" in coloured
    assert "\033[31munavailable" in coloured
    assert "\033[33munknown" in coloured
    doc = json.loads(run_catalog(system, "--json"))
    assert {p["id"]: p["health"] for p in doc["providers"]} == EXPECTED_HEALTH


def test_cli_reports_an_unreachable_api(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "iop", "catalog", "--url", "http://127.0.0.1:9"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "cannot reach" in out.stderr


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (Debian package 'chromium')")
def test_ui_page_shows_the_catalog(system: System) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(f"{system.api_url}/ui")
            page.wait_for_selector("#status[data-ok='1']", timeout=15_000)
            nodes = [n.get_attribute("data-node") for n in page.locator("[data-testid=node]").all()]
            assert nodes == ["n1", "n2", "n3"]
            seen = {}
            for node in ("n1", "n2", "n3"):
                for row in page.locator(f"[data-node={node}] [data-testid=provider]").all():
                    pid = row.get_attribute("data-provider")
                    seen[pid] = (node, row.locator("[data-testid=health]").inner_text(),
                                 row.locator("[data-testid=category]").inner_text(),
                                 row.locator("[data-testid=load]").inner_text().strip(),
                                 row.locator("[data-testid=queued]").inner_text())
            assert {pid: v[1] for pid, v in seen.items()} == EXPECTED_HEALTH
            assert {pid: v[2] for pid, v in seen.items()} == EXPECTED_CATEGORY
            assert {pid: v[0] for pid, v in seen.items()} == {"up": "n1", "sick": "n1", "tool": "n1",
                                                              "hosted": "n2", "ghost": "n3"}
            assert seen["hosted"][3] == "1/1"
            assert seen["hosted"][4] == "2"
            busy = page.locator("[data-testid=model][data-model=busy]")
            assert busy.locator("[data-testid=queued]").inner_text() == "2"
            pool = page.locator("[data-testid=model][data-model=pool]")
            assert pool.locator("[data-testid=candidate]").count() == 3
            # It refreshes by itself: a change in Redis shows up without a reload.
            system.fakes["up"].control(healthy=False)
            up_health = "document.querySelector('[data-provider=up] [data-testid=health]').textContent"
            page.wait_for_function(f"() => {up_health} === 'unavailable'", timeout=20_000)
        finally:
            browser.close()
            system.fakes["up"].control(healthy=True)
