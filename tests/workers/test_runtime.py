"""What a config implies for a node's worker (workers/runtime.py): its ``NodeRuntime``, and
its adapters across reloads -- kept, retired (still there for the jobs they run), replaced,
added -- with HTTP sessions sized to the node."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import Redis

from dispatcher.config import Config, parse
from dispatcher.scripts import Scripts
from workers.adapters.openai_http import OpenAIHttpAdapter, session_size
from workers.runtime import NodeRuntime, ProviderAdapters

pytestmark = pytest.mark.anyio


def provider(pid: str, capacity: int = 1, url: str = "http://127.0.0.1:9") -> dict[str, Any]:
    return {"id": pid, "type": "openai_api", "base_url": url, "models": ["t"], "capacity": capacity}


def config(*providers: dict[str, Any], other_node: bool = False) -> Config:
    nodes = [{"id": "n1", "providers": list(providers)}]
    if other_node:
        nodes.append({"id": "n2", "providers": [provider("q")]})
    return parse({
        "models": [{"id": "m", "providers": {p["id"]: "t" for p in providers}}],
        "nodes": nodes,
    }).config


def test_a_runtime_is_the_node_its_config_names() -> None:
    scripts = Scripts(Redis())  # never connects: nothing here runs a script
    cfg = config(provider("a"), provider("b", capacity=3), other_node=True)
    runtime = NodeRuntime.build(cfg, "n1", scripts)
    assert runtime is not None
    assert runtime.config is cfg
    assert runtime.node.id == "n1"
    assert list(runtime.providers) == ["a", "b"]
    b = runtime.provider("b")
    assert b is not None
    assert b.capacity == 3
    assert runtime.provider("q") is None  # another node's
    assert NodeRuntime.build(cfg, "n9", scripts) is None


def test_a_runtime_has_the_plans_of_its_own_config() -> None:
    scripts = Scripts(Redis())
    one = NodeRuntime.build(config(provider("a")), "n1", scripts)
    two = NodeRuntime.build(config(provider("a"), provider("b")), "n1", scripts)
    assert one is not None
    assert two is not None
    assert one.calls is not two.calls


async def test_adapters_through_reloads() -> None:
    first = config(provider("a"), provider("b"), provider("c"))
    adapters = ProviderAdapters()
    adapters.open(first.nodes[0])
    try:
        a, b, c = adapters["a"], adapters["b"], adapters["c"]
        assert "a" in adapters
        assert isinstance(a, OpenAIHttpAdapter)

        # Removed: no longer current, but a job dispatched to it before still runs on it.
        adapters.retire("a")
        assert "a" not in adapters
        assert adapters.for_job("a") is a

        # Changed: a new adapter for new jobs; the old one kept for the running ones.
        changed = provider("b", url="http://127.0.0.1:10")
        second = config(changed, provider("c"))
        adapters.replace(second.nodes[0].providers[0], second.nodes[0])
        assert adapters["b"] is not b
        assert adapters.for_job("b") is adapters["b"]
        assert b in adapters.retired.values()

        # Added.
        third = config(changed, provider("c"), provider("d"))
        adapters.add(third.nodes[0].providers[2], third.nodes[0])
        assert adapters.for_job("d") is adapters["d"]
        assert adapters["c"] is c  # unchanged: kept
        assert adapters.for_job("zzz") is None
    finally:
        await adapters.aclose()


async def test_sessions_grow_with_the_node_and_all_close_at_exit() -> None:
    adapters = ProviderAdapters()
    small = config(provider("a", capacity=1))
    adapters.open(small.nodes[0])
    first = adapters["a"]
    assert isinstance(first, OpenAIHttpAdapter)
    session = first.session
    assert session_size(session) >= 1

    # A provider added without raising what the pool must hold shares the session.
    same = config(provider("a", capacity=1), provider("b", capacity=0))
    adapters.add(same.nodes[0].providers[1], same.nodes[0])
    shared = adapters["b"]
    assert isinstance(shared, OpenAIHttpAdapter)
    assert shared.session is session

    # One that raises it gets a session sized for the whole node.
    big = config(provider("a", capacity=1), provider("b", capacity=0), provider("c", capacity=40))
    adapters.add(big.nodes[0].providers[2], big.nodes[0])
    grown = adapters["c"]
    assert isinstance(grown, OpenAIHttpAdapter)
    assert grown.session is not session
    assert session_size(grown.session) >= 41

    await adapters.aclose()
    assert session.closed
    assert grown.session.closed
