"""What a worker publishes of a provider's load (``lua/capacity.lua``), and what dispatch makes
of it (``lib/provider_state.lua``), against real Redis servers (every available version): the
limit in force, load iop does not send, a rate limit's pause, the history of the limit."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from dispatcher import keys, wire
from dispatcher.catalog import read_catalog
from tests.dispatcher.harness import Harness, make_config

pytestmark = pytest.mark.anyio


def report(capacity: int, **extra: object) -> wire.CapacityReport:
    return wire.CapacityReport(capacity=capacity, mode="auto", **extra)  # type: ignore[arg-type]


async def placed(h: Harness, n: int) -> list[str]:
    """Submit ``n`` jobs of model m; where each went ('' for one left waiting)."""
    out = []
    for _ in range(n):
        job, status = await h.submit("m")
        out.append((await h.assignment(job)).provider if status == "dispatched" else "")
    return out


async def test_a_limit_that_rises_takes_waiting_jobs_at_once(any_redis: Redis) -> None:
    h = Harness(any_redis, make_config({"p": 1}, {"m": ["p"]}))
    await h.up("p")
    assert await placed(h, 3) == ["p", "", ""]
    assert await h.node.publish_capacity("p", report(3, moved=True)) == 2  # the two waiting ones
    assert await h.in_flight("p") == 3


async def test_a_limit_that_falls_below_in_flight_dispatches_nothing_until_under_it(any_redis: Redis) -> None:
    h = Harness(any_redis, make_config({"p": 4}, {"m": ["p"]}))
    await h.up("p")
    running = await placed(h, 4)
    assert running == ["p"] * 4
    await h.node.publish_capacity("p", report(2, moved=True))
    assert await placed(h, 1) == [""]
    jobs = [a for a in await h.assignments()]
    # Two finish: in_flight 2, still not under the limit: the waiting job stays.
    for a in jobs[:2]:
        await h.node.finish(a, b"x")
    assert await h.in_flight("p") == 2
    assert len(await h.queued("m")) == 1
    await h.node.finish(jobs[2], b"x")
    assert await h.in_flight("p") == 2  # under it: the waiting one went
    assert await h.queued("m") == []


async def test_load_iop_does_not_send_counts_against_the_provider(any_redis: Redis) -> None:
    h = Harness(any_redis, make_config({"a": 4, "b": 4}, {"m": ["a", "b"]}))
    await h.up("a")
    await h.up("b")
    await h.node.publish_capacity("a", report(4, external=3))
    # a has one free slot of four, b four: b first, until it is as loaded as a.
    assert await placed(h, 5) == ["b", "b", "b", "a", "b"]
    view = next(p for p in (await read_catalog(h.redis, h.config)).providers if p.id == "a")
    assert view.external_load == 3
    assert view.load_ratio == 1.0  # (1 of iop's + 3 of others') / 4


async def test_a_rate_limit_holds_a_provider_for_as_long_as_it_says(any_redis: Redis) -> None:
    h = Harness(any_redis, make_config({"a": 4, "b": 4}, {"m": ["a", "b"]}))
    await h.up("a")
    await h.up("b")
    await h.node.publish_capacity("a", report(4, hold_ms=60_000, hold_reason="429: nothing sent for 60s"))
    assert await placed(h, 3) == ["b", "b", "b"]  # a is idle and the lower id, yet held
    view = next(p for p in (await read_catalog(h.redis, h.config)).providers if p.id == "a")
    assert view.rate_limited is not None
    assert view.rate_limited.reason.startswith("429")
    assert view.health == "available"  # held is not down: nothing is refused for it
    await h.node.publish_capacity("a", report(4))
    assert await placed(h, 1) == ["a"]


async def test_the_catalog_shows_the_limit_its_mode_reason_engine_and_history(any_redis: Redis) -> None:
    config = make_config({"p": 1}, {"m": ["p"]})
    h = Harness(any_redis, config)
    await h.up("p")
    engine = wire.EngineReading(running=3, waiting=1, kv_usage=0.5, age_ms=40)
    for limit, moved in ((2, True), (3, True), (4, True), (4, False)):  # unmoved: no history entry
        await h.node.publish_capacity("p", report(limit, reason=f"test: {limit - 1} → {limit}", moved=moved,
                                                  engine=wire.encode(engine).decode(), service_ms=1200.0))
    raw = await h.redis.lrange(keys.capacity_history("p"), 0, -1)
    assert [e.decode().split(":")[1] for e in raw] == ["2", "3", "4"]
    view = next(p for p in (await read_catalog(h.redis, h.config)).providers if p.id == "p")
    assert view.capacity == 4
    assert view.capacity_reason == ""  # a fixed provider's config: its reason is not shown
    assert view.engine is not None
    assert (view.engine.running, view.engine.waiting, view.engine.kv_usage) == (3, 1, 0.5)
    assert view.engine.age_ms >= 40
    assert view.service_ms == 1200.0
