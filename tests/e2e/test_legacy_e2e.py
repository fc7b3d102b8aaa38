"""A legacy-shape config end to end, through real processes: from the caller's side nothing
changed. Two routes on one ollama-type adapter instance, backed by the fake provider;
API + worker + a private Redis; the official ``openai`` SDK as the caller."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from iop.redis_server import RedisServer
from tests.e2e.system import System

MESSAGES: Any = [{"role": "user", "content": "hello"}]

ROUTES = {"llama3": "llama3:8b", "qwen": "qwen3.6:35b-q4_K_M"}


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[System]:
    sys_ = System(tmp_path_factory.mktemp("legacy-e2e"), redis_server)
    sys_.write_config({
        "queue": {"max_queue": 10, "queue_timeout_ms": 20_000},
        "openai": {"model_routes": [
            {"model": model, "adapter": "ollama-local", "target": target} for model, target in ROUTES.items()
        ]},
        "nodes": [{"id": "n1", "adapters": {
            # The instance lists neither target: the routes add them.
            "ollama-local": {"type": "ollama", "base_url": f"http://127.0.0.1:{sys_.port('ollama')}", "capacity": 2},
        }}],
    })
    try:
        sys_.fake("ollama", "--models", ",".join(ROUTES.values()))
        sys_.worker("n1")
        sys_.api()
        sys_.wait_available("ollama-local")
        yield sys_
    finally:
        sys_.close()


@pytest.fixture
def client(system: System) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{system.api_url}/v1", api_key="unused", max_retries=0, timeout=30)


def test_models_lists_the_route_ids(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == list(ROUTES)
    assert client.models.retrieve("qwen").id == "qwen"


@pytest.mark.parametrize(("model", "target"), sorted(ROUTES.items()))
def test_chat_answers_as_the_route_id_and_sends_the_target(
    client: openai.OpenAI, system: System, model: str, target: str
) -> None:
    fake = system.fakes["ollama"]
    seen_before = len(fake.requests())
    raw = client.chat.completions.with_raw_response.create(model=model, messages=MESSAGES)
    completion = raw.parse()
    assert completion.model == model
    assert completion.choices[0].message.content
    assert raw.headers["x-iop-provider"] == "ollama-local"
    assert raw.headers["x-iop-served-model"] == target
    assert raw.headers["x-iop-node"] == "n1"
    new = fake.requests()[seen_before:]
    assert [r["model"] for r in new] == [target]


def test_streaming_through_a_legacy_route(client: openai.OpenAI, system: System) -> None:
    chunks = list(client.chat.completions.create(model="llama3", messages=MESSAGES, stream=True))
    assert chunks
    assert {c.model for c in chunks} == {"llama3"}
    assert system.fakes["ollama"].requests()[-1]["model"] == "llama3:8b"


def test_worker_publishes_the_converted_provider(system: System) -> None:
    prov = system.provider("ollama-local")
    assert prov["node"] == "n1"
    assert prov["type"] == "ollama"
    assert prov["category"] == "local_inference"
    assert prov["capacity"] == "2"
    assert json.loads(prov["models"]) == list(ROUTES.values())


def test_processes_log_the_deprecation_warnings(system: System) -> None:
    for name in ("worker-n1", "api"):
        log = next(p for p in system.procs if p.name == name).log()
        for ri, model in enumerate(ROUTES):
            assert f"$.openai.model_routes[{ri}] ({model}): legacy route" in log, log
        assert "$.nodes[0].adapters.ollama-local: legacy adapter instance" in log
        assert "iop config migrate" in log
