"""The catalog as operators see it, from real processes: the CLI table and the /ui page
(headless Chromium), for a known mix of healthy, failing, unknown and saturated providers,
with the endpoints each serves and the slots hint of a llama.cpp provider (a stand-in
llama-server in this process, answering /health, /v1/models, /props and /slots)."""

from __future__ import annotations

import contextlib
import json
import re
import struct
import subprocess
import sys
import threading
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from dispatcher.endpoints import DEFAULT_ENDPOINTS
from iop.redis_server import RedisServer
from tests.e2e.browser import CHROMIUM, CHROMIUM_ARGS
from tests.e2e.system import System, http_provider

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
# What the page shows for a value it does not have (an en dash, U+2013).
NONE = "\u2013"


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
    # ... queued, tok/s, cache hit rate (none reported: -), models
    assert "██████████ 1/1 1.00 2 0 - m-hosted" in " ".join(rows["hosted"].split())
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
            # No provider here reports cached prompt tokens, and no group has affinity on.
            headers = [h.lower() for h in page.locator("[data-node=n1] thead th").all_inner_texts()]
            assert headers[headers.index("queued") + 1] == "cache"
            assert set(page.locator("[data-testid=provider] [data-testid=cache]").all_inner_texts()) == {NONE}
            assert set(page.locator("[data-testid=model] [data-testid=affinity]").all_inner_texts()) == {"off"}
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


def png_pixels(png: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB(A) bytes) of an 8-bit, non-interlaced PNG, as Chromium writes them."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", b""
    while pos < len(png):
        length, kind = struct.unpack(">I4s", png[pos:pos + 8])
        if kind == b"IHDR":
            header = png[pos + 8:pos + 8 + length]
        elif kind == b"IDAT":
            idat += png[pos + 8:pos + 8 + length]
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert (depth, interlace) == (8, 0), (depth, interlace)
    assert colour in (2, 6), colour  # RGB or RGBA
    bpp = 3 if colour == 2 else 4
    raw, stride = zlib.decompress(idat), width * bpp
    rows: list[bytes] = []
    prev = bytearray(stride)
    for r in range(height):
        kind, line = raw[r * (stride + 1)], bytearray(raw[r * (stride + 1) + 1:(r + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + a) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + b) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        rows.append(bytes(line[j] for j in range(stride) if bpp == 3 or j % 4 != 3))
        prev = line
    return width, height, rows


def path_points(d: str) -> list[tuple[float, float]]:
    return [(float(x), float(y)) for x, y in re.findall(r"[ML]\s*(-?[\d.]+)[ ,]+(-?[\d.]+)", d)]


def test_a_missing_qualification_report_is_a_404_that_says_how_to_make_one(system: System) -> None:
    # This system's config has no qualify section: the answer says that too.
    resp = httpx.get(f"{system.api_url}/qualifications/pool", timeout=10)
    assert resp.status_code == 404, resp.text
    error = resp.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "qualification_not_found")
    assert error["message"].startswith("No qualification report of 'pool' yet: qualification runs are off in this "
                                       "iop: add a `qualify:` section to the config"), error
    assert "`iop qualify --model pool` makes one" in error["message"]
    run = httpx.post(f"{system.api_url}/admin/qualifications/pool/runs", json={}, timeout=10)
    assert run.status_code == 404, run.text
    assert run.json()["error"]["type"] == "invalid_request_error"
    assert "add a `qualify:` section to the config" in run.json()["error"]["message"]


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (Debian package 'chromium')")
def test_ui_qualifications_page_shows_why_there_is_no_report(system: System) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(f"{system.api_url}/ui/qualifications?model=pool")
            status = page.locator("[data-testid=status]")
            page.wait_for_function("!document.getElementById('status').textContent.startsWith('loading')",
                                   timeout=15_000)
            said = status.inner_text()
            assert said.startswith("No qualification report of 'pool' yet"), said
            assert "answered 404" not in said
            assert page.locator("[data-testid=qualified]").count() == 0
        finally:
            browser.close()


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (Debian package 'chromium')")
def test_ui_page_draws_the_last_minutes(system: System, tmp_path: Path) -> None:
    """The page keeps what its polls saw and draws it: queue depth per model, load (and tokens/s)
    per provider, one line per series that moves when the catalog does."""
    from playwright.sync_api import sync_playwright

    system.wait_available("up", "tool")
    doc = httpx.get(f"{system.api_url}/catalog", timeout=10).json()
    models = [m["id"] for m in doc["models"]]
    providers = [p["id"] for p in doc["providers"]]
    expected_charts = ["queue", "load"] + (["tokens"] if "tokens_per_s" in doc["providers"][0] else [])
    held: list[threading.Thread] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(f"{system.api_url}/ui")
            # attached, not visible: a flat line has no height
            page.wait_for_selector("[data-testid=chart][data-chart=load] path", state="attached", timeout=15_000)
            # Traffic while the page polls: 'up' holds what it gets. Its group also has 'tool',
            # which wins ties and answers at once: bursts of requests to 'pool' until one is held.
            system.fakes["up"].control(hang=True)
            for _ in range(10):
                for _ in range(3):
                    thread = threading.Thread(target=lambda: httpx.post(
                        f"{system.api_url}/v1/chat/completions", json={"model": "pool", "messages": []}, timeout=60))
                    thread.start()
                    held.append(thread)
                try:
                    system.wait_until("a request held by up", lambda: system.in_flight("up") >= 1, timeout=2)
                    break
                except TimeoutError:
                    continue
            assert system.in_flight("up") >= 1
            # Until the page has seen up busy, and every series has a line (two points or more).
            up_load = "[data-chart=load] path[data-series=up]"
            page.wait_for_function(
                f"() => Number(document.querySelector('{up_load}').dataset.last) >= 0.5"
                " && [...document.querySelectorAll('[data-testid=chart] path')].every(p => +p.dataset.points >= 2)",
                timeout=30_000)

            charts = page.locator("[data-testid=chart]")
            assert [c.get_attribute("data-chart") for c in charts.all()] == expected_charts
            series = {str(c.get_attribute("data-chart")): [str(p.get_attribute("data-series"))
                                                           for p in c.locator("path").all()]
                      for c in charts.all()}
            assert series["queue"] == models
            assert series["load"] == providers
            if "tokens" in series:
                assert series["tokens"] == providers
            box = charts.first.locator("svg").bounding_box()
            assert box is not None
            assert box["width"] > 250, box
            assert box["height"] > 80, box
            view_box = charts.first.locator("svg").get_attribute("viewBox") or ""
            view_w, view_h = (float(v) for v in view_box.split()[2:])
            lines: dict[tuple[str, str], list[tuple[float, float]]] = {}
            for chart, ids in series.items():
                for sid in ids:
                    path = page.locator(f"[data-chart='{chart}'] path[data-series='{sid}']")
                    points = path_points(path.get_attribute("d") or "")
                    assert len(points) >= 2, (chart, sid, path.get_attribute("d"))
                    assert all(0 <= x <= view_w and 0 <= y <= view_h for x, y in points), (chart, sid, points)
                    assert [x for x, _ in points] == sorted(x for x, _ in points), (chart, sid)
                    lines[(chart, sid)] = points
            # The values behind the lines: 'busy' waits with 2, 'hosted' runs 1 of 1, 'up' went from idle to busy.
            last = {(c, s): page.locator(f"[data-chart='{c}'] path[data-series='{s}']").get_attribute("data-last")
                    for c, s in lines}
            assert last[("queue", "busy")] == "2"
            assert last[("queue", "nowhere")] == "0"
            assert last[("load", "hosted")] == "1"
            assert float(last[("load", "up")] or 0) >= 0.5
            # Higher values are drawn higher (smaller y): busy's queue over nowhere's, up's load rising.
            assert lines[("queue", "busy")][-1][1] < lines[("queue", "nowhere")][-1][1]
            assert lines[("load", "up")][-1][1] < lines[("load", "up")][0][1]
            assert lines[("load", "hosted")][-1][1] < lines[("load", "sick")][-1][1]
            # Each chart names its series with the latest value.
            queue_legend = page.locator("[data-chart=queue] .legend").inner_text()
            assert "busy 2" in queue_legend
            assert "pool" in queue_legend
            assert "hosted 100%" in page.locator("[data-chart=load] .legend").inner_text()
            axis = page.locator("[data-chart=load] svg text").all_text_contents()
            assert {"0%", "50%", "100%", "now"} <= set(axis)
            # the left edge: how far back the page has seen, with a minus sign (U+2212)
            assert re.fullmatch(r"\u2212\d+ s", axis[-3]), axis

            # What a person sees: the charts laid out, and in each picture the lines in their colours.
            shot = tmp_path / "ui-charts.png"
            page.locator("#charts-section").screenshot(path=str(shot))
            width, height, _ = png_pixels(shot.read_bytes())
            assert width >= 800, width
            assert height >= 150, height
            for chart, visible in (("queue", ["busy"]), ("load", ["hosted", "up"])):
                picture = tmp_path / f"ui-{chart}.png"
                page.locator(f"[data-chart={chart}] svg").screenshot(path=str(picture))
                colours = {sid: bytes.fromhex((page.locator(f"[data-chart={chart}] path[data-series={sid}]")
                                               .get_attribute("stroke") or "").lstrip("#")) for sid in visible}
                drawn = dict.fromkeys(visible, 0)
                for row in png_pixels(picture.read_bytes())[2]:
                    for i in range(0, len(row), 3):
                        for sid, colour in colours.items():
                            if sum(abs(a - b) for a, b in zip(row[i:i + 3], colour, strict=True)) <= 12:
                                drawn[sid] += 1
                assert all(n >= 40 for n in drawn.values()), (chart, drawn)
            full = tmp_path / "ui.png"
            page.screenshot(path=str(full), full_page=True)
            assert png_pixels(full.read_bytes())[1] > height
            # Measured in one call on the page: its polls redraw the tables, so an element found
            # by one call may be gone by the next.
            table_boxes = page.eval_on_selector_all(
                "table", "ts => ts.filter(t => t.getClientRects().length > 0)"
                " .map(t => { const r = t.getBoundingClientRect(); return [r.width, r.height]; })")
            assert table_boxes
            for table_width, table_height in table_boxes:
                assert table_width > 100, table_boxes
                assert table_height > 20, table_boxes
            assert page.locator("[data-testid=provider]").count() == len(providers)
        finally:
            browser.close()
            system.fakes["up"].control(hang=False)
            for thread in held:
                thread.join(timeout=30)


def _catalog_shape(poll: int) -> dict[str, Any]:
    """A catalog as /catalog may answer while fields are added: 'a' and 'b' carry ``drain`` and
    ``tokens_per_s``, 'c' neither (and capacity 0, so it has no load to draw)."""
    def provider(pid: str, capacity: int, in_flight: int, **extra: Any) -> dict[str, Any]:
        return {"id": pid, "node_id": "n1", "type": "vllm", "category": "local_inference", "health": "available",
                "reason": "", "capacity": capacity, "in_flight": in_flight, "queued": poll, "models": [f"m-{pid}"],
                "missing_models": [], "lifecycle_capabilities": {}, "endpoints": ["chat/completions"], "slots": None,
                **extra}

    providers = [provider("a", 4, poll, drain="draining", tokens_per_s=10.0 * poll),
                 provider("b", 2, 0, drain="drained", tokens_per_s=0.0),
                 {**provider("c", 0, 0), "health": "unavailable", "reason": "capacity 0"}]
    candidates = [{"provider": p["id"], "served_name": f"m-{p['id']}", "node_id": "n1", "health": p["health"],
                   "capacity": p["capacity"], "in_flight": p["in_flight"]} for p in providers]
    return {"server_time_ms": 1_800_000_000_000 + 3000 * poll, "providers": providers,
            "models": [{"id": "m", "display_name": "M", "candidates": candidates, "queued": poll,
                        "oldest_wait_ms": None, "available_slots": 1, "tenants": []}],
            "nodes": [{"id": "n1", "providers": ["a", "b", "c"]}], "tenants": []}


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (Debian package 'chromium')")
def test_ui_page_draws_drain_states_gaps_and_absent_fields() -> None:
    """The page against canned catalogs, its clock run by the test: drain badges, tokens/s only for
    providers that report it, no load line without capacity, and a gap where polls failed."""
    from playwright.sync_api import Route, sync_playwright

    polls = {"n": 0}
    failures: list[int] = []  # statuses to answer the next polls with

    def answer(route: Route) -> None:
        poll = polls["n"]
        polls["n"] += 1
        if failures:
            route.fulfill(status=failures.pop(0), body="down")
        else:
            route.fulfill(status=200, content_type="application/json", body=json.dumps(_catalog_shape(poll)))

    ui = (Path(__file__).resolve().parents[2] / "api" / "ui.html").read_text()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.clock.install()
            page.route("http://iop.test/ui", lambda route: route.fulfill(body=ui, content_type="text/html"))
            page.route("http://iop.test/catalog", answer)
            page.goto("http://iop.test/ui")
            queue = "[data-chart=queue] path[data-series=m]"

            def poll_until(points: int) -> None:
                page.clock.run_for(3000)
                page.wait_for_function(f"() => document.querySelector('{queue}')?.dataset.points === '{points}'")

            page.wait_for_selector(queue, state="attached")
            poll_until(2)
            poll_until(3)
            # The drain state beside the health, in the providers table and among the candidates.
            drains = {pid: page.locator(f"[data-provider={pid}] [data-testid=drain]").all_inner_texts()
                      for pid in "abc"}
            assert drains == {"a": ["draining"], "b": ["drained"], "c": []}
            assert page.locator("[data-provider=a] [data-testid=health]").inner_text() == "available"
            assert page.locator("[data-testid=candidate-drain]").all_inner_texts() == ["draining", "drained"]
            charts = [c.get_attribute("data-chart") for c in page.locator("[data-testid=chart]").all()]
            assert charts == ["queue", "load", "tokens"]
            tokens = page.locator("[data-chart=tokens] path")
            assert [p.get_attribute("data-series") for p in tokens.all()] == ["a", "b"]
            assert page.locator("[data-chart=tokens] path[data-series=a]").get_attribute("data-last") == "20"
            load = {p.get_attribute("data-series"): (p.get_attribute("data-points"), p.get_attribute("data-last"))
                    for p in page.locator("[data-chart=load] path").all()}
            assert load == {"a": ("3", "0.5"), "b": ("3", "0"), "c": ("0", "")}
            # Failed polls draw nothing; the next good one starts a new piece of line.
            failures += [500, 502, 503]
            for status in (500, 502, 503):
                page.clock.run_for(3000)
                page.wait_for_function(
                    f"() => document.getElementById('status').textContent.endsWith('catalog answered {status}')")
            poll_until(4)
            d = page.locator(queue).get_attribute("d") or ""
            assert d.count("M") == 2, d
            assert page.locator(queue).get_attribute("data-last") == "6"
        finally:
            browser.close()


def _cache_catalog() -> dict[str, Any]:
    """A catalog with the prefix-cache fields: a warm provider, a cold one, one of an older iop
    without them; groups with prefix and session affinity, one with it off, one of an older iop."""
    def provider(pid: str, **extra: Any) -> dict[str, Any]:
        return {"id": pid, "node_id": "n1", "type": "vllm", "category": "local_inference", "health": "available",
                "reason": "", "capacity": 2, "in_flight": 0, "queued": 0, "models": ["m"], "missing_models": [],
                "lifecycle_capabilities": {}, "endpoints": ["chat/completions"], "slots": None, **extra}

    def affinity(mode: str, bound: float, blocks: int, max_blocks: int, hit: int, miss: int,
                 spill: int) -> dict[str, Any]:
        return {"mode": mode, "load_bound": bound, "index_blocks": blocks, "index_max_blocks": max_blocks,
                "decisions": {"hit": hit, "miss": miss, "spill": spill}}

    providers = [provider("warm", prompt_tokens=1000, cached_tokens=623, cache_hit_rate=0.623),
                 provider("cold", prompt_tokens=500, cached_tokens=0, cache_hit_rate=None),
                 provider("older")]
    candidates = [{"provider": "warm", "served_name": "m", "node_id": "n1", "health": "available",
                   "capacity": 2, "in_flight": 0}]

    def model(mid: str, **extra: Any) -> dict[str, Any]:
        return {"id": mid, "display_name": mid, "candidates": candidates, "queued": 0, "oldest_wait_ms": None,
                "available_slots": 2, "tenants": [], **extra}

    return {"server_time_ms": 1_800_000_000_000, "providers": providers,
            "models": [model("pre", affinity={**affinity("prefix", 1.25, 120, 10000, 30, 8, 2), "home_queue": 1.0,
                                              "home_queued": 4}),
                       model("ses", affinity=affinity("session", 2.0, 0, 200000, 0, 0, 0)),
                       model("plain", affinity=None), model("old")],
            "nodes": [{"id": "n1", "providers": ["warm", "cold", "older"]}], "tenants": []}


@contextlib.contextmanager
def canned_ui_page(catalog: dict[str, Any]) -> Iterator[Any]:
    """The /ui page in Chromium, its /catalog answered with ``catalog``, once it has drawn it;
    a missing cell fails fast."""
    from playwright.sync_api import sync_playwright

    ui = (Path(__file__).resolve().parents[2] / "api" / "ui.html").read_text()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.route("http://iop.test/ui", lambda route: route.fulfill(body=ui, content_type="text/html"))
            page.route("http://iop.test/catalog", lambda route: route.fulfill(
                status=200, content_type="application/json", body=json.dumps(catalog)))
            page.set_default_timeout(5_000)
            page.goto("http://iop.test/ui")
            page.wait_for_selector("#status[data-ok='1']", timeout=15_000)
            yield page
        finally:
            browser.close()


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (Debian package 'chromium')")
def test_ui_page_shows_cache_hit_rates_and_affinity(tmp_path: Path) -> None:
    """The page against a canned catalog: each provider's cache hit rate, and each model group's
    affinity (mode, bound, index blocks, decisions and their hit share), or "off"."""
    with canned_ui_page(_cache_catalog()) as page:
        cache = {pid: page.locator(f"[data-provider={pid}] [data-testid=cache]").inner_text()
                 for pid in ("warm", "cold", "older")}
        assert cache == {"warm": "62%", "cold": NONE, "older": NONE}
        assert page.locator("[data-provider=warm] [data-testid=cache]").get_attribute("title") == (
            "623 of 1000 prompt tokens served from its prefix cache")
        fields = ("mode", "bound", "index", "hit", "miss", "spill", "hit-share")
        affinity = {m: tuple(page.locator(f"[data-model={m}] [data-testid=affinity-{f}]").inner_text()
                             for f in fields) for m in ("pre", "ses")}
        assert affinity == {"pre": ("prefix", "1.25", "120/10000", "30", "8", "2", "75%"),
                            "ses": ("session", "2", "0/200000", "0", "0", "0", NONE)}
        cell = page.locator("[data-model=pre] [data-testid=affinity]").inner_text()
        assert " ".join(cell.split()) == (
            "prefix · bound 1.25\u00d7 index 120/10000 blocks hit 30 · miss 8 · spill 2 (75% hits) "
            "home queue 1\u00d7 · 4 past capacity")
        # No home queue (an older iop, or home_queue 0): no line for it.
        assert page.locator("[data-model=ses] [data-testid=affinity-home-queued]").count() == 0
        for off in ("plain", "old"):
            assert page.locator(f"[data-model={off}] [data-testid=affinity]").inner_text() == "off"
            assert page.locator(f"[data-model={off}] [data-testid=affinity-mode]").count() == 0
        shot = tmp_path / "ui-cache.png"
        page.screenshot(path=str(shot), full_page=True)
        for table in page.locator("table:visible").all():
            box = table.bounding_box()
            assert box is not None
            assert box["width"] > 100, box


def _limits_catalog() -> dict[str, Any]:
    """The cache catalog with tenants: one with every limit (its request window full), one with
    a token window alone, one without limits, and one of an older iop without the field."""
    def tenant(name: str, limits: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
        return {"name": name, "band": "standard", "weight": 1, "models": None, "max_queued": None,
                "max_in_flight": None, "queued": 0, "in_flight": 0, "limits": limits, **extra}

    def limits(rpm: int | None, r_used: int, tpm: int | None, t_used: int, tpd: int | None, today: int,
               refused: tuple[int, int, int]) -> dict[str, Any]:
        return {"requests_per_minute": rpm, "requests_used": r_used, "tokens_per_minute": tpm,
                "tokens_used": t_used, "tokens_per_day": tpd, "tokens_used_today": today,
                "refused": dict(zip(("requests", "tokens", "budget"), refused, strict=True))}

    older = tenant("older")
    del older["limits"]
    return {**_cache_catalog(), "tenants": [
        tenant("web", limits(60, 60, 20000, 3400, 1000000, 51200, (3, 0, 1)), max_in_flight=4),
        tenant("bulk", limits(None, 0, 100000, 250, None, 0, (0, 2, 0))),
        tenant("eval"), older]}


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (Debian package 'chromium')")
def test_ui_page_shows_tenant_rate_limits_and_refusals(tmp_path: Path) -> None:
    """The page against a canned catalog: per tenant, "used / limit" in each window (a dash for
    a window without a limit), the full one marked, its refusals by reason; a dash without limits."""
    with canned_ui_page(_limits_catalog()) as page:
        assert page.locator("#tenants-section").is_visible()
        headers = page.locator("[data-testid=tenants] thead th").all_inner_texts()
        assert [h.lower() for h in headers] == ["tenant", "band", "weight", "queued", "in flight", "limits",
                                                "rate limits", "models"]
        fields = ("limit-rpm", "limit-tpm", "limit-tpd", "refused-requests", "refused-tokens", "refused-budget")
        values = {t: tuple(page.locator(f"[data-tenant={t}] [data-testid={f}]").inner_text() for f in fields)
                  for t in ("web", "bulk")}
        assert values == {"web": ("60 / 60", "3400 / 20000", "51200 / 1000000", "3", "0", "1"),
                          "bulk": (NONE, "250 / 100000", NONE, "0", "2", "0")}
        cell = page.locator("[data-tenant=web] [data-testid=rate-limits]").inner_text()
        assert [" ".join(line.split()) for line in cell.splitlines() if line.strip()] == [
            "requests/min 60 / 60", "tokens/min 3400 / 20000", "tokens/day 51200 / 1000000",
            "refused: 3 requests, 0 tokens, 1 budget"]
        # Only a window used up is marked.
        full = page.locator("[data-testid=rate-limits] .full")
        assert [(f.get_attribute("data-testid"), f.inner_text()) for f in full.all()] == [("limit-rpm", "60 / 60")]
        assert page.locator("[data-tenant=web] [data-testid=limit-tpd]").get_attribute("title") == (
            "51200 of 1000000 tokens today (UTC)")
        # The max_queued / max_in_flight limits stay in their own column.
        assert page.locator("[data-tenant=web] [data-testid=limits]").inner_text() == "in flight ≤ 4"
        # Without limits (null, or a catalog that does not say): a dash, nothing more.
        for name in ("eval", "older"):
            assert page.locator(f"[data-tenant={name}] [data-testid=rate-limits]").inner_text() == NONE
            assert page.locator(f"[data-tenant={name}] [data-testid^=limit-]").count() == 0
            assert page.locator(f"[data-tenant={name}] [data-testid^=refused-]").count() == 0
        page.locator("#tenants-section").screenshot(path=str(tmp_path / "ui-tenant-limits.png"))


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
