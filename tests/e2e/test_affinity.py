"""Cache-aware dispatch through real processes: three API processes that share nothing but
Redis send each tenant's prompts to one provider (the one that served its head first),
for chat, completions, Responses and Messages alike, and a drained home loses its tenants
at once; a busy home takes its tenant's next prompt into its engine's queue (affinity.home_queue)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from iop.redis_server import RedisServer
from tests.e2e.system import System, fast_dispatch, http_provider

PROVIDERS = ("p1", "p2", "p3")
APIS = ("api-1", "api-2", "api-3")


@pytest.fixture
def system(tmp_path: Path, redis_server: RedisServer) -> Iterator[System]:
    sys_ = System(tmp_path, redis_server)
    sys_.write_config({
        "dispatch": fast_dispatch(lease_ms=5000),
        "models": [{"id": "m", "providers": {p: "served" for p in PROVIDERS},
                    "affinity": {"mode": "prefix", "load_bound": 1.25}}],
        "nodes": [{"id": "n1", "providers": [
            http_provider(p, "vllm", sys_.port(p), 8, ["served"],
                          endpoints=["chat/completions", "completions", "responses", "messages"])
            for p in PROVIDERS]}],
    })
    try:
        for p in PROVIDERS:
            sys_.fake(p, "--tokens", "3")
        sys_.worker("n1")
        for name in APIS:
            sys_.api(name)
        sys_.wait_available(*PROVIDERS)
        yield sys_
    finally:
        sys_.close()


def document(tenant: str) -> str:
    return f"You are the assistant of tenant {tenant}. " + f"Rule {tenant}: be precise and cite clause {tenant}. " * 200


def body(endpoint: str, tenant: str, question: str) -> dict[str, object]:
    doc = document(tenant)
    if endpoint == "chat/completions":
        return {"model": "m", "messages": [{"role": "system", "content": doc}, {"role": "user", "content": question}]}
    if endpoint == "completions":
        return {"model": "m", "prompt": doc + "\n" + question}
    if endpoint == "responses":
        return {"model": "m", "instructions": doc, "input": question}
    return {"model": "m", "max_tokens": 16, "system": doc, "messages": [{"role": "user", "content": question}]}


def served_by(system: System, api: str, endpoint: str, tenant: str, question: str) -> str:
    r = httpx.post(f"{system.api_url_of(api)}/v1/{endpoint}", json=body(endpoint, tenant, question), timeout=30)
    assert r.status_code == 200, r.text
    return r.headers["x-iop-provider"]


@pytest.mark.parametrize("endpoint", ["chat/completions", "completions", "responses", "messages"])
def test_three_api_processes_send_a_tenant_home(system: System, endpoint: str) -> None:
    homes: dict[str, set[str]] = defaultdict(set)
    for round_ in range(4):
        for i, tenant in enumerate("abcdef"):
            api = APIS[(i + round_) % len(APIS)]
            homes[tenant].add(served_by(system, api, endpoint, tenant, f"question {round_} of {tenant}"))
    assert all(len(places) == 1 for places in homes.values()), dict(homes)
    # The tenants' heads are spread over the providers, not piled on one.
    assert len({next(iter(p)) for p in homes.values()}) > 1, dict(homes)
    catalog = httpx.get(f"{system.api_url}/catalog", timeout=10).json()
    model = next(m for m in catalog["models"] if m["id"] == "m")
    assert model["affinity"]["decisions"]["hit"] >= 18


def test_a_drained_home_loses_its_tenants_at_once(system: System) -> None:
    home = served_by(system, APIS[0], "chat/completions", "z", "first")
    r = httpx.post(f"{system.api_url}/admin/providers/{home}/drain", timeout=10)
    assert r.status_code == 200, r.text
    elsewhere = {served_by(system, APIS[1], "chat/completions", "z", f"q{i}") for i in range(3)}
    assert home not in elsewhere
    assert len(elsewhere) == 1  # a second home, kept


@pytest.fixture
def one_slot_system(tmp_path: Path, redis_server: RedisServer) -> Iterator[System]:
    """Two providers of capacity 1 whose engines run one answer at a time and queue the rest
    (``--parallel 1``), each answer taking 1.5 s: longer than affinity's max_wait_ms."""
    sys_ = System(tmp_path, redis_server)
    sys_.write_config({
        "dispatch": fast_dispatch(lease_ms=5000),
        "models": [{"id": "m", "providers": {p: "served" for p in ("q1", "q2")},
                    "affinity": {"mode": "prefix", "home_queue": 1.0}}],
        "nodes": [{"id": "n1", "providers": [
            http_provider(p, "vllm", sys_.port(p), 1, ["served"]) for p in ("q1", "q2")]}],
    })
    try:
        for p in ("q1", "q2"):
            sys_.fake(p, "--tokens", "3", "--parallel", "1", "--delay-ms", "1500")
        sys_.worker("n1")
        sys_.api("api-1")
        sys_.wait_available("q1", "q2")
        yield sys_
    finally:
        sys_.close()


def test_a_busy_home_queues_its_own_prompt_in_its_engine(one_slot_system: System) -> None:
    """With its one slot taken, a home takes its tenant's next prompt past its capacity, into
    its engine's queue; the other provider, idle, is not given it."""
    system = one_slot_system
    home = served_by(system, "api-1", "chat/completions", "x", "first")
    with ThreadPoolExecutor(2) as pool:
        served = list(pool.map(lambda q: served_by(system, "api-1", "chat/completions", "x", q), ["a", "b"]))
    assert served == [home, home]
    catalog = httpx.get(f"{system.api_url}/catalog", timeout=10).json()
    affinity = next(m for m in catalog["models"] if m["id"] == "m")["affinity"]
    assert (affinity["home_queue"], affinity["home_queued"]) == (1.0, 1)
