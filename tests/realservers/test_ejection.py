"""Ejection on evidence in front of real servers (issue 29): LiteLLM's proxy answers a request
asking ``mock_response: "litellm.InternalServerError"`` with its own 500, llama-cpp-python
answers ``"temperature": "hot"`` with a 500 validation error. A burst of such requests beside
ordinary traffic takes no provider out of rotation, and every ordinary request is answered.

Each server stands behind iop twice (two provider ids on one server, model ``twice``) and
once (model ``once``): a bad request that fails on both of ``twice``'s providers is the
request's fault; ``once``'s only provider is never ejected for 5xx."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from iop.redis_server import RedisServer
from tests.e2e.system import System
from tests.realservers.servers import LITELLM_GPT, LLAMA_CHAT, RealServer

pytestmark = pytest.mark.realservers

TWICE, ONCE = "twice", "once"
BAD = {
    "litellm": {"mock_response": "litellm.InternalServerError"},
    "llamacpp": {"temperature": "hot"},
}


def system_for(tmp: pytest.TempPathFactory, server: RealServer, served: str, capacity: int) -> Iterator[System]:
    def provider(pid: str) -> dict[str, Any]:
        return {"id": pid, "type": "openai_api", "base_url": server.url, "capacity": capacity,
                "models": [served], "endpoints": ["chat/completions"], "timeout_s": 60}

    with RedisServer() as redis_server:
        system = System(tmp.mktemp(f"ejection-{server.kind}"), redis_server)
        system.write_config({
            "models": [{"id": TWICE, "providers": {"r1": served, "r2": served}},
                       {"id": ONCE, "providers": {"r3": served}}],
            "nodes": [{"id": "n1", "providers": [provider("r1"), provider("r2"), provider("r3")]}],
        })
        try:
            system.worker("n1")
            system.api()
            system.wait_available("r1", "r2", "r3")
            yield system
        finally:
            system.close()


@pytest.fixture(scope="module")
def behind_litellm(tmp_path_factory: pytest.TempPathFactory, litellm: RealServer) -> Iterator[System]:
    yield from system_for(tmp_path_factory, litellm, LITELLM_GPT, 4)


@pytest.fixture(scope="module")
def behind_llamacpp(tmp_path_factory: pytest.TempPathFactory, llamacpp: RealServer) -> Iterator[System]:
    # llama-cpp-python runs one request at a time (a lock around its model).
    yield from system_for(tmp_path_factory, llamacpp, LLAMA_CHAT, 1)


def body(model: str, bad: dict[str, Any] | None, i: int) -> dict[str, Any]:
    return {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": f"hello {i}"}], **(bad or {})}


async def burst(system: System, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=system.api_url, timeout=120) as client:
        return list(await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies)))


def catalog(system: System) -> dict[str, Any]:
    providers = httpx.get(f"{system.api_url}/catalog", timeout=10).json()["providers"]
    return {p["id"]: p for p in providers}


@pytest.mark.parametrize("kind", ["litellm", "llamacpp"])
def test_a_burst_of_requests_the_server_fails_ejects_nobody(kind: str, request: pytest.FixtureRequest) -> None:
    system: System = request.getfixturevalue(f"behind_{kind}")
    n = 10 if kind == "llamacpp" else 20
    bodies = [body(model, BAD[kind] if bad else None, i) for i in range(n) for model in (TWICE, ONCE)
              for bad in (True, False)]
    answers = asyncio.run(burst(system, bodies))
    for sent, resp in zip(bodies, answers, strict=True):
        if len(sent) > 3:  # a bad one: the server's own 500, relayed with its body
            assert resp.status_code == 500, resp.text
            assert resp.json()["error"]["message"]
        else:
            assert resp.status_code == 200, resp.text
    view = catalog(system)
    for pid in ("r1", "r2", "r3"):
        assert view[pid]["health"] == "available", view[pid]["reason"]
        assert view[pid]["ejection"] is None
    # Every bad request to ``twice`` failed on both providers: the request's fault, n times.
    excused = sum((view[pid]["evidence"] or {}).get("excused_5xx", 0) for pid in ("r1", "r2"))
    assert excused == n
    for model in (TWICE, ONCE):
        resp = httpx.post(f"{system.api_url}/v1/chat/completions", json=body(model, None, 99), timeout=60)
        assert resp.status_code == 200, resp.text
