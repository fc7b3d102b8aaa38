"""Tokens per second per provider: ``lua/finish.lua``'s two 10 s buckets in the provider
hash (every available Redis version), and how ``dispatcher/wire.py`` TokenWindow reads them.

The server's clock cannot be moved, so time passing is played by moving ``tok_t0`` back."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import Redis

from dispatcher import keys, wire
from dispatcher.catalog import read_catalog
from tests.dispatcher.harness import Harness, make_config

pytestmark = pytest.mark.anyio


@pytest.fixture
async def h(any_redis: Redis) -> Harness:
    harness = Harness(any_redis, make_config({"a": 4}, {"m": ["a"]}))
    await harness.up("a")
    return harness


async def now_ms(redis: Redis) -> int:
    sec, usec = await redis.time()
    return int(sec) * 1000 + int(usec) // 1000


async def window(h: Harness) -> dict[str, int]:
    raw = await h.redis.hmget(keys.provider("a"), ["tok_t0", "tok_cur", "tok_prev"])
    return {name: int(v) for name, v in zip(("t0", "cur", "prev"), raw, strict=True) if v is not None}


async def run_one(h: Harness, tokens: int, fence_delta: int = 0) -> str:
    job, status = await h.submit("m")
    assert status == "dispatched"
    a = await h.assignment(job)
    if fence_delta:
        a = type(a)(**{**{f: getattr(a, f) for f in a.__struct_fields__}, "fence": a.fence + fence_delta})
    return str(await h.node.finish(a, b"x", tokens=tokens))


async def age(h: Harness, ms: int) -> int:
    """Make the current bucket ``ms`` old; its new start."""
    t0 = await now_ms(h.redis) - ms
    await h.redis.hset(keys.provider("a"), "tok_t0", t0)
    return t0


async def test_a_finish_without_tokens_writes_nothing(h: Harness) -> None:
    assert await run_one(h, 0) == "released"
    assert await window(h) == {}


async def test_the_first_tokens_open_a_bucket_and_more_add_to_it(h: Harness) -> None:
    before = await now_ms(h.redis)
    await run_one(h, 40)
    w = await window(h)
    assert w["cur"] == 40
    assert w["prev"] == 0
    assert before <= w["t0"] <= await now_ms(h.redis)
    await run_one(h, 2)
    assert await window(h) == {**w, "cur": 42}


async def test_one_bucket_later_the_current_becomes_the_previous(h: Harness) -> None:
    await run_one(h, 40)
    t0 = await age(h, 12_000)
    await run_one(h, 5)
    assert await window(h) == {"t0": t0 + 10_000, "cur": 5, "prev": 40}


async def test_two_buckets_later_both_start_afresh(h: Harness) -> None:
    await run_one(h, 40)
    await age(h, 25_000)
    before = await now_ms(h.redis)
    await run_one(h, 5)
    w = await window(h)
    assert (w["cur"], w["prev"]) == (5, 0)
    assert w["t0"] >= before


async def test_a_clock_gone_back_starts_afresh(h: Harness) -> None:
    await run_one(h, 40)
    await age(h, -60_000)  # a new primary whose clock is a minute behind
    await run_one(h, 5)
    w = await window(h)
    assert (w["cur"], w["prev"]) == (5, 0)
    assert w["t0"] <= await now_ms(h.redis)


async def test_a_stale_finish_counts_nothing(h: Harness) -> None:
    assert await run_one(h, 40, fence_delta=1) == "stale"
    assert await window(h) == {}


async def test_a_requeue_counts_only_what_it_is_given(h: Harness) -> None:
    job, _ = await h.submit("m")
    assert await h.node.finish(await h.assignment(job), b"", mode="requeue") == "requeued"
    assert await window(h) == {}


def fields(t0: int, cur: int, prev: int) -> dict[str, str]:
    return {"tok_t0": str(t0), "tok_cur": str(cur), "tok_prev": str(prev)}


@pytest.mark.parametrize(("elapsed", "cur", "prev", "expected"), [
    (0, 50, 0, 5.0),  # the bucket just began: what it holds, over 10 s
    (0, 50, 100, 15.0),  # ... and all of the one before
    (5_000, 50, 100, 10.0),  # half of the one before still in the window
    (9_999, 50, 100, 5.001),
    (10_000, 50, 100, 5.0),  # not rolled over yet: the current one is now the one before
    (15_000, 50, 100, 2.5),
    (20_000, 50, 100, 0.0),  # idle for two buckets
    (-3_000, 50, 100, 15.0),  # a clock behind the bucket: as if it just began
])
def test_the_rate_read_from_the_buckets(elapsed: int, cur: int, prev: int, expected: float) -> None:
    window = wire.token_window(fields(1_000_000, cur, prev))
    assert window is not None
    assert window.per_s(1_000_000 + elapsed) == pytest.approx(expected)


@pytest.mark.parametrize("found", [{}, {"tok_cur": "5"}, {"tok_t0": "x", "tok_cur": "5"}])
def test_no_window_is_no_rate(found: dict[str, str]) -> None:
    assert wire.token_window(found) is None


async def test_the_catalog_shows_the_rate(h: Harness) -> None:
    before: Any = await read_catalog(h.redis, h.config)
    assert before.providers[0].tokens_per_s == 0.0
    await run_one(h, 30)
    after: Any = await read_catalog(h.redis, h.config)
    assert after.providers[0].tokens_per_s == pytest.approx(3.0)


async def test_prompt_and_cached_tokens_add_up_to_the_providers_cache_hit_rate(h: Harness) -> None:
    for prompt, cached in ((1000, 900), (500, 0), (500, 100)):
        job, _ = await h.submit("m")
        assert await h.node.finish(await h.assignment(job), b"x", tokens=5, prompt=prompt, cached=cached) == "released"
    raw = await h.redis.hmget(keys.provider("a"), ["prompt_tokens", "cached_tokens"])
    assert [int(v) for v in raw] == [2000, 1000]
    view = next(p for p in (await read_catalog(h.redis, h.config)).providers if p.id == "a")
    assert (view.prompt_tokens, view.cached_tokens, view.cache_hit_rate) == (2000, 1000, 0.5)
    # A fenced-off worker's finish (its job was taken over) adds nothing.
    assert await run_one(h, 3, fence_delta=1) == "stale"
    assert int(await h.redis.hget(keys.provider("a"), "prompt_tokens")) == 2000


async def test_a_provider_that_reports_no_cached_tokens_has_no_hit_rate(h: Harness) -> None:
    job, _ = await h.submit("m")
    await h.node.finish(await h.assignment(job), b"x", prompt=300)
    view = next(p for p in (await read_catalog(h.redis, h.config)).providers if p.id == "a")
    assert (view.prompt_tokens, view.cache_hit_rate) == (300, None)
