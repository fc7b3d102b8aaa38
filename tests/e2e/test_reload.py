"""Reloading the config file in running processes (``SIGHUP``), from real processes.

Providers are added, resized and removed while requests keep coming through two API
processes, one of which is never reloaded: every request still gets its one complete
answer, a new provider takes work as soon as its worker publishes it, and no process --
not even the one that still has the old config -- sends anything to a provider once its
worker has applied its removal. An invalid file changes nothing; a removed model answers
404 while its waiting requests end one way or the other; keys rotate.
"""

from __future__ import annotations

import hashlib
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dispatcher import keys
from tests.e2e.system import Planned, Proc, System, answer_problem, fast_dispatch, http_provider

pytestmark = pytest.mark.timeout(180)

TOKENS = 3
# Within this the new provider must have served a request after its worker reloaded: a
# heartbeat interval (200 ms) plus a probe, with room for a loaded 2-core machine.
NEW_PROVIDER_WITHIN_S = 5.0


def config(system: System, pool: dict[str, int], models: dict[str, list[str]] | None = None,
           **extra: Any) -> dict[str, Any]:
    """One node n1 with the providers of ``pool`` (id -> capacity); each model served by
    the given providers (default: model m by all of them)."""
    models = models or {"m": list(pool)}
    return {
        "queue": {"max_queue": 200, "queue_timeout_ms": 20_000},
        "dispatch": fast_dispatch(),
        "models": [{"id": mid, "providers": {pid: "fake-model" for pid in pids}} for mid, pids in models.items()],
        "nodes": [{"id": "n1", "providers": [
            http_provider(pid, "vllm", system.port(pid), capacity, ["fake-model"]) for pid, capacity in pool.items()
        ]}],
        **extra,
    }


def hang_up(*procs: Proc) -> None:
    for proc in procs:
        proc.signal(signal.SIGHUP)


def wait_reloaded(system: System, proc: Proc, times: int) -> None:
    system.wait_until(f"{proc.name} reloaded {times} time(s)", lambda: proc.log().count(" applied (") >= times)


class Load(threading.Thread):
    """Requests one after another (JSON and streamed in turn) through one API until told to stop."""

    def __init__(self, api: str, name: str) -> None:
        super().__init__(daemon=True)
        self.api = api
        self.name = name
        self.stop_flag = threading.Event()
        # (planned, (status, text) or the exception, provider, finished at)
        self.results: list[tuple[Planned, Any, str, float]] = []

    def run(self) -> None:
        n = 0
        while not self.stop_flag.is_set():
            n += 1
            planned = Planned(f"{self.name}-{n}", self.api, stream=n % 2 == 0, delay_ms=0, tokens=TOKENS)
            provider = ""
            try:
                url = f"{self.api}/v1/chat/completions"
                with httpx.stream("POST", url, json=planned.body(), timeout=60) as resp:
                    provider = resp.headers.get("x-iop-provider", "")
                    result: Any = (resp.status_code, resp.read().decode())
            except httpx.HTTPError as exc:
                result = exc
            self.results.append((planned, result, provider, time.monotonic()))

    def problems(self) -> list[str]:
        return [f"{p.marker}: {problem}" for p, r, _, _ in self.results if (problem := answer_problem(p, r))]


def served_by(loads: list[Load], provider: str, after: float = 0.0) -> int:
    return sum(1 for load in loads for *_, pid, at in load.results if pid == provider and at > after)


def test_reload_under_load_adds_resizes_and_removes_providers(system: System) -> None:
    system.write_config(config(system, {"a": 2}))
    fakes = {pid: system.fake(pid, "--delay-ms", "60", "--tokens", str(TOKENS), "--token-interval-ms", "10")
             for pid in ("a", "b")}
    worker = system.worker("n1")
    api = system.api("api")
    system.api("stale")  # never reloaded: it keeps the first config
    system.wait_available("a")
    system.wait_serving(worker)
    loads = [Load(url, f"{name}{i}") for url, name in ((system.api_url, "fresh"), (system.api_url_of("stale"), "old"))
             for i in range(3)]
    for load in loads:
        load.start()
    try:
        system.wait_until("load under way", lambda: served_by(loads, "a") >= 6)

        # Add b.
        system.write_config(config(system, {"a": 2, "b": 2}))
        hang_up(worker, api)
        wait_reloaded(system, worker, 1)
        added_at = time.monotonic()
        system.wait_until("b serves", lambda: served_by(loads, "b") > 0, timeout=NEW_PROVIDER_WITHIN_S)
        assert system.provider("b")["capacity"] == "2"

        # Take a away and resize b; only the worker and one API learn of it.
        system.write_config(config(system, {"b": 3}))
        hang_up(worker, api)
        wait_reloaded(system, worker, 2)
        wait_reloaded(system, api, 2)
        assert system.provider("a")["health"] == "unavailable"
        assert system.provider("a")["reason"] == "removed from the config"
        # Marked before the reload is logged; b's new capacity comes with the heartbeat the
        # reload asks for, just after.
        system.wait_until("b resized", lambda: system.provider("b")["capacity"] == "3", timeout=5)
        # Jobs dispatched to a just before the mark may still be on their way to it.
        time.sleep(0.5)
        seen_by_a = len(fakes["a"].requests())
        removed_at = time.monotonic()
        system.wait_until("more load", lambda: served_by(loads, "b", after=removed_at) >= 20)
    finally:
        for load in loads:
            load.stop_flag.set()
        for load in loads:
            load.join(60)

    assert not [p for load in loads for p in load.problems()], system.logs()
    assert len(fakes["a"].requests()) == seen_by_a, "a got requests after its worker removed it"
    assert served_by(loads, "a", after=removed_at) == 0
    # The stale API kept sending work, all of it to b.
    assert sum(1 for *_, pid, at in loads[-1].results if at > removed_at) > 0
    assert served_by(loads, "b", after=added_at) > 0
    system.wait_until("slots given back", lambda: system.in_flight("a") == 0 and system.in_flight("b") == 0)
    catalog = httpx.get(f"{system.api_url}/catalog", timeout=10).json()
    assert [p["id"] for p in catalog["providers"]] == ["b"]
    assert catalog["providers"][0]["capacity"] == 3


def test_an_invalid_file_changes_nothing_and_says_why(system: System) -> None:
    system.write_config(config(system, {"a": 2}))
    system.fake("a", "--tokens", str(TOKENS))
    worker = system.worker("n1")
    api = system.api("api")
    system.wait_available("a")
    system.wait_serving(worker)

    bad = config(system, {"a": 2})
    bad["models"][0]["providers"]["nowhere"] = "x"
    bad["nodes"][0]["providers"][0]["type"] = "nonsense"
    system.write_config(bad)
    hang_up(worker, api)
    for proc in (worker, api):
        system.wait_until(f"{proc.name} refused the file", lambda p=proc: "nothing changed" in p.log())
        log = proc.log()
        assert "$.models[0].providers.nowhere" in log, log
        assert "$.nodes[0].providers[0].type" in log, log
        assert " applied (" not in log

    planned = Planned("after-bad-reload", system.api_url, stream=True, delay_ms=0, tokens=TOKENS)
    assert answer_problem(planned, planned.send()) is None
    assert system.provider("a")["health"] == "available"
    assert system.provider("a")["capacity"] == "2"


def test_a_removed_model_answers_404_and_its_waiting_requests_end(system: System) -> None:
    models = {"m": ["a"], "gone": ["a"]}
    system.write_config(config(system, {"a": 1}, models, queue={"max_queue": 10, "queue_timeout_ms": 4000}))
    system.fake("a", "--delay-ms", "1500", "--tokens", str(TOKENS))
    worker = system.worker("n1")
    api = system.api("api")
    system.wait_available("a")
    system.wait_serving(worker)

    waiting = [Planned(f"w{i}", system.api_url, stream=i % 2 == 1, delay_ms=0, tokens=TOKENS, model="gone")
               for i in range(3)]
    results: dict[str, Any] = {}

    def send(p: Planned) -> None:
        try:
            results[p.marker] = p.send()
        except httpx.HTTPError as exc:
            results[p.marker] = exc

    threads = [threading.Thread(target=send, args=(p,), daemon=True) for p in waiting]
    for t in threads:
        t.start()
        time.sleep(0.05)
    # All three submitted before the reload (a slow client could otherwise arrive after it,
    # and rightly get a 404).
    system.wait_until("one running, two waiting",
                      lambda: system.in_flight("a") == 1 and system.redis.zcard(keys.queue("gone")) == 2)

    system.write_config(config(system, {"a": 1}, {"m": ["a"]}, queue={"max_queue": 10, "queue_timeout_ms": 4000}))
    hang_up(worker, api)
    wait_reloaded(system, api, 1)
    wait_reloaded(system, worker, 1)
    resp = httpx.post(f"{system.api_url}/v1/chat/completions", json=Planned("new", "", False, 0, TOKENS,
                                                                            model="gone").body(), timeout=10)
    assert resp.status_code == 404, resp.text
    assert resp.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{system.api_url}/v1/models", timeout=10).json()["data"][0]["id"] == "m"

    for t in threads:
        t.join(30)
    # Each waiting request got exactly one answer: its own, or the queue's timeout.
    for p in waiting:
        result = results[p.marker]
        assert isinstance(result, tuple), result
        status, text = result
        if status == 200:
            assert answer_problem(p, result) is None
        else:
            assert status == 503, result
            assert "queue_timeout" in text, result
    assert sum(1 for p in waiting if results[p.marker][0] == 200) >= 1  # the one already running
    planned = Planned("still-served", system.api_url, stream=False, delay_ms=0, tokens=TOKENS)
    assert answer_problem(planned, planned.send()) is None
    system.wait_until("nothing left", lambda: system.in_flight("a") == 0 and not system.redis.hlen("{iop}:jobs"))


def test_keys_rotate_on_reload(system: System, tmp_path: Path) -> None:
    def keyed(key: str) -> dict[str, Any]:
        digest = hashlib.sha256(key.encode()).hexdigest()
        return config(system, {"a": 2}, api={"keys": [{"name": "team", "key_sha256": digest}]})

    system.write_config(keyed("old-key"))
    system.fake("a", "--tokens", str(TOKENS))
    worker = system.worker("n1")
    api = system.api("api")
    system.wait_available("a")
    system.wait_serving(worker)
    body = Planned("k", "", False, 0, TOKENS).body()

    def status(key: str) -> int:
        return httpx.post(f"{system.api_url}/v1/chat/completions", json=body, timeout=10,
                          headers={"authorization": f"Bearer {key}"}).status_code

    assert (status("old-key"), status("new-key")) == (200, 401)
    system.write_config(keyed("new-key"))
    hang_up(api)
    wait_reloaded(system, api, 1)
    assert (status("old-key"), status("new-key")) == (401, 200)


@pytest.fixture
def system(tmp_path: Path, redis_server: Any) -> Iterator[System]:
    with System(tmp_path, redis_server) as sys_:
        yield sys_
