"""Streams that outlive their provider (issue 49) through real processes: a streamed answer cut
after output began goes on on another provider of its model, and the caller sees one whole
answer.

Two fake providers of type ``vllm`` (which can continue) serve model ``m``, ``a`` first
(``preference``). ``a``'s stream is cut after ``CUT`` content chunks (the fake's ``cut_after``:
the connection closes mid-stream, the worker reports ``provider_error``), or its worker is
SIGKILLed mid-stream (``worker_lost``, two nodes). The caller's stream must complete: the joined
text is exactly the uninterrupted answer, one role chunk, one ``[DONE]``, the first stream's
``id`` on every chunk, an SSE comment at the splice, the finish chunk's ``iop`` member naming
both providers, the usage of the whole answer (the prompt once: as the uncut answer's). Not
continued -- the stream ends with its error event, as before -- when the model says so
(``continue_streams: false``, ``max_continuations: 0``), for a structured output, or when no
provider of the model can continue (``openai_api``).

Once ``a``'s stream has begun the test takes ``a`` out (its probe fails: ``healthy: false``) and
clears its ``cut_after`` (a request reads it when it arrives), so the continuation goes to ``b``;
should it reach ``a`` before that, ``a`` answers it too, and ``b`` the next one.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from iop.redis_server import RedisServer
from tests.e2e.system import Fake, System, fast_dispatch, http_provider

N = 12  # words of every answer
CUT = 3  # content chunks before the cut
INTERVAL_MS = 300  # between chunks of the stream that is cut: the test acts while it runs
WHOLE = " ".join(f"tok{i}" for i in range(N))
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "count for me"}]


@dataclass
class Streamed:
    """A streamed answer as the caller read it."""

    status: int
    headers: dict[str, str]
    payloads: list[str] = field(default_factory=list)  # data: lines
    comments: list[str] = field(default_factory=list)  # ": ..." lines

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [json.loads(p) for p in self.payloads if p != "[DONE]"]

    def text(self, endpoint: str) -> str:
        pieces = []
        for chunk in self.chunks:
            for choice in chunk.get("choices") or []:
                piece = choice.get("delta", {}).get("content") if endpoint == "chat" else choice.get("text")
                if piece:
                    pieces.append(piece)
        return "".join(pieces)

    def context(self) -> str:
        return f"status {self.status}\ncomments {self.comments}\npayloads:\n" + "\n".join(self.payloads)


def stream(system: System, path: str, body: dict[str, Any],
           on_output: Callable[[], None] | None = None) -> Streamed:
    """POST a streamed request (compact JSON) and read it to its end; ``on_output`` runs once, when
    the first chunk with text arrives."""
    called = False
    with httpx.stream("POST", f"{system.api_url}/v1/{path}", json=body, timeout=60) as resp:
        got = Streamed(resp.status_code, dict(resp.headers))
        for line in resp.iter_lines():
            if line.startswith("data: "):
                payload = line[len("data: "):]
                got.payloads.append(payload)
                if on_output is not None and not called and payload != "[DONE]" and _has_text(payload):
                    called = True
                    on_output()
            elif line.startswith(":"):
                got.comments.append(line)
    return got


def _has_text(payload: str) -> bool:
    try:
        chunk = json.loads(payload)
    except ValueError:
        return False
    return any(c.get("delta", {}).get("content") or c.get("text") for c in chunk.get("choices") or [])


def continuations(fake: Fake) -> list[dict[str, Any]]:
    """The requests ``fake`` received that continue an answer (chat: a trailing assistant
    message; completions: a prompt ending in the answer's words)."""
    found = []
    for r in fake.requests():
        body = r["body"] or {}
        messages = body.get("messages")
        chat = isinstance(messages, list) and messages and messages[-1].get("role") == "assistant"
        if chat or (isinstance(body.get("prompt"), str) and "tok0" in body["prompt"]):
            found.append(body)
    return found


def assert_whole(system: System, got: Streamed, endpoint: str, first: str, last: str, reason: str) -> dict[str, Any]:
    """The checks of a continued answer every test shares; its ``iop`` member."""
    context = got.context() + "\n" + system.logs()
    assert got.status == 200, context
    assert got.payloads.count("[DONE]") == 1, context
    assert got.payloads[-1] == "[DONE]", context
    chunks = got.chunks
    assert not [c for c in chunks if "error" in c], context
    assert got.text(endpoint) == WHOLE, context
    assert len({c["id"] for c in chunks}) == 1, context
    assert len({c["created"] for c in chunks}) == 1, context
    assert {c["model"] for c in chunks} == {"m"}, context
    if endpoint == "chat":
        roles = [c for c in chunks if c["choices"] and "role" in c["choices"][0].get("delta", {})]
        assert len(roles) == 1, context
        assert roles[0] is chunks[0], context
    finished = [c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
    assert len(finished) == 1, context
    assert finished[0]["choices"][0]["finish_reason"] == "stop", context
    iop = finished[0].get("iop")
    assert isinstance(iop, dict), context
    providers = iop["providers"]
    assert providers[0] == first, context
    assert providers[-1] == last, context
    assert iop["continued"] == len(providers) - 1 >= 1, context
    assert len(got.comments) == iop["continued"], context
    assert got.comments[-1] == f": iop continued on {last} after {reason}", context
    assert all(c.startswith(": iop continued on ") for c in got.comments), context
    return iop


def usage_of(got: Streamed) -> dict[str, Any]:
    [last] = [c for c in got.chunks if c.get("usage")]
    assert last["choices"] == [], got.context()
    usage: dict[str, Any] = last["usage"]
    return usage


# --------------------------------------------------------------------------- two providers, one node


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[System]:
    sys_ = System(tmp_path_factory.mktemp("continuation"), redis_server)
    both = {"a": "served", "b": "served"}
    sys_.write_config({
        "dispatch": fast_dispatch(),
        "queue": {"max_queue": 50, "queue_timeout_ms": 30_000},
        "models": [
            {"id": "m", "providers": both, "preference": ["a"]},
            {"id": "off", "providers": both, "preference": ["a"], "continue_streams": False},
            {"id": "zero", "providers": both, "preference": ["a"], "max_continuations": 0},
            # h1 and h2 are openai_api providers on the same two fakes: they cannot continue.
            {"id": "hosted", "providers": {"h1": "served", "h2": "served"}, "preference": ["h1"]},
            {"id": "mixed", "providers": {"a": "served", "h2": "served"}, "preference": ["a"]},
        ],
        "nodes": [{"id": "n1", "providers": [
            http_provider("a", "vllm", sys_.port("fa"), 8, ["served"]),
            http_provider("b", "vllm", sys_.port("fb"), 8, ["served"]),
            http_provider("h1", "openai_api", sys_.port("fa"), 8, ["served"]),
            http_provider("h2", "openai_api", sys_.port("fb"), 8, ["served"]),
        ]}],
    })
    with sys_:
        sys_.fake("fa", "--models", "served", "--tokens", str(N))
        sys_.fake("fb", "--models", "served", "--tokens", str(N))
        sys_.worker("n1")
        sys_.api()
        sys_.wait_available("a", "b", "h1", "h2")
        yield sys_


@pytest.fixture
def system(pair: System) -> Iterator[System]:
    """The pair, every provider in rotation and no cut set; put back so after the test."""
    for fake in pair.fakes.values():
        fake.control(cut_after=None, healthy=True, token_interval_ms=0)
        httpx.delete(f"{fake.url}/_fake/requests", timeout=5)
    pair.wait_available("a", "b", "h1", "h2")
    yield pair
    for fake in pair.fakes.values():
        fake.control(cut_after=None, healthy=True, token_interval_ms=0)
    pair.wait_available("a", "b", "h1", "h2")


def cut_a(system: System) -> Callable[[], None]:
    """Cut ``a``'s next stream after ``CUT`` chunks; what to do once it has begun: take ``a`` out
    and clear the cut, so that the continuation goes to ``b``."""
    fa = system.fakes["fa"]
    fa.control(cut_after=CUT, token_interval_ms=INTERVAL_MS)
    return lambda: fa.control(healthy=False, cut_after=None)


def test_a_cut_chat_stream_goes_on_on_the_other_provider(system: System) -> None:
    body = {"model": "m", "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}}
    uncut = stream(system, "chat/completions", body)
    assert uncut.status == 200, uncut.context()
    assert uncut.headers.get("x-iop-provider") == "a", uncut.context()
    assert uncut.text("chat") == WHOLE, uncut.context()
    assert not uncut.comments, uncut.context()
    assert usage_of(uncut)["completion_tokens"] == N

    got = stream(system, "chat/completions", body, on_output=cut_a(system))
    assert_whole(system, got, "chat", "a", "b", "provider_error")
    # The prompt counted once (the continuation's held the text so far), every token generated.
    assert usage_of(got) == usage_of(uncut), got.context()
    # b was asked to continue the text a had written, with vLLM's flags.
    [asked] = continuations(system.fakes["fb"])
    assert asked["messages"][:-1] == MESSAGES
    assert asked["messages"][-1] == {"role": "assistant", "content": "".join(f"tok{i} " for i in range(CUT))}
    assert asked["continue_final_message"] is True
    assert asked["add_generation_prompt"] is False


def test_a_cut_completions_stream_goes_on_on_the_other_provider(system: System) -> None:
    body = {"model": "m", "prompt": "Count:", "max_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}}
    uncut = stream(system, "completions", body)
    assert uncut.status == 200, uncut.context()
    assert uncut.text("completions") == WHOLE, uncut.context()

    got = stream(system, "completions", body, on_output=cut_a(system))
    assert_whole(system, got, "completions", "a", "b", "provider_error")
    assert usage_of(got) == usage_of(uncut), got.context()
    [asked] = continuations(system.fakes["fb"])
    so_far = "".join(f"tok{i} " for i in range(CUT))
    assert asked["prompt"] == "Count:" + so_far
    assert asked["max_tokens"] == 50 - CUT


def test_max_tokens_is_reduced_by_what_was_used(system: System) -> None:
    body = {"model": "m", "messages": MESSAGES, "stream": True, "max_tokens": 100, "max_completion_tokens": 90}
    got = stream(system, "chat/completions", body, on_output=cut_a(system))
    assert_whole(system, got, "chat", "a", "b", "provider_error")
    [asked] = continuations(system.fakes["fb"])
    assert (asked["max_tokens"], asked["max_completion_tokens"]) == (100 - CUT, 90 - CUT)


def test_a_continuation_skips_the_providers_that_cannot_continue(system: System) -> None:
    """Model ``mixed``: ``a`` (vllm) and ``h2`` (openai_api, on fake fb). The continuation goes
    to ``a`` again -- once it is back -- never to ``h2``."""
    fa = system.fakes["fa"]
    fa.control(cut_after=CUT, token_interval_ms=INTERVAL_MS)
    body = {"model": "mixed", "messages": MESSAGES, "stream": True}
    got = stream(system, "chat/completions", body, on_output=lambda: fa.control(cut_after=None))
    context = got.context() + "\n" + system.logs()
    assert got.status == 200, context
    assert got.payloads[-1] == "[DONE]", context
    assert got.text("chat") == WHOLE, context
    finished = [c for c in got.chunks if c["choices"] and c["choices"][0].get("finish_reason")]
    assert finished, context
    assert set(finished[0]["iop"]["providers"]) == {"a"}, context
    assert system.fakes["fb"].requests() == [], context


def test_a_continuation_whose_provider_fails_before_its_output_goes_to_another(system: System) -> None:
    """Once ``a``'s stream has begun it answers 502 to anything new. If the continuation reaches
    ``a`` (preferred; whether its worker has taken ``a`` out after the cut by then is a race), ``a``
    fails it before any output and it is retried on ``b``, like any job: its wait must not take
    that requeue for a stream lost after output (it did, once: the caller got an error). Either
    way the caller gets the whole answer, continued by ``b``."""
    fa = system.fakes["fa"]
    fa.control(cut_after=CUT, token_interval_ms=INTERVAL_MS)
    body = {"model": "m", "messages": MESSAGES, "stream": True}
    try:
        got = stream(system, "chat/completions", body, on_output=lambda: fa.control(cut_after=None, fail_status=502))
    finally:
        fa.control(fail_status=None)
    assert_whole(system, got, "chat", "a", "b", "provider_error")
    assert len(continuations(fa)) <= 1, got.context()
    assert len(continuations(system.fakes["fb"])) == 1, got.context()


@pytest.mark.parametrize(("model", "extra"), [
    pytest.param("off", {}, id="continue_streams-false"),
    pytest.param("zero", {}, id="max_continuations-0"),
    pytest.param("m", {"response_format": {"type": "json_object"}}, id="json_object"),
    pytest.param("hosted", {}, id="openai_api-only"),
])
def test_not_continued_the_stream_ends_with_its_error(system: System, model: str, extra: dict[str, Any]) -> None:
    system.fakes["fa"].control(cut_after=CUT, token_interval_ms=50)
    body = {"model": model, "messages": MESSAGES, "stream": True, **extra}
    got = stream(system, "chat/completions", body)
    context = got.context() + "\n" + system.logs()
    assert got.status == 200, context
    assert "[DONE]" not in got.payloads, context
    *chunks, last = [json.loads(p) for p in got.payloads]
    assert last["error"]["code"] == "provider_error", context
    # Output had begun (the role chunk and tok0 come in one piece): what reached the worker of it.
    contents = [c["choices"][0]["delta"].get("content") for c in chunks]
    assert len(contents) >= 2, context
    assert contents == ["", *(f"tok{i} " for i in range(CUT))][:len(contents)], context
    assert not got.comments, context
    assert continuations(system.fakes["fa"]) == [], context
    assert continuations(system.fakes["fb"]) == [], context


def test_not_continued_a_cut_inside_a_tool_call() -> None:
    pytest.skip("the fake provider does not stream tool_calls: a cut inside one cannot be made here "
                "(api/continuation.py Transcript.why_not is unit-tested in tests/api)")


def continuation_counts(system: System) -> dict[tuple[str, str, str], float]:
    text = httpx.get(f"{system.api_url}/metrics", timeout=10).text
    found: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "iop_continuations_total":
                found[(s.labels["model"], s.labels["reason"], s.labels["outcome"])] = s.value
    return found


def test_metrics_count_continuations_and_refusals(system: System) -> None:
    before = continuation_counts(system)
    got = stream(system, "chat/completions", {"model": "m", "messages": MESSAGES, "stream": True},
                 on_output=cut_a(system))
    assert_whole(system, got, "chat", "a", "b", "provider_error")
    system.fakes["fa"].control(cut_after=CUT, healthy=True, token_interval_ms=50)
    system.wait_available("a")
    refused = stream(system, "chat/completions", {"model": "m", "messages": MESSAGES, "stream": True,
                                                  "response_format": {"type": "json_object"}})
    assert json.loads(refused.payloads[-1])["error"]["code"] == "provider_error", refused.context()
    after = continuation_counts(system)
    key = ("m", "provider_error", "continued")
    assert after.get(key, 0) - before.get(key, 0) >= 1, after
    refusals = {k: v - before.get(k, 0) for k, v in after.items()
                if k[:2] == ("m", "provider_error") and k[2].startswith("refused")}
    assert sum(refusals.values()) == 1, after
    [(_, _, outcome)] = [k for k, v in refusals.items() if v]
    assert "structured output" in outcome, after


# --------------------------------------------------------------------------- a worker killed


@pytest.fixture
def two_nodes(tmp_path: Path) -> Iterator[System]:
    """``a`` on node n1, ``b`` on node n2, a worker each; a Redis of their own (the pair's
    processes, a worker of a node n1 too, still run on the shared one)."""
    with RedisServer() as redis_server, System(tmp_path, redis_server) as sys_:
        sys_.write_config({
            "dispatch": fast_dispatch(),
            "queue": {"max_queue": 50, "queue_timeout_ms": 30_000},
            "models": [{"id": "m", "providers": {"a": "served", "b": "served"}, "preference": ["a"]}],
            "nodes": [
                {"id": "n1", "providers": [http_provider("a", "vllm", sys_.port("fa"), 8, ["served"])]},
                {"id": "n2", "providers": [http_provider("b", "vllm", sys_.port("fb"), 8, ["served"])]},
            ],
        })
        sys_.fake("fa", "--models", "served", "--tokens", str(N))
        sys_.fake("fb", "--models", "served", "--tokens", str(N))
        sys_.worker("n1")
        sys_.worker("n2")
        sys_.api()
        sys_.wait_available("a", "b")
        yield sys_


def test_a_stream_whose_worker_is_killed_goes_on_on_the_other_node(two_nodes: System) -> None:
    system = two_nodes
    body = {"model": "m", "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}}
    uncut = stream(system, "chat/completions", body)
    assert uncut.headers.get("x-iop-provider") == "a", uncut.context()
    assert uncut.text("chat") == WHOLE, uncut.context()

    system.fakes["fa"].control(token_interval_ms=INTERVAL_MS)
    doomed = next(p for p in system.procs if p.name == "worker-n1")
    got = stream(system, "chat/completions", body, on_output=doomed.kill)
    assert not doomed.alive()
    assert_whole(system, got, "chat", "a", "b", "worker_lost")
    assert usage_of(got) == usage_of(uncut), got.context()
    [asked] = continuations(system.fakes["fb"])
    given = asked["messages"][-1]["content"]
    assert given, asked
    assert WHOLE.startswith(given), asked
