"""Runtime control on the /ui page (issue 48), in headless Chromium.

Most cases run the page against canned answers (its ``/catalog`` and the ``/admin`` endpoints
answered by the test, as docs/DESIGN.md shapes them), so they say what the page shows and
sends whatever the server does: the override markers and their titles, the ``disabled``
badge, each control's request, the server's error message, the refresh after a success, the
audit panel (only when ``/admin/audit`` answers), an older iop's catalog. The last case runs
the page against real processes: an operator disables a provider, caps another, sets a
model's fallbacks from the page, and the catalog and the audit show it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from iop.redis_server import RedisServer
from tests.e2e.browser import CHROMIUM, CHROMIUM_ARGS
from tests.e2e.system import System, http_provider

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (Debian package 'chromium')")

UI = (Path(__file__).resolve().parents[2] / "api" / "ui.html").read_text()
# 2026-05-01 13:04:00 UTC: the server's clock in the canned catalogs.
NOW = 1_777_640_640_000
MINUTE = 60_000
ADMIN_KEY = "admin-key-ui-e2e"
# What the page shows for a value it does not have, and between two bounds (an en dash, U+2013).
DASH = "\u2013"


def override(value: Any, config: Any, until: int | None = None, by: str = "ops") -> dict[str, Any]:
    """One field of a catalog ``override``: ``{"value", "config", "by", "at", "until"}``."""
    return {"value": value, "config": config, "by": by, "at": NOW - 5 * MINUTE, "until": until}


def provider(pid: str, capacity: int = 2, **extra: Any) -> dict[str, Any]:
    return {"id": pid, "node_id": "n1", "type": "vllm", "category": "local_inference", "health": "available",
            "reason": "", "capacity": capacity, "in_flight": 0, "queued": 0, "models": ["m"], "missing_models": [],
            "lifecycle_capabilities": {}, "endpoints": ["chat/completions"], "slots": None, "enabled": True,
            "override": {}, **extra}


def group(mid: str, providers: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"id": mid, "display_name": mid, "queued": 0, "oldest_wait_ms": None, "available_slots": 1, "tenants": [],
            "candidates": [{"provider": p["id"], "served_name": "m", "node_id": "n1", "health": p["health"],
                            "capacity": p["capacity"], "in_flight": 0} for p in providers],
            "fallbacks": [], "preference": [p["id"] for p in providers], "override": {}, **extra}


class Pool:
    """The canned fleet's state, which the canned admin endpoints change: gpu1 disabled for an
    hour, api capped at 2 (config 6) until 14:03 UTC, auto's bounds narrowed until cleared,
    'chat' with its fallbacks and preference overridden; 'plain' and 'older' untouched, 'older'
    as an older iop shows a provider (no ``enabled``, no ``override``)."""

    def __init__(self) -> None:
        self.gpu1_disabled = True

    def catalog(self) -> dict[str, Any]:
        gpu1 = provider("gpu1", enabled=not self.gpu1_disabled,
                        override={"enabled": override(False, True, NOW + 60 * MINUTE)} if self.gpu1_disabled else {})
        api = provider("api", 2, override={"capacity": override(2, 6, NOW + 59 * MINUTE)})
        auto = provider("auto", 4, capacity_mode="auto", capacity_bounds=[1, 8], capacity_reason="learning",
                        override={"capacity_bounds": override({"min": 1, "max": 8}, {"min": 1, "max": 16},
                                                              by="alice")})
        plain, older = provider("plain"), provider("older")
        del older["enabled"], older["override"]
        chat = group("chat", [api, gpu1], fallbacks=["small", "tiny"], preference=["api", "gpu1"],
                     override={"fallbacks": override(["small", "tiny"], ["small"], NOW + 2 * 24 * 60 * MINUTE),
                               "preference": override(["api", "gpu1"], ["gpu1", "api"])})
        old_group = group("old", [older])
        del old_group["fallbacks"], old_group["preference"], old_group["override"]
        providers = [gpu1, api, auto, plain, older]
        return {"server_time_ms": NOW, "providers": providers,
                "models": [chat, group("plain", [plain, auto]), old_group],
                "nodes": [{"id": "n1", "providers": [p["id"] for p in providers]}], "tenants": []}


AUDIT = {"entries": [
    {"id": "1777640340000-0", "at": NOW - 5 * MINUTE, "by": "ops", "action": "disable", "target": "provider/gpu1",
     "before": True, "after": False, "via": "cli"},
    {"id": "1777640000000-0", "at": NOW - 11 * MINUTE, "by": "alice", "action": "capacity", "target": "provider/auto",
     "before": {"min": 1, "max": 16}, "after": {"min": 1, "max": 8}, "via": "http"}]}

Answer = tuple[int, Any]
Admin = Callable[[str, str, Any, dict[str, str]], Answer]


@contextlib.contextmanager
def canned_page(pool: Pool, admin: Admin, clock: bool = False) -> Iterator[tuple[Any, list[dict[str, Any]]]]:
    """The page in Chromium, ``/catalog`` answered from ``pool``, each ``/admin`` call by
    ``admin(method, path, body, headers)`` and kept in the list yielded with the page."""
    from playwright.sync_api import Route, sync_playwright

    calls: list[dict[str, Any]] = []

    def answer_admin(route: Route) -> None:
        req = route.request
        path = req.url.removeprefix("http://iop.test")
        body = json.loads(req.post_data) if req.post_data else None
        calls.append({"method": req.method, "path": path, "body": body, "headers": req.headers})
        status, doc = admin(req.method, path, body, req.headers)
        route.fulfill(status=status, content_type="application/json", body=json.dumps(doc))

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            if clock:
                page.clock.install()
            page.route("http://iop.test/ui", lambda route: route.fulfill(body=UI, content_type="text/html"))
            page.route("http://iop.test/catalog", lambda route: route.fulfill(
                status=200, content_type="application/json", body=json.dumps(pool.catalog())))
            page.route(re.compile(r"http://iop\.test/admin/.*"), answer_admin)
            page.set_default_timeout(5_000)
            page.goto("http://iop.test/ui")
            page.wait_for_selector("#status[data-ok='1']", timeout=15_000)
            yield page, calls
        finally:
            browser.close()


def audit_only(method: str, path: str, body: Any, headers: dict[str, str]) -> Answer:
    return (200, AUDIT) if path.startswith("/admin/audit") else (404, {"error": {"message": "not here"}})


def message(page: Any) -> tuple[str, str]:
    """The control message, once the call it reports has answered: (ok|error, text)."""
    page.wait_for_function("() => { const m = document.getElementById('control-message');"
                           " return m.dataset.state && !m.textContent.endsWith('…'); }")
    box = page.locator("[data-testid=control-message]")
    return box.get_attribute("data-state") or "", box.inner_text()


def test_overridden_values_are_marked_with_until_when_and_the_config_value() -> None:
    with canned_page(Pool(), audit_only) as (page, _):
        def marks(scope: str) -> dict[str, str]:
            return {m.get_attribute("data-field") or "": m.inner_text()
                    for m in page.locator(f"{scope} [data-testid=override]").all()}

        assert marks("[data-testid=provider][data-provider=gpu1]") == {"enabled": "override until 14:04 UTC"}
        assert marks("[data-testid=provider][data-provider=api]") == {"capacity": "override until 14:03 UTC"}
        assert marks("[data-testid=provider][data-provider=auto]") == {"capacity_bounds": "override"}
        for pid in ("plain", "older"):
            assert marks(f"[data-testid=provider][data-provider={pid}]") == {}
        # Who, when, until when, and the config's value, in the marker's title.
        title = page.locator("[data-testid=provider][data-provider=api] [data-testid=override]").get_attribute("title")
        assert title == ("capacity 2: set by ops at 2026-05-01 12:59:00 UTC\n"
                         "until 2026-05-01 14:03:00 UTC (59 min left), then the config's value again\nconfig: 6")
        title = page.locator("[data-provider=auto] [data-testid=override][data-field=capacity_bounds]").first
        assert (title.get_attribute("title") or "").splitlines() == [
            f"capacity bounds 1{DASH}8: set by alice at 2026-05-01 12:59:00 UTC", "until an operator clears it",
            f"config: 1{DASH}16"]
        # The effective capacity stays where it was; the marker follows it.
        assert page.locator("[data-provider=api] [data-testid=load]").inner_text().strip() == (
            "0/2override until 14:03 UTC")
        # Disabled: a badge beside the health, which stays the probe's word, and among the candidates.
        assert page.locator("[data-testid=provider][data-provider=gpu1] [data-testid=health]").inner_text() == (
            "available")
        assert page.locator("[data-testid=provider] [data-testid=disabled]").all_inner_texts() == ["disabled"]
        assert page.locator("[data-testid=provider][data-provider=gpu1] [data-testid=disabled]").count() == 1
        candidates = page.locator("[data-testid=model][data-model=chat] [data-testid=candidate]")
        assert [c.locator("[data-testid=candidate-disabled]").count() for c in candidates.all()] == [0, 1]
        # A model group's fallbacks, and its preference when an operator set one, marked.
        chat = "[data-testid=model][data-model=chat]"
        assert page.locator(f"{chat} [data-testid=fallbacks]").inner_text() == "small, tiny"
        assert page.locator(f"{chat} [data-testid=preference]").inner_text() == "api, gpu1"
        assert marks(chat) == {"fallbacks": "override until 2026-05-03 13:04 UTC", "preference": "override"}
        assert page.locator(f"{chat} [data-field=preference]").get_attribute("title") == (
            "preference api, gpu1: set by ops at 2026-05-01 12:59:00 UTC\nuntil an operator clears it\n"
            "config: gpu1, api")
        plain = "[data-testid=model][data-model=plain]"
        assert page.locator(f"{plain} [data-testid=routing]").inner_text() == "fallbacks: none"
        assert page.locator(f"{plain} [data-testid=preference]").count() == 0
        # An older iop's group: no routing fields, a dash.
        assert page.locator("[data-testid=model][data-model=old] [data-testid=routing]").inner_text() == DASH
        # The control rows show the same state.
        gpu1 = page.locator("[data-testid=provider-control][data-provider=gpu1] [data-testid=ctl-state]")
        assert gpu1.locator("[data-testid=ctl-disabled]").inner_text() == "disabled"
        assert page.locator("[data-testid=provider-control][data-provider=plain] [data-testid=ctl-state]").inner_text(
        ) == "enabled"
        # Bounds inputs only for a provider whose capacity is learned.
        assert page.locator("[data-provider=auto] [data-testid=ctl-min]").count() == 1
        assert page.locator("[data-provider=api] [data-testid=ctl-min]").count() == 0
        assert page.locator("[data-provider=api] [data-testid=ctl-capacity]").get_attribute("placeholder") == "2"
        assert page.locator("[data-model=chat] [data-testid=ctl-fallbacks]").get_attribute("placeholder") == (
            "small, tiny")


def test_the_audit_panel_lists_the_last_actions_and_hides_without_them() -> None:
    with canned_page(Pool(), audit_only) as (page, calls):
        page.wait_for_selector("#audit-section:not([hidden])")
        rows = page.locator("[data-testid=audit-entry]")
        assert [[" ".join(c.split()) for c in r.locator("td").all_inner_texts()] for r in rows.all()] == [
            ["2026-05-01 12:59:00 UTC", "ops", "disable", "provider/gpu1", "true", "false", "cli"],
            ["2026-05-01 12:53:00 UTC", "alice", "capacity", "provider/auto", '{"min":1,"max":16}',
             '{"min":1,"max":8}', "http"]]
        assert [c["path"] for c in calls] == ["/admin/audit?limit=20"]
    # An older iop (404), or a key that may not read it: no panel, the rest as ever.
    with canned_page(Pool(), lambda *_: (404, {"status_code": 404, "detail": "Not Found"})) as (page, calls):
        page.wait_for_function("() => document.getElementById('control-section').hidden === false")
        page.wait_for_timeout(300)
        assert page.locator("#audit-section").is_hidden()
        assert [c["path"] for c in calls] == ["/admin/audit?limit=20"]


def test_each_control_sends_its_request_and_refreshes_on_success() -> None:
    pool = Pool()

    def admin(method: str, path: str, body: Any, headers: dict[str, str]) -> Answer:
        if path.startswith("/admin/audit"):
            return 200, AUDIT
        if (method, path) == ("POST", "/admin/providers/gpu1/enable"):
            pool.gpu1_disabled = False
            return 200, {"target": "provider", "id": "gpu1", "field": "enabled", "cleared": True}
        if (method, path) == ("POST", "/admin/providers/plain/disable"):
            return 200, {"target": "provider", "id": "plain", "field": "enabled", "value": False, "config": True,
                         "by": "ops", "at": NOW, "until": NOW + (body or {}).get("for_s", 0) * 1000, "via": "http"}
        if (method, path) == ("PUT", "/admin/providers/api/capacity"):
            if body["capacity"] > 6:
                return 422, {"error": {"message": "capacity 7 is above max_capacity 6", "type": "invalid_request_error",
                                       "code": "capacity_out_of_bounds"}}
            return 200, {"target": "provider", "id": "api", "field": "capacity", "value": body["capacity"],
                         "config": 6, "by": "ops", "at": NOW, "until": None, "via": "http"}
        if path.endswith("/capacity") or path.endswith("/preference") or path.endswith("/fallbacks"):
            field = path.rsplit("/", 1)[1]
            if method == "DELETE":
                return 200, {"target": "x", "id": "x", "field": field, "cleared": False}
            return 200, {"target": "x", "id": "x", "field": field, "value": body.get(field, body.get("providers")),
                         "config": [], "by": "ops", "at": NOW, "until": None, "via": "http"}
        if path.endswith("/drain") or path.endswith("/resume"):
            return 200, {"provider": "plain", "drain": "draining" if path.endswith("drain") else None, "in_flight": 1}
        return 404, {"error": {"message": f"Unknown provider or model: {path}"}}

    with canned_page(pool, admin) as (page, calls):
        def click(row: str, testid: str) -> tuple[str, str]:
            page.locator(f"{row} [data-testid={testid}]").click()
            return message(page)

        def audits() -> int:
            return len([c for c in calls if c["path"].startswith("/admin/audit")])

        def sent() -> tuple[str, str, Any]:
            call = [c for c in calls if not c["path"].startswith("/admin/audit")][-1]
            return call["method"], call["path"], call["body"]

        gpu1, plain, api, auto = (f"[data-testid=provider-control][data-provider={pid}]"
                                  for pid in ("gpu1", "plain", "api", "auto"))
        chat = "[data-testid=model-control][data-model=chat]"

        # Enable: the catalog is read again at once, and the badge goes.
        read = audits()
        assert click(gpu1, "ctl-enable") == ("ok", "gpu1: enable: enabled again")
        assert sent() == ("POST", "/admin/providers/gpu1/enable", None)
        page.wait_for_function("() => !document.querySelector('[data-testid=provider] [data-testid=disabled]')")
        # ... and the audit too, before its next turn among the polls.
        for _ in range(50):
            if audits() > read:
                break
            page.wait_for_timeout(20)
        assert audits() == read + 1
        # Disable for an hour: the duration as for_s; no call for a duration that is none.
        page.locator(f"{plain} [data-testid=ctl-for]").fill("1h")
        assert click(plain, "ctl-disable") == ("ok", "plain: disable: disabled, until 14:04 UTC")
        assert sent() == ("POST", "/admin/providers/plain/disable", {"for_s": 3600})
        assert page.locator(f"{plain} [data-testid=ctl-for]").input_value() == ""  # cleared after a success
        n = len(calls)
        page.locator(f"{plain} [data-testid=ctl-for]").fill("soon")
        assert click(plain, "ctl-disable") == ("error", "plain: disable: “soon” is no duration: 90s, 15m, 1h, 2d, "
                                                        "or seconds")
        assert len(calls) == n
        page.locator(f"{plain} [data-testid=ctl-for]").fill("")
        # No body without a duration.
        click(plain, "ctl-disable")
        assert sent() == ("POST", "/admin/providers/plain/disable", None)
        # Drain and resume, as before.
        assert click(plain, "ctl-drain") == ("ok", "plain: drain: draining, 1 running")
        assert sent() == ("POST", "/admin/providers/plain/drain", None)
        click(plain, "ctl-resume")
        assert sent() == ("POST", "/admin/providers/plain/resume", None)
        # A capacity the server refuses: its own message, the input kept to correct it.
        page.locator(f"{api} [data-testid=ctl-capacity]").fill("7")
        assert click(api, "ctl-capacity-set") == (
            "error", "api: capacity refused (422): capacity 7 is above max_capacity 6")
        assert page.locator(f"{api} [data-testid=ctl-capacity]").input_value() == "7"
        page.locator(f"{api} [data-testid=ctl-capacity]").fill("3")
        page.locator(f"{api} [data-testid=ctl-for]").fill("90m")
        assert click(api, "ctl-capacity-set") == ("ok", "api: capacity: capacity 3 (config 6), until cleared")
        assert sent() == ("PUT", "/admin/providers/api/capacity", {"capacity": 3, "for_s": 5400})
        n = len(calls)
        page.locator(f"{api} [data-testid=ctl-capacity]").fill("two")
        assert click(api, "ctl-capacity-set") == ("error", "api: capacity: capacity “two” is not a whole number")
        page.locator(f"{api} [data-testid=ctl-capacity]").fill("")
        assert click(api, "ctl-capacity-set") == ("error", "api: capacity: enter a capacity")
        assert len(calls) == n
        assert click(api, "ctl-capacity-clear") == ("ok", "api: capacity: no capacity override to clear")
        assert sent() == ("DELETE", "/admin/providers/api/capacity", None)
        # Bounds of capacity: auto.
        page.locator(f"{auto} [data-testid=ctl-min]").fill("2")
        page.locator(f"{auto} [data-testid=ctl-max]").fill("12")
        click(auto, "ctl-capacity-set")
        assert sent() == ("PUT", "/admin/providers/auto/capacity", {"min": 2, "max": 12})
        # A model's fallbacks and preference, comma-separated; "none" for no fallbacks.
        page.locator(f"{chat} [data-testid=ctl-fallbacks]").fill(" small , tiny,, ")
        page.locator(f"{chat} [data-testid=ctl-for]").fill("2d")
        assert click(chat, "ctl-fallbacks-set") == ("ok", "chat: fallbacks: fallbacks small, tiny (config none), "
                                                          "until cleared")
        assert sent() == ("PUT", "/admin/models/chat/fallbacks", {"fallbacks": ["small", "tiny"], "for_s": 172800})
        page.locator(f"{chat} [data-testid=ctl-fallbacks]").fill("none")
        click(chat, "ctl-fallbacks-set")
        assert sent() == ("PUT", "/admin/models/chat/fallbacks", {"fallbacks": []})
        click(chat, "ctl-fallbacks-clear")
        assert sent() == ("DELETE", "/admin/models/chat/fallbacks", None)
        page.locator(f"{chat} [data-testid=ctl-preference]").fill("gpu1,api")
        click(chat, "ctl-preference-set")
        assert sent() == ("PUT", "/admin/models/chat/preference", {"providers": ["gpu1", "api"]})
        n = len(calls)
        assert click(chat, "ctl-preference-set") == ("error", "chat: preference: enter provider ids, comma-separated")
        assert len(calls) == n
        click(chat, "ctl-preference-clear")
        assert sent() == ("DELETE", "/admin/models/chat/preference", None)
        # The admin endpoints the UI called are those of the spec; nothing says it came from the CLI.
        assert all("x-iop-via" not in c["headers"] for c in calls)


def test_a_missing_key_asks_for_one_and_the_next_call_carries_it() -> None:
    def admin(method: str, path: str, body: Any, headers: dict[str, str]) -> Answer:
        if headers.get("authorization") != f"Bearer {ADMIN_KEY}":
            return 401, {"error": {"message": "Incorrect or missing API key", "type": "invalid_request_error"}}
        if path.startswith("/admin/audit"):
            return 200, AUDIT
        return 200, {"provider": "plain", "drain": "draining", "in_flight": 0}

    with canned_page(Pool(), admin) as (page, calls):
        row = "[data-testid=provider-control][data-provider=plain]"
        assert page.locator("#auth").is_hidden()
        assert page.locator("#audit-section").is_hidden()
        page.locator(f"{row} [data-testid=ctl-drain]").click()
        assert message(page) == ("error", "plain: drain refused (401): Incorrect or missing API key")
        assert page.locator("#auth").is_visible()
        page.fill("#key", ADMIN_KEY)
        page.click("#auth button")
        page.wait_for_selector("#audit-section:not([hidden])")
        page.locator(f"{row} [data-testid=ctl-drain]").click()
        assert message(page) == ("ok", "plain: drain: draining, 0 running")
        drains = [c for c in calls if c["path"] == "/admin/providers/plain/drain"]
        assert [c["headers"].get("authorization") for c in drains] == [None, f"Bearer {ADMIN_KEY}"]


def test_what_an_operator_types_survives_the_polls() -> None:
    """The page redraws every 3 s; the control rows are not rebuilt, so an input keeps its text
    and its focus, and its placeholder follows the catalog."""
    pool = Pool()
    with canned_page(pool, audit_only, clock=True) as (page, _):
        field = page.locator("[data-testid=model-control][data-model=chat] [data-testid=ctl-fallbacks]")
        field.click()
        field.type("small, ti")
        page.evaluate("() => { window.__field = document.activeElement; }")
        pool.gpu1_disabled = False
        page.clock.run_for(3000)
        page.wait_for_function("() => !document.querySelector('[data-testid=provider] [data-testid=disabled]')")
        page.clock.run_for(3000)
        assert field.input_value() == "small, ti"
        assert page.evaluate("() => document.activeElement === window.__field")
        # The state cell follows the catalog all the same.
        state = page.locator("[data-testid=provider-control][data-provider=gpu1] [data-testid=ctl-state]")
        assert state.inner_text() == "enabled"


def test_a_catalog_without_the_new_fields() -> None:
    """An older iop's catalog: no ``enabled``, ``override``, ``fallbacks``, ``preference``. Nothing
    is marked, every row is drawn, and the controls are there (an older server's 404 says why
    they fail)."""
    class Older(Pool):
        def catalog(self) -> dict[str, Any]:
            doc = super().catalog()
            for p in doc["providers"]:
                p.pop("enabled", None)
                p.pop("override", None)
            for m in doc["models"]:
                for field in ("fallbacks", "preference", "override"):
                    m.pop(field, None)
            return doc

    def admin(method: str, path: str, body: Any, headers: dict[str, str]) -> Answer:
        return 404, {"status_code": 404, "detail": "Not Found"}

    with canned_page(Older(), admin) as (page, _):
        assert page.locator("[data-testid=provider]").count() == 5
        assert page.locator("[data-testid=override]").count() == 0
        assert page.locator("[data-testid=disabled], [data-testid=candidate-disabled]").count() == 0
        assert set(page.locator("[data-testid=routing]").all_inner_texts()) == {DASH}
        assert page.locator("[data-testid=provider-control]").count() == 5
        row = "[data-testid=provider-control][data-provider=gpu1]"
        assert page.locator(f"{row} [data-testid=ctl-state]").inner_text() == "enabled"
        page.locator(f"{row} [data-testid=ctl-disable]").click()
        assert message(page) == ("error", "gpu1: disable refused (404): Not Found")


# --- against real processes ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[System]:
    """Two providers of one model, a second model to fall back to, admin keys on: the page
    asks for one."""
    sys_ = System(tmp_path_factory.mktemp("ui-control"), redis_server)
    sys_.env["IOP_E2E_ADMIN_KEYS"] = ADMIN_KEY
    sys_.write_config({
        "api": {"admin_keys_env": "IOP_E2E_ADMIN_KEYS"},
        "dispatch": {"heartbeat_interval_ms": 200, "probe_interval_ms": 300},
        "models": [{"id": "m", "providers": {"a": "served", "b": "served"}},
                   {"id": "spare", "providers": {"b": "served"}}],
        "nodes": [{"id": "n1", "providers": [http_provider("a", "vllm", sys_.port("fa"), 4, ["served"]),
                                             http_provider("b", "vllm", sys_.port("fb"), 6, ["served"])]}],
    })
    with sys_:
        for name in ("fa", "fb"):
            sys_.fake(name, "--models", "served")
        sys_.worker("n1")
        sys_.api()
        sys_.wait_available("a", "b")
        yield sys_


def test_control_from_the_page_through_real_processes(system: System) -> None:
    from playwright.sync_api import sync_playwright

    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}

    def catalog() -> dict[str, Any]:
        doc: dict[str, Any] = httpx.get(f"{system.api_url}/catalog", headers=auth, timeout=10).json()
        return doc

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.set_default_timeout(15_000)
            page.goto(f"{system.api_url}/ui")
            page.fill("#key", ADMIN_KEY)
            page.click("#auth button")
            page.wait_for_selector("#status[data-ok='1']")
            a, b = ("[data-testid=provider-control][data-provider=a]",
                    "[data-testid=provider-control][data-provider=b]")
            # Disable a for an hour.
            page.locator(f"{a} [data-testid=ctl-for]").fill("1h")
            page.locator(f"{a} [data-testid=ctl-disable]").click()
            assert message(page)[0] == "ok", message(page)
            page.wait_for_selector("[data-testid=provider][data-provider=a] [data-testid=disabled]")
            mark = page.locator("[data-testid=provider][data-provider=a] [data-testid=override][data-field=enabled]")
            assert mark.inner_text().startswith("override until ")
            provider_a = next(p for p in catalog()["providers"] if p["id"] == "a")
            assert provider_a["enabled"] is False
            assert provider_a["override"]["enabled"]["until"] is not None
            # Cap b at 2; a capacity of 0 is refused with the server's message.
            page.locator(f"{b} [data-testid=ctl-capacity]").fill("0")
            page.locator(f"{b} [data-testid=ctl-capacity-set]").click()
            state, text = message(page)
            assert state == "error"
            assert "(422)" in text, text
            page.locator(f"{b} [data-testid=ctl-capacity]").fill("2")
            page.locator(f"{b} [data-testid=ctl-capacity-set]").click()
            assert message(page)[0] == "ok", message(page)
            page.wait_for_selector("[data-testid=provider][data-provider=b] [data-field=capacity]")
            load = page.locator("[data-testid=provider][data-provider=b] [data-testid=load]").inner_text()
            assert load.strip() == "0/2override", load
            # m falls back to spare.
            m = "[data-testid=model-control][data-model=m]"
            page.locator(f"{m} [data-testid=ctl-fallbacks]").fill("spare")
            page.locator(f"{m} [data-testid=ctl-fallbacks-set]").click()
            assert message(page)[0] == "ok", message(page)
            page.wait_for_selector("[data-testid=model][data-model=m] [data-testid=override][data-field=fallbacks]")
            assert page.locator("[data-testid=model][data-model=m] [data-testid=fallbacks]").inner_text() == "spare"
            # The audit panel lists them, newest first, from the page (via http).
            page.wait_for_function("() => document.querySelectorAll('[data-testid=audit-entry]').length >= 3")
            actions = [(r.locator("[data-testid=audit-action]").inner_text(),
                        r.locator("[data-testid=audit-target]").inner_text(),
                        r.locator("[data-testid=audit-via]").inner_text())
                       for r in page.locator("[data-testid=audit-entry]").all()[:3]]
            assert actions == [("fallbacks", "model/m", "http"), ("capacity", "provider/b", "http"),
                               ("disable", "provider/a", "http")]
            # iop catalog marks the same, from the same catalog.
            table = subprocess.run([sys.executable, "-m", "iop", "catalog", "--url", system.api_url, "--no-colour"],
                                   capture_output=True, text=True, timeout=60, check=True,
                                   env={**os.environ, "IOP_ADMIN_KEY": ADMIN_KEY}).stdout.splitlines()
            row_a = next(line for line in table if line.split()[:1] == ["a"])
            assert "available (disabled)" in row_a, table
            for pattern in (r"    disabled \(override by .*, until ([-0-9]{10} )?\d\d:\d\d UTC, (59m|1h00m) left\)",
                            r"    capacity 2 \(override by .*, config 6\)",
                            r"    fallbacks spare \(override by .*, config none\)"):
                assert any(re.fullmatch(pattern, line) for line in table), (pattern, table)
            assert "    a -> served  available (disabled)  0/4" in table, table
            # Clear everything from the page; the markers go.
            page.locator(f"{a} [data-testid=ctl-enable]").click()
            assert message(page)[0] == "ok"
            page.locator(f"{b} [data-testid=ctl-capacity-clear]").click()
            assert message(page)[0] == "ok"
            page.locator(f"{m} [data-testid=ctl-fallbacks-clear]").click()
            assert message(page)[0] == "ok"
            page.wait_for_function("() => !document.querySelector('[data-testid=override]')")
            assert page.locator("[data-testid=disabled]").count() == 0
        finally:
            browser.close()
            for path in ("providers/a/enable", "providers/b/capacity", "models/m/fallbacks"):
                method = "POST" if path.endswith("enable") else "DELETE"
                httpx.request(method, f"{system.api_url}/admin/{path}", headers=auth, timeout=10)
