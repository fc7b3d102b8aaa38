"""Live figures from traffic (issue 32): what a worker tallies of the calls it finishes
(``WorkerSide.finish``, ``dispatcher/live.py`` Tallies) and its flush adds to a provider x
model's buckets (``lua/live.lua``), the uptime heartbeats keep (``lua/lib/uptime.lua``),
and how ``dispatcher/live.py`` and the catalog read them, against a real Redis of every
available version. The server's clock cannot be moved, so an older bucket is played by
writing one with an older number."""

from __future__ import annotations

import random
import re
import statistics
from typing import cast

import msgspec
import pytest
from redis.asyncio import Redis

from dispatcher import keys, live, scripts, wire
from dispatcher.catalog import read_catalog
from dispatcher.live import LiveSample, percentile
from tests.dispatcher.harness import Harness, make_config

pytestmark = pytest.mark.anyio


@pytest.fixture
async def h(any_redis: Redis) -> Harness:
    harness = Harness(any_redis, make_config({"a": 8, "b": 8}, {"m": ["a", "b"], "n": ["a"]}))
    await harness.up("a")
    await harness.up("b")
    return harness


async def now_ms(redis: Redis) -> int:
    sec, usec = await redis.time()
    return int(sec) * 1000 + int(usec) // 1000


async def run_one(h: Harness, sample: LiveSample | None, model: str = "m", tokens: int = 0) -> str:
    """One call finished, and the worker's tallies flushed."""
    job, status = await h.submit(model)
    assert status == "dispatched"
    a = await h.assignment(job)
    outcome = str(await h.node.finish(a, b"x", tokens=tokens, live=sample))
    await h.node.flush_live()
    return outcome


async def buckets(h: Harness, provider: str, model: str = "m") -> dict[str, wire.LiveBucket]:
    raw = cast(dict[bytes, bytes], await h.redis.hgetall(keys.live(provider, model)))
    out = {}
    for k, v in raw.items():
        b = wire.live_bucket(v)
        assert b is not None, v
        out[k.decode()] = b
    return out


def test_the_lua_windows_are_pythons() -> None:
    source = scripts.source("live")
    table = re.search(r"LIVE_WINDOWS = \{(.*)\}\n", source)
    assert table is not None
    found = tuple((n, int(length), int(count)) for n, length, count in
                  re.findall(r"\{'(\w+)', (\d+), (\d+)\}", table.group(1)))
    assert found == live.WINDOWS


async def test_a_finish_without_a_sample_writes_no_figures(h: Harness) -> None:
    assert await run_one(h, None) == "released"
    assert await h.redis.exists(keys.live("a", "m")) == 0
    assert await h.redis.exists(keys.live("b", "m")) == 0


async def test_an_answered_call_lands_in_the_current_bucket_of_every_window(h: Harness) -> None:
    await h.set_in_flight("b", 8)
    before = await now_ms(h.redis)
    await run_one(h, LiveSample(e2e_ms=900.0, ttft_ms=100.0), tokens=80)
    got = await buckets(h, "a")
    assert len(got) == 3
    for name, length, count in live.WINDOWS:
        field = next(f for f in got if f.startswith(name + ":"))
        b = got[field]
        assert b.at in (before // length, (before // length) + 1)
        assert field == f"{name}:{b.at % count}"
        assert b.requests == 1
        assert b.errors == {}
        assert b.ttft == {live.bin_of(100.0): 1}
        assert b.e2e == {live.bin_of(900.0): 1}
        # 80 tokens over the 800 ms after the first output.
        assert b.tps == {live.bin_of(100.0): 1}


async def test_errors_are_counted_by_kind_and_kept_out_of_the_latencies(h: Harness) -> None:
    await h.set_in_flight("b", 8)  # everything to a
    await run_one(h, LiveSample(e2e_ms=20.0, error="5xx"))
    await run_one(h, LiveSample(e2e_ms=20.0, error="5xx"))
    await run_one(h, LiveSample(e2e_ms=30.0, error="timeout"))
    await run_one(h, LiveSample(e2e_ms=50.0))  # a JSON answer: no TTFT
    b = (await buckets(h, "a"))
    five = next(v for k, v in b.items() if k.startswith("5m:"))
    assert five.requests == 4
    assert five.errors == {"5xx": 2, "timeout": 1}
    assert five.ttft == {}
    assert five.e2e == {live.bin_of(50.0): 1}
    assert five.tps == {}


async def test_each_model_of_a_provider_has_its_own_figures(h: Harness) -> None:
    await h.set_in_flight("b", 8)
    await run_one(h, LiveSample(e2e_ms=10.0), model="m")
    await run_one(h, LiveSample(e2e_ms=10.0), model="n")
    await run_one(h, LiveSample(e2e_ms=10.0), model="n")
    cat = await read_catalog(h.redis, h.config)
    a = next(p for p in cat.providers if p.id == "a")
    assert a.live_by_model["m"]["5m"].requests == 1
    assert a.live_by_model["n"]["5m"].requests == 2
    assert a.live["5m"].requests == 3
    assert a.live["24h"].requests == 3
    b = next(p for p in cat.providers if p.id == "b")
    assert b.live["5m"].requests == 0
    assert b.live["5m"].ttft_ms is None


async def test_a_bucket_from_an_older_turn_of_its_slot_is_replaced_not_added_to(h: Harness) -> None:
    await h.set_in_flight("b", 8)
    now = await now_ms(h.redis)
    length, count = live.WINDOWS[0][1], live.WINDOWS[0][2]
    at = now // length
    old = wire.LiveBucket(at=at - count, requests=50, e2e={live.bin_of(5.0): 50})
    await h.redis.hset(keys.live("a", "m"), f"5m:{at % count}", msgspec.msgpack.encode(old))
    await run_one(h, LiveSample(e2e_ms=400.0))
    b = (await buckets(h, "a"))[f"5m:{(await now_ms(h.redis)) // length % count}"]
    assert b.requests == 1
    assert b.e2e == {live.bin_of(400.0): 1}


async def test_the_catalog_reads_only_buckets_inside_each_window(h: Harness) -> None:
    now = await now_ms(h.redis)
    length, count = live.WINDOWS[0][1], live.WINDOWS[0][2]
    at = now // length
    inside = wire.LiveBucket(at=at - count + 2, requests=3, e2e={live.bin_of(100.0): 3})
    outside = wire.LiveBucket(at=at - count - 1, requests=7, e2e={live.bin_of(100.0): 7})
    await h.redis.hset(keys.live("a", "m"), mapping={
        f"5m:{(at - count + 2) % count}": msgspec.msgpack.encode(inside),
        f"5m:{(at - count - 1) % count}": msgspec.msgpack.encode(outside)})
    a = next(p for p in (await read_catalog(h.redis, h.config)).providers if p.id == "a")
    assert a.live["5m"].requests == 3
    e2e = a.live["5m"].e2e_ms
    assert e2e is not None
    assert 100.0 <= e2e.p50 < 105.0


async def test_a_fenced_finish_counts_nothing(h: Harness) -> None:
    job, _ = await h.submit("m")
    a = await h.assignment(job)
    stale = type(a)(**{**{f: getattr(a, f) for f in a.__struct_fields__}, "fence": a.fence + 1})
    assert str(await h.node.finish(stale, b"x", live=LiveSample(e2e_ms=10.0))) == "stale"
    assert len(h.node.tallies) == 0
    assert await h.node.flush_live() == 0
    assert await h.redis.exists(keys.live(a.provider, "m")) == 0


async def test_a_flush_adds_many_calls_as_one_by_one_would(h: Harness) -> None:
    """The tally is binned by the worker and added at once: the same buckets as a flush after
    every call."""
    await h.set_in_flight("b", 8)
    rnd = random.Random(3)
    samples = [LiveSample(e2e_ms=rnd.uniform(50, 5000), ttft_ms=rnd.choice([None, rnd.uniform(1, 40)]),
                          error=rnd.choice(["", "", "", "5xx", "timeout"])) for _ in range(40)]
    tokens = [rnd.randint(0, 300) for _ in samples]
    for sample, n in zip(samples, tokens, strict=True):
        await run_one(h, sample, tokens=n)
    one_by_one = await buckets(h, "a")
    await h.redis.delete(keys.live("a", "m"))
    for sample, n in zip(samples, tokens, strict=True):
        job, _ = await h.submit("m")
        await h.node.finish(await h.assignment(job), b"x", tokens=n, live=sample)
    assert len(h.node.tallies) == 1
    assert await h.node.flush_live() == 1
    at_once = await buckets(h, "a")
    assert at_once.keys() == one_by_one.keys()
    for field, b in at_once.items():
        assert msgspec.structs.replace(b, at=0) == msgspec.structs.replace(one_by_one[field], at=0), field
    five = next(v for k, v in at_once.items() if k.startswith("5m:"))
    assert five.requests == 40
    assert sum(five.errors.values()) == sum(1 for s in samples if s.error)


async def test_a_flush_redis_refused_is_kept_for_the_next(h: Harness) -> None:
    await h.set_in_flight("b", 8)
    job, _ = await h.submit("m")
    await h.node.finish(await h.assignment(job), b"x", live=LiveSample(e2e_ms=30.0))
    job, _ = await h.submit("m")
    await h.node.finish(await h.assignment(job), b"x", live=LiveSample(e2e_ms=30.0, error="5xx"))
    real = h.calls.add_live

    async def refuse(*args: object) -> int:
        raise ConnectionError("Redis went away")

    h.calls.add_live = refuse  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        await h.node.flush_live()
    h.calls.add_live = real  # type: ignore[method-assign]
    job, _ = await h.submit("m")
    await h.node.finish(await h.assignment(job), b"x", live=LiveSample(e2e_ms=30.0))
    assert await h.node.flush_live() == 1
    five = next(v for k, v in (await buckets(h, "a")).items() if k.startswith("5m:"))
    assert five.requests == 3
    assert five.errors == {"5xx": 1}
    assert five.e2e == {live.bin_of(30.0): 2}


def test_a_percentile_read_from_the_histogram_is_within_the_bins_half_width() -> None:
    rnd = random.Random(7)
    for _ in range(20):
        mu, sigma = rnd.uniform(2, 8), rnd.uniform(0.05, 1.0)
        samples = [rnd.lognormvariate(mu, sigma) for _ in range(1000)]
        hist: dict[int, int] = {}
        for s in samples:
            hist[live.bin_of(s)] = hist.get(live.bin_of(s), 0) + 1
        for q in (0.5, 0.9):
            exact = statistics.quantiles(samples, n=100, method="inclusive")[int(q * 100) - 1]
            got = percentile(hist, q)
            assert got is not None
            assert abs(got / exact - 1) < 0.025 + 0.01, (q, got, exact)


def test_an_empty_histogram_has_no_percentile() -> None:
    assert percentile({}, 0.5) is None


# --- uptime, from heartbeats ----------------------------------------------------------------


async def up_buckets(h: Harness, provider: str) -> dict[str, wire.UptimeBucket]:
    raw = cast(dict[bytes, bytes], await h.redis.hgetall(keys.provider(provider)))
    return {k.decode(): b for k, v in raw.items() if k.startswith(b"up:")
            and (b := wire.uptime_bucket(v.decode())) is not None}


async def window_total(h: Harness, provider: str, window: str) -> wire.UptimeBucket:
    """A window's buckets added up (a test may straddle a bucket's end)."""
    got = [b for k, b in (await up_buckets(h, provider)).items() if k.startswith(f"up:{window}:")]
    return wire.UptimeBucket(0, sum(b.up_ms for b in got), sum(b.seen_ms for b in got))


async def test_heartbeats_of_an_available_provider_count_its_time_as_up(h: Harness) -> None:
    await h.redis.hset(keys.provider("a"), "hb_ms", await now_ms(h.redis) - 1000)
    await h.up("a")
    got = await up_buckets(h, "a")
    assert len(got) == 3
    for b in got.values():
        assert 1000 <= b.seen_ms < 1500
        assert b.up_ms == b.seen_ms
    a = next(p for p in (await read_catalog(h.redis, h.config)).providers if p.id == "a")
    assert a.live["5m"].uptime == 1.0


async def test_time_reported_unavailable_or_past_a_heartbeats_expiry_is_not_up(h: Harness) -> None:
    now = await now_ms(h.redis)
    # Up for 1 s (the last heartbeat expired 1 s after it was sent), silent 3 s after.
    await h.redis.hset(keys.provider("a"), mapping={"hb_ms": now - 4000, "hb_exp": now - 3000})
    await h.up("a")
    b = await window_total(h, "a", "5m")
    assert 4000 <= b.seen_ms < 4500
    assert b.up_ms == 1000
    await h.redis.hset(keys.provider("a"), "hb_ms", (await now_ms(h.redis)) - 2000)
    await h.up("a", "unavailable")  # the 2 s before it were still up: it said available then
    await h.redis.hset(keys.provider("a"), "hb_ms", (await now_ms(h.redis)) - 2000)
    await h.up("a")  # those 2 s it was unavailable
    b = await window_total(h, "a", "5m")
    assert 3000 <= b.up_ms < 3100
    assert 8000 <= b.seen_ms < 9000
    a = next(p for p in (await read_catalog(h.redis, h.config)).providers if p.id == "a")
    assert a.live["5m"].uptime is not None
    assert 0.3 < a.live["5m"].uptime < 0.4


async def test_a_provider_never_heard_of_has_no_uptime_rather_than_zero(h: Harness) -> None:
    cat = await read_catalog(h.redis, h.config)
    a = next(p for p in cat.providers if p.id == "a")
    assert a.live["5m"].uptime is None  # one heartbeat so far: nothing seen yet


async def test_a_pair_no_call_touches_past_its_longest_window_expires(h: Harness) -> None:
    await run_one(h, LiveSample(e2e_ms=120.0, ttft_ms=40.0, error=""))
    key = keys.live("a", "m") if await h.redis.exists(keys.live("a", "m")) else keys.live("b", "m")
    ttl_ms = await h.redis.pttl(key)
    longest_ms = max(length * count for _, length, count in live.WINDOWS)
    # Kept past the 24h window (a removed provider's figures do not stay forever), each call
    # giving it that long again.
    assert longest_ms < ttl_ms <= longest_ms + 3600 * 1000
