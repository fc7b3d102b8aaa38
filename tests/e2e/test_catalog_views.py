"""The catalog as operators see it, from real processes: the CLI table and the /ui page
(headless Chromium), for a known mix of healthy, failing, unknown and saturated providers,
with the endpoints each serves and the slots hint of a llama.cpp provider (a stand-in
llama-server in this process, answering /health, /v1/models, /props and /slots)."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from dispatcher.endpoints import DEFAULT_ENDPOINTS
from iop.redis_server import RedisServer
from tests.e2e.system import System, http_provider

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
EXPECTED_HEALTH = {"up": "available", "sick": "unavailable", "tool": "available", "hosted": "available",
                   "ghost": "unknown", "llama": "available"}
EXPECTED_CATEGORY = {"up": "local_inference", "sick": "local_inference", "tool": "cli", "hosted": "api",
                     "ghost": "local_inference", "llama": "local_inference"}
# hosted lists its endpoints; the others serve their type's default.
HOSTED_ENDPOINTS = ["chat/completions", "audio/speech"]
EXPECTED_ENDPOINTS = {"up": list(DEFAULT_ENDPOINTS["vllm"]), "sick": list(DEFAULT_ENDPOINTS["ollama"]),
                      "tool": list(DEFAULT_ENDPOINTS["cli"]), "hosted": HOSTED_ENDPOINTS,
                      "ghost": list(DEFAULT_ENDPOINTS["lemonade"]), "llama": list(DEFAULT_ENDPOINTS["llamacpp"])}
# The stand-in llama-server runs 8 parallel slots; its provider is configured with capacity 2.
LLAMA_SLOTS = 8


class LlamaServer(BaseHTTPRequestHandler):
    """What llama-server answers on the endpoints its probe asks (shapes of its README)."""

    def do_GET(self) -> None:
        slot = {"id": 0, "id_task": -1, "n_ctx": 4096, "speculative": False, "is_processing": False,
                "params": {"n_predict": -1, "temperature": 0.8}, "next_token": {"has_next_token": True}}
        answers: dict[str, Any] = {
            "/health": {"status": "ok"},
            "/v1/models": {"models": [{"name": "m-llama", "model": "m-llama"}], "object": "list",
                           "data": [{"id": "m-llama", "object": "model", "created": 0, "owned_by": "llamacpp"}]},
            "/props": {"default_generation_settings": {**slot, "prompt": ""}, "total_slots": LLAMA_SLOTS,
                       "model_path": "/models/m-llama.gguf", "chat_template": "{{ messages }}",
                       "modalities": {"vision": False}, "build_info": "b6500-2dd8a1d6", "is_sleeping": False},
            "/slots": [{**slot, "id": i} for i in range(LLAMA_SLOTS)],
        }
        found = self.path in answers
        body = json.dumps(answers[self.path] if found else {"error": {"code": 404, "message": "File Not Found",
                                                                       "type": "not_found_error"}}).encode()
        self.send_response(200 if found else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[System]:
    sys_ = System(tmp_path_factory.mktemp("catalog"), redis_server)
    sys_.write_config({
        "dispatch": {"heartbeat_interval_ms": 200, "probe_interval_ms": 300},
        "models": [
            {"id": "pool", "display_name": "The pool", "providers": {"up": "m-up", "sick": "m-sick", "tool": "m-tool"}},
            {"id": "busy", "providers": {"hosted": "m-hosted"}},
            {"id": "nowhere", "providers": {"ghost": "m-ghost"}},
            {"id": "gguf", "providers": {"llama": "m-llama"}},
        ],
        "nodes": [
            {"id": "n1", "providers": [
                http_provider("up", "vllm", sys_.port("up"), 2, ["m-up"]),
                http_provider("sick", "ollama", sys_.port("sick"), 2, ["m-sick"]),
                {"id": "tool", "type": "cli", "capacity": 1, "models": ["m-tool"],
                 "command": [sys.executable, "-c", "import sys; sys.stdout.write(sys.stdin.read()[::-1])"]},
            ]},
            {"id": "n2", "providers": [
                http_provider("hosted", "openai_api", sys_.port("hosted"), 1, ["m-hosted"], endpoints=HOSTED_ENDPOINTS),
                http_provider("llama", "llamacpp", sys_.port("llama"), 2, ["m-llama"]),
            ]},
            # No worker ever runs for n3: its provider stays unknown.
            {"id": "n3", "providers": [http_provider("ghost", "lemonade", sys_.port("ghost"), 1, ["m-ghost"])]},
        ],
    })
    background: list[threading.Thread] = []
    llama = ThreadingHTTPServer(("127.0.0.1", sys_.port("llama")), LlamaServer)
    background.append(threading.Thread(target=llama.serve_forever, daemon=True))
    background[0].start()
    try:
        sys_.fake("up", "--models", "m-up")
        sys_.fake("sick", "--models", "m-sick").control(healthy=False)
        hosted = sys_.fake("hosted", "--models", "m-hosted")
        sys_.worker("n1")
        sys_.worker("n2")
        sys_.api()
        sys_.wait_available("up", "tool", "hosted", "llama")
        sys_.wait_until("llama's slots reported", lambda: sys_.provider("llama").get("slots") == str(LLAMA_SLOTS))
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
        llama.shutdown()
        for thread in background:
            thread.join(timeout=30)
        sys_.close()
        llama.server_close()


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
    assert "██████████ 1/1 1.00 2 m-hosted" in " ".join(rows["hosted"].split())
    assert "░░░░░░░░░░ 0/2 0.00" in rows["up"]
    assert "503" in text  # sick's probe reason is printed under it
    assert "never seen" in text
    assert "busy (busy): queued 2" in text
    # llama: its capacity, and the 8 slots llama-server reports beside it.
    assert f"░░░░░░░░░░ 0/2 (slots {LLAMA_SLOTS}) 0.00" in rows["llama"]
    assert "slots" not in rows["up"] + rows["hosted"]
    # Each provider's endpoints on the line under it (short names), within 120 columns.
    assert max(len(line) for line in text.splitlines()) <= 120
    assert "    endpoints: chat, speech" in lines
    assert ("    endpoints: chat, completions, embeddings, messages, count_tokens, rerank, tokenize, detokenize"
            in lines)
    assert "    endpoints: chat, completions" in lines  # tool (cli)


def test_cli_table_colours_health_and_prints_json(system: System) -> None:
    coloured = run_catalog(system, "--colour")
    assert "\033[32mavailable" in coloured
    assert "\033[31munavailable" in coloured
    assert "\033[33munknown" in coloured
    doc = json.loads(run_catalog(system, "--json"))
    assert {p["id"]: p["health"] for p in doc["providers"]} == EXPECTED_HEALTH
    assert {p["id"]: p["endpoints"] for p in doc["providers"]} == EXPECTED_ENDPOINTS
    assert {p["id"]: p["slots"] for p in doc["providers"]} == {pid: LLAMA_SLOTS if pid == "llama" else None
                                                                for pid in EXPECTED_HEALTH}


def test_catalog_json_over_http(system: System) -> None:
    doc = httpx.get(f"{system.api_url}/catalog", timeout=10).json()
    llama = next(p for p in doc["providers"] if p["id"] == "llama")
    assert (llama["type"], llama["capacity"], llama["slots"]) == ("llamacpp", 2, LLAMA_SLOTS)
    assert llama["reported_models"] == ["m-llama"]
    assert llama["missing_models"] == []
    assert llama["endpoints"] == list(DEFAULT_ENDPOINTS["llamacpp"])
    # The hint is not capacity: the group's free slots follow the configured 2.
    gguf = next(m for m in doc["models"] if m["id"] == "gguf")
    assert gguf["available_slots"] == 2


def test_cli_reports_an_unreachable_api(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "iop", "catalog", "--url", "http://127.0.0.1:9"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "cannot reach" in out.stderr


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (Debian package 'chromium')")
def test_ui_page_shows_the_catalog(system: System, tmp_path: Path) -> None:
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
                                                              "hosted": "n2", "llama": "n2", "ghost": "n3"}
            assert seen["hosted"][3] == "1/1"
            # The slots hint beside llama's capacity, and nowhere else.
            assert seen["llama"][3] == f"0/2 (slots {LLAMA_SLOTS})"
            assert page.locator("[data-testid=slots]").count() == 1
            # Each provider's endpoints: short names, the full name in each chip's data.
            for pid, expected in EXPECTED_ENDPOINTS.items():
                chips = page.locator(f"[data-provider={pid}] [data-testid=endpoints] .ep")
                assert [c.get_attribute("data-endpoint") for c in chips.all()] == expected, pid
            hosted_eps = page.locator("[data-provider=hosted] [data-testid=endpoints]").inner_text()
            assert hosted_eps.split() == ["chat", "speech"]
            assert seen["hosted"][4] == "2"
            busy = page.locator("[data-testid=model][data-model=busy]")
            assert busy.locator("[data-testid=queued]").inner_text() == "2"
            pool = page.locator("[data-testid=model][data-model=pool]")
            assert pool.locator("[data-testid=candidate]").count() == 3
            # What a person sees: the page rendered, its tables laid out with real sizes.
            shot = tmp_path / "ui.png"
            page.screenshot(path=str(shot), full_page=True)
            png = shot.read_bytes()
            assert png[:8] == b"\x89PNG\r\n\x1a\n"
            width, height = struct.unpack(">II", png[16:24])
            assert width >= 800, width
            assert height >= 400, height
            for table in page.locator("table:visible").all():
                box = table.bounding_box()
                assert box is not None
                assert box["width"] > 100, box
                assert box["height"] > 20, box
            # It refreshes by itself: a change in Redis shows up without a reload.
            system.fakes["up"].control(healthy=False)
            up_health = "document.querySelector('[data-provider=up] [data-testid=health]').textContent"
            page.wait_for_function(f"() => {up_health} === 'unavailable'", timeout=20_000)
        finally:
            browser.close()
            system.fakes["up"].control(healthy=True)


# --- tenants (flow control) ----------------------------------------------------------------------

TENANT_KEYS = {"web": "web-key-e2e", "eval": "eval-key-e2e"}


@pytest.fixture(scope="module")
def tenant_system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    """Two tenants in two bands on one provider of two slots that holds every request: web
    (max_in_flight 1) runs one and waits with another, eval runs one and waits with two.
    Its own Redis: the module's other system lives beside it."""
    background: list[threading.Thread] = []
    with RedisServer() as server:
        sys_ = System(tmp_path_factory.mktemp("tenants"), server)
        sys_.env.update({"IOP_E2E_WEB": TENANT_KEYS["web"], "IOP_E2E_EVAL": TENANT_KEYS["eval"]})
        sys_.write_config({
            "dispatch": {"heartbeat_interval_ms": 200, "probe_interval_ms": 300},
            "queue": {"queue_timeout_ms": 120_000},
            "api": {"priorities": ["interactive", "batch"], "default_priority": "batch",
                    "keys": [{"name": "web", "key_env": "IOP_E2E_WEB", "priority": "interactive", "weight": 2,
                              "max_in_flight": 1},
                             {"name": "eval", "key_env": "IOP_E2E_EVAL", "priority": "batch", "max_queued": 5}]},
            "models": [{"id": "shared", "providers": {"slow": "m-slow"}}],
            "nodes": [{"id": "n1", "providers": [http_provider("slow", "vllm", sys_.port("slow"), 2, ["m-slow"])]}],
        })
        try:
            slow = sys_.fake("slow", "--models", "m-slow")
            sys_.worker("n1")
            sys_.api()
            sys_.wait_available("slow")
            slow.control(hang=True)

            def counters() -> dict[str, int]:
                raw: dict[bytes, bytes] = sys_.redis.hgetall("{iop}:tenants")  # type: ignore[assignment]
                return {k.decode(): int(v) for k, v in raw.items()}

            def send(tenant: str) -> None:
                thread = threading.Thread(target=lambda: httpx.post(
                    f"{sys_.api_url}/v1/chat/completions", json={"model": "shared", "messages": []},
                    headers={"authorization": f"Bearer {TENANT_KEYS[tenant]}"}, timeout=180))
                thread.start()
                background.append(thread)

            # In this order, so that each tenant holds exactly one of the two slots.
            for tenant, running, queued in (("web", 1, 0), ("web", 1, 1), ("eval", 1, 0), ("eval", 1, 1),
                                            ("eval", 1, 2)):
                send(tenant)
                sys_.wait_until(f"{tenant}: {running} running, {queued} waiting", lambda t=tenant, r=running, q=queued:
                                (counters().get(f"r:{t}", 0), counters().get(f"q:{t}", 0)) == (r, q))
            yield sys_
        finally:
            if "slow" in sys_.fakes:
                sys_.fakes["slow"].control(hang=False)
            for thread in background:
                thread.join(timeout=60)
            sys_.close()


def test_tenants_in_the_catalog_cli_and_metrics(tenant_system: System) -> None:
    env = {**tenant_system.env, "IOP_ADMIN_KEY": TENANT_KEYS["web"]}
    out = subprocess.run([sys.executable, "-m", "iop", "catalog", "--url", tenant_system.api_url, "--no-colour"],
                         capture_output=True, text=True, timeout=60, check=True, env=env).stdout
    lines = out.splitlines()
    start = lines.index("tenants")
    assert start < lines.index("model groups")
    assert [" ".join(line.split()) for line in lines[start + 1:start + 4]] == [
        "TENANT BAND WEIGHT QUEUED IN FLIGHT LIMITS",
        "web interactive 2 1 1 in flight <= 1",
        "eval batch 1 2 1 queued <= 5",
    ]
    assert "shared (shared): queued 3, oldest wait" in out
    assert "    tenant web: queued 1, in flight 1" in lines
    assert "    tenant eval: queued 2, in flight 1" in lines

    auth = {"authorization": f"Bearer {TENANT_KEYS['eval']}"}
    doc = httpx.get(f"{tenant_system.api_url}/catalog", headers=auth, timeout=10).json()
    assert [(t["name"], t["band"], t["queued"], t["in_flight"]) for t in doc["tenants"]] == [
        ("web", "interactive", 1, 1), ("eval", "batch", 2, 1)]
    (shared,) = doc["models"]
    assert shared["queued"] == 3  # its two band lanes
    assert shared["tenants"] == [{"tenant": "web", "queued": 1, "in_flight": 1},
                                 {"tenant": "eval", "queued": 2, "in_flight": 1}]
    metrics = httpx.get(f"{tenant_system.api_url}/metrics", headers=auth, timeout=10).text
    assert 'iop_tenant_queued{model="shared",tenant="eval"} 2.0' in metrics
    assert 'iop_tenant_in_flight{tenant="web"} 1.0' in metrics


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (Debian package 'chromium')")
def test_ui_page_shows_the_tenants(tenant_system: System) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(f"{tenant_system.api_url}/ui")
            # The catalog wants a key: the page asks for one.
            page.wait_for_selector("#auth", state="visible", timeout=15_000)
            page.fill("#key", TENANT_KEYS["web"])
            page.click("#auth button")
            page.wait_for_selector("#status[data-ok='1']", timeout=15_000)
            assert page.locator("#tenants-section").is_visible()
            cols = ("band", "queued", "in-flight", "limits")
            rows = {row.get_attribute("data-tenant"): tuple(row.locator(f"[data-testid={c}]").inner_text()
                                                            for c in cols)
                    for row in page.locator("[data-testid=tenant]").all()}
            assert rows == {"web": ("interactive", "1", "1", "in flight ≤ 1"),
                            "eval": ("batch", "2", "1", "queued ≤ 5")}
            shared = page.locator("[data-testid=model][data-model=shared]")
            assert shared.locator("[data-testid=queued]").inner_text() == "3"
            uses = {u.get_attribute("data-tenant"): (u.locator("[data-testid=use-queued]").inner_text(),
                                                     u.locator("[data-testid=use-in-flight]").inner_text())
                    for u in shared.locator("[data-testid=tenant-use]").all()}
            assert uses == {"web": ("1", "1"), "eval": ("2", "1")}
        finally:
            browser.close()


def test_no_tenants_without_flow_control(system: System) -> None:
    doc = httpx.get(f"{system.api_url}/catalog", timeout=10).json()
    assert doc["tenants"] == []
    assert all(m["tenants"] == [] for m in doc["models"])
    assert "tenants" not in run_catalog(system, "--no-colour").splitlines()
