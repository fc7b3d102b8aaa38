"""Two real llama.cpp ``llama-server``s in router mode, each holding one model at a time
(``--models-max 1``), behind iop (a worker and an API process, both providers ``llamacpp``
with ``lifecycle: managed``), two models served by both, and four clients asking for both at
once. iop reads what each router holds (``GET /models``), loads through its API, and sends a
request only where its model is loaded: after the warm-up each model stays on one server,
every request is answered, and no load is a request's (the router loads a model a request
names by itself: iop would see that as a load it did not place, ``runtime``).

Without it, a request for the model a server does not hold makes that server evict the other
and load it: about every other request loads."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from iop.redis_server import RedisServer
from tests.e2e.system import System, fast_dispatch, http_provider
from tests.realservers.servers import LLAMA_ROUTER_MODELS, RealServer, start_llama_router, unavailable

pytestmark = pytest.mark.realservers

A, B, _ = LLAMA_ROUTER_MODELS
PER_CLIENT = 12


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[System]:
    reason = unavailable("llama-server")
    if reason is not None:
        pytest.skip(reason)
    routers: list[RealServer] = []
    try:
        for name in ("r1", "r2"):
            routers.append(start_llama_router(tmp_path_factory.mktemp(name), 1))
        sys_ = System(tmp_path_factory.mktemp("iop-router-fleet"), redis_server)
        managed = {"lifecycle": "managed", "load_s": 2.0, "load_timeout_s": 120, "unload_idle_s": 1.0,
                   "timeout_s": 120}
        sys_.write_config({
            "dispatch": fast_dispatch(lease_ms=15_000),
            "queue": {"max_queue": 100, "queue_timeout_ms": 120_000},
            "models": [{"id": f"iop-{m}", "providers": {"p1": m, "p2": m}} for m in (A, B)],
            "nodes": [{"id": "n1", "providers": [
                http_provider(f"p{i}", "llamacpp", r.port, 1, list(LLAMA_ROUTER_MODELS), **managed)
                for i, r in enumerate(routers, start=1)]}],
        })
        with sys_:
            sys_.worker("n1")
            sys_.api()
            sys_.wait_available("p1", "p2")
            sys_.wait_until("models read", lambda: all(sys_.provider(p).get(f"ms:{A}") for p in ("p1", "p2")),
                            timeout=60)
            yield sys_
    finally:
        for r in routers:
            r.stop()


def ask(system: System, model: str) -> int:
    resp = httpx.post(f"{system.api_url}/v1/chat/completions", timeout=120,
                      json={"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    return resp.status_code


def catalog(system: System) -> list[dict[str, Any]]:
    providers: list[dict[str, Any]] = httpx.get(f"{system.api_url}/catalog", timeout=10).json()["providers"]
    return providers


def counted(system: System, kind: str, reason: str) -> int:
    return sum(s[kind].get(reason, 0) for p in catalog(system) for s in p["models_state"].values())


def test_router_reports_its_models_and_max_loaded(fleet: System) -> None:
    for p in catalog(fleet):
        assert p["lifecycle"] == "managed"
        assert p["max_loaded"] == 1  # the router's --models-max, from /props
        assert set(p["models_state"]) == set(LLAMA_ROUTER_MODELS)


def test_two_models_at_once_each_settle_on_one_router(fleet: System, tmp_path: Path) -> None:
    def client(model: str) -> list[int]:
        return [ask(fleet, model) for _ in range(PER_CLIENT)]

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(client, [f"iop-{A}", f"iop-{B}", f"iop-{A}", f"iop-{B}"]))
    assert all(s == 200 for statuses in results for s in statuses), results
    # Every load was placed by iop, one per model: none came from a request landing on a
    # router that did not hold its model.
    assert counted(fleet, "loads", "runtime") == 0
    assert counted(fleet, "loads", "demand") <= 4
    held = {p["id"]: sorted(m for m, s in p["models_state"].items() if s["state"] == "loaded")
            for p in catalog(fleet)}
    assert sorted(m for models in held.values() for m in models) == [A, B], held
    assert all(len(models) == 1 for models in held.values()), held
