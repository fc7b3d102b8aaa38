"""Tenants' rate limits through real processes: three API processes that share nothing but
Redis enforce one limit (60 requests a minute is 60 across the fleet, not 60 per process),
every answer carries the headers clients read and they count down, and the official
``openai`` and ``anthropic`` SDKs back off on the 429 and then succeed."""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import openai
import pytest

from iop.redis_server import RedisServer
from tests.e2e.system import System, http_provider

APIS = ("api-1", "api-2", "api-3")
TENANTS = {"fleet": 60, "count": 6, "sdk-openai": 20, "sdk-anthropic": 20}


def key(tenant: str) -> str:
    return f"key-{tenant}"


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key(tenant)}"}


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[System]:
    sys_ = System(tmp_path_factory.mktemp("limits"), redis_server)
    sys_.write_config({
        "api": {"keys": [{"name": t, "key_sha256": hashlib.sha256(key(t).encode()).hexdigest(),
                          "limits": {"requests_per_minute": rpm, "tokens_per_minute": 1_000_000}}
                         for t, rpm in TENANTS.items()]},
        "queue": {"max_queue": 1000},
        "models": [{"id": "m", "providers": {"p": "served"}}],
        "nodes": [{"id": "n1", "providers": [http_provider("p", "vllm", sys_.port("f"), 64, ["served"],
                                                           endpoints=["chat/completions", "messages"])]}],
    })
    with sys_:
        sys_.fake("f", "--models", "served", "--tokens", "2")
        sys_.worker("n1")
        for name in APIS:
            sys_.api(name)
        sys_.wait_available("p")
        yield sys_


def chat(system: System, tenant: str, api: str) -> httpx.Response:
    return httpx.post(f"{system.api_url_of(api)}/v1/chat/completions", headers=auth(tenant), timeout=30,
                      json={"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})


def exhaust(system: System, tenant: str) -> None:
    """Spend the tenant's window: requests until one is refused."""
    for i in range(100):
        status = chat(system, tenant, APIS[i % 3]).status_code
        if status == 429:
            return
        assert status == 200
    raise AssertionError("never refused")


def test_a_limit_holds_across_the_fleet_not_per_process(system: System) -> None:
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=18) as pool:
        answers = list(pool.map(lambda i: chat(system, "fleet", APIS[i % 3]), range(90)))
    elapsed = time.monotonic() - started
    statuses = [a.status_code for a in answers]
    assert set(statuses) <= {200, 429}
    # A sliding minute: 60 at once, then one more each second (60 a minute) -- never 60 per
    # process (180).
    assert 60 <= statuses.count(200) <= 60 + math.ceil(elapsed), (statuses.count(200), elapsed)
    refused = next(a for a in answers if a.status_code == 429)
    assert refused.json()["error"]["code"] == "rate_limited"
    assert 1 <= int(refused.headers["retry-after"]) <= 2
    assert 0 < int(refused.headers["retry-after-ms"]) <= 1000
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"


def test_the_headers_count_down_whichever_process_answers(system: System) -> None:
    answers = [chat(system, "count", api) for api in (*APIS, *APIS)]
    assert [a.status_code for a in answers] == [200] * 6
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers] == ["5", "4", "3", "2", "1", "0"]
    assert {a.headers["x-ratelimit-limit-requests"] for a in answers} == {"6"}
    # Ten seconds per request at 6 a minute: the window is full again in about a minute.
    assert answers[-1].headers["x-ratelimit-reset-requests"].endswith("s")
    assert answers[0].headers["x-ratelimit-limit-tokens"] == "1000000"
    refused = chat(system, "count", "api-2")
    assert refused.status_code == 429
    assert 9 <= int(refused.headers["retry-after"]) <= 10


def refusals(system: System, tenant: str) -> int:
    catalog = httpx.get(f"{system.api_url}/catalog", headers=auth(tenant), timeout=10).json()
    return next(t for t in catalog["tenants"] if t["name"] == tenant)["limits"]["refused"]["requests"]


def test_the_openai_sdk_backs_off_on_the_429_and_then_succeeds(system: System) -> None:
    exhaust(system, "sdk-openai")
    before = refusals(system, "sdk-openai")
    # What the SDK sent and got, in order: it must be refused, then wait what the 429 told it.
    seen: list[tuple[float, Any]] = []
    hooks = {"request": [lambda _: seen.append((time.monotonic(), None))],
             "response": [lambda r: seen.append((time.monotonic(), r))]}
    client = openai.OpenAI(base_url=f"{system.api_url_of('api-2')}/v1", api_key=key("sdk-openai"), max_retries=2,
                           timeout=30, http_client=openai.DefaultHttpxClient(event_hooks=hooks))
    raw = client.chat.completions.with_raw_response.create(
        model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert raw.parse().choices[0].message.content
    # It was refused first (20 a minute: one each 3 s), and waited as told before it tried again.
    assert refusals(system, "sdk-openai") > before
    answers = [(at, r) for at, r in seen if r is not None]
    refused_at, refused = next((at, r) for at, r in answers if r.status_code == 429)
    retried_at = next(at for at, r in seen if r is None and at > refused_at)
    told_s = int(refused.headers["retry-after-ms"]) / 1000
    assert 0 < told_s <= 3
    assert retried_at - refused_at >= told_s
    assert raw.headers["x-ratelimit-remaining-requests"] == "0"


def test_the_anthropic_sdk_backs_off_on_the_429_and_then_succeeds(system: System) -> None:
    exhaust(system, "sdk-anthropic")
    before = refusals(system, "sdk-anthropic")
    client = anthropic.Anthropic(base_url=system.api_url_of("api-3"), max_retries=2, timeout=30,
                                 default_headers={"x-api-key": key("sdk-anthropic")})
    raw = client.messages.with_raw_response.create(
        model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert raw.parse().content
    assert refusals(system, "sdk-anthropic") > before
    # Anthropic's names on its endpoint, the reset as a time.
    assert raw.headers["anthropic-ratelimit-requests-limit"] == "20"
    assert raw.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert raw.headers["anthropic-ratelimit-requests-reset"].endswith("Z")
    refused = httpx.post(f"{system.api_url_of('api-1')}/v1/messages", headers={"x-api-key": key("sdk-anthropic")},
                         json={"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
                         timeout=30)
    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "rate_limit_error"
