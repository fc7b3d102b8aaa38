"""Runtime control (issue 48) through real processes: three API replicas and two worker
processes (both serving node n1) on one Redis, fake providers behind them.

An operator's override, written through any replica, holds on every replica and worker:
a disabled provider gets no new request while its running ones finish; a capacity of 2
holds in_flight at 2 or under whoever dispatches; a model's fallbacks and preference are
what every replica and worker routes by. Overrides survive SIGKILL of every API and worker
process, lapse by themselves, are dropped by a reload that removes what they name, and are
audited with the admin key's name (never the key). Bad input, a caller's key and a Redis
that is down change nothing. A managed (Ollama-like) provider loads and unloads a model on
an operator's order.

What a provider ran comes from the fake's own counters (``/_fake/stats``); which provider
and model answered a request, from its ``x-iop-provider`` / ``x-iop-model`` headers; that
every replica applied an override, from its own ``/catalog`` (built from the config that
replica runs). Every wait is on a condition, never on the clock.

The pool (node n1): ``a`` (capacity 6) and ``b`` (3) serve model ``m``; ``c`` (3) alone
serves ``solo``; ``au`` (capacity auto, max_capacity 8) serves ``am``; ``o``, a managed
Ollama holding one model at a time, serves ``x`` (fallbacks: ``y``) and ``y``; ``d`` serves
``dm`` until the last test reloads a file without them.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from dispatcher import keys
from iop.redis_server import RedisServer
from tests.e2e.system import Planned, Proc, System, answer_problem, api_with_config, fast_dispatch, http_provider
from tests.waiting import eventually_sync

pytestmark = pytest.mark.timeout(240)

ADMIN_ENV, CALLER_ENV = "IOP_TEST_ADMIN_KEYS", "IOP_TEST_CALLER_KEYS"
ADMIN_NAME, ADMIN_KEY = "ops", "secret1"
CALLER_KEY = "caller-key-1"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
CALLER = {"authorization": f"Bearer {CALLER_KEY}"}
TOKENS = 3
CAPACITY = {"a": 6, "b": 3, "c": 3}
LOAD_CLIENTS_PER_API = 4
# Generous bound for "every process has applied it" (the goal is 1 s; a timing
# claim is bench's business, not a pass/fail test's).
FLEET_WIDE_S = 15.0


# --- the fleet -------------------------------------------------------------------------------------------


def fleet_config(system: System, with_d: bool = True) -> dict[str, Any]:
    fake_args = {"timeout_s": 60}
    providers = [
        http_provider("a", "vllm", system.port("fa"), CAPACITY["a"], ["served"], **fake_args),
        http_provider("b", "vllm", system.port("fb"), CAPACITY["b"], ["served"], **fake_args),
        http_provider("c", "vllm", system.port("fc"), CAPACITY["c"], ["served"], **fake_args),
        {**http_provider("au", "vllm", system.port("fc"), 1, ["served"]), "capacity": "auto", "max_capacity": 8},
        http_provider("o", "ollama", system.port("fo"), 2, ["x", "y"], lifecycle="managed", max_loaded=1,
                      load_s=0.15, unload_idle_s=0.5),
    ]
    models: list[dict[str, Any]] = [
        {"id": "m", "providers": {"a": "served", "b": "served"}},
        {"id": "solo", "providers": {"c": "served"}},
        {"id": "am", "providers": {"au": "served"}},
        {"id": "x", "providers": {"o": "x"}, "fallbacks": ["y"]},
        {"id": "y", "providers": {"o": "y"}},
    ]
    if with_d:
        providers.append(http_provider("d", "vllm", system.port("fb"), 2, ["served"]))
        models.append({"id": "dm", "providers": {"d": "served"}})
    return {
        "api": {"admin_keys_env": ADMIN_ENV, "api_keys_env": CALLER_ENV},
        "dispatch": fast_dispatch(lease_ms=5000),
        "queue": {"max_queue": 200, "queue_timeout_ms": 60_000},
        "models": models,
        "nodes": [{"id": "n1", "providers": providers}],
    }


@dataclass
class Fleet:
    system: System
    apis: list[Proc]
    workers: list[Proc]

    @property
    def urls(self) -> list[str]:
        return [self.system.api_url_of(p.name) for p in self.apis]

    def url(self, i: int) -> str:
        return self.urls[i]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    # A Redis of its own, with its AOF: one test stops it and starts it again.
    with RedisServer(appendonly=True) as redis_server:
        system = System(tmp_path_factory.mktemp("runtime-control"), redis_server)
        system.env[ADMIN_ENV] = f"{ADMIN_NAME}:{ADMIN_KEY}"
        system.env[CALLER_ENV] = CALLER_KEY
        try:
            system.write_config(fleet_config(system))
            for name in ("fa", "fb", "fc"):
                system.fake(name, "--models", "served", "--tokens", str(TOKENS), "--delay-ms", "40",
                            "--token-interval-ms", "10")
            system.fake("fo", "--models", "x,y", "--tokens", str(TOKENS), "--max-loaded", "1", "--load-ms", "150")
            workers = [system.worker("n1", f"worker-{i}") for i in (1, 2)]
            apis = [system.api(f"api-{i}") for i in (1, 2, 3)]
            system.wait_available("a", "b", "c", "o")
            for worker in workers:
                system.wait_serving(worker)
            system.wait_until("o's models read", lambda: system.provider("o").get("ms:x") == "unloaded")
            yield Fleet(system, apis, workers)
        finally:
            system.close()


@pytest.fixture(autouse=True)
def clean(fleet: Fleet) -> Iterator[None]:
    """After each test: the fakes answer, every override is cleared (but one whose target a
    reload removed: that answers 404), nothing runs."""
    yield
    system = fleet.system
    for name in ("fa", "fb", "fc"):
        system.fakes[name].control(hang=False)
    for view in overrides(fleet):
        clear(fleet, view, missing_ok=True)
    system.wait_until("nothing running", lambda: all(system.in_flight(p) == 0 for p in CAPACITY), timeout=60)


# --- HTTP helpers ----------------------------------------------------------------------------------------


def admin(fleet: Fleet, method: str, path: str, api: int = 0, body: Any = None,
          headers: dict[str, str] | None = None) -> httpx.Response:
    """An /admin call on replica ``api`` with the admin key (or ``headers``)."""
    return httpx.request(method, f"{fleet.url(api)}{path}", json=body, timeout=60,
                         headers=ADMIN if headers is None else headers)


def ok(resp: httpx.Response, status: int = 200) -> Any:
    assert resp.status_code == status, f"{resp.request.method} {resp.request.url}: {resp.status_code} {resp.text}"
    return resp.json()


def error(resp: httpx.Response, status: int) -> dict[str, Any]:
    """The error of an answer that must be refused with ``status``."""
    assert resp.status_code == status, f"{resp.request.method} {resp.request.url}: {resp.status_code} {resp.text}"
    err: dict[str, Any] = resp.json()["error"]
    return err


def overrides(fleet: Fleet, api: int = 0) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = ok(admin(fleet, "GET", "/admin/overrides", api))["overrides"]
    return found


def clear(fleet: Fleet, view: dict[str, Any], missing_ok: bool = False) -> None:
    """Clear one override as listed (``missing_ok``: one whose target the config no longer
    has answers 404, and stays)."""
    target, oid, field = view["target"], view["id"], view["field"]
    if field == "enabled":
        resp = admin(fleet, "POST", f"/admin/providers/{oid}/enable")
    elif target == "provider":
        resp = admin(fleet, "DELETE", f"/admin/providers/{oid}/capacity")
    else:
        resp = admin(fleet, "DELETE", f"/admin/models/{oid}/{field}")
    if not (missing_ok and resp.status_code == 404):
        ok(resp)


def audit(fleet: Fleet, api: int = 0, **params: Any) -> list[dict[str, Any]]:
    query = "&".join(f"{k}={v}" for k, v in params.items())
    entries: list[dict[str, Any]] = ok(admin(fleet, "GET", f"/admin/audit?{query}", api))["entries"]
    return entries


def catalog(fleet: Fleet, api: int) -> dict[str, Any]:
    doc: dict[str, Any] = ok(httpx.get(f"{fleet.url(api)}/catalog", headers=ADMIN, timeout=30))
    return doc


def provider_of(doc: dict[str, Any], pid: str) -> dict[str, Any]:
    return next(p for p in doc["providers"] if p["id"] == pid)


def model_of(doc: dict[str, Any], mid: str) -> dict[str, Any]:
    return next(m for m in doc["models"] if m["id"] == mid)


def on_every_replica(fleet: Fleet, what: str, holds: Callable[[dict[str, Any]], bool],
                     timeout: float = FLEET_WIDE_S) -> None:
    """Until every replica's /catalog satisfies ``holds``."""
    fleet.system.wait_until(f"{what}, on every replica",
                            lambda: all(holds(catalog(fleet, i)) for i in range(len(fleet.apis))), timeout=timeout)


APPLIED = re.compile(r"overrides applied \(version (\d+)\)")


def applied_version(proc: Proc, since: int = 0) -> int:
    """The newest overrides version ``proc`` says it runs (logged past offset ``since`` of its
    log); -1 if none. A process logs it when the overrides change the config it runs (a
    model's fallbacks or preference, a learned capacity's bounds)."""
    return max((int(v) for v in APPLIED.findall(proc.log()[since:])), default=-1)


def wait_applied(fleet: Fleet, since: dict[str, int] | None = None) -> None:
    """Until every API and worker process runs the overrides as they are now in Redis.
    (``/catalog`` shows what Redis holds at once, so it cannot say that a replica routes by
    it yet: the process's own word can.)"""
    version = int(fleet.system.redis.get(keys.OVERRIDES_VERSION) or 0)
    for proc in [*fleet.apis, *fleet.workers]:
        fleet.system.wait_until(
            f"{proc.name} runs overrides version {version}",
            lambda p=proc: applied_version(p, (since or {}).get(p.name, 0)) >= version, timeout=FLEET_WIDE_S)


@dataclass
class Result:
    planned: Planned
    answer: Any  # (status, text), or the exception
    provider: str  # x-iop-provider
    model: str  # x-iop-model
    sent: float  # time.monotonic()
    done: float

    @property
    def status(self) -> int | None:
        return self.answer[0] if isinstance(self.answer, tuple) else None


def ask(client: httpx.Client, api: str, marker: str, model: str = "m", stream: bool = False) -> Result:
    planned = Planned(marker, api, stream, 0, TOKENS, model=model)
    sent = time.monotonic()
    try:
        with client.stream("POST", f"{api}/v1/chat/completions", json=planned.body(), headers=CALLER) as resp:
            answer: Any = (resp.status_code, resp.read().decode())
            provider, served = resp.headers.get("x-iop-provider", ""), resp.headers.get("x-iop-model", "")
    except httpx.HTTPError as exc:
        answer, provider, served = exc, "", ""
    return Result(planned, answer, provider, served, sent, time.monotonic())


def ask_once(fleet: Fleet, api: int, marker: str, model: str = "m", stream: bool = False) -> Result:
    with httpx.Client(timeout=60) as client:
        return ask(client, fleet.url(api), marker, model, stream)


class Load(threading.Thread):
    """Requests for ``m`` one after another (JSON and streamed in turn) through one replica."""

    def __init__(self, api: str, name: str) -> None:
        super().__init__(daemon=True)
        self.api = api
        self.name = name
        self.stop_flag = threading.Event()
        self.results: list[Result] = []

    def run(self) -> None:
        n = 0
        with httpx.Client(timeout=60) as client:
            while not self.stop_flag.is_set():
                n += 1
                self.results.append(ask(client, self.api, f"{self.name}-{n}", stream=n % 2 == 0))


class Loads:
    """LOAD_CLIENTS_PER_API clients on each replica, until stopped."""

    def __init__(self, fleet: Fleet, tag: str) -> None:
        self.loads = [Load(url, f"{tag}-{i}-{j}") for i, url in enumerate(fleet.urls)
                      for j in range(LOAD_CLIENTS_PER_API)]

    def __enter__(self) -> Loads:
        for load in self.loads:
            load.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        for load in self.loads:
            load.stop_flag.set()
        for load in self.loads:
            load.join(90)

    def results(self) -> list[Result]:
        return [r for load in self.loads for r in list(load.results)]

    def served_by(self, provider: str, sent_after: float = 0.0) -> int:
        return sum(1 for r in self.results() if r.provider == provider and r.sent > sent_after)

    def problems(self) -> list[str]:
        return [f"{r.planned.marker} ({r.planned.api}): {p}" for r in self.results()
                if (p := answer_problem(r.planned, r.answer))]


class Sampler(threading.Thread):
    """Samples a provider hash's in_flight and capacity in a tight loop (one script call per
    sample: each one instant)."""

    SCRIPT = "return redis.call('HMGET', KEYS[1], 'in_flight', 'capacity')"

    def __init__(self, system: System, pid: str) -> None:
        super().__init__(daemon=True)
        self.redis = system.redis
        self.key = keys.provider(pid)
        self.samples: list[tuple[int, int]] = []
        self.stop_flag = threading.Event()

    def run(self) -> None:
        while not self.stop_flag.is_set():
            in_flight, capacity = self.redis.eval(self.SCRIPT, 1, self.key)
            self.samples.append((int(in_flight or 0), int(capacity or 0)))
            time.sleep(0.001)

    def stop(self) -> list[tuple[int, int]]:
        self.stop_flag.set()
        self.join(10)
        return self.samples


# --- 6. bad input changes nothing ------------------------------------------------------------------------


def test_bad_input_is_refused_clearly_and_changes_nothing(fleet: Fleet) -> None:
    system = fleet.system
    version = system.redis.get(keys.OVERRIDES_VERSION)
    audited = system.redis.xlen(keys.AUDIT)

    # The audit's bounds: a time before 0 or past any stream id, a limit out of range (422).
    for query in ("since=-805741", f"since={2**64}", "limit=0", "limit=1001"):
        assert error(admin(fleet, "GET", f"/admin/audit?{query}"), 422)["code"] == "invalid_override"

    # Unknown provider or model: 404.
    unknown_provider: list[tuple[str, str, Any]] = [
        ("POST", "/admin/providers/nope/disable", None),
        ("POST", "/admin/providers/nope/enable", None),
        ("PUT", "/admin/providers/nope/capacity", {"capacity": 2}),
        ("DELETE", "/admin/providers/nope/capacity", None),
        ("POST", "/admin/providers/nope/models/x/load", None),
    ]
    for method, path, body in unknown_provider:
        assert error(admin(fleet, method, path, body=body), 404)["code"] == "provider_not_found", path
    unknown_model: list[tuple[str, str, Any]] = [
        ("PUT", "/admin/models/nope/fallbacks", {"fallbacks": ["m"]}),
        ("PUT", "/admin/models/nope/preference", {"providers": ["a"]}),
        ("DELETE", "/admin/models/nope/fallbacks", None),
        ("DELETE", "/admin/models/nope/preference", None),
        ("POST", "/admin/providers/o/models/nope/load", None),
    ]
    for method, path, body in unknown_model:
        assert error(admin(fleet, method, path, body=body), 404)["code"] == "model_not_found", path

    # Capacities out of bounds: 422, naming the bound.
    assert "at least 1" in error(admin(fleet, "PUT", "/admin/providers/a/capacity", body={"capacity": 0}), 422)[
        "message"]
    # A fixed capacity's ceiling is the default max_capacity, 64.
    too_many = admin(fleet, "PUT", "/admin/providers/a/capacity", body={"capacity": 65})
    assert "64, the most an override may give" in error(too_many, 422)["message"]
    # A learned one's, its max_capacity (8): for a fixed override and for the bounds.
    assert "max_capacity 8" in error(admin(fleet, "PUT", "/admin/providers/au/capacity", body={"capacity": 9}),
                                     422)["message"]
    assert "max_capacity 8" in error(admin(fleet, "PUT", "/admin/providers/au/capacity",
                                           body={"min": 1, "max": 9}), 422)["message"]
    assert "min 3 is above max 2" in error(admin(fleet, "PUT", "/admin/providers/au/capacity",
                                                 body={"min": 3, "max": 2}), 422)["message"]
    # Bounds are for a learned capacity only.
    error(admin(fleet, "PUT", "/admin/providers/a/capacity", body={"min": 1, "max": 2}), 422)
    # A time that is not one.
    error(admin(fleet, "POST", "/admin/providers/a/disable", body={"for_s": 0}), 422)
    error(admin(fleet, "POST", "/admin/providers/a/disable", body={"for_s": -5}), 422)
    # A body that is not what the endpoint takes.
    error(admin(fleet, "PUT", "/admin/providers/a/capacity", body={"capacity": "two"}), 422)

    # Fallbacks: a loop (x already falls back to y), itself, an unknown model.
    assert "loop" in error(admin(fleet, "PUT", "/admin/models/y/fallbacks", body={"fallbacks": ["x"]}), 422)[
        "message"]
    error(admin(fleet, "PUT", "/admin/models/m/fallbacks", body={"fallbacks": ["m"]}), 422)
    assert "nope" in error(admin(fleet, "PUT", "/admin/models/m/fallbacks", body={"fallbacks": ["nope"]}), 422)[
        "message"]
    # Preference: a provider that does not serve the model, none at all.
    assert "'c'" in error(admin(fleet, "PUT", "/admin/models/m/preference", body={"providers": ["c"]}), 422)[
        "message"]
    error(admin(fleet, "PUT", "/admin/models/m/preference", body={"providers": []}), 422)

    # No key, or a caller's key, on an API with admin keys: 401, as for drain (the key is not
    # an admin key: tests/e2e/test_admin_exposure.py).
    for headers in ({}, CALLER):
        error(admin(fleet, "POST", "/admin/providers/a/disable", headers=headers), 401)
        error(admin(fleet, "PUT", "/admin/providers/a/capacity", body={"capacity": 2}, headers=headers), 401)
        error(admin(fleet, "POST", "/admin/providers/o/models/x/load", headers=headers), 401)

    # A caller's key on an API with caller keys and no admin keys: 403, a caller key never suffices.
    keyless = fleet_config(system)
    keyless["api"] = {"api_keys_env": CALLER_ENV}
    proc, url = api_with_config(system, "api-callers-only", keyless)
    try:
        writes: list[tuple[str, str, Any]] = [("POST", "/admin/providers/a/disable", None),
                                              ("PUT", "/admin/providers/a/capacity", {"capacity": 2}),
                                              ("PUT", "/admin/models/m/preference", {"providers": ["b"]}),
                                              ("POST", "/admin/providers/o/models/x/load", None)]
        for method, path, body in writes:
            resp = httpx.request(method, f"{url}{path}", json=body, headers=CALLER, timeout=30)
            assert error(resp, 403)["code"] == "admin_key_required", path
    finally:
        proc.stop()

    # Nothing changed: no override, no new version, nothing audited, every provider as configured.
    assert overrides(fleet) == []
    assert system.redis.hlen(keys.OVERRIDES) == 0
    assert system.redis.get(keys.OVERRIDES_VERSION) == version
    assert system.redis.xlen(keys.AUDIT) == audited
    doc = catalog(fleet, 2)
    for pid, cap in CAPACITY.items():
        assert (provider_of(doc, pid)["enabled"], provider_of(doc, pid)["capacity"]) == (True, cap)
    assert system.provider("a").get("off") is None


# --- 1. disable under load, then enable ------------------------------------------------------------------


def test_disable_under_load_stops_new_work_everywhere_and_enable_brings_it_back(fleet: Fleet) -> None:
    system = fleet.system
    fa = system.fakes["fa"]
    fa.hooks(track_executions=True)
    # a holds every request it gets: once it holds 6 (its capacity, so every slot of a's is
    # one of them and no request is on its way to it), those 6 are running at the disable.
    fa.control(hang=True)
    with Loads(fleet, "dis") as loads:
        system.wait_until("a full of held requests, b serving",
                          lambda: (fa.stats()["in_flight"], system.in_flight("a")) == (CAPACITY["a"], CAPACITY["a"])
                          and loads.served_by("b") >= 5)
        received = fa.stats()["total"]

        view = ok(admin(fleet, "POST", "/admin/providers/a/disable", api=1))
        disabled_at, disabled_wall = time.monotonic(), time.time()
        assert {k: view[k] for k in ("target", "id", "field", "value", "config", "by", "until", "via")} == {
            "target": "provider", "id": "a", "field": "enabled", "value": False, "config": True, "by": ADMIN_NAME,
            "until": None, "via": "http"}
        on_every_replica(fleet, "a disabled", lambda d: provider_of(d, "a")["enabled"] is False
                         and provider_of(d, "a")["override"].get("enabled", {}).get("by") == ADMIN_NAME)

        # The held requests finish normally; a has free slots now, and gets nothing new.
        fa.control(hang=False)
        system.wait_until("a's running requests finished", lambda: system.in_flight("a") == 0)
        released_at = time.monotonic()
        system.wait_until("b serves on alone", lambda: loads.served_by("b", sent_after=released_at) >= 30,
                          timeout=60)
        late = [e for e in fa.executions() if e["started"] > disabled_wall]
        assert fa.stats()["total"] == received, f"a received requests after it was disabled: {late}"
        assert system.in_flight("a") == 0
        # Those a ran when it was disabled were answered (whole: checked with the rest below).
        held = [r for r in loads.results() if r.provider == "a" and r.done > disabled_at]
        assert len(held) == CAPACITY["a"], [(r.planned.marker, r.status) for r in held]
        assert all(r.status == 200 for r in held)

        cleared = ok(admin(fleet, "POST", "/admin/providers/a/enable", api=2))
        assert cleared == {"target": "provider", "id": "a", "field": "enabled", "cleared": True}
        enabled_at = time.monotonic()
        on_every_replica(fleet, "a enabled", lambda d: provider_of(d, "a")["enabled"] is True
                         and provider_of(d, "a")["override"] == {})
        system.wait_until("a serves again", lambda: loads.served_by("a", sent_after=enabled_at) >= 5)
        # Enabling what is enabled changes nothing.
        assert ok(admin(fleet, "POST", "/admin/providers/a/enable"))["cleared"] is False
    assert not loads.problems(), loads.problems()[:10]
    # Audited: the disable and the enable, by the admin key's name.
    entries = audit(fleet, limit=2)
    assert [(e["action"], e["target"], e["by"], e["via"]) for e in entries] == [
        ("enable", "provider/a", ADMIN_NAME, "http"), ("disable", "provider/a", ADMIN_NAME, "http")]
    assert (entries[1]["before"], entries[1]["after"]) == (True, False)


# --- 2. a capacity under load ----------------------------------------------------------------------------


def test_capacity_override_holds_across_replicas_and_workers_then_clears(fleet: Fleet) -> None:
    system = fleet.system
    fa = system.fakes["fa"]
    with Loads(fleet, "cap") as loads:
        system.wait_until("a runs more than 2", lambda: system.in_flight("a") > 2)

        view = ok(admin(fleet, "PUT", "/admin/providers/a/capacity", api=0, body={"capacity": 2}))
        assert (view["field"], view["value"], view["config"], view["by"]) == ("capacity", 2, CAPACITY["a"], ADMIN_NAME)
        on_every_replica(fleet, "a's capacity 2", lambda d: provider_of(d, "a")["capacity"] == 2
                         and provider_of(d, "a")["override"].get("capacity", {}).get("value") == 2
                         and provider_of(d, "a")["override"]["capacity"]["config"] == CAPACITY["a"])
        # What ran beyond 2 finishes; from then on a never runs more than 2, whoever dispatches.
        system.wait_until("a down to 2", lambda: system.in_flight("a") <= 2 and fa.stats()["in_flight"] <= 2)
        sampler = Sampler(system, "a")
        sampler.start()
        httpx.post(f"{fa.url}/_fake/stats/reset", timeout=5).raise_for_status()
        start = loads.served_by("a")
        try:
            # Long enough for many heartbeats of both workers, each proposing capacity 6.
            system.wait_until("a served 40 more", lambda: loads.served_by("a") >= start + 40, timeout=90)
        finally:
            samples = sampler.stop()
        assert len(samples) > 100
        assert max(s[0] for s in samples) <= 2, f"in_flight over the override: {max(s[0] for s in samples)}"
        assert max(s[0] for s in samples) == 2, "the load never filled a's 2 slots: the test measured nothing"
        assert {s[1] for s in samples} == {2}, f"capacities seen: {sorted({s[1] for s in samples})}"
        assert 1 <= fa.stats()["max_in_flight"] <= 2, fa.stats()

        cleared = ok(admin(fleet, "DELETE", "/admin/providers/a/capacity", api=2))
        assert cleared == {"target": "provider", "id": "a", "field": "capacity", "cleared": True}
        on_every_replica(fleet, "a's capacity back to 6", lambda d: provider_of(d, "a")["capacity"] == CAPACITY["a"]
                         and provider_of(d, "a")["override"] == {})
        system.wait_until("a runs more than 2 again", lambda: system.in_flight("a") > 2)
    assert not loads.problems(), loads.problems()[:10]
    entries = audit(fleet, limit=2)
    assert [(e["action"], e["before"], e["after"]) for e in entries] == [
        ("capacity.clear", 2, CAPACITY["a"]), ("capacity", CAPACITY["a"], 2)]


def test_bounds_of_a_learned_capacity_hold_on_every_process_then_clear(fleet: Fleet) -> None:
    system = fleet.system
    system.wait_until("au's capacity published", lambda: int(system.provider("au").get("capacity") or 0) >= 1)
    view = ok(admin(fleet, "PUT", "/admin/providers/au/capacity", api=1, body={"min": 2, "max": 3}))
    assert (view["field"], view["value"], view["config"]) == ("capacity_bounds", {"min": 2, "max": 3},
                                                              {"min": 1, "max": 8})
    # The catalog shows them, every API and worker process runs them (its workers learn
    # within them), and the capacity in force is within them.
    on_every_replica(fleet, "au bounded to 2..3", lambda d: provider_of(d, "au")["capacity_bounds"] == [2, 3]
                     and provider_of(d, "au")["override"]["capacity_bounds"]["value"] == {"min": 2, "max": 3}
                     and 2 <= provider_of(d, "au")["capacity"] <= 3)
    wait_applied(fleet)
    assert 2 <= int(system.provider("au")["capacity"]) <= 3

    cleared = ok(admin(fleet, "DELETE", "/admin/providers/au/capacity", api=2))
    assert cleared == {"target": "provider", "id": "au", "field": "capacity", "cleared": True}
    on_every_replica(fleet, "au's bounds back to 1..8", lambda d: provider_of(d, "au")["capacity_bounds"] == [1, 8]
                     and provider_of(d, "au")["override"] == {})
    wait_applied(fleet)
    entries = audit(fleet, limit=2)
    assert [(e["action"], e["before"], e["after"]) for e in entries] == [
        ("capacity.clear", {"min": 2, "max": 3}, {"min": 1, "max": 8}),
        ("capacity", {"min": 1, "max": 8}, {"min": 2, "max": 3})]


# --- 3. a model's fallbacks and preference ---------------------------------------------------------------


def test_model_fallbacks_and_preference_hold_on_every_replica(fleet: Fleet) -> None:
    system = fleet.system
    c_received = system.fakes["fc"].stats()["total"]

    # solo's only provider disabled, no fallbacks: refused.
    ok(admin(fleet, "POST", "/admin/providers/c/disable"))
    on_every_replica(fleet, "c disabled", lambda d: provider_of(d, "c")["enabled"] is False)
    refused = ask_once(fleet, 0, "solo-alone", model="solo")
    assert refused.status == 503, refused.answer
    assert "no_provider_available" in refused.answer[1]

    # Fallbacks for solo: m takes its requests, through every replica.
    view = ok(admin(fleet, "PUT", "/admin/models/solo/fallbacks", api=1, body={"fallbacks": ["m"]}))
    assert (view["target"], view["id"], view["field"], view["value"], view["config"]) == (
        "model", "solo", "fallbacks", ["m"], [])
    on_every_replica(fleet, "solo falls back to m", lambda d: model_of(d, "solo")["fallbacks"] == ["m"]
                     and model_of(d, "solo")["override"]["fallbacks"]["value"] == ["m"])
    wait_applied(fleet)
    for i in range(len(fleet.apis)):
        for stream in (False, True):
            result = ask_once(fleet, i, f"solo-fb-{i}-{stream}", model="solo", stream=stream)
            assert result.status == 200, result.answer
            assert result.model == "m", (i, result.model)
            assert result.provider in ("a", "b")

    # Cleared: solo has no fallbacks again, anywhere.
    cleared = ok(admin(fleet, "DELETE", "/admin/models/solo/fallbacks", api=2))
    assert cleared == {"target": "model", "id": "solo", "field": "fallbacks", "cleared": True}
    on_every_replica(fleet, "solo without fallbacks", lambda d: model_of(d, "solo")["fallbacks"] == []
                     and model_of(d, "solo")["override"] == {})
    wait_applied(fleet)
    for i in range(len(fleet.apis)):
        assert ask_once(fleet, i, f"solo-again-{i}", model="solo").status == 503
    ok(admin(fleet, "POST", "/admin/providers/c/enable"))
    assert system.fakes["fc"].stats()["total"] == c_received

    # Preference: idle, m goes to a (equal load, lower id); with b preferred, to b only.
    system.wait_until("a and b idle", lambda: system.in_flight("a") == system.in_flight("b") == 0)
    assert [ask_once(fleet, i, f"pref-none-{i}").provider for i in range(3)] == ["a"] * 3
    view = ok(admin(fleet, "PUT", "/admin/models/m/preference", api=2, body={"providers": ["b", "a"]}))
    assert (view["field"], view["value"], view["config"]) == ("preference", ["b", "a"], [])
    on_every_replica(fleet, "m prefers b", lambda d: model_of(d, "m")["preference"] == ["b", "a"]
                     and model_of(d, "m")["override"]["preference"]["by"] == ADMIN_NAME)
    wait_applied(fleet)
    served = [ask_once(fleet, i % 3, f"pref-b-{i}", stream=i % 2 == 1) for i in range(9)]
    assert all(r.status == 200 for r in served), [r.answer for r in served]
    assert [r.provider for r in served] == ["b"] * 9
    # Under more load than b takes, a fills in after b.
    with Loads(fleet, "pref") as loads:
        system.wait_until("b full and a used", lambda: loads.served_by("a") >= 3 and loads.served_by("b") >= 3)
    assert not loads.problems(), loads.problems()[:10]

    cleared = ok(admin(fleet, "DELETE", "/admin/models/m/preference", api=0))
    assert cleared["cleared"] is True
    on_every_replica(fleet, "m's preference back", lambda d: model_of(d, "m")["preference"] == []
                     and model_of(d, "m")["override"] == {})
    wait_applied(fleet)
    system.wait_until("a and b idle", lambda: system.in_flight("a") == system.in_flight("b") == 0)
    assert [ask_once(fleet, i, f"pref-cleared-{i}").provider for i in range(3)] == ["a"] * 3
    actions = [e["action"] for e in audit(fleet, limit=6)]
    assert actions == ["preference.clear", "preference", "enable", "fallbacks.clear", "fallbacks", "disable"]


# --- 5. an override lapses by itself ---------------------------------------------------------------------


def test_an_override_with_a_time_lapses_by_itself(fleet: Fleet) -> None:
    system = fleet.system
    view = ok(admin(fleet, "POST", "/admin/providers/c/disable", api=1, body={"for_s": 1}))
    assert view["until"] == view["at"] + 1000
    listed = overrides(fleet, api=2)
    assert [(o["id"], o["field"], o["until"]) for o in listed] == [("c", "enabled", view["until"])]
    # Nobody clears it: it goes by itself, and c takes work again.
    system.wait_until("the override lapsed", lambda: overrides(fleet) == [], timeout=FLEET_WIDE_S)
    on_every_replica(fleet, "c enabled", lambda d: provider_of(d, "c")["enabled"] is True
                     and provider_of(d, "c")["override"] == {})
    assert system.provider("c").get("off") is None
    for i in range(len(fleet.apis)):
        result = ask_once(fleet, i, f"solo-after-lapse-{i}", model="solo")
        assert (result.status, result.provider) == (200, "c"), result.answer
    lapsed = [e for e in audit(fleet, since=view["at"]) if e["via"] == "expiry"]
    assert len(lapsed) == 1, lapsed
    assert (lapsed[0]["action"], lapsed[0]["target"], lapsed[0]["before"], lapsed[0]["after"]) == (
        "enable", "provider/c", False, True)
    assert lapsed[0]["at"] >= view["until"]


# --- 8. load and unload a model --------------------------------------------------------------------------


def lifecycle(fleet: Fleet) -> dict[str, Any]:
    found: dict[str, Any] = httpx.get(f"{fleet.system.fakes['fo'].url}/_fake/lifecycle", timeout=5).json()
    return found


def model_state(doc: dict[str, Any], pid: str, served: str) -> str:
    state: str = provider_of(doc, pid)["models_state"][served]["state"]
    return state


def test_load_and_unload_a_model_on_a_managed_provider(fleet: Fleet) -> None:
    answer = ok(admin(fleet, "POST", "/admin/providers/o/models/x/load", api=0), 202)
    assert answer == {"provider": "o", "model": "x", "state": "loading"}
    on_every_replica(fleet, "x loaded on o", lambda d: model_state(d, "o", "x") == "loaded")
    assert lifecycle(fleet)["loaded"] == ["x"]
    assert lifecycle(fleet)["loads"]["x"]["api"] == 1

    answer = ok(admin(fleet, "POST", "/admin/providers/o/models/x/unload", api=1), 202)
    assert answer == {"provider": "o", "model": "x", "state": "unloading"}
    on_every_replica(fleet, "x unloaded from o", lambda d: model_state(d, "o", "x") == "unloaded")
    fleet.system.wait_until("the fake unloaded x", lambda: lifecycle(fleet)["loaded"] == [])
    assert lifecycle(fleet)["unloads"]["x"]["api"] == 1

    # A provider whose models iop does not manage: 409, nothing ordered.
    err = error(admin(fleet, "POST", "/admin/providers/a/models/served/load", api=2), 409)
    assert "lifecycle" in err["message"]
    error(admin(fleet, "POST", "/admin/providers/a/models/served/unload", api=2), 409)
    entries = audit(fleet, limit=2)
    assert [(e["action"], e["target"], e["by"]) for e in entries] == [
        ("unload", "provider/o", ADMIN_NAME), ("load", "provider/o", ADMIN_NAME)]


def control_actions(fleet: Fleet, api: int) -> dict[str, float]:
    text = httpx.get(f"{fleet.url(api)}/metrics", headers=ADMIN, timeout=30).text
    found = {}
    for line in text.splitlines():
        if line.startswith("iop_control_actions_total{"):
            labels, value = line.rsplit(" ", 1)
            found[labels.split('action="', 1)[1].split('"', 1)[0]] = float(value)
    return found


def test_drain_and_resume_are_audited_and_every_replica_counts_actions_alike(fleet: Fleet) -> None:
    assert ok(admin(fleet, "POST", "/admin/providers/b/drain", api=0))["drain"] == "drained"
    assert ok(admin(fleet, "POST", "/admin/providers/b/resume", api=1, headers={**ADMIN, "x-iop-via": "cli"}))[
        "drain"] is None
    entries = audit(fleet, limit=2)
    assert [(e["action"], e["target"], e["by"], e["via"]) for e in entries] == [
        ("resume", "provider/b", ADMIN_NAME, "cli"), ("drain", "provider/b", ADMIN_NAME, "http")]
    counts = [control_actions(fleet, i) for i in range(len(fleet.apis))]
    assert counts[0] == counts[1] == counts[2], counts
    # Every kind done so far in this module, counted once each time it was done.
    for action in ("disable", "enable", "capacity", "capacity.clear", "load", "unload", "drain", "resume"):
        assert counts[0].get(action, 0) >= 1, (action, counts[0])
    assert counts[0]["drain"] == sum(1 for e in audit(fleet, limit=1000) if e["action"] == "drain")


# --- 4. every process killed and started again -----------------------------------------------------------


def test_overrides_survive_killing_every_api_and_worker(fleet: Fleet) -> None:
    system = fleet.system
    cli = {**ADMIN, "x-iop-via": "cli"}
    disabled = ok(admin(fleet, "POST", "/admin/providers/c/disable", api=0, body={"for_s": 3600}, headers=cli))
    assert disabled["via"] == "cli"
    ok(admin(fleet, "PUT", "/admin/providers/a/capacity", api=1, body={"capacity": 3}))
    ok(admin(fleet, "PUT", "/admin/models/m/preference", api=2, body={"providers": ["b", "a"]}))
    ok(admin(fleet, "PUT", "/admin/models/solo/fallbacks", api=0, body={"fallbacks": ["m"]}))
    before = overrides(fleet)
    assert len(before) == 4

    for proc in [*fleet.apis, *fleet.workers]:
        proc.kill()
    # Nothing heartbeats a now; the next heartbeat is a new worker's.
    heartbeat = int(system.provider("a")["hb_exp"])
    serving = [w.log().count("serving node") for w in fleet.workers]
    logged = {p.name: len(p.log()) for p in [*fleet.apis, *fleet.workers]}
    for worker in fleet.workers:
        worker.start()
    for api in fleet.apis:
        api.start()
    for api in fleet.apis:
        system.wait_api_ready(api)
    for worker, count in zip(fleet.workers, serving, strict=True):
        system.wait_until(f"{worker.name} serving again", lambda w=worker, n=count: w.log().count("serving node") > n)
    # The new workers have heartbeated a (proposing its config capacity, 6).
    system.wait_until("a heartbeated by the new workers", lambda: int(system.provider("a")["hb_exp"]) > heartbeat)
    system.wait_available("a", "b", "c")
    # Every new process read the overrides when it started, and runs them.
    wait_applied(fleet, since=logged)

    # Every override still in force, listed by a new replica as before.
    after = overrides(fleet, api=2)
    assert after == before
    # Sorted by target, id, field.
    assert [(o["target"], o["id"], o["field"]) for o in after] == [
        ("model", "m", "preference"), ("model", "solo", "fallbacks"),
        ("provider", "a", "capacity"), ("provider", "c", "enabled")]
    c_view = next(o for o in after if o["field"] == "enabled")
    assert c_view["until"] == c_view["at"] + 3600 * 1000
    assert all(o["by"] == ADMIN_NAME for o in after)
    on_every_replica(fleet, "the overrides in the catalog", lambda d: (
        provider_of(d, "c")["enabled"] is False and provider_of(d, "a")["capacity"] == 3
        and model_of(d, "m")["preference"] == ["b", "a"] and model_of(d, "solo")["fallbacks"] == ["m"]
        and provider_of(d, "c")["override"]["enabled"]["until"] == c_view["until"]))

    # Dispatch honours them: solo goes to m (c disabled), m to b first; c gets nothing.
    c_received = system.fakes["fc"].stats()["total"]
    for i in range(6):
        result = ask_once(fleet, i % 3, f"after-restart-{i}", model="solo", stream=i % 2 == 0)
        assert (result.status, result.model, result.provider) == (200, "m", "b"), (result.answer, result.provider)
    assert system.fakes["fc"].stats()["total"] == c_received
    # a's capacity holds at 3 under load, whatever the new workers propose.
    sampler = Sampler(system, "a")
    sampler.start()
    try:
        with Loads(fleet, "restart") as loads:
            system.wait_until("a used", lambda: loads.served_by("a") >= 20, timeout=60)
    finally:
        samples = sampler.stop()
    assert not loads.problems(), loads.problems()[:10]
    assert max(s[0] for s in samples) <= 3
    assert {s[1] for s in samples} == {3}

    # The audit says what was done and by whom (never the key), newest first.
    entries = audit(fleet, api=1, since=disabled["at"])
    assert [(e["action"], e["target"], e["by"], e["via"]) for e in entries] == [
        ("fallbacks", "model/solo", ADMIN_NAME, "http"),
        ("preference", "model/m", ADMIN_NAME, "http"),
        ("capacity", "provider/a", ADMIN_NAME, "http"),
        ("disable", "provider/c", ADMIN_NAME, "cli")]
    assert [e["at"] for e in entries] == sorted((e["at"] for e in entries), reverse=True)
    assert ADMIN_KEY not in admin(fleet, "GET", "/admin/audit?limit=1000").text


# --- 6 (cont.). a write while Redis is down --------------------------------------------------------------


def test_a_write_while_redis_is_down_answers_503_and_leaves_nothing(fleet: Fleet) -> None:
    system = fleet.system
    version = system.redis.get(keys.OVERRIDES_VERSION)
    # Stopped cleanly (its AOF on disk), so it comes back with everything it held.
    system.redis_server.stop()
    try:
        for api, (method, path, body) in enumerate([
            ("POST", "/admin/providers/c/disable", {"for_s": 600}),
            ("PUT", "/admin/providers/a/capacity", {"capacity": 2}),
            ("PUT", "/admin/models/solo/fallbacks", {"fallbacks": ["m"]}),
        ]):
            err = error(admin(fleet, method, path, api=api, body=body), 503)
            assert err["code"] == "redis_unavailable", err
    finally:
        system.redis_server.start()
        system.redis.close()
        system.redis = type(system.redis).from_url(system.redis_server.url)
    for url in fleet.urls:
        system.wait_until(f"{url} ready", lambda u=url: httpx.get(f"{u}/readyz", timeout=5).status_code == 200,
                          timeout=30)
    system.wait_available("a", "b", "c")
    assert overrides(fleet) == []
    assert system.redis.get(keys.OVERRIDES_VERSION) == version
    on_every_replica(fleet, "nothing in force", lambda d: (
        provider_of(d, "c")["enabled"] is True and provider_of(d, "a")["capacity"] == CAPACITY["a"]
        and model_of(d, "solo")["fallbacks"] == [] and all(p["override"] == {} for p in d["providers"])))
    result = ask_once(fleet, 0, "after-outage", model="solo")
    assert (result.status, result.provider) == (200, "c"), result.answer


# --- 7. a reload that removes what an override names -----------------------------------------------------


def test_a_reload_that_removes_a_provider_drops_its_overrides(fleet: Fleet) -> None:
    system = fleet.system
    since = ok(admin(fleet, "POST", "/admin/providers/d/disable", api=0))["at"]
    ok(admin(fleet, "PUT", "/admin/providers/d/capacity", api=1, body={"capacity": 1}))
    # These survive the reload.
    ok(admin(fleet, "POST", "/admin/providers/c/disable", api=0))
    ok(admin(fleet, "PUT", "/admin/providers/a/capacity", api=2, body={"capacity": 4}))
    ok(admin(fleet, "PUT", "/admin/models/solo/fallbacks", api=1, body={"fallbacks": ["m"]}))
    wait_applied(fleet)  # every process has read all of the above

    procs = [*fleet.apis, *fleet.workers]
    reloaded = [p.log().count(" applied (") for p in procs]
    system.write_config(fleet_config(system, with_d=False))
    # One more override on what the file removes, set just before the reload reaches the
    # processes (an operator's change and a deploy at once): dropped as well.
    ok(admin(fleet, "PUT", "/admin/models/dm/preference", api=2, body={"providers": ["d"]}))
    for proc in procs:
        proc.signal(signal.SIGHUP)
    for proc, count in zip(procs, reloaded, strict=True):
        system.wait_until(f"{proc.name} reloaded", lambda p=proc, n=count: p.log().count(" applied (") > n)

    def listed() -> set[tuple[str, str]]:
        return {(o["id"], o["field"]) for o in overrides(fleet)}

    survivors = {("c", "enabled"), ("a", "capacity"), ("solo", "fallbacks")}
    try:
        eventually_sync(listed, lambda found: not found & {("d", "enabled"), ("d", "capacity")},
                        what="d's overrides dropped", within=FLEET_WIDE_S)
        # One set just before the reload too: each process reads the overrides when it reloads.
        eventually_sync(listed, lambda found: found == survivors,
                        what="dm's override, set just before the reload, dropped too", within=FLEET_WIDE_S)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{system.logs()}") from None
    dropped = [line for p in procs for line in p.log().splitlines() if "dropped" in line]
    assert any("override enabled of d dropped" in line for line in dropped), dropped
    assert any("override capacity of d dropped" in line for line in dropped), dropped
    assert any("override preference of dm dropped" in line for line in dropped), dropped
    on_every_replica(fleet, "d gone, the rest in force", lambda d: (
        all(p["id"] != "d" for p in d["providers"]) and all(m["id"] != "dm" for m in d["models"])
        and provider_of(d, "c")["enabled"] is False and provider_of(d, "a")["capacity"] == 4
        and model_of(d, "solo")["fallbacks"] == ["m"]))
    entries = audit(fleet, since=since)
    by_target = {(e["target"], e["via"]) for e in entries}
    assert {("provider/d", "reload"), ("model/dm", "reload"), ("config", "reload")} <= by_target, entries
    # The reload itself is audited once for the fleet, though five processes reloaded.
    assert sum(1 for e in entries if e["action"] == "reload") == 1, entries
