"""Every relayed endpoint end to end, through real processes (API + worker + fake providers
+ a private Redis), with the official ``openai`` and ``anthropic`` SDKs as callers where
they exist: Responses (JSON, typed streams, stored responses pinned to their provider),
Anthropic Messages, count_tokens, rerank, score, tokenize, audio, images; endpoint-aware
selection; and relaying faithfully (no invented end, retry on another provider, stale
keep-alive connections, the provider's headers).

One system serves the whole module; each test puts the fakes it changed back as they were.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import openai
import pytest

from dispatcher import keys
from dispatcher.endpoints import ENDPOINTS
from iop.redis_server import RedisServer
from tests.e2e.system import Fake, System, api_with_config, fast_dispatch, http_provider, sse_payloads

KEY = "caller-key-endpoints"
KEYS_ENV = "IOP_TEST_ENDPOINT_KEYS"
AUTH = {"authorization": f"Bearer {KEY}"}
TOKENS = 6
WORDS = " ".join(f"tok{i}" for i in range(TOKENS))

RESP = "gpt-resp"  # Responses, on two providers that each keep their own store
ALIAS = "all-in-one"  # one vllm provider listing every endpoint
MIXED = "mixed"  # p-a serves chat only, p-b chat and rerank
QUIRKY = "quirky"
RETRY = "retry"  # p-bad (tried first: the lower id) and p-good
BAD_ONLY = "bad-only"

# fake name -> the served names it reports
FAKES = {
    "r1": "resp-1",
    "r2": "resp-2",
    "all": "all-served",
    "ab": "a-only,a-mixed,b-mixed",
    "quirk": "quirk-served",
    "bad": "bad-served",
    "good": "good-served",
}
DEFAULTS: dict[str, Any] = {
    "delay_ms": 0, "tokens": TOKENS, "token_interval_ms": 0, "fail_status": None, "hang": False, "garbage": False,
    "healthy": True, "stream_no_done": False, "empty_200": False, "close_idle_keepalive": False,
}
PROVIDERS = ["p-r1", "p-r2", "p-all", "p-a", "p-b", "p-quirk", "p-bad", "p-good"]
MESSAGES: Any = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[System]:
    sys_ = System(tmp_path_factory.mktemp("endpoints"), redis_server)
    sys_.env[KEYS_ENV] = KEY

    def vllm(pid: str, fake: str, models: list[str], **extra: Any) -> dict[str, Any]:
        return http_provider(pid, "vllm", sys_.port(fake), 2, models, timeout_s=15, **extra)

    sys_.write_config({
        "api": {"api_keys_env": KEYS_ENV},
        "queue": {"max_queue": 50, "queue_timeout_ms": 15_000},
        "dispatch": fast_dispatch(lease_ms=3000),
        "models": [
            {"id": RESP, "providers": {"p-r1": "resp-1", "p-r2": "resp-2"}},
            {"id": ALIAS, "providers": {"p-all": "all-served"}},
            {"id": "chat-only", "providers": {"p-a": "a-only"}},
            {"id": MIXED, "providers": {"p-a": "a-mixed", "p-b": "b-mixed"}},
            {"id": QUIRKY, "providers": {"p-quirk": "quirk-served"}},
            {"id": RETRY, "providers": {"p-bad": "bad-served", "p-good": "good-served"}},
            {"id": BAD_ONLY, "providers": {"p-bad": "bad-served"}},
        ],
        "nodes": [{"id": "n1", "providers": [
            vllm("p-r1", "r1", ["resp-1"]),
            vllm("p-r2", "r2", ["resp-2"]),
            vllm("p-all", "all", ["all-served"], endpoints=list(ENDPOINTS)),
            vllm("p-a", "ab", ["a-only", "a-mixed"], endpoints=["chat/completions"]),
            vllm("p-b", "ab", ["b-mixed"], endpoints=["chat/completions", "rerank"]),
            vllm("p-quirk", "quirk", ["quirk-served"]),
            vllm("p-bad", "bad", ["bad-served"]),
            vllm("p-good", "good", ["good-served"]),
        ]}],
    })
    try:
        # Seven fakes take a second each to start: start them side by side.
        with ThreadPoolExecutor(len(FAKES)) as pool:
            started = [pool.submit(sys_.fake, name, "--models", models, "--tokens", str(TOKENS))
                       for name, models in FAKES.items()]
            sys_.worker("n1")
            sys_.api()
            for future in started:
                future.result()
        sys_.wait_available(*PROVIDERS)
        yield sys_
    finally:
        sys_.close()


@pytest.fixture(autouse=True)
def _restore(request: pytest.FixtureRequest, system: System) -> Iterator[None]:
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed > failed:
        print(system.logs())
    for fake in system.fakes.values():
        fake.control(**DEFAULTS)
    system.wait_until("every slot released", lambda: all(system.in_flight(p) == 0 for p in PROVIDERS), timeout=15)


@pytest.fixture
def client(system: System) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{system.api_url}/v1", api_key=KEY, max_retries=0, timeout=30)


@pytest.fixture
def claude(system: System) -> anthropic.Anthropic:
    # This SDK sends an api_key as `Authorization: Bearer`; Anthropic's own header is x-api-key.
    return anthropic.Anthropic(base_url=system.api_url, default_headers={"x-api-key": KEY}, max_retries=0,
                               timeout=30)


def post(system: System, path: str, body: Any, *, url: str | None = None, headers: dict[str, str] = AUTH
         ) -> httpx.Response:
    return httpx.post(f"{url or system.api_url}/v1/{path}", json=body, headers=headers, timeout=30)


def stream_text(system: System, path: str, body: Any) -> tuple[httpx.Response, str]:
    with httpx.stream("POST", f"{system.api_url}/v1/{path}", json=body, headers=AUTH, timeout=30) as resp:
        return resp, resp.read().decode()


def seen(fake: Fake, path: str) -> list[dict[str, Any]]:
    return [r for r in fake.requests() if r["path"] == path]


def forget(*fakes: Fake) -> None:
    for fake in fakes:
        httpx.delete(f"{fake.url}/_fake/requests", timeout=5).raise_for_status()


def event_names(text: str) -> list[str]:
    return [line[len("event: "):] for line in text.splitlines() if line.startswith("event: ")]


# ------------------------------------------------------------------------------------------- Responses


def test_responses_json_names_the_alias(client: openai.OpenAI, system: System) -> None:
    raw = client.responses.with_raw_response.create(model=RESP, input="hello")
    response = raw.parse()
    assert response.model == RESP
    assert response.output_text == WORDS
    provider = raw.headers["x-iop-provider"]
    served = {"p-r1": "resp-1", "p-r2": "resp-2"}[provider]
    assert raw.headers["x-iop-served-model"] == served
    made = seen(system.fakes[provider[2:]], "/v1/responses")
    assert made, "the provider that answered never saw the request"
    assert made[-1]["model"] == served
    assert RESP not in {r["model"] for f in ("r1", "r2") for r in system.fakes[f].requests()}


def test_responses_stream_events_in_order(client: openai.OpenAI, system: System) -> None:
    events = list(client.responses.create(model=RESP, input="hello", stream=True))
    expected = [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * TOKENS,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]
    assert [e.type for e in events] == expected
    assert [e.sequence_number for e in events] == list(range(len(expected)))
    carrying = [e for e in events if hasattr(e, "response")]
    assert [e.type for e in carrying] == ["response.created", "response.in_progress", "response.completed"]
    assert {e.response.model for e in carrying} == {RESP}
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == WORDS

    # The wire itself: typed events, each with its `event:` line, and no [DONE] (OpenAI sends none).
    resp, text = stream_text(system, "responses", {"model": RESP, "input": "hello", "stream": True})
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers["x-iop-provider"] in {"p-r1", "p-r2"}
    payloads = [json.loads(p) for p in sse_payloads(text)]
    assert event_names(text) == expected == [p["type"] for p in payloads]
    assert "[DONE]" not in text
    assert all(p["response"]["model"] == RESP for p in payloads if "response" in p)
    assert "resp-1" not in text
    assert "resp-2" not in text


def _hold_p_r1(system: System) -> threading.Thread:
    """A chat request of RESP held on p-r1 (the idle pool's first choice), so that the next
    request goes to p-r2; release with ``r1.control(hang=False)``."""
    r1 = system.fakes["r1"]
    r1.control(hang=True)
    thread = threading.Thread(target=post, args=(system, "chat/completions", {"model": RESP, "messages": MESSAGES}))
    thread.start()
    system.wait_until("p-r1 holds a request", lambda: r1.stats()["in_flight"] == 1, timeout=10)
    assert system.in_flight("p-r1") == 1
    return thread


def test_stored_response_calls_go_to_the_provider_that_made_it(client: openai.OpenAI, system: System) -> None:
    r1, r2 = system.fakes["r1"], system.fakes["r2"]
    holder = _hold_p_r1(system)
    try:
        first = client.responses.with_raw_response.create(model=RESP, input="first turn")
    finally:
        r1.control(hang=False)
        holder.join(timeout=30)
    assert first.headers["x-iop-provider"] == "p-r2"
    system.wait_until("p-r1 idle", lambda: system.in_flight("p-r1") == 0, timeout=10)
    forget(r1, r2)
    # Idle again, the pool's own choice is p-r1 (the lower id) ...
    assert client.responses.with_raw_response.create(model=RESP, input="x", store=False).headers[
        "x-iop-provider"] == "p-r1"
    forget(r1)

    # ... but every turn of the conversation goes where its state is.
    previous = first.parse().id
    ids = [previous]
    for turn in range(4):
        raw = client.responses.with_raw_response.create(model=RESP, input=f"turn {turn}",
                                                        previous_response_id=previous)
        assert raw.headers["x-iop-provider"] == "p-r2"
        response = raw.parse()
        assert response.previous_response_id == previous
        assert response.model == RESP
        previous = response.id
        ids.append(previous)

    got = client.responses.with_raw_response.retrieve(previous)
    assert got.headers["x-iop-provider"] == "p-r2"
    assert got.parse().id == previous
    assert got.parse().model == RESP
    items = client.responses.input_items.with_raw_response.list(previous, order="asc")
    assert items.headers["x-iop-provider"] == "p-r2"
    assert [item.model_dump()["content"][0]["text"] for item in items.parse().data] == ["turn 3"]
    deleted = client.responses.with_raw_response.delete(ids[1])
    assert deleted.headers["x-iop-provider"] == "p-r2"
    assert deleted.http_response.json() == {"id": ids[1], "object": "response", "deleted": True}
    # iop's own 404: the delete made it forget the id (the provider is not asked again).
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(ids[1])
    assert info.value.code == "response_not_found"

    assert r1.requests() == [], "the provider without the state saw some of the conversation"
    calls = [(r.get("method", "POST"), r["path"]) for r in r2.requests()]
    assert calls == [
        *[("POST", "/v1/responses")] * 4,
        ("GET", f"/v1/responses/{previous}"),
        ("GET", f"/v1/responses/{previous}/input_items"),
        ("DELETE", f"/v1/responses/{ids[1]}"),
    ]
    assert [r["body"]["previous_response_id"] for r in r2.requests()[:4]] == ids[:4]
    # iop noted every id, and which provider made it, but the deleted one.
    noted = {i: system.redis.hget(keys.RESPONSES, i) for i in [ids[0], *ids[2:]]}
    assert {v.split(b"\t")[0] if isinstance(v, bytes) else v for v in noted.values()} == {b"p-r2"}, noted
    assert system.redis.hget(keys.RESPONSES, ids[1]) is None
    assert system.redis.zscore(keys.RESPONSES_BY_EXPIRY, ids[1]) is None


def test_unknown_response_id_is_404(client: openai.OpenAI, system: System) -> None:
    forget(*system.fakes.values())
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve("resp_never_made")
    assert info.value.code == "response_not_found"
    for method, path in (("GET", "resp_never_made/input_items"), ("DELETE", "resp_never_made"),
                         ("POST", "resp_never_made/cancel")):
        resp = httpx.request(method, f"{system.api_url}/v1/responses/{path}", headers=AUTH, timeout=10)
        assert resp.status_code == 404, (method, path, resp.text)
        assert resp.json()["error"]["code"] == "response_not_found"
    resp = post(system, "responses", {"model": RESP, "input": "x", "previous_response_id": "resp_never_made"})
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "response_not_found"
    assert resp.json()["error"]["param"] == "previous_response_id"
    assert all(f.requests() == [] for f in system.fakes.values())


def test_response_provider_down_is_503_at_once(client: openai.OpenAI, system: System) -> None:
    raw = client.responses.with_raw_response.create(model=RESP, input="remember me")
    holder = raw.headers["x-iop-provider"]
    other = "p-r2" if holder == "p-r1" else "p-r1"
    fake = system.fakes[holder[2:]]
    response_id = raw.parse().id
    fake.control(healthy=False)
    try:
        system.wait_until(f"{holder} marked down", lambda: system.provider(holder).get("health") != "available",
                          timeout=15)
        for method, path, body in (
            ("GET", f"responses/{response_id}", None),
            ("GET", f"responses/{response_id}/input_items", None),
            ("POST", "responses", {"model": RESP, "input": "next", "previous_response_id": response_id}),
        ):
            started = time.monotonic()
            resp = httpx.request(method, f"{system.api_url}/v1/{path}", json=body, headers=AUTH, timeout=30)
            elapsed = time.monotonic() - started
            assert resp.status_code == 503, resp.text
            assert resp.json()["error"]["code"] == "response_provider_unavailable"
            assert int(resp.headers["retry-after"]) >= 1
            assert elapsed < 3, f"{method} {path} waited {elapsed:.1f}s: a queue timeout, not an answer at once"
        # A new conversation is served by the provider that is up.
        fresh = client.responses.with_raw_response.create(model=RESP, input="new")
        assert fresh.headers["x-iop-provider"] == other
    finally:
        fake.control(healthy=True)
        system.wait_available(holder)
    again = client.responses.with_raw_response.retrieve(response_id)
    assert again.headers["x-iop-provider"] == holder


def test_response_provider_gone_is_409(client: openai.OpenAI, system: System) -> None:
    raw = client.responses.with_raw_response.create(model=RESP, input="remember me")
    holder = raw.headers["x-iop-provider"]
    response_id = raw.parse().id
    # A second API on the same Redis whose config no longer has the provider holding it.
    config = copy.deepcopy(system.config)
    for model in config["models"]:
        model["providers"].pop(holder, None)
    for node in config["nodes"]:
        node["providers"] = [p for p in node["providers"] if p["id"] != holder]
    proc, url = api_with_config(system, "api-without-holder", config)
    try:
        resp = httpx.get(f"{url}/v1/responses/{response_id}", headers=AUTH, timeout=30)
        assert resp.status_code == 409, resp.text
        assert resp.json()["error"]["code"] == "response_provider_gone"
        resp = post(system, "responses", {"model": RESP, "input": "next", "previous_response_id": response_id},
                    url=url)
        assert resp.status_code == 409, resp.text
        assert resp.json()["error"]["code"] == "response_provider_gone"
        # The gateway that still has it answers as before.
        assert client.responses.with_raw_response.retrieve(response_id).headers["x-iop-provider"] == holder
    finally:
        proc.stop()


# ------------------------------------------------------------------------------------ Anthropic Messages


def test_messages_with_the_anthropic_sdk(claude: anthropic.Anthropic, system: System) -> None:
    fake = system.fakes["all"]
    forget(fake)
    beta = "fake-feature-2025-01-01"
    raw = claude.messages.with_raw_response.create(
        model=ALIAS, max_tokens=64, messages=MESSAGES, extra_headers={"anthropic-beta": beta})
    message = raw.parse()
    assert message.model == ALIAS
    assert message.content[0].text == WORDS  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn"
    assert raw.headers["anthropic-ratelimit-requests-remaining"] == "99"
    assert raw.headers["request-id"].startswith("req_fake")
    assert raw.headers["x-iop-provider"] == "p-all"
    version = raw.http_request.headers["anthropic-version"]

    with claude.messages.stream(model=ALIAS, max_tokens=64, messages=MESSAGES,
                                extra_headers={"anthropic-beta": beta}) as stream:
        events = list(stream)
        final = stream.get_final_message()
        headers = stream.response.headers
    starts = [e for e in events if e.type == "message_start"]
    assert len(starts) == 1
    assert starts[0].message.model == ALIAS
    assert final.model == ALIAS
    assert final.content[0].text == WORDS  # type: ignore[union-attr]
    assert events[-1].type == "message_stop"
    assert headers["anthropic-ratelimit-requests-remaining"] == "99"
    assert headers["request-id"].startswith("req_fake")

    recorded = seen(fake, "/v1/messages")
    assert [r["stream"] for r in recorded] == [False, True]
    for record in recorded:
        assert record["model"] == "all-served"
        assert record["headers"] == {"anthropic-version": version, "anthropic-beta": beta}
        assert record["authorization"] is None  # the caller's key never reaches a provider

    # The wire: event lines, message_start's model renamed, no [DONE].
    body = {"model": ALIAS, "max_tokens": 16, "messages": MESSAGES, "stream": True}
    with httpx.stream("POST", f"{system.api_url}/v1/messages", json=body, timeout=30,
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}) as resp:
        text = resp.read().decode()
    assert resp.status_code == 200
    assert event_names(text)[0] == "message_start"
    assert event_names(text)[-1] == "message_stop"
    assert json.loads(sse_payloads(text)[0])["message"]["model"] == ALIAS
    assert "[DONE]" not in text


def test_messages_errors_are_anthropic_shaped(claude: anthropic.Anthropic, system: System) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="no-such-model", max_tokens=8, messages=MESSAGES)
    assert missing.value.status_code == 404
    body = missing.value.body
    assert isinstance(body, dict)
    assert body["type"] == "error"
    assert body["error"]["type"] == "not_found_error"
    assert "no-such-model" in body["error"]["message"]

    wrong = anthropic.Anthropic(base_url=system.api_url, default_headers={"x-api-key": "not-a-key"}, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        wrong.messages.create(model=ALIAS, max_tokens=8, messages=MESSAGES)
    assert denied.value.status_code == 401
    assert isinstance(denied.value.body, dict)
    assert denied.value.body["type"] == "error"
    assert denied.value.body["error"]["type"] == "authentication_error"

    resp = httpx.post(f"{system.api_url}/v1/messages/count_tokens", json={"model": "nope", "messages": MESSAGES},
                      headers={"x-api-key": KEY}, timeout=10)
    assert resp.status_code == 404
    assert resp.json()["type"] == "error"
    assert resp.json()["error"]["type"] == "not_found_error"


# ---------------------------------------------------------------- count_tokens, rerank, score, tokenize


def direct(fake: Fake, path: str, body: dict[str, Any], served: str = "all-served") -> dict[str, Any]:
    """What the provider itself answers ``body`` on ``path``, asked with its served name."""
    resp = httpx.post(f"{fake.url}{path}", json={**body, "model": served}, timeout=30)
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    return answer


def same_answer(got: dict[str, Any], expected: dict[str, Any]) -> dict[str, Any]:
    """``expected`` as iop should relay it: ``model`` renamed where the provider put one, and
    ``got``'s volatile ``id`` / ``created``."""
    expected = {**expected, **{k: got[k] for k in ("id", "created") if k in expected and k in got}}
    if "model" in expected:
        expected["model"] = ALIAS
    return expected


def test_rerank_score_tokenize_pass_through(system: System) -> None:
    fake = system.fakes["all"]
    forget(fake)
    rerank_body = {"model": ALIAS, "query": "red apple", "documents": ["green pear", "a red apple pie", "blue sky"],
                   "top_n": 2}
    rerank = post(system, "rerank", rerank_body)
    assert rerank.status_code == 200, rerank.text
    ranked = rerank.json()
    assert ranked["model"] == ALIAS
    assert [r["index"] for r in ranked["results"]] == [1, 0]
    assert ranked["results"][0]["document"] == {"text": "a red apple pie"}
    assert ranked["results"][0]["relevance_score"] > 0
    assert ranked == same_answer(ranked, direct(fake, "/v1/rerank", rerank_body))

    score_body = {"model": ALIAS, "text_1": "red apple", "text_2": ["red apple", "blue sky"]}
    score = post(system, "score", score_body)
    assert score.status_code == 200, score.text
    scored = score.json()
    assert scored["model"] == ALIAS
    assert scored["object"] == "list"
    assert [(d["index"], d["score"]) for d in scored["data"]] == [(0, 1.0), (1, 0.0)]
    assert scored == same_answer(scored, direct(fake, "/v1/score", score_body))

    tokenized = post(system, "tokenize", {"model": ALIAS, "prompt": "tok3 tok7 tok1"})
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["tokens"] == [3, 7, 1]
    assert tokenized.json()["count"] == 3
    detokenized = post(system, "detokenize", {"model": ALIAS, "tokens": [3, 7]})
    assert detokenized.status_code == 200, detokenized.text
    assert detokenized.json()["prompt"] == "tok3 tok7"

    # vLLM serves tokenize / detokenize at its root, not under /v1.
    assert [(r["path"], r["model"]) for r in fake.requests()] == [
        ("/v1/rerank", "all-served"),
        ("/v1/rerank", "all-served"),  # the direct call
        ("/v1/score", "all-served"),
        ("/v1/score", "all-served"),
        ("/tokenize", "all-served"),
        ("/detokenize", "all-served"),
    ]


def test_count_tokens(claude: anthropic.Anthropic, system: System) -> None:
    fake = system.fakes["all"]
    forget(fake)
    messages: Any = [{"role": "user", "content": "one two three"}]
    raw = claude.messages.with_raw_response.count_tokens(model=ALIAS, messages=messages, system="four five")
    assert raw.parse().input_tokens == 5
    assert raw.headers["x-iop-provider"] == "p-all"
    assert raw.headers["anthropic-ratelimit-requests-remaining"] == "99"
    (record,) = seen(fake, "/v1/messages/count_tokens")
    assert record["model"] == "all-served"
    assert record["headers"]["anthropic-version"] == raw.http_request.headers["anthropic-version"]


def test_answers_without_a_model_are_not_given_one(system: System) -> None:
    """count_tokens, tokenize, detokenize and images answers carry no ``model``: relayed as
    they came, they get none either (only a ``model`` the provider sent is renamed)."""
    fake = system.fakes["all"]
    cases: list[tuple[str, dict[str, Any]]] = [
        ("messages/count_tokens", {"model": ALIAS, "messages": [{"role": "user", "content": "one two"}]}),
        ("tokenize", {"model": ALIAS, "prompt": "tok3 tok7 tok1"}),
        ("detokenize", {"model": ALIAS, "tokens": [3, 7]}),
        ("images/generations", {"model": ALIAS, "prompt": "a red square"}),
    ]
    added = {}
    for path, body in cases:
        upstream = "/" + path if path in ("tokenize", "detokenize") else "/v1/" + path
        expected = direct(fake, upstream, body)
        resp = post(system, path, body, headers={**AUTH, "x-api-key": KEY})
        assert resp.status_code == 200, resp.text
        got = resp.json()
        assert {k: v for k, v in got.items() if k != "model"} == same_answer(got, expected), path
        if "model" in got:
            added[path] = got["model"]
    assert added == {}, f"iop added a `model` the provider's answer did not have: {added}"

# ------------------------------------------------------------------------------------------ audio, images


def test_audio_transcription_relays_the_file_byte_for_byte(client: openai.OpenAI, system: System) -> None:
    fake = system.fakes["all"]
    forget(fake)
    audio = os.urandom(6000)
    upload = ("clip.wav", audio, "audio/wav")

    result = client.audio.transcriptions.create(model=ALIAS, file=upload)
    assert result.text == "fake transcript of 6000 bytes by all-served"
    (record,) = seen(fake, "/v1/audio/transcriptions")
    assert record["model"] == "all-served"
    assert record["body"]["model"] == "all-served"
    assert record["body"]["file"]["size"] == len(audio)
    assert record["body"]["file"]["sha256"] == hashlib.sha256(audio).hexdigest()
    assert record["body"]["file"]["filename"] == "clip.wav"

    raw = client.audio.transcriptions.with_raw_response.create(model=ALIAS, file=upload, response_format="text")
    assert raw.headers["content-type"].startswith("text/plain")
    assert raw.http_response.text == "fake transcript of 6000 bytes by all-served\n"

    events = list(client.audio.transcriptions.create(model=ALIAS, file=upload, stream=True))
    assert [e.type for e in events][-1] == "transcript.text.done"
    assert {e.type for e in events[:-1]} == {"transcript.text.delta"}
    assert "".join(e.delta for e in events[:-1]) == events[-1].text  # type: ignore[union-attr]
    assert events[-1].text == "fake transcript of 6000 bytes by all-served"  # type: ignore[union-attr]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # this SDK deprecates translations
        translated = client.audio.translations.create(model=ALIAS, file=upload)
    assert translated.text == "fake translation of 6000 bytes by all-served"
    records = seen(fake, "/v1/audio/transcriptions") + seen(fake, "/v1/audio/translations")
    assert len(records) == 4
    assert {r["body"]["file"]["sha256"] for r in records} == {hashlib.sha256(audio).hexdigest()}
    assert records[2]["body"]["stream"] == "true"


def test_audio_speech_streams_the_binary_body(client: openai.OpenAI, system: System) -> None:
    fake = system.fakes["all"]
    fake.control(tokens=5, token_interval_ms=150)
    words = "the quick brown fox jumps over the lazy dog"
    direct = httpx.post(f"{fake.url}/v1/audio/speech", timeout=30,
                        json={"model": "all-served", "input": words, "voice": "alloy", "response_format": "wav"})
    assert direct.status_code == 200
    pieces: list[tuple[float, int]] = []
    body = bytearray()
    with client.audio.speech.with_streaming_response.create(model=ALIAS, input=words, voice="alloy",
                                                            response_format="wav") as resp:
        assert resp.headers["content-type"] == "audio/wav"
        assert resp.headers["x-iop-provider"] == "p-all"
        for piece in resp.iter_bytes():
            pieces.append((time.monotonic(), len(piece)))
            body += piece
    assert bytes(body) == direct.content
    assert len(body) == int(direct.headers["x-fake-audio-bytes"])
    assert body[:4] == b"RIFF"
    # Paced by the provider, it arrived as it was produced, not in one piece at the end.
    assert len(pieces) > 1, pieces
    assert pieces[-1][0] - pieces[0][0] > 0.2, pieces
    assert seen(fake, "/v1/audio/speech")[-1]["model"] == "all-served"


def test_images_pass_through(client: openai.OpenAI, system: System) -> None:
    fake = system.fakes["all"]
    result = client.images.generate(model=ALIAS, prompt="a red square", n=2)
    direct = httpx.post(f"{fake.url}/v1/images/generations", timeout=30,
                        json={"model": "all-served", "prompt": "a red square", "n": 2}).json()
    assert [(d.b64_json, d.revised_prompt) for d in result.data or []] == [
        (d["b64_json"], d["revised_prompt"]) for d in direct["data"]]
    assert len(result.data or []) == 2
    assert seen(fake, "/v1/images/generations")[-2]["model"] == "all-served"


# ------------------------------------------------------------------------------- endpoint-aware selection


def test_unsupported_endpoint_is_400_at_once(system: System) -> None:
    fake = system.fakes["ab"]
    forget(fake)
    started = time.monotonic()
    resp = post(system, "rerank", {"model": "chat-only", "query": "q", "documents": ["d"]})
    elapsed = time.monotonic() - started
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "unsupported_endpoint"
    assert elapsed < 2
    # Nothing was queued, nothing reached a provider.
    assert [k for k in system.redis.scan_iter(match=keys.queue("chat-only") + "*") if system.redis.zcard(k)] == []
    assert system.redis.hlen(keys.JOBS) == 0
    assert fake.requests() == []
    # Its chat still works.
    assert post(system, "chat/completions", {"model": "chat-only", "messages": MESSAGES}).status_code == 200


def test_requests_go_only_to_providers_that_serve_the_endpoint(system: System) -> None:
    fake = system.fakes["ab"]
    forget(fake)
    body = {"model": MIXED, "query": "red apple", "documents": ["red apple", "pear"]}
    # p-a (the lower id) is idle, and is the pool's choice for chat ...
    assert post(system, "chat/completions", {"model": MIXED, "messages": MESSAGES}).headers[
        "x-iop-provider"] == "p-a"
    # ... but never for rerank, which it does not serve.
    for _ in range(3):
        resp = post(system, "rerank", body)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-iop-provider"] == "p-b"
        assert resp.json()["model"] == MIXED

    # Concurrent, four reranks fill p-b (capacity 2) and the other two wait for it, p-a idle.
    fake.control(delay_ms=400)
    with ThreadPoolExecutor(4) as pool:
        reranks = [pool.submit(post, system, "rerank", body) for _ in range(4)]
        assert [f.result().headers["x-iop-provider"] for f in reranks] == ["p-b"] * 4
    # Four chats fill both.
    with ThreadPoolExecutor(4) as pool:
        chats = [pool.submit(post, system, "chat/completions", {"model": MIXED, "messages": MESSAGES})
                 for _ in range(4)]
        assert sorted(f.result().headers["x-iop-provider"] for f in chats) == ["p-a", "p-a", "p-b", "p-b"]
    assert system.fakes["ab"].stats()["max_in_flight"] >= 2
    reranked = seen(fake, "/v1/rerank")
    assert len(reranked) == 7
    assert {r["model"] for r in reranked} == {"b-mixed"}
    assert {r["model"] for r in seen(fake, "/v1/chat/completions")} == {"a-mixed", "b-mixed"}


# ------------------------------------------------------------------------------------ relaying faithfully


def test_no_invented_done(system: System) -> None:
    fake = system.fakes["quirk"]
    fake.control(stream_no_done=True)
    resp, text = stream_text(system, "chat/completions", {"model": QUIRKY, "messages": MESSAGES, "stream": True})
    assert resp.status_code == 200
    payloads = sse_payloads(text)
    assert "[DONE]" not in payloads
    assert json.loads(payloads[0])["model"] == QUIRKY
    # Every chunk the provider sent, then the error that says it never ended.
    assert "".join(json.loads(p)["choices"][0]["delta"].get("content") or ""
                   for p in payloads[:-1] if json.loads(p)["choices"]) == WORDS
    error = json.loads(payloads[-1])["error"]
    assert error["code"] == "provider_error"
    assert "ended early" in error["message"]

    fake.control(stream_no_done=False, empty_200=True)
    resp = post(system, "chat/completions", {"model": QUIRKY, "messages": MESSAGES})
    assert resp.status_code == 502, resp.text
    assert resp.json()["error"]["code"] == "provider_error"
    resp, text = stream_text(system, "chat/completions", {"model": QUIRKY, "messages": MESSAGES, "stream": True})
    assert "[DONE]" not in text
    if resp.status_code == 200:
        error = json.loads(sse_payloads(text)[-1])["error"]
    else:
        assert resp.status_code == 502
        error = json.loads(text)["error"]
    assert error["code"] == "provider_error"
    assert "ended" in error["message"] or "empty" in error["message"], error


def test_5xx_is_retried_on_another_provider(client: openai.OpenAI, system: System) -> None:
    bad, good = system.fakes["bad"], system.fakes["good"]
    forget(bad, good)
    bad.control(fail_status=500)
    markers = []
    for i in range(3):
        marker = f"json-{i}"
        raw = client.chat.completions.with_raw_response.create(model=RETRY, messages=MESSAGES, user=marker)
        assert raw.headers["x-iop-provider"] == "p-good"
        assert raw.parse().choices[0].message.content == WORDS
        assert raw.parse().model == RETRY
        markers.append(marker)
    for i in range(3):
        marker = f"stream-{i}"
        with client.chat.completions.with_streaming_response.create(
                model=RETRY, messages=MESSAGES, user=marker, stream=True) as resp:
            assert resp.headers["x-iop-provider"] == "p-good"
            text = resp.read().decode()
        assert sse_payloads(text)[-1] == "[DONE]"
        markers.append(marker)
    tried = [r["body"]["user"] for r in bad.requests()]
    assert len(tried) == len(set(tried)), f"a request was tried twice on the failing provider: {tried}"
    assert set(tried) <= set(markers)
    assert [r["body"]["user"] for r in good.requests()] == markers

    # Alone, the failing provider's own answer reaches the caller (tests/e2e/test_provider_errors.py).
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model=BAD_ONLY, messages=MESSAGES)
    assert info.value.status_code == 500
    assert info.value.response.headers["x-iop-provider"] == "p-bad"
    assert "fake provider failure (status 500)" in info.value.message
    streamed, text = stream_text(system, "chat/completions", {"model": BAD_ONLY, "messages": MESSAGES, "stream": True})
    assert streamed.status_code == 500
    assert json.loads(text)["error"]["message"] == "fake provider failure (status 500)"


def test_stale_keepalive_connection_is_retried(system: System) -> None:
    fake = system.fakes["quirk"]
    forget(fake)
    fake.control(close_idle_keepalive=True)
    failures = []
    for i in range(12):
        body = {"model": QUIRKY, "messages": MESSAGES, "stream": i % 2 == 1}
        resp, text = stream_text(system, "chat/completions", body)
        ok = resp.status_code == 200 and ("[DONE]" in text if body["stream"] else json.loads(text)["model"] == QUIRKY)
        if not ok:
            failures.append((i, resp.status_code, text[-300:]))
    assert failures == []
    assert len(seen(fake, "/v1/chat/completions")) == 12


def test_provider_headers_pass_through(system: System) -> None:
    body = {"model": ALIAS, "messages": MESSAGES}
    json_resp = post(system, "chat/completions", body)
    stream_resp, _ = stream_text(system, "chat/completions", {**body, "stream": True})
    responses_resp, _ = stream_text(system, "responses", {"model": ALIAS, "input": "hi", "stream": True})
    for resp in (json_resp, stream_resp, responses_resp):
        assert resp.status_code == 200
        headers = resp.headers
        assert len(headers["x-request-id"]) == 36
        assert int(headers["openai-processing-ms"]) >= 0
        assert headers["x-ratelimit-remaining-requests"] == "99"
        assert headers["x-iop-provider"] == "p-all"
        # The provider's hop-by-hop `Keep-Alive: timeout=5` is not relayed.
        assert headers.get("keep-alive") != "timeout=5"
    assert json_resp.headers["x-request-id"] != stream_resp.headers["x-request-id"]
