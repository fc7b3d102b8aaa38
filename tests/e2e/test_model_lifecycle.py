"""Models that load and unload, through real processes: two fake Ollamas (``iop fake-provider
--max-loaded 1 --load-ms``: each holds one model at a time, starts with none, and a request
for a model it does not hold makes it load that model, evicting the other) behind one API
and one worker, both serving models x and y.

A model loaded nowhere is answered (its first request places a load and waits for it), and
under traffic for both models at once each settles on one server: every load is one iop
ordered through Ollama's API (``/api/generate``), none is a request's, and there are few.
What the fakes loaded comes from their own counters (``/_fake/lifecycle``); what iop
believes, from ``/catalog``."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from iop.redis_server import RedisServer
from tests.e2e.browser import CHROMIUM, CHROMIUM_ARGS
from tests.e2e.system import System, fast_dispatch, http_provider

LOAD_MS = 150
PER_CLIENT = 25


def lifecycle(system: System, name: str) -> dict[str, Any]:
    result: dict[str, Any] = httpx.get(f"{system.fakes[name].url}/_fake/lifecycle", timeout=5).json()
    return result


def loads(system: System, reason: str) -> int:
    return sum(n.get(reason, 0) for name in ("fa", "fb") for n in lifecycle(system, name)["loads"].values())


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[System]:
    sys_ = System(tmp_path_factory.mktemp("lifecycle"), redis_server)
    managed = {"lifecycle": "managed", "max_loaded": 1, "load_s": LOAD_MS / 1000, "unload_idle_s": 0.5}
    sys_.write_config({
        "dispatch": fast_dispatch(lease_ms=5000),
        "queue": {"max_queue": 100, "queue_timeout_ms": 60_000},
        "models": [{"id": m, "providers": {"a": m, "b": m}} for m in ("x", "y")],
        "nodes": [{"id": "n1", "providers": [
            http_provider("a", "ollama", sys_.port("fa"), 2, ["x", "y"], **managed),
            http_provider("b", "ollama", sys_.port("fb"), 2, ["x", "y"], **managed)]}],
    })
    with sys_:
        for name in ("fa", "fb"):
            sys_.fake(name, "--models", "x,y", "--tokens", "3", "--max-loaded", "1", "--load-ms", str(LOAD_MS))
        sys_.worker("n1")
        sys_.api()
        sys_.wait_available("a", "b")
        # The worker has read what each runtime holds (nothing yet).
        sys_.wait_until("models read", lambda: all(
            sys_.provider(p).get("ms:x") == "unloaded" for p in ("a", "b")))
        yield sys_


def ask(system: System, model: str) -> int:
    resp = httpx.post(f"{system.api_url}/v1/chat/completions", timeout=60,
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}]})
    return resp.status_code


def catalog_states(system: System) -> dict[str, dict[str, str]]:
    body = httpx.get(f"{system.api_url}/catalog", timeout=10).json()
    return {p["id"]: {m: s["state"] for m, s in p["models_state"].items()} for p in body["providers"]}


def test_a_model_loaded_nowhere_is_answered_after_one_load(system: System) -> None:
    assert ask(system, "x") == 200
    # One load, through the API (iop placed it), on one server.
    assert loads(system, "api") == 1
    assert loads(system, "request") == 0
    states = catalog_states(system)
    assert sorted(s["x"] for s in states.values()) == ["loaded", "unloaded"]
    body = httpx.get(f"{system.api_url}/catalog", timeout=10).json()
    holder = next(p for p in body["providers"] if p["models_state"]["x"]["state"] == "loaded")
    assert (holder["lifecycle"], holder["max_loaded"]) == ("managed", 1)
    assert holder["models_state"]["x"]["load_s"] is not None


def test_traffic_for_two_models_settles_each_on_one_server(system: System) -> None:
    before_api = loads(system, "api")

    def client(model: str) -> list[int]:
        return [ask(system, model) for _ in range(PER_CLIENT)]

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(client, ["x", "y", "x", "y"]))
    assert all(status == 200 for statuses in results for status in statuses), results
    # Every load was iop's, through Ollama's API; none was a request landing where its model
    # was not: with static models, about half of these 100 requests would each load one.
    assert loads(system, "request") == 0
    assert loads(system, "api") - before_api <= 4
    states = catalog_states(system)
    held = sorted((m, p) for p, s in states.items() for m, st in s.items() if st == "loaded")
    assert [m for m, _ in held] == ["x", "y"], states
    assert held[0][1] != held[1][1], held
    # And the fakes agree with the catalog.
    assert {name: lifecycle(system, name)["loaded"] for name in ("fa", "fb")} == {
        "fa": [m for m, p in held if p == "a"], "fb": [m for m, p in held if p == "b"]}


def test_metrics_count_loads_and_say_what_is_loaded(system: System) -> None:
    text = httpx.get(f"{system.api_url}/metrics", timeout=10).text
    assert 'iop_model_loaded{model="x",provider=' in text
    lines = [line for line in text.splitlines() if line.startswith("iop_model_loads_total{")]
    assert lines
    assert all('reason="demand"' in line or 'reason="runtime"' in line for line in lines)
    assert sum(float(line.rsplit(" ", 1)[1]) for line in lines if 'reason="demand"' in line) == loads(system, "api")


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (Debian package 'chromium')")
def test_ui_marks_each_models_state(system: System) -> None:
    from playwright.sync_api import sync_playwright

    want = catalog_states(system)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(f"{system.api_url}/ui")
            page.wait_for_selector("[data-testid=model-state]")
            shown = {pid: {el.get_attribute("data-model"): el.get_attribute("data-state")
                           for el in page.locator(f"[data-provider={pid}] [data-testid=model-state]").all()}
                     for pid in ("a", "b")}
        finally:
            browser.close()
    assert shown == want
