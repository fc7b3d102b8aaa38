"""``Worker`` as the wiring of its parts (workers/worker.py), in this event loop against a
private redis-server and the project's fake providers: what a reload swaps and what it
tells Redis, and what it refuses; the live figures it flushes, every second and when it
stops. (Signals, shutdown and crashes: tests/e2e, with real processes.)"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml
from redis.asyncio import Redis

from dispatcher import keys, wire
from dispatcher.config import Config, parse
from dispatcher.config.field_rules import restart_paths
from dispatcher.exceptions import ConfigError
from dispatcher.live import FLUSH_S, LiveSample
from iop.fake_provider import FakeOptions, start
from iop.redis_server import RedisServer, free_port
from tests.waiting import eventually
from workers.worker import Worker

pytestmark = pytest.mark.anyio

HOST = "127.0.0.1"


def raw_config(redis_url: str, ports: dict[str, int], capacities: dict[str, int] | None = None,
               node: str = "n1") -> dict[str, Any]:
    capacities = capacities or {}
    return {
        "redis": {"url": redis_url},
        "models": [{"id": "m", "providers": {pid: "t" for pid in ports}}],
        "nodes": [{"id": node, "providers": [
            {"id": pid, "type": "openai_api", "base_url": f"http://{HOST}:{port}", "models": ["t"],
             "capacity": capacities.get(pid, 1), "timeout_s": 10}
            for pid, port in ports.items()]}],
        "dispatch": {"heartbeat_interval_ms": 50, "heartbeat_ttl_ms": 2000, "probe_interval_ms": 100,
                     "probe_timeout_ms": 1000, "drain_grace_s": 0, "lease_ms": 900, "reap_interval_ms": 100},
    }


@pytest.fixture
async def fakes() -> AsyncIterator[dict[str, int]]:
    """Three fake providers, a, b and c: their ports."""
    ports = {pid: free_port() for pid in ("a", "b", "c")}
    runners = [await start(HOST, port, FakeOptions(models=["t"])) for port in ports.values()]
    try:
        yield ports
    finally:
        for runner in runners:
            await runner.cleanup()


async def provider_hash(redis: Redis, pid: str) -> dict[str, str]:
    raw: dict[bytes, bytes] = await redis.hgetall(keys.provider(pid))  # type: ignore[assignment]
    return {k.decode(): v.decode() for k, v in raw.items()}


async def until(redis: Redis, pid: str, check: Callable[[dict[str, str]], bool]) -> dict[str, str]:
    return await eventually(lambda: provider_hash(redis, pid), check, what=f"{pid}'s hash")


@contextlib.asynccontextmanager
async def serving(path: Path, raw: dict[str, Any], redis: Redis) -> AsyncIterator[Worker]:
    """A worker of node n1 running from the config file ``path`` (written with ``raw``), once
    its provider ``a`` is available; stopped at the end."""
    await anyio.Path(path).write_text(yaml.safe_dump(raw))
    worker = Worker(parse(raw).config, "n1", str(path))
    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.run)
        try:
            await until(redis, "a", lambda h: h.get("health") == "available")
            yield worker
        finally:
            worker.stop()


def test_what_a_worker_gives_its_parts_at_start_is_what_a_reload_cannot_change() -> None:
    # Worker.__init__ hands lease_ms, heartbeat_interval_ms and drain_grace_s to its parts
    # once: right only while the whole dispatch section waits for a restart.
    assert ("dispatch",) in restart_paths(Config)


def test_a_worker_for_a_node_the_config_lacks_is_refused(redis_server: RedisServer) -> None:
    config = parse(raw_config(redis_server.url, {"a": 9})).config
    with pytest.raises(ConfigError, match="no node with id 'n9'"):
        Worker(config, "n9")


async def test_a_reload_swaps_the_runtime_and_tells_redis_what_changed(
    tmp_path: Path, redis_server: RedisServer, redis: Redis, fakes: dict[str, int]
) -> None:
    path = tmp_path / "iop.yaml"
    async with serving(path, raw_config(redis_server.url, {"a": fakes["a"], "b": fakes["b"]}), redis) as worker:
        await until(redis, "b", lambda h: h.get("health") == "available")
        old_runtime = worker.runtime
        old_b = worker.adapters["b"]
        old_a = worker.adapters["a"]

        # a resized, b removed, c added.
        path.write_text(yaml.safe_dump(raw_config(redis_server.url, {"a": fakes["a"], "c": fakes["c"]},
                                                  capacities={"a": 4})))
        assert await worker.reload()

        assert worker.runtime is not old_runtime
        assert [p.id for p in worker.runtime.node.providers] == ["a", "c"]
        # One reference swapped: every part sees the new config (its plans) through it.
        assert worker.current() is worker.runtime
        assert worker.side.calls is worker.runtime.calls
        assert worker.reaper.calls is worker.runtime.calls
        assert worker.reaper.provider_ids == ["a", "c"]
        removed = await provider_hash(redis, "b")
        assert removed["health"] == "unavailable"
        assert removed["reason"] == "removed from the config"
        assert removed["removed"] == "1"
        assert "b" not in worker.adapters
        assert worker.adapters.for_job("b") is old_b  # what it runs finishes on it
        assert worker.adapters["a"] is not old_a
        await until(redis, "a", lambda h: h.get("capacity") == "4")
        await until(redis, "c", lambda h: h.get("health") == "available")
        # b stays as the reload left it: nothing heartbeats it any more.
        for _ in range(3):
            beat = (await provider_hash(redis, "a"))["hb_ms"]
            await until(redis, "a", lambda h, beat=beat: h["hb_ms"] != beat)  # type: ignore[misc]
        assert (await provider_hash(redis, "b"))["removed"] == "1"


async def test_a_reload_without_the_node_changes_nothing(
    tmp_path: Path, redis_server: RedisServer, redis: Redis, fakes: dict[str, int]
) -> None:
    path = tmp_path / "iop.yaml"
    async with serving(path, raw_config(redis_server.url, {"a": fakes["a"]}), redis) as worker:
        before = worker.runtime
        path.write_text(yaml.safe_dump(raw_config(redis_server.url, {"a": fakes["a"]}, node="other")))
        assert not await worker.reload()
        assert worker.runtime is before
        assert "a" in worker.adapters


async def test_a_worker_without_a_config_file_does_not_reload(redis_server: RedisServer) -> None:
    worker = Worker(parse(raw_config(redis_server.url, {"a": 9})).config, "n1")
    try:
        assert not await worker.reload()
    finally:
        await worker.clients.aclose()


async def test_the_calls_a_worker_tallied_reach_the_live_figures_within_a_flush(
    tmp_path: Path, redis_server: RedisServer, redis: Redis, fakes: dict[str, int]
) -> None:
    async with serving(tmp_path / "iop.yaml", raw_config(redis_server.url, {"a": fakes["a"]}), redis) as worker:
        worker.side.tallies.add("a", "m", LiveSample(e2e_ms=120.0))
        await eventually(lambda: redis.exists(keys.live("a", "m")), within=5 * FLUSH_S, what="a flush")
        assert len(worker.side.tallies) == 0


async def test_a_stopping_worker_writes_what_it_tallied_last(
    tmp_path: Path, redis_server: RedisServer, redis: Redis, fakes: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("workers.worker.FLUSH_S", 3600.0)  # no flush but the last one
    async with serving(tmp_path / "iop.yaml", raw_config(redis_server.url, {"a": fakes["a"]}), redis) as worker:
        worker.side.tallies.add("a", "m", LiveSample(e2e_ms=120.0, error="5xx"))
        assert not await redis.exists(keys.live("a", "m"))
    raw = await redis.hgetall(keys.live("a", "m"))
    buckets = [wire.live_bucket(v) for v in raw.values()]
    assert len(buckets) == 3
    assert all(b is not None and b.requests == 1 and b.errors == {"5xx": 1} for b in buckets)
