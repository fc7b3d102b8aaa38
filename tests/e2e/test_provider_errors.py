"""What a caller gets when the provider misbehaves, through real processes: the provider's
own error answers (retried on another provider where that may help, else passed through
with their status, body and headers, wrapped into the endpoint's error shape when they are
not in it), and iop's own 502 / 504 for what only iop can know."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from iop.redis_server import RedisServer
from tests.e2e.system import Fake, System, http_provider

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
PAIR = "pair"  # pa (tried first: the lower id) and pb
MESSAGES: Any = [{"role": "user", "content": "hi"}]
CLEAN = {"fail_status": None, "fail_with": None, "garbage": False, "delay_ms": 0, "hang": False}

HTML_502 = ("<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n"
            "<center><h1>502 Bad Gateway</h1></center>\r\n<hr><center>nginx/1.27.4</center>\r\n</body>\r\n</html>\r\n")


def overloaded(request_id: str) -> dict[str, Any]:
    """Anthropic's 529, as its API answers it."""
    body = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}, "request_id": request_id}
    return {"status": 529, "body": json.dumps(body), "headers": {"retry-after": "7", "request-id": request_id}}


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[System]:
    sys_ = System(tmp_path_factory.mktemp("errors"), redis_server)
    sys_.write_config({
        "models": [
            {"id": "m", "providers": {"p": "served"}},
            {"id": PAIR, "providers": {"pa": "served", "pb": "served"}},
        ],
        "nodes": [{"id": "n1", "providers": [
            http_provider("p", "vllm", sys_.port("f"), 2, ["served"], timeout_s=1.0),
            http_provider("pa", "vllm", sys_.port("fa"), 2, ["served"], timeout_s=10.0),
            http_provider("pb", "vllm", sys_.port("fb"), 2, ["served"], timeout_s=10.0),
        ]}],
        # What each status does to the request, not to the provider: pa answers 5xx on
        # purpose, request after request, and must stay in rotation for the next test
        # (ejection on that evidence: tests/e2e/test_ejection.py).
        "ejection": {"consecutive_5xx": 0, "failure_rate": 0},
    })
    with sys_:
        for name in ("f", "fa", "fb"):
            sys_.fake(name, "--models", "served", "--tokens", "3")
        sys_.worker("n1")
        sys_.api()
        sys_.wait_available("p", "pa", "pb")
        yield sys_


@pytest.fixture
def fake(system: System) -> Iterator[Fake]:
    for each in system.fakes.values():
        forget(each)
    yield system.fakes["f"]
    for each in system.fakes.values():
        each.control(**CLEAN)
    # Whatever happened, the slots came back.
    system.wait_until("slots released", lambda: all(system.in_flight(p) == 0 for p in ("p", "pa", "pb")),
                      timeout=15)
    # The next test starts with no provider paused, so that the lower id is tried first again.
    unpaused(system)


def unpaused(system: System) -> None:
    """Until no provider is paused by a 429 it answered (docs/PROVIDERS.md, rate limits: a 429
    without retry-after pauses its provider for 1 s, doubling while they follow each other)."""
    system.wait_until("no provider paused by a 429", lambda: all(
        int(system.provider(p).get("hold_until") or 0) <= time.time() * 1000 for p in ("p", "pa", "pb")), timeout=15)


@pytest.fixture
def pair(system: System, fake: Fake) -> tuple[Fake, Fake]:
    return system.fakes["fa"], system.fakes["fb"]


def forget(fake: Fake) -> None:
    httpx.delete(f"{fake.url}/_fake/requests", timeout=5).raise_for_status()


def markers(fake: Fake) -> list[str]:
    return [r["body"].get("user") or r["body"].get("metadata", {}).get("user_id") for r in fake.requests()]


def post(system: System, body: dict[str, object] = BODY, path: str = "chat/completions") -> httpx.Response:
    return httpx.post(f"{system.api_url}/v1/{path}", json=body, timeout=30)


def post_stream(system: System, body: dict[str, object], path: str = "chat/completions") -> tuple[httpx.Response, str]:
    with httpx.stream("POST", f"{system.api_url}/v1/{path}", json={**body, "stream": True}, timeout=30) as resp:
        return resp, resp.read().decode()


# ------------------------------------------------------------------ the provider's own answers


def test_a_status_another_provider_may_not_share_goes_to_it(system: System, pair: tuple[Fake, Fake]) -> None:
    bad, good = pair
    sent = []
    for status in (429, 500, 502, 503, 529):
        if status == 429:
            # With retry-after 0: a 429 otherwise pauses its provider for a second (docs/
            # PROVIDERS.md, rate limits), and the next requests would skip pa for that.
            error = {"error": {"message": "fake provider failure (status 429)", "type": "rate_limit_error",
                               "param": None, "code": None}}
            bad.control(fail_status=None, fail_with={"status": 429, "body": json.dumps(error),
                                                     "headers": {"retry-after": "0"}})
        else:
            bad.control(fail_with=None, fail_status=status)
        for stream in (False, True):
            marker = f"{status}-{'stream' if stream else 'json'}"
            body = {"model": PAIR, "messages": MESSAGES, "user": marker}
            if stream:
                resp, text = post_stream(system, body)
                assert text.endswith("data: [DONE]\n\n"), text
            else:
                resp = post(system, body)
                assert resp.json()["choices"][0]["message"]["content"] == "tok0 tok1 tok2"
            assert resp.status_code == 200, (status, resp.headers, system.logs())
            assert resp.headers["x-iop-provider"] == "pb"
            sent.append(marker)
    # Each went to pa first (the lower id), once, and never back to it.
    assert markers(bad) == sent
    assert markers(good) == sent


def test_a_status_another_provider_would_share_is_the_callers_at_once(
    system: System, pair: tuple[Fake, Fake]
) -> None:
    bad, good = pair
    for status in (400, 404, 422, 501, 504):
        bad.control(fail_status=status)
        resp = post(system, {"model": PAIR, "messages": MESSAGES, "user": str(status)})
        assert resp.status_code == status, resp.text
        assert resp.json()["error"]["message"] == f"fake provider failure (status {status})"
        assert resp.headers["x-iop-provider"] == "pa"
    assert markers(good) == []


def test_anthropic_overloaded_everywhere_is_the_providers_529(system: System, pair: tuple[Fake, Fake]) -> None:
    first, last = pair
    first.control(fail_with=overloaded("req_first"))
    last.control(fail_with=overloaded("req_last"))
    body = {"model": PAIR, "max_tokens": 16, "messages": MESSAGES, "metadata": {"user_id": "raw"}}
    resp = post(system, body, "messages")
    assert resp.status_code == 529, resp.text
    # The answer of the provider tried last, whole: its body byte for byte, its headers.
    assert resp.content == overloaded("req_last")["body"].encode()
    assert resp.headers["retry-after"] == "7"
    assert resp.headers["request-id"] == "req_last"
    assert resp.headers["x-iop-provider"] == "pb"
    assert markers(first) == markers(last) == ["raw"]

    # A 529 takes each provider out of rotation until its probe (made as soon as it runs
    # nothing) brings it back: wait for that before each next request, or a slow machine
    # answers 503 no_provider_available instead.
    def both_back() -> None:
        system.wait_available("pa", "pb")

    both_back()
    # Asked for a stream: the same answer, an error status and no stream.
    resp, text = post_stream(system, body, "messages")
    assert resp.status_code == 529
    assert resp.headers["content-type"].startswith("application/json")
    assert text == overloaded("req_last")["body"]

    claude = anthropic.Anthropic(base_url=system.api_url, api_key="unused", max_retries=0, timeout=30)
    both_back()
    with pytest.raises(anthropic.OverloadedError) as info:
        claude.messages.create(model=PAIR, max_tokens=16, messages=MESSAGES)
    assert info.value.status_code == 529
    assert info.value.request_id == "req_last"
    assert info.value.response.headers["retry-after"] == "7"
    both_back()
    with pytest.raises(anthropic.OverloadedError):
        claude.messages.create(model=PAIR, max_tokens=16, messages=MESSAGES, stream=True)


def test_the_only_providers_429_reaches_the_caller_with_its_retry_headers(system: System, fake: Fake) -> None:
    error = {"error": {"message": "Rate limit reached for requests", "type": "requests", "param": None,
                       "code": "rate_limit_exceeded"}}
    headers = {"retry-after": "3", "retry-after-ms": "2500", "x-should-retry": "true", "x-request-id": "req-429"}
    fake.control(fail_with={"status": 429, "body": json.dumps(error), "headers": headers})
    resp = post(system)
    assert resp.status_code == 429
    assert resp.json() == error
    for name, value in headers.items():
        assert resp.headers[name] == value, name
    assert len(fake.requests()) == 1

    client = openai.OpenAI(base_url=f"{system.api_url}/v1", api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model="m", messages=MESSAGES)
    assert info.value.code == "rate_limit_exceeded"


def test_an_error_in_shape_passes_byte_for_byte(system: System, fake: Fake) -> None:
    # Extra fields, odd spacing, llama.cpp's integer code: still what the SDKs read.
    raw = ('{ "error" : {"code": 503, "message": "Loading model", "type": "unavailable_error"},'
           ' "extra": [1, 2] }\n')
    fake.control(fail_with={"status": 503, "body": raw})
    for resp in (post(system), post_stream(system, BODY)[0]):
        assert resp.status_code == 503
        assert resp.read() == raw.encode()
        assert resp.headers["x-iop-provider"] == "p"


def test_a_long_error_body_is_not_cut(system: System, fake: Fake) -> None:
    error = {"error": {"message": "prompt too long: " + "token " * 850, "type": "server_error", "param": None,
                       "code": None}}
    raw = json.dumps(error)
    assert len(raw) > 5000
    fake.control(fail_with={"status": 500, "body": raw})
    resp = post(system)
    assert resp.status_code == 500
    assert resp.content == raw.encode()


def test_fastapis_404_is_wrapped_in_the_endpoints_shape(system: System, fake: Fake) -> None:
    # What a vLLM without the route answers (an older one asked for /v1/messages/count_tokens).
    fake.control(fail_with={"status": 404, "body": '{"detail":"Not Found"}'})
    resp = post(system)
    assert resp.status_code == 404
    assert resp.json() == {"error": {
        "message": 'provider p answered 404: {"detail":"Not Found"}',
        "type": "invalid_request_error", "param": None, "code": "upstream_error"}}

    resp = post(system, {"model": "m", "messages": MESSAGES}, "messages/count_tokens")
    assert resp.status_code == 404
    assert resp.json() == {"type": "error", "error": {
        "type": "not_found_error", "message": 'provider p answered 404: {"detail":"Not Found"}'}}
    claude = anthropic.Anthropic(base_url=system.api_url, api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.count_tokens(model="m", messages=MESSAGES)
    assert "provider p answered 404" in info.value.message


def test_a_proxys_html_page_is_wrapped(system: System, fake: Fake) -> None:
    fake.control(fail_with={"status": 502, "body": HTML_502, "content_type": "text/html"})
    for resp in (post(system), post_stream(system, BODY)[0]):
        assert resp.status_code == 502
        assert resp.headers["content-type"].startswith("application/json")
        error = json.loads(resp.read())["error"]
        assert error["code"] == "upstream_error"
        assert error["type"] == "server_error"
        assert error["message"].startswith("provider p answered 502: <html> <head><title>502 Bad Gateway</title>")
        assert "nginx/1.27.4" in error["message"]


@pytest.mark.parametrize(("content_type", "body", "message"), [
    ("text/plain", "upstream connect error or disconnect/reset before headers\n",
     "provider p answered 503: upstream connect error or disconnect/reset before headers"),
    ("application/json", "", "provider p answered 503 with an empty body"),
])
def test_text_or_nothing_is_wrapped(system: System, fake: Fake, content_type: str, body: str, message: str) -> None:
    fake.control(fail_with={"status": 503, "body": body, "content_type": content_type})
    resp = post(system)
    assert resp.status_code == 503
    assert resp.json() == {"error": {"message": message, "type": "server_error", "param": None,
                                     "code": "upstream_error"}}


# ------------------------------------------------------------------ iop's own errors


@pytest.mark.parametrize("status", [400, 422, 429])
def test_provider_4xx_is_passed_through(system: System, fake: Fake, status: int) -> None:
    fake.control(fail_status=status)
    direct = httpx.post(f"{fake.url}/v1/chat/completions", json={**BODY, "model": "served"})
    resp = post(system)
    assert resp.status_code == status
    assert resp.json() == direct.json()


def test_provider_4xx_on_a_stream_request_is_passed_through(system: System, fake: Fake) -> None:
    fake.control(fail_status=400)
    resp = post(system, {**BODY, "stream": True})
    assert resp.status_code == 400
    assert "error" in resp.json()


def test_provider_timeout_is_504(system: System, fake: Fake) -> None:
    fake.control(delay_ms=5000)
    resp = post(system)
    assert resp.status_code == 504
    assert resp.json()["error"]["code"] == "provider_timeout"


def test_invalid_json_from_provider_is_502(system: System, fake: Fake) -> None:
    fake.control(garbage=True)
    resp = post(system)
    assert resp.status_code == 502
    assert resp.json()["error"]["code"] == "provider_error"


def test_broken_stream_ends_with_an_error_event(system: System, fake: Fake) -> None:
    fake.control(garbage=True)
    with httpx.stream("POST", f"{system.api_url}/v1/chat/completions", json={**BODY, "stream": True},
                      timeout=30) as resp:
        text = resp.read().decode()
    assert resp.status_code == 200
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    # The valid first chunk went through, then the error; no [DONE] after a failure.
    assert json.loads(events[0])["model"] == "m"
    assert json.loads(events[-1])["error"]["code"] == "provider_error"
    assert "[DONE]" not in text
