"""End to end through real processes, with the official ``openai`` SDK as the caller:
API + two node workers + fake providers + a private Redis."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from iop.redis_server import RedisServer
from tests.e2e.system import System, http_provider

ALIAS = "qwen3.6:35b"


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[System]:
    sys_ = System(tmp_path_factory.mktemp("e2e"), redis_server)
    sys_.write_config({
        "queue": {"max_queue": 50, "queue_timeout_ms": 20_000},
        "models": [
            {"id": ALIAS, "display_name": "Qwen 3.6 35B", "providers": {"p-a": "qwen-a", "p-b": "qwen-b:q4"}},
            {"id": "embed", "providers": {"p-a": "embed-a", "p-b": "embed-b"}},
            {"id": "slow", "providers": {"p-slow": "slow-served"}, "max_queue": 1},
        ],
        "nodes": [
            {"id": "n1", "providers": [
                http_provider("p-a", "vllm", sys_.port("a"), 2, ["qwen-a", "embed-a"]),
                http_provider("p-slow", "sglang", sys_.port("slow"), 1, ["slow-served"]),
            ]},
            {"id": "n2", "providers": [
                http_provider("p-b", "ollama", sys_.port("b"), 3, ["qwen-b:q4", "embed-b"]),
            ]},
        ],
    })
    try:
        sys_.fake("a", "--models", "qwen-a,embed-a")
        sys_.fake("b", "--models", "qwen-b:q4,embed-b")
        sys_.fake("slow", "--models", "slow-served", "--tokens", "5", "--token-interval-ms", "150")
        sys_.worker("n1")
        sys_.worker("n2")
        sys_.api()
        sys_.wait_available("p-a", "p-b", "p-slow")
        yield sys_
    finally:
        sys_.close()


@pytest.fixture
def client(system: System) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{system.api_url}/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(autouse=True)
def _show_logs_on_failure(request: pytest.FixtureRequest, system: System) -> Iterator[None]:
    yield
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(system.logs())


def served_models_seen(system: System) -> set[str]:
    return {r["model"] for name in ("a", "b") for r in system.fakes[name].requests()}


MESSAGES: Any = [{"role": "user", "content": "hello"}]


def test_models_list(client: openai.OpenAI) -> None:
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == [ALIAS, "embed", "slow"]
    assert models.data[0].model_extra == {"display_name": "Qwen 3.6 35B"}
    one = client.models.retrieve(ALIAS)
    assert one.id == ALIAS


def test_chat_json_rewrites_model_both_ways(client: openai.OpenAI, system: System) -> None:
    raw = client.chat.completions.with_raw_response.create(model=ALIAS, messages=MESSAGES)
    completion = raw.parse()
    assert completion.model == ALIAS
    assert completion.choices[0].message.content
    provider = raw.headers["x-iop-provider"]
    served = raw.headers["x-iop-served-model"]
    assert (provider, served) in {("p-a", "qwen-a"), ("p-b", "qwen-b:q4")}
    assert raw.headers["x-iop-node"] == {"p-a": "n1", "p-b": "n2"}[provider]
    assert int(raw.headers["x-iop-queue-ms"]) >= 0
    # The provider saw its own served name, never the alias.
    assert served in served_models_seen(system)
    assert ALIAS not in served_models_seen(system)


def test_idle_pool_prefers_the_lower_provider_id(client: openai.OpenAI) -> None:
    # 0/2 and 0/3 are equal ratios with equal in_flight: the tie goes to the lower id, every time.
    for _ in range(3):
        raw = client.chat.completions.with_raw_response.create(model=ALIAS, messages=MESSAGES)
        assert raw.headers["x-iop-provider"] == "p-a"


def test_concurrent_requests_fill_both_candidates(client: openai.OpenAI, system: System) -> None:
    for name in ("a", "b"):
        system.fakes[name].control(delay_ms=500)
    providers: list[str] = []
    try:
        threads = [
            threading.Thread(target=lambda: providers.append(
                client.chat.completions.with_raw_response.create(model=ALIAS, messages=MESSAGES)
                .headers["x-iop-provider"]))
            for _ in range(5)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
    finally:
        for name in ("a", "b"):
            system.fakes[name].control(delay_ms=0)
    # Five at once fill p-a (capacity 2) and p-b (capacity 3) exactly.
    assert sorted(providers) == ["p-a", "p-a", "p-b", "p-b", "p-b"]
    assert {"qwen-a", "qwen-b:q4"} <= served_models_seen(system)


def test_chat_stream(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=ALIAS, messages=MESSAGES, stream=True)
    chunks = list(stream)
    assert chunks
    assert {c.model for c in chunks} == {ALIAS}
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.split() == [f"tok{i}" for i in range(16)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stream_with_usage(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=ALIAS, messages=MESSAGES, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 16


def test_stream_chunks_arrive_while_the_provider_is_still_generating(client: openai.OpenAI, system: System) -> None:
    slow = system.fakes["slow"]
    stream = client.chat.completions.create(model="slow", messages=MESSAGES, stream=True)
    in_flight_at_first_content = None
    contents = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if in_flight_at_first_content is None:
                in_flight_at_first_content = slow.stats()["in_flight"]
            contents.append(chunk.choices[0].delta.content)
    # The provider was still producing the answer when its first token reached us.
    assert in_flight_at_first_content == 1
    assert len(contents) == 5
    system.wait_until("slow provider idle", lambda: slow.stats()["in_flight"] == 0, timeout=10)


def test_completions_json_and_stream(client: openai.OpenAI) -> None:
    completion = client.completions.create(model=ALIAS, prompt="Say hi")
    assert completion.model == ALIAS
    assert completion.choices[0].text
    chunks = list(client.completions.create(model=ALIAS, prompt="Say hi", stream=True))
    assert {c.model for c in chunks} == {ALIAS}
    assert "".join(c.choices[0].text for c in chunks if c.choices).split()[:2] == ["tok0", "tok1"]


def test_embeddings(client: openai.OpenAI) -> None:
    result = client.embeddings.create(model="embed", input=["one", "two", "three"])
    assert result.model == "embed"
    assert [d.index for d in result.data] == [0, 1, 2]
    assert all(len(d.embedding) == 8 for d in result.data)
    again = client.embeddings.create(model="embed", input=["one"])
    assert again.data[0].embedding == result.data[0].embedding


def test_unknown_model_is_not_found(client: openai.OpenAI, system: System) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert info.value.code == "model_not_found"
    # A model id outside models[] is never executed anywhere.
    assert "no-such-model" not in {r["model"] for f in system.fakes.values() for r in f.requests()}


def test_queue_full_is_a_rate_limit_error(client: openai.OpenAI, system: System) -> None:
    slow = system.fakes["slow"]
    slow.control(delay_ms=3000)
    results: list[object] = []

    def call() -> None:
        try:
            results.append(client.chat.completions.create(model="slow", messages=MESSAGES))
        except openai.APIError as exc:
            results.append(exc)

    background = [threading.Thread(target=call) for _ in range(2)]
    try:
        background[0].start()
        system.wait_until("slow provider busy", lambda: slow.stats()["in_flight"] == 1, timeout=10)
        background[1].start()
        system.wait_until("one job waiting", lambda: system.redis.zcard("{iop}:q:slow") == 1, timeout=10)
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model="slow", messages=MESSAGES)
        assert info.value.code == "queue_full"
        assert int(info.value.response.headers["retry-after"]) >= 1
    finally:
        slow.control(delay_ms=0)
        for thread in background:
            thread.join(timeout=60)
    # The two admitted requests were answered.
    assert len(results) == 2
    assert all(not isinstance(r, Exception) for r in results)


def test_health_endpoints(system: System) -> None:
    assert httpx.get(f"{system.api_url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{system.api_url}/readyz")
    assert ready.status_code == 200
    assert ready.json()["status"] == "ready"


def test_workers_publish_their_providers(system: System) -> None:
    assert system.provider("p-a")["node"] == "n1"
    assert system.provider("p-slow")["type"] == "sglang"
    assert system.provider("p-b")["capacity"] == "3"
