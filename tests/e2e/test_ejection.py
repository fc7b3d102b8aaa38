"""Ejection on evidence, through real processes (fake providers, a worker, an API, a private
redis-server): one caller's bad requests never take a provider out of rotation for the
others; a provider that fails everything leaves after a handful of requests and comes back
once it recovers; a provider that was killed leaves at its first refused call."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from iop.redis_server import RedisServer
from tests.e2e.system import System, fast_dispatch, http_provider

PAIR = "pair"  # pa (tried first: the lower id) and pb
SOLO = "solo"  # p alone
BAD = {"fake": {"fail_status": 500}}  # what the fake fails by what the request carries


def chat(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


@pytest.fixture
def system(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[System]:
    sys_ = System(tmp_path_factory.mktemp("ejection"), redis_server)
    sys_.write_config({
        "models": [{"id": PAIR, "providers": {"pa": "served", "pb": "served"}},
                   {"id": SOLO, "providers": {"p": "served"}}],
        "nodes": [{"id": "n1", "providers": [
            http_provider("pa", "vllm", sys_.port("fa"), 4, ["served"], timeout_s=20),
            http_provider("pb", "vllm", sys_.port("fb"), 4, ["served"], timeout_s=20),
            http_provider("p", "vllm", sys_.port("f"), 4, ["served"], timeout_s=20),
        ]}],
        # Probes seldom: what takes a provider out here is its calls, not a probe.
        "dispatch": fast_dispatch(probe_interval_ms=60_000, busy_probe_interval_ms=60_000),
        "ejection": {"base_s": 2, "max_s": 8},
    })
    with sys_:
        for name in ("fa", "fb", "f"):
            sys_.fake(name, "--models", "served", "--tokens", "3").hooks(body_overrides=True)
        sys_.worker("n1")
        sys_.api()
        sys_.wait_available("pa", "pb", "p")
        yield sys_


def catalog_provider(system: System, pid: str) -> dict[str, Any]:
    catalog = httpx.get(f"{system.api_url}/catalog", timeout=10).json()
    return next(p for p in catalog["providers"] if p["id"] == pid)


def post(system: System, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{system.api_url}/v1/chat/completions", json=body, timeout=30)


async def burst(system: System, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=system.api_url, timeout=60) as client:
        return list(await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies)))


def test_a_burst_of_failing_requests_beside_ordinary_traffic_ejects_nobody(system: System) -> None:
    bodies = [chat(model, **(BAD if bad else {}), user=f"{model}-{'bad' if bad else 'ok'}-{i}")
              for i in range(40) for model in (PAIR, SOLO) for bad in (True, False)]
    answers = asyncio.run(burst(system, bodies))
    for body, resp in zip(bodies, answers, strict=True):
        if "fake" in body:
            # The upstream's own answer, as before: its status and its body.
            assert resp.status_code == 500, resp.text
            assert resp.json()["error"]["message"] == "fake provider failure (status 500)"
        else:
            assert resp.status_code == 200, resp.text
    for pid in ("pa", "pb", "p"):
        view = catalog_provider(system, pid)
        assert view["health"] == "available", view["reason"]
        assert view["ejection"] is None
    # Tried on both providers of the pair, each bad request was the request's fault.
    excused = sum((catalog_provider(system, pid)["evidence"] or {}).get("excused_5xx", 0) for pid in ("pa", "pb"))
    assert excused == 40
    # Nobody gets no_provider_available for what another caller sent.
    for model in (PAIR, SOLO):
        assert post(system, chat(model)).status_code == 200


def test_a_provider_failing_everything_leaves_after_a_handful_and_comes_back_when_it_recovers(
        system: System) -> None:
    broken = system.fakes["fa"]
    broken.control(fail_status=500)
    served_by = []
    for _ in range(8):
        resp = post(system, chat(PAIR))
        assert resp.status_code == 200, resp.text  # retried on pb
        served_by.append(resp.headers["x-iop-provider"])
    assert served_by == ["pb"] * 8
    # Five consecutive 500s that pb answered instead, then it got nothing more.
    assert broken.stats()["total"] == 5
    view = catalog_provider(system, "pa")
    assert view["health"] == "unavailable"
    assert view["ejection"]["state"] == "ejected"
    assert re.match(r"ejected: 5 consecutive 500s on different requests; on trial again at \d\d:\d\d:\d\d UTC$",
                    view["reason"]), view["reason"]
    metrics = httpx.get(f"{system.api_url}/metrics", timeout=10).text
    assert re.search(r'iop_provider_ejections_total\{[^}]*provider="pa"[^}]*reason="consecutive_5xx"[^}]*\} 1\.0',
                     metrics), metrics

    broken.control(fail_status=None)  # it recovers
    system.wait_until("pa on trial", lambda: (catalog_provider(system, "pa")["ejection"] or {}).get("state")
                      == "on_trial", timeout=30)
    # On trial: the next request goes to pa (idle, the lower id) and its answer brings it back.
    assert post(system, chat(PAIR)).headers["x-iop-provider"] == "pa"
    view = catalog_provider(system, "pa")
    assert view["ejection"] is None
    assert view["health"] == "available"
    assert view["reason"] == ""
    assert post(system, chat(PAIR)).headers["x-iop-provider"] == "pa"


def test_a_killed_provider_leaves_at_its_first_refused_call(system: System) -> None:
    system.fakes["fa"].proc.kill()
    resp = post(system, chat(PAIR))
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-iop-provider"] == "pb"
    # No probe is due for a minute: its one refused call took it out.
    system.wait_until("pa out of rotation", lambda: system.provider("pa").get("health") == "unavailable", timeout=10)
    view = catalog_provider(system, "pa")
    assert view["health"] == "unavailable"
    # Its call's words, or those of the probe its failed call asked for at once.
    assert re.search(r"connection refused|cannot connect", view["reason"], re.IGNORECASE), view["reason"]
    assert post(system, chat(PAIR)).headers["x-iop-provider"] == "pb"
