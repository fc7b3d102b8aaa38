"""What a caller gets when the provider misbehaves, through real processes."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from iop.redis_server import RedisServer
from tests.e2e.system import Fake, System, http_provider

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[System]:
    sys_ = System(tmp_path_factory.mktemp("errors"), redis_server)
    sys_.write_config({
        "models": [{"id": "m", "providers": {"p": "served"}}],
        "nodes": [{"id": "n1", "providers": [
            http_provider("p", "vllm", sys_.port("f"), 2, ["served"], timeout_s=1.0)]}],
    })
    with sys_:
        sys_.fake("f", "--models", "served", "--tokens", "3")
        sys_.worker("n1")
        sys_.api()
        sys_.wait_available("p")
        yield sys_


@pytest.fixture
def fake(system: System) -> Iterator[Fake]:
    fake = system.fakes["f"]
    yield fake
    fake.control(fail_status=None, garbage=False, delay_ms=0, hang=False)
    # Whatever happened, the slot came back.
    system.wait_until("slot released", lambda: system.in_flight("p") == 0, timeout=15)


def post(system: System, body: dict[str, object] = BODY) -> httpx.Response:
    return httpx.post(f"{system.api_url}/v1/chat/completions", json=body, timeout=30)


def test_provider_5xx_is_502(system: System, fake: Fake) -> None:
    fake.control(fail_status=500)
    resp = post(system)
    assert resp.status_code == 502
    assert resp.json()["error"]["code"] == "provider_error"
    assert resp.headers["x-iop-provider"] == "p"


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
