"""``iop provider disable|enable|capacity|load|unload``, ``iop model fallbacks|prefer``,
``iop overrides`` and ``iop audit`` (``iop/control_cli.py``): their arguments, the HTTP
requests they send and what they print of the answers and errors.

The API is a stand-in (:class:`FakeControl`): a real HTTP server in a thread that records
every request and answers as issue 48's interface says the admin endpoints do, for a small
pool (``gpu1`` fixed at 6, ``gpu-auto`` with ``capacity: auto`` 1-16, ``gpu-b`` managed, the
models ``qwen3.6:35b`` and ``llama3.1:8b``), with its errors: 404 unknown, 422 naming the
bound, 401/403 without the admin key, 503 Redis down. ``iop provider drain|resume`` run
against it too, to show they are unchanged.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.error
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

from iop import control_cli
from iop.cli import build_parser, main
from iop.control_cli import (
    EPOCH_MS_FROM,
    Request,
    build_request,
    clock,
    describe_audit,
    describe_overrides,
    parse_duration,
    since_ms,
)
from iop.http_client import VIA, VIA_HEADER, call
from iop.redis_server import free_port

ADMIN_KEY = "sk-admin-test"
MAX_CAPACITY = 8
# 2026-12-07 14:03:10 UTC
AT_MS = 1_796_652_190_000


@dataclass
class Seen:
    """One request as the server got it."""
    method: str
    path: str  # raw, as sent: percent-escapes kept
    parts: list[str]  # its segments, decoded, as a router would see them
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class FakeControl:
    url: str
    seen: list[Seen] = field(default_factory=list)
    overrides: list[dict[str, Any]] = field(default_factory=list)
    audit: list[dict[str, Any]] = field(default_factory=list)
    redis_down: bool = False
    # What `/admin/...` answers instead, whatever it is asked (a proxy in front, say).
    raw_answer: tuple[int, bytes, str] | None = None

    def last(self) -> Seen:
        assert self.seen, "no request reached the server"
        return self.seen[-1]


PROVIDERS: dict[str, dict[str, Any]] = {
    "gpu1": {"capacity": 6},
    "gpu-auto": {"capacity": "auto", "bounds": {"min": 1, "max": 16}},
    "gpu-b": {"capacity": 2, "managed": True},
}
MODELS: dict[str, dict[str, list[str]]] = {
    "qwen3.6:35b": {"fallbacks": ["llama3.1:8b"], "preference": ["gpu1", "gpu-b"]},
    "llama3.1:8b": {"fallbacks": [], "preference": ["gpu-b", "gpu-auto"]},
}


def _error(status: int, code: str, message: str) -> tuple[int, dict[str, Any]]:
    return status, {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}


def _view(target: str, ident: str, name: str, value: Any, config: Any, body: dict[str, Any]) -> dict[str, Any]:
    for_s = body.get("for_s")
    return {"target": target, "id": ident, "field": name, "value": value, "config": config, "by": "ops",
            "at": AT_MS, "until": None if for_s is None else AT_MS + for_s * 1000, "via": "cli"}


def answer(fake: FakeControl, method: str, parts: list[str], body: dict[str, Any],
           query: dict[str, list[str]]) -> tuple[int, dict[str, Any]]:
    """What the admin endpoints answer (issue 48's spec), for the small pool above."""
    if fake.redis_down:
        return _error(503, "redis_unavailable", "Redis is unavailable, nothing was changed: Connection refused")
    route = (method, *parts)
    match route:
        case ("GET", "admin", "overrides"):
            return 200, {"overrides": fake.overrides}
        case ("GET", "admin", "audit"):
            limit = int(query.get("limit", ["100"])[0])
            since = int(query.get("since", ["0"])[0])
            return 200, {"entries": [e for e in fake.audit if e["at"] >= since][:limit]}
        case (_, "admin", "providers", pid, *_) if pid not in PROVIDERS:
            return _error(404, "provider_not_found", f"No provider '{pid}' in the config")
        case (_, "admin", "models", mid, *_) if mid not in MODELS:
            return _error(404, "model_not_found", f"The model '{mid}' does not exist")
        case ("POST", "admin", "providers", pid, "drain"):
            return 200, {"provider": pid, "drain": "draining", "in_flight": 2}
        case ("POST", "admin", "providers", pid, "resume"):
            return 200, {"provider": pid, "drain": None, "in_flight": 0}
        case ("POST", "admin", "providers", pid, "disable"):
            return 200, _view("provider", pid, "enabled", False, True, body)
        case ("POST", "admin", "providers", pid, "enable"):
            return 200, {"target": "provider", "id": pid, "field": "enabled", "cleared": True}
        case ("PUT", "admin", "providers", pid, "capacity"):
            values = [v for k, v in body.items() if k in ("capacity", "min", "max")]
            if any(v > MAX_CAPACITY for v in values):
                return _error(422, "invalid_override", f"capacity {max(values)} is above provider '{pid}''s "
                              f"max_capacity {MAX_CAPACITY}")
            if "capacity" in body:
                return 200, _view("provider", pid, "capacity", body["capacity"], PROVIDERS[pid]["capacity"], body)
            return 200, _view("provider", pid, "capacity_bounds", {"min": body["min"], "max": body["max"]},
                              PROVIDERS[pid].get("bounds"), body)
        case ("DELETE", "admin", "providers", pid, "capacity"):
            return 200, {"target": "provider", "id": pid, "field": "capacity", "cleared": False}
        case ("POST", "admin", "providers", pid, "models", served, "load" | "unload" as action):
            if not PROVIDERS[pid].get("managed"):
                return _error(409, "control_conflict", f"iop does not load or unload the models of provider "
                              f"'{pid}' (lifecycle: static)")
            already = {"load": "loaded", "unload": "unloaded"}[action] if served == "llama3.1:8b" else None
            return 202, {"provider": pid, "model": served, "state": already or action + "ing"}
        case ("PUT", "admin", "models", mid, "fallbacks"):
            return 200, _view("model", mid, "fallbacks", body["fallbacks"], MODELS[mid]["fallbacks"], body)
        case ("PUT", "admin", "models", mid, "preference"):
            return 200, _view("model", mid, "preference", body["providers"], MODELS[mid]["preference"], body)
        case ("DELETE", "admin", "models", mid, "fallbacks" | "preference" as name):
            return 200, {"target": "model", "id": mid, "field": name, "cleared": True}
    return 404, {"status_code": 404, "detail": "Not Found"}


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeControl]:
    """The stand-in API; the admin key is in ``IOP_ADMIN_KEY``, as an operator's would be."""
    monkeypatch.setenv("IOP_ADMIN_KEY", ADMIN_KEY)
    monkeypatch.delenv("IOP_URL", raising=False)
    state: list[FakeControl] = []

    class Handler(BaseHTTPRequestHandler):
        def _any(self) -> None:
            stub = state[0]
            split = urlsplit(self.path)
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            seen = Seen(self.command, self.path, [unquote(p) for p in split.path.strip("/").split("/")],
                        parse_qs(split.query), {k.lower(): v for k, v in self.headers.items()}, raw)
            stub.seen.append(seen)
            if stub.raw_answer is not None:
                status, payload, media = stub.raw_answer
            else:
                auth = seen.headers.get("authorization")
                if auth is None:
                    status, doc = _error(401, "invalid_api_key", "An admin key is required")
                elif auth != f"Bearer {ADMIN_KEY}":
                    status, doc = _error(403, "admin_key_required", "This needs an admin key")
                else:
                    status, doc = answer(stub, self.command, seen.parts, json.loads(raw) if raw else {}, seen.query)
                payload, media = json.dumps(doc).encode(), "application/json"
            self.send_response(status)
            self.send_header("Content-Type", media)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = do_PUT = do_DELETE = _any

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.append(FakeControl(f"http://127.0.0.1:{server.server_address[1]}"))
    # A short poll: shutdown() waits for one, and every test here stops a server.
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield state[0]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def call_main(*args: str) -> int:
    """``main(args)``'s status, whether it returns it or raises SystemExit (argparse)."""
    try:
        return main(list(args))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1


def run(fake: FakeControl, *args: str) -> int:
    return call_main(*args, "--url", fake.url)


def today(ms: int) -> str:
    """``clock`` of a time on today's date, as the commands print it."""
    return time.strftime("%H:%M:%S UTC", time.gmtime(ms / 1000))


# --------------------------------------------------------------------------- DURATION


@pytest.mark.parametrize(("text", "seconds"), [
    ("90s", 90), ("15m", 900), ("1h", 3600), ("2d", 172800), ("45", 45), ("3600", 3600), ("1H", 3600), (" 5m ", 300),
])
def test_durations(text: str, seconds: int) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "1x", "h", "-5", "1.5h", "1 h", "1h30m", "0", "0s"])
def test_bad_durations_are_refused_with_the_forms_named(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"duration"):
        parse_duration(text)


@pytest.mark.parametrize("argv", [
    ["provider", "disable", "gpu1", "--for", "soon"],
    ["provider", "capacity", "gpu1", "2", "--for", "1x"],
    ["model", "fallbacks", "qwen3.6:35b", "llama3.1:8b", "--for=-1h"],
    ["model", "prefer", "qwen3.6:35b", "gpu1", "--for", "0"],
    ["audit", "--since", "yesterday"],
])
def test_a_bad_duration_exits_2_and_sends_nothing(fake: FakeControl, argv: list[str],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert run(fake, *argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: iop ")
    assert "90s, 15m, 1h, 2d, or a number of seconds" in err or "at least 1 second" in err, err
    assert fake.seen == []


def test_the_duration_error_says_which_option_and_what_to_give(fake: FakeControl,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert run(fake, "provider", "disable", "gpu1", "--for", "soon") == 2
    assert ("iop provider disable: error: argument --for: 'soon' is not a duration: give 90s, 15m, 1h, 2d, "
            "or a number of seconds") in capsys.readouterr().err


def test_since_is_a_duration_back_from_now_or_a_time_in_ms() -> None:
    now = AT_MS
    assert since_ms("1h", now) == now - 3_600_000
    assert since_ms("90", now) == now - 90_000  # a bare number of seconds, as --for takes it
    assert since_ms(str(AT_MS - 5), now) == AT_MS - 5  # an audit entry's `at`, to page back from
    assert since_ms(str(EPOCH_MS_FROM), now) == EPOCH_MS_FROM
    with pytest.raises(argparse.ArgumentTypeError, match="neither a duration"):
        since_ms("2026-12-07", now)


# --------------------------------------------------------------------------- arguments -> request


def request_of(*argv: str) -> Request:
    return build_request(build_parser().parse_args(list(argv)))


@pytest.mark.parametrize(("argv", "expected"), [
    (["provider", "disable", "gpu1"], Request("POST", "/admin/providers/gpu1/disable")),
    (["provider", "disable", "gpu1", "--for", "1h"], Request("POST", "/admin/providers/gpu1/disable", {"for_s": 3600})),
    (["provider", "enable", "gpu1"], Request("POST", "/admin/providers/gpu1/enable")),
    (["provider", "capacity", "gpu1", "2"], Request("PUT", "/admin/providers/gpu1/capacity", {"capacity": 2})),
    (["provider", "capacity", "gpu1", "2", "--for", "15m"],
     Request("PUT", "/admin/providers/gpu1/capacity", {"capacity": 2, "for_s": 900})),
    (["provider", "capacity", "gpu-auto", "--min", "1", "--max", "8", "--for", "2d"],
     Request("PUT", "/admin/providers/gpu-auto/capacity", {"min": 1, "max": 8, "for_s": 172800})),
    (["provider", "capacity", "gpu1", "--clear"], Request("DELETE", "/admin/providers/gpu1/capacity")),
    (["provider", "load", "gpu-b", "qwen3.6:35b-a3b-q4_K_M"],
     Request("POST", "/admin/providers/gpu-b/models/qwen3.6%3A35b-a3b-q4_K_M/load")),
    (["provider", "unload", "gpu-b", "hf.co/org/m:Q4"],
     Request("POST", "/admin/providers/gpu-b/models/hf.co%2Forg%2Fm%3AQ4/unload")),
    (["model", "fallbacks", "qwen3.6:35b", "llama3.1:8b, other"],
     Request("PUT", "/admin/models/qwen3.6%3A35b/fallbacks", {"fallbacks": ["llama3.1:8b", "other"]})),
    (["model", "fallbacks", "qwen3.6:35b", ""], Request("PUT", "/admin/models/qwen3.6%3A35b/fallbacks",
                                                        {"fallbacks": []})),
    (["model", "fallbacks", "qwen3.6:35b", "--clear"], Request("DELETE", "/admin/models/qwen3.6%3A35b/fallbacks")),
    (["model", "prefer", "qwen3.6:35b", "gpu-b,gpu1", "--for", "90"],
     Request("PUT", "/admin/models/qwen3.6%3A35b/preference", {"providers": ["gpu-b", "gpu1"], "for_s": 90})),
    (["model", "prefer", "qwen3.6:35b", "--clear"], Request("DELETE", "/admin/models/qwen3.6%3A35b/preference")),
    (["overrides"], Request("GET", "/admin/overrides")),
    (["audit"], Request("GET", "/admin/audit")),
    (["audit", "--limit", "5", "--since", str(AT_MS)], Request("GET", f"/admin/audit?since={AT_MS}&limit=5")),
])
def test_each_command_makes_its_request(argv: list[str], expected: Request) -> None:
    assert request_of(*argv) == expected


@pytest.mark.parametrize(("argv", "message"), [
    (["provider", "capacity", "gpu1"], "give one of N (a fixed capacity), --min A --max B"),
    (["provider", "capacity", "gpu1", "2", "--clear"], "not N and --clear"),
    (["provider", "capacity", "gpu1", "2", "--min", "1", "--max", "3"], "not N and --min/--max"),
    (["provider", "capacity", "gpu1", "--min", "1"], "--min and --max go together"),
    (["provider", "capacity", "gpu1", "--min", "4", "--max", "2"], "--min 4 is above --max 2"),
    (["provider", "capacity", "gpu1", "--clear", "--for", "1h"], "does not go with --clear"),
    (["model", "fallbacks", "qwen3.6:35b"], "give the fallbacks (comma-separated) or --clear"),
    (["model", "fallbacks", "qwen3.6:35b", "a", "--clear"], "give either the fallbacks or --clear, not both"),
    (["model", "prefer", "qwen3.6:35b", " , "], "give at least one provider to prefer"),
    (["model", "prefer", "qwen3.6:35b", "--clear", "--for", "1h"], "does not go with --clear"),
])
def test_arguments_that_make_no_request_exit_2_with_the_usage(
    fake: FakeControl, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(fake, *argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: iop {argv[0]} {argv[1]}")
    assert message in err
    assert fake.seen == []


@pytest.mark.parametrize(("argv", "message"), [
    (["provider", "capacity", "gpu1", "0"], "argument N: 0: must be at least 1"),
    (["provider", "capacity", "gpu1", "two"], "argument N: 'two' is not a whole number"),
    (["provider", "capacity", "gpu1", "--min", "0", "--max", "2"], "argument --min: 0: must be at least 1"),
    (["audit", "--limit", "0"], "argument --limit: 0: must be from 1 to 1000"),
    (["audit", "--limit", "1001"], "argument --limit: 1001: must be from 1 to 1000"),
    (["provider", "load", "gpu-b"], "the following arguments are required: MODEL"),
    (["model"], "the following arguments are required: model_command"),
    (["provider", "disable"], "the following arguments are required: ID"),
])
def test_argparse_refuses_bad_values(fake: FakeControl, argv: list[str], message: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert call_main(*argv) == 2
    assert message in capsys.readouterr().err
    assert fake.seen == []


def test_the_new_commands_take_iop_url_and_key_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IOP_URL", "http://iop.example:9090")
    parser = build_parser()
    for argv in (["provider", "disable", "p"], ["provider", "enable", "p"], ["provider", "capacity", "p", "2"],
                 ["provider", "load", "p", "m"], ["provider", "unload", "p", "m"], ["model", "fallbacks", "m", "a"],
                 ["model", "prefer", "m", "p"], ["overrides"], ["audit"]):
        args = parser.parse_args(argv)
        assert (args.url, args.key_env, args.json) == ("http://iop.example:9090", "IOP_ADMIN_KEY", False), argv


# --------------------------------------------------------------------------- against the server


def test_disable_for_an_hour(fake: FakeControl, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(fake, "provider", "disable", "gpu1", "--for", "1h") == 0
    seen = fake.last()
    assert (seen.method, seen.path, seen.json()) == ("POST", "/admin/providers/gpu1/disable", {"for_s": 3600})
    assert seen.headers[VIA_HEADER.lower()] == VIA == "cli"
    assert seen.headers["authorization"] == f"Bearer {ADMIN_KEY}"
    assert seen.headers["content-type"] == "application/json"
    until = AT_MS + 3_600_000
    assert capsys.readouterr().out == f"gpu1: disabled (config enabled) until {clock(until, int(time.time() * 1000))}" \
        ", by ops\n"


def test_disable_without_expiry_sends_an_empty_body(fake: FakeControl, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(fake, "provider", "disable", "gpu1") == 0
    seen = fake.last()
    assert (seen.method, seen.body, seen.headers["content-length"]) == ("POST", b"", "0")
    assert seen.headers["content-type"] != "application/json"  # urllib's default for a body, as drain's
    assert capsys.readouterr().out == "gpu1: disabled (config enabled), no expiry, by ops\n"


def test_enable_says_the_override_is_gone(fake: FakeControl, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(fake, "provider", "enable", "gpu1") == 0
    assert (fake.last().method, fake.last().path) == ("POST", "/admin/providers/gpu1/enable")
    assert capsys.readouterr().out == "gpu1: enabled (its disable override cleared)\n"


def test_capacity_fixed_and_bounds(fake: FakeControl, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(fake, "provider", "capacity", "gpu1", "2") == 0
    assert (fake.last().method, fake.last().json()) == ("PUT", {"capacity": 2})
    assert capsys.readouterr().out == "gpu1: capacity 2 (config 6), no expiry, by ops\n"

    assert run(fake, "provider", "capacity", "gpu-auto", "--min", "2", "--max", "4", "--for", "15m") == 0
    assert fake.last().json() == {"min": 2, "max": 4, "for_s": 900}
    out = capsys.readouterr().out
    assert out.startswith("gpu-auto: capacity bounds 2-4 (config 1-16) until ")
    assert out.endswith(", by ops\n")


def test_capacity_clear_of_nothing_says_nothing_changed(fake: FakeControl,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert run(fake, "provider", "capacity", "gpu1", "--clear") == 0
    seen = fake.last()
    assert (seen.method, seen.path, seen.body) == ("DELETE", "/admin/providers/gpu1/capacity", b"")
    assert capsys.readouterr().out == "gpu1: no capacity override; nothing changed\n"


def test_model_fallbacks_and_preference(fake: FakeControl, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(fake, "model", "fallbacks", "qwen3.6:35b", "llama3.1:8b") == 0
    seen = fake.last()
    # The id's ':' goes escaped; the server reads the id back whole.
    assert (seen.method, seen.path) == ("PUT", "/admin/models/qwen3.6%3A35b/fallbacks")
    assert seen.parts == ["admin", "models", "qwen3.6:35b", "fallbacks"]
    assert seen.json() == {"fallbacks": ["llama3.1:8b"]}
    assert capsys.readouterr().out == "qwen3.6:35b: fallbacks llama3.1:8b (config llama3.1:8b), no expiry, by ops\n"

    assert run(fake, "model", "fallbacks", "llama3.1:8b", "qwen3.6:35b", "--for", "2d") == 0
    assert "llama3.1:8b: fallbacks qwen3.6:35b (config none) until " in capsys.readouterr().out

    assert run(fake, "model", "prefer", "qwen3.6:35b", "gpu-b,gpu1") == 0
    assert fake.last().json() == {"providers": ["gpu-b", "gpu1"]}
    assert capsys.readouterr().out == "qwen3.6:35b: preference gpu-b,gpu1 (config gpu1,gpu-b), no expiry, by ops\n"

    assert run(fake, "model", "prefer", "qwen3.6:35b", "--clear") == 0
    assert (fake.last().method, fake.last().path) == ("DELETE", "/admin/models/qwen3.6%3A35b/preference")
    assert capsys.readouterr().out == "qwen3.6:35b: preference override cleared; the config's applies\n"


def test_load_and_unload_a_served_name_with_slashes(fake: FakeControl, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(fake, "provider", "load", "gpu-b", "hf.co/org/m:Q4") == 0
    seen = fake.last()
    assert seen.path == "/admin/providers/gpu-b/models/hf.co%2Forg%2Fm%3AQ4/load"
    assert seen.parts == ["admin", "providers", "gpu-b", "models", "hf.co/org/m:Q4", "load"]
    assert capsys.readouterr().out == "gpu-b: loading hf.co/org/m:Q4\n"
    assert run(fake, "provider", "unload", "gpu-b", "qwen3.6:35b-a3b", "--json") == 0
    assert json.loads(capsys.readouterr().out) == {"provider": "gpu-b", "model": "qwen3.6:35b-a3b",
                                                   "state": "unloading"}


def test_a_load_of_what_is_there_already_says_so(fake: FakeControl, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(fake, "provider", "load", "gpu-b", "llama3.1:8b") == 0
    assert capsys.readouterr().out == "gpu-b: llama3.1:8b is loaded already; nothing to do\n"
    assert run(fake, "provider", "unload", "gpu-b", "llama3.1:8b") == 0
    assert capsys.readouterr().out == "gpu-b: llama3.1:8b is not loaded; nothing to do\n"


def test_json_prints_the_answer_as_it_came(fake: FakeControl, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(fake, "provider", "capacity", "gpu1", "3", "--for", "90s", "--json") == 0
    assert json.loads(capsys.readouterr().out) == {
        "target": "provider", "id": "gpu1", "field": "capacity", "value": 3, "config": 6, "by": "ops",
        "at": AT_MS, "until": AT_MS + 90_000, "via": "cli"}


def test_overrides_one_line_each(fake: FakeControl, capsys: pytest.CaptureFixture[str]) -> None:
    now = int(time.time() * 1000)
    soon = now + 60_000
    # Out of order: the lines come by target, id, field all the same.
    fake.overrides = [
        {"target": "provider", "id": "gpu1", "field": "capacity", "value": 2, "config": 6, "by": "ops",
         "at": now, "until": None, "via": "cli"},
        {"target": "model", "id": "qwen3.6:35b", "field": "fallbacks", "value": [], "config": ["llama3.1:8b"],
         "by": "alice", "at": now, "until": None, "via": "cli"},
        {"target": "provider", "id": "gpu-auto", "field": "capacity_bounds", "value": {"min": 1, "max": 4},
         "config": {"min": 1, "max": 16}, "by": "key-0a1b2c3d", "at": now, "until": soon, "via": "http"},
    ]
    assert run(fake, "overrides") == 0
    assert (fake.last().method, fake.last().path) == ("GET", "/admin/overrides")
    lines = capsys.readouterr().out.splitlines()
    assert [line.split() for line in lines] == [
        ["model", "qwen3.6:35b", "fallbacks", "none", "config", "llama3.1:8b", "by", "alice", "no", "expiry"],
        ["provider", "gpu-auto", "capacity_bounds", "1-4", "config", "1-16", "by", "key-0a1b2c3d", "until",
         *today(soon).split()],
        ["provider", "gpu1", "capacity", "2", "config", "6", "by", "ops", "no", "expiry"],
    ]
    # One column each: every line's `config` starts where the others' does.
    assert len({line.index("config") for line in lines}) == 1

    assert run(fake, "overrides", "--json") == 0
    assert json.loads(capsys.readouterr().out) == {"overrides": fake.overrides}
    fake.overrides = []
    assert run(fake, "overrides") == 0
    assert capsys.readouterr().out == "no overrides in force\n"


def audit_entries() -> list[dict[str, Any]]:
    return [
        {"id": "1796652250000-0", "at": AT_MS + 60_000, "by": "expiry", "action": "disable",
         "target": "provider/gpu1", "before": False, "after": True, "via": "expiry"},
        {"id": "1796652190000-0", "at": AT_MS, "by": "ops", "action": "capacity", "target": "provider/gpu1",
         "before": 6, "after": 2, "via": "cli"},
        {"id": "1796652130000-0", "at": AT_MS - 60_000, "by": "loopback", "action": "fallbacks",
         "target": "model/qwen3.6:35b", "before": ["llama3.1:8b"], "after": [], "via": "http"},
        {"id": "1796652070000-0", "at": AT_MS - 120_000, "by": "ops", "action": "reload", "target": "config",
         "before": None, "after": {"providers": ["+gpu-c"]}, "via": "reload"},
    ]


def test_audit_newest_first(fake: FakeControl, capsys: pytest.CaptureFixture[str]) -> None:
    fake.audit = audit_entries()
    assert run(fake, "audit") == 0
    assert (fake.last().path, fake.last().query) == ("/admin/audit", {})
    lines = capsys.readouterr().out.splitlines()
    assert [line.split() for line in lines] == [
        ["2026-12-07", "14:04:10", "expiry", "disable", "provider/gpu1", "false", "->", "true", "via", "expiry"],
        ["2026-12-07", "14:03:10", "ops", "capacity", "provider/gpu1", "6", "->", "2", "via", "cli"],
        ["2026-12-07", "14:02:10", "loopback", "fallbacks", "model/qwen3.6:35b", "llama3.1:8b", "->", "none",
         "via", "http"],
        ["2026-12-07", "14:01:10", "ops", "reload", "config", "-", "->", '{"providers":["+gpu-c"]}', "via", "reload"],
    ]
    assert len({line.index("via ") for line in lines}) == 1


def test_audit_since_and_limit(fake: FakeControl, capsys: pytest.CaptureFixture[str]) -> None:
    fake.audit = audit_entries()
    before = int(time.time() * 1000)
    assert run(fake, "audit", "--since", "1h", "--limit", "2", "--json") == 0
    after = int(time.time() * 1000)
    query = fake.last().query
    assert query["limit"] == ["2"]
    assert before - 3_600_000 <= int(query["since"][0]) <= after - 3_600_000
    assert json.loads(capsys.readouterr().out) == {"entries": []}  # the fake's entries are from 2026-12-07

    assert run(fake, "audit", "--since", str(AT_MS)) == 0
    assert fake.last().query == {"since": [str(AT_MS)]}
    assert len(capsys.readouterr().out.splitlines()) == 2

    fake.audit = []
    assert run(fake, "audit") == 0
    assert capsys.readouterr().out == "no audit entries\n"


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(("argv", "status", "said"), [
    (["provider", "disable", "ghost"], 404, "No provider 'ghost' in the config (provider_not_found)"),
    (["model", "prefer", "nope", "gpu1"], 404, "The model 'nope' does not exist (model_not_found)"),
    (["provider", "capacity", "gpu1", "9"], 422,
     "capacity 9 is above provider 'gpu1''s max_capacity 8 (invalid_override)"),
    (["provider", "load", "gpu1", "m"], 409,
     "iop does not load or unload the models of provider 'gpu1' (lifecycle: static) (control_conflict)"),
])
def test_a_refusal_exits_1_with_the_servers_message(fake: FakeControl, argv: list[str], status: int, said: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert run(fake, *argv) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"{fake.url}{fake.last().path} answered {status}: {said}\n"


def test_without_the_admin_key(fake: FakeControl, monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CALLER_KEY", "sk-caller")
    assert run(fake, "provider", "enable", "gpu1", "--key-env", "CALLER_KEY") == 1
    assert fake.last().headers["authorization"] == "Bearer sk-caller"
    assert "answered 403: This needs an admin key (admin_key_required)" in capsys.readouterr().err
    monkeypatch.delenv("IOP_ADMIN_KEY")
    assert run(fake, "overrides") == 1
    assert "authorization" not in fake.last().headers
    assert "answered 401: " in capsys.readouterr().err


def test_redis_down_is_503(fake: FakeControl, capsys: pytest.CaptureFixture[str]) -> None:
    fake.redis_down = True
    assert run(fake, "model", "fallbacks", "qwen3.6:35b", "--clear") == 1
    said = "answered 503: Redis is unavailable, nothing was changed: Connection refused (redis_unavailable)"
    assert said in capsys.readouterr().err


def test_an_answer_that_is_not_iops_is_quoted(fake: FakeControl, capsys: pytest.CaptureFixture[str]) -> None:
    fake.raw_answer = (502, b"<html><body>502 Bad Gateway</body></html>" + b" " * 1000 + b"tail", "text/html")
    assert run(fake, "audit") == 1
    err = capsys.readouterr().err
    assert f"{fake.url}/admin/audit answered 502: <html><body>502 Bad Gateway</body></html>" in err
    assert "tail" not in err


def test_nothing_listening_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert call_main("provider", "disable", "gpu1", "--url", url) == 1
    assert capsys.readouterr().err.startswith(f"cannot reach {url}: ")


def test_call_sends_a_json_body_with_any_method(fake: FakeControl) -> None:
    doc = call(fake.url, "DELETE", "/admin/models/qwen3.6%3A35b/fallbacks", ADMIN_KEY, body={"why": "test"})
    assert doc == {"target": "model", "id": "qwen3.6:35b", "field": "fallbacks", "cleared": True}
    seen = fake.last()
    assert (seen.method, seen.json(), seen.headers["content-type"]) == ("DELETE", {"why": "test"}, "application/json")
    call(fake.url, "GET", "/admin/overrides", ADMIN_KEY)
    assert (fake.last().body, fake.last().headers[VIA_HEADER.lower()]) == (b"", "cli")
    with pytest.raises(urllib.error.HTTPError):
        call(fake.url, "PUT", "/admin/providers/gpu1/capacity", ADMIN_KEY, body={"capacity": 99})


# --------------------------------------------------------------------------- drain and resume, unchanged


def test_drain_and_resume_still_answer_as_before(fake: FakeControl, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(fake, "provider", "drain", "gpu1") == 0
    seen = fake.last()
    assert (seen.method, seen.path, seen.body) == ("POST", "/admin/providers/gpu1/drain", b"")
    assert seen.headers[VIA_HEADER.lower()] == "cli"  # their audit entries say so too
    assert capsys.readouterr().out == "gpu1: draining (2 running)\n"
    assert run(fake, "provider", "resume", "gpu1", "--json") == 0
    assert json.loads(capsys.readouterr().out) == {"provider": "gpu1", "drain": None, "in_flight": 0}
    assert run(fake, "provider", "drain", "ghost") == 1
    assert "answered 404: No provider 'ghost' in the config (provider_not_found)" in capsys.readouterr().err


# --------------------------------------------------------------------------- the lines themselves


def test_clock_gives_the_date_of_another_day() -> None:
    assert clock(AT_MS, AT_MS + 3_600_000) == "14:03:10 UTC"
    assert clock(AT_MS + 2 * 86_400_000, AT_MS) == "2026-12-09 14:03:10 UTC"


def test_lines_of_an_unknown_field_and_of_nothing() -> None:
    # A field a newer API adds still prints, as compact JSON.
    doc = {"overrides": [{"target": "provider", "id": "p", "field": "weights", "value": {"a": 1}, "config": None,
                          "by": "ops", "until": None}]}
    assert describe_overrides(doc, AT_MS) == ['provider  p  weights  {"a":1}  config -  by ops  no expiry']
    assert describe_audit({"entries": []}) == ["no audit entries"]
    assert control_cli.describe({"target": "provider", "id": "p", "field": "enabled", "cleared": False}, AT_MS) == [
        "p: no disable override; nothing changed"]
