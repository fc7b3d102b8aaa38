"""Token usage through real processes: the providers' ``usage`` counted in
``iop_tokens_total`` per model, provider, kind and tenant (two API processes: the counts of
both add up in any scrape), the usage chunk iop asked for kept from a caller who did not ask,
and every provider's tokens per second in ``/catalog``.

The fake provider reports ``prompt_tokens`` as the length of the body it received / 4, so
the expected counts come from what it recorded."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from iop.redis_server import RedisServer
from tests.e2e.system import System, http_provider, sse_payloads

TOKENS = 5
KEYS = {"alice": "key-alice", "bob": "key-bob"}


@pytest.fixture
def system(tmp_path: Path, redis_server: RedisServer) -> Iterator[System]:
    sys_ = System(tmp_path, redis_server)
    sys_.write_config({
        "api": {"keys": [{"name": name, "key_sha256": hashlib.sha256(key.encode()).hexdigest()}
                         for name, key in KEYS.items()]},
        "models": [{"id": "m", "providers": {"p": "served"}}, {"id": "quiet", "providers": {"q": "served"}}],
        "nodes": [{"id": "n1", "providers": [
            http_provider("p", "vllm", sys_.port("f"), 4, ["served"]),
            http_provider("q", "ollama", sys_.port("g"), 4, ["served"], stream_usage=False),
        ]}],
    })
    try:
        sys_.fake("f", "--models", "served", "--tokens", str(TOKENS))
        sys_.fake("g", "--models", "served", "--tokens", str(TOKENS))
        sys_.worker("n1")
        sys_.api(workers=2)
        sys_.wait_available("p", "q")
        yield sys_
    finally:
        sys_.close()


def post(system: System, tenant: str, path: str, body: dict[str, Any]) -> httpx.Response:
    # Compact JSON: the fake's prompt count is then recomputable from the body it recorded.
    return httpx.post(f"{system.api_url}/v1/{path}", content=msgspec.json.encode(body), timeout=30,
                      headers={"Authorization": f"Bearer {KEYS[tenant]}", "Content-Type": "application/json"})


def prompt_of(recorded: dict[str, Any]) -> int:
    """What the fake counted as prompt tokens for a request it recorded."""
    return max(1, len(msgspec.json.encode(recorded["body"])) // 4)


def tokens(system: System) -> dict[tuple[str, str, str, str], float]:
    text = httpx.get(f"{system.api_url}/metrics", headers={"Authorization": f"Bearer {KEYS['alice']}"}).text
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "iop_tokens_total":
                found[(s.labels["model"], s.labels["provider"], s.labels["kind"], s.labels["tenant"])] = s.value
    return found


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


def test_tokens_are_counted_and_the_usage_chunk_reaches_only_who_asked(system: System) -> None:
    fake = system.fakes["f"]

    answer = post(system, "alice", "chat/completions", chat("a JSON answer"))
    assert answer.status_code == 200
    json_usage = answer.json()["usage"]
    assert json_usage["completion_tokens"] == TOKENS

    plain = post(system, "alice", "chat/completions", chat("a stream that did not ask", stream=True))
    assert plain.status_code == 200
    chunks = [json.loads(p) for p in sse_payloads(plain.text) if p != "[DONE]"]
    assert all(c["choices"] for c in chunks)
    assert not any("usage" in c for c in chunks)
    assert plain.text.endswith("data: [DONE]\n\n")
    asked_for_it = fake.requests()[-1]
    assert asked_for_it["body"]["stream_options"] == {"include_usage": True}

    asked = post(system, "bob", "chat/completions",
                 chat("a stream that asked", stream=True, stream_options={"include_usage": True}))
    last = [json.loads(p) for p in sse_payloads(asked.text) if p != "[DONE]"][-1]
    assert last["choices"] == []
    assert last["model"] == "m"
    assert last["usage"]["completion_tokens"] == TOKENS

    embedded = post(system, "bob", "embeddings", {"model": "m", "input": ["one two three", "four"]})
    assert embedded.status_code == 200

    assert tokens(system) == {
        ("m", "p", "prompt", "alice"): json_usage["prompt_tokens"] + prompt_of(asked_for_it),
        ("m", "p", "completion", "alice"): 2 * TOKENS,
        ("m", "p", "prompt", "bob"): last["usage"]["prompt_tokens"] + 4,
        ("m", "p", "completion", "bob"): TOKENS,
    }

    catalog = httpx.get(f"{system.api_url}/catalog", headers={"Authorization": f"Bearer {KEYS['alice']}"}).json()
    rates = {p["id"]: p["tokens_per_s"] for p in catalog["providers"]}
    # 15 completion tokens finished within the last seconds: 1.5 per second over the 10 s
    # window (less only if the requests took longer than a bucket).
    assert 0 < rates["p"] <= 3 * TOKENS / 10
    assert rates["q"] == 0.0


def test_a_provider_with_stream_usage_off_is_not_asked(system: System) -> None:
    resp = post(system, "alice", "chat/completions", {**chat("hi", stream=True), "model": "quiet"})
    assert resp.status_code == 200
    assert "stream_options" not in system.fakes["g"].requests()[-1]["body"]
    assert not any(model == "quiet" for model, *_ in tokens(system))
    # A JSON answer carries its usage whatever stream_usage says.
    assert post(system, "alice", "chat/completions", {**chat("hi"), "model": "quiet"}).status_code == 200
    counted = tokens(system)
    assert counted[("quiet", "q", "completion", "alice")] == TOKENS
