"""What a config implies for a node's worker (workers/runtime.py): its ``NodeRuntime``, and
its adapters across reloads -- kept, retired (still there for the jobs they run, closed once
none does), replaced, added -- with HTTP sessions sized to the node."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import Redis

from dispatcher.config import Config, parse
from dispatcher.events import Assignment
from dispatcher.scripts import Scripts
from workers.adapters.base import Adapter
from workers.adapters.openai_http import OpenAIHttpAdapter, session_size
from workers.leases import Runs
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
        assert b in [r.adapter for r in adapters.retired]

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


def job(name: str, provider: str) -> Assignment:
    return Assignment(entry_id="1-0", job=name, fence=1, provider=provider, target="t", model="m", lane="",
                      replica="r1", endpoint="chat/completions", stream=False, attempt=1, submitted_ms=0,
                      dispatched_ms=0, body=b"")


def closes(monkeypatch: pytest.MonkeyPatch, adapter: Adapter) -> list[Adapter]:
    """A list that gets ``adapter`` when it is closed."""
    closed: list[Adapter] = []

    async def aclose() -> None:
        closed.append(adapter)

    monkeypatch.setattr(adapter, "aclose", aclose)
    return closed


async def test_a_retired_adapter_is_closed_once_its_runs_are_done(monkeypatch: pytest.MonkeyPatch) -> None:
    runs = Runs(keep_s=60)
    adapters = ProviderAdapters(runs)
    adapters.open(config(provider("a"), provider("b")).nodes[0])
    try:
        a, b = adapters["a"], adapters["b"]
        a_closed, b_closed = closes(monkeypatch, a), closes(monkeypatch, b)
        on_a, on_b = runs.start(job("j1", "a")), runs.start(job("j2", "b"))
        adapters.retire("a")
        changed = config(provider("b", url="http://127.0.0.1:10")).nodes[0]
        adapters.replace(changed.providers[0], changed)
        assert await adapters.close_idle() == 0  # each has a run that may be calling it
        assert len(adapters.retired) == 2

        # A job of the removed provider read after the reload runs on its old adapter, and
        # holds it too.
        late = runs.start(job("j3", "a"))
        assert adapters.for_job("a") is a
        runs.end(on_a)
        assert await adapters.close_idle() == 0
        assert a_closed == []

        runs.end(late)
        runs.end(on_b)
        # A new run of the changed provider runs on its new adapter: it holds nothing old.
        runs.start(job("j4", "b"))
        assert await adapters.close_idle() == 2
        assert (a_closed, b_closed) == ([a], [b])
        assert adapters.retired == []
        assert adapters.for_job("a") is None
    finally:
        await adapters.aclose()


async def test_a_retired_adapter_is_kept_at_least_keep_s() -> None:
    adapters = ProviderAdapters(Runs(keep_s=60), keep_s=3600)
    adapters.open(config(provider("a")).nodes[0])
    try:
        adapters.retire("a")
        assert await adapters.close_idle() == 0
        assert adapters.for_job("a") is not None  # a job dispatched before the reload may still come
    finally:
        await adapters.aclose()


async def test_a_provider_removed_again_loses_no_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    # Removed, added back, removed again: both of its old adapters are kept (for their runs)
    # and closed, not the first one overwritten by the second and never closed.
    runs = Runs(keep_s=60)
    adapters = ProviderAdapters(runs)
    node = config(provider("a"), provider("b")).nodes[0]
    adapters.open(node)
    try:
        first = adapters["a"]
        first_closed = closes(monkeypatch, first)
        on_first = runs.start(job("j1", "a"))
        adapters.retire("a")
        adapters.add(node.providers[0], node)
        second = adapters["a"]
        second_closed = closes(monkeypatch, second)
        assert second is not first
        assert adapters.for_job("a") is second  # jobs read from now on: the new adapter
        on_second = runs.start(job("j2", "a"))
        adapters.retire("a")
        assert [r.adapter for r in adapters.retired] == [first, second]
        assert adapters.for_job("a") is second
        assert await adapters.close_idle() == 0
        runs.end(on_first)
        assert await adapters.close_idle() == 1
        assert first_closed == [first]
        runs.end(on_second)
        assert await adapters.close_idle() == 1
        assert second_closed == [second]
    finally:
        await adapters.aclose()
