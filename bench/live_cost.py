"""What the live figures cost Redis per call: ``lua/live.lua`` adding a worker's tally of N
calls to a provider x model's buckets, N from 1 (what ``finish.lua`` paid on every request
when it wrote each call's figures itself) up to a busy second's calls (what a worker's flush
pays now, ``dispatcher/live.py`` FLUSH_S).

    python -m bench.live_cost [--flushes 300] [--calls 1,10,100,1000]

A private redis-server; one pair's hash, its buckets first filled by 3,000 calls, so every
histogram holds what an hour of traffic spreads over it. Two spreads of calls:
*spread*, TTFT log-normal around 150 ms (sigma 1) and generation log-normal around 1.1 s
(sigma 0.8), 10-500 tokens out, one call in 20 a 5xx; *narrow*, JSON answers of 0.8-1.3 ms
with 16 tokens (bench.throughput's fake provider, which answers at once). Each row: µs per
flush is Redis's own time in the script (INFO commandstats' EVALSHA usec over the flushes),
and µs per call that over the calls a flush carries. Writes the ``live-cost`` section of
docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import random

from msgspec import msgpack
from redis.asyncio import Redis

from bench.stack import load_average, machine, markdown_table, write_section
from dispatcher import keys
from dispatcher.live import LiveSample, Tallies
from dispatcher.scripts import Script
from iop.redis_server import RedisServer

COMMAND = "python -m bench.live_cost"


def sample(rnd: random.Random, spread: str) -> tuple[LiveSample, int]:
    if spread == "narrow":
        return LiveSample(e2e_ms=rnd.uniform(0.8, 1.3)), 16
    if rnd.random() < 0.05:
        return LiveSample(e2e_ms=rnd.uniform(5, 50), error="5xx"), 0
    ttft = rnd.lognormvariate(5.0, 1.0)
    return LiveSample(e2e_ms=ttft + rnd.lognormvariate(7.0, 0.8), ttft_ms=ttft), rnd.randint(10, 500)


async def evalsha_usec(redis: Redis) -> tuple[int, int]:
    stats = await redis.info("commandstats")
    row = stats.get("cmdstat_evalsha", {})
    return int(row.get("calls", 0)), int(row.get("usec", 0))


async def flushes(redis: Redis, script: Script, rnd: random.Random, spread: str, calls: int, n: int) -> float:
    """µs Redis spent per flush of ``calls`` calls, over ``n`` flushes."""
    key = keys.live("p", "m")
    tallies = Tallies()
    before_calls, before_usec = await evalsha_usec(redis)
    for _ in range(n):
        for _ in range(calls):
            s, tokens = sample(rnd, spread)
            tallies.add("p", "m", s, tokens)
        taken = tallies.take()
        await script([key], [msgpack.encode(taken[("p", "m")])])
    after_calls, after_usec = await evalsha_usec(redis)
    assert after_calls - before_calls == n
    return (after_usec - before_usec) / n


async def measure(url: str, spreads: list[str], sizes: list[int], n: int) -> list[list[str]]:
    redis = Redis.from_url(url)
    script = Script(redis, None, "live")
    rows = []
    try:
        await redis.script_load(script.source)
        for spread in spreads:
            rnd = random.Random(f"live-cost-{spread}")
            await redis.delete(keys.live("p", "m"))
            await flushes(redis, script, rnd, spread, 100, 30)  # an hour's histograms
            hash_bytes = sum(len(v) for v in (await redis.hgetall(keys.live("p", "m"))).values())
            base = None
            for size in sizes:
                per_flush = await flushes(redis, script, rnd, spread, size, n)
                per_call = per_flush / size
                base = base or per_call
                rows.append([spread, f"{hash_bytes:,}", f"{size:,}", f"{per_flush:.1f}", f"{per_call:.2f}",
                             f"{base / per_call:.0f}x" if size > 1 else "-"])
    finally:
        await redis.aclose()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flushes", type=int, default=300)
    ap.add_argument("--calls", default="1,10,100,1000")
    args = ap.parse_args()
    sizes = [int(x) for x in args.calls.split(",")]
    before = load_average()
    with RedisServer() as server:
        rows = asyncio.run(measure(server.url, ["spread", "narrow"], sizes, args.flushes))
    table = markdown_table(["calls", "the pair's buckets (bytes)", "calls per flush", "µs per flush in Redis",
                            "µs per call", "cheaper per call than 1 per flush"], rows)
    notes = (f"{args.flushes} flushes per row. Machine: {machine()}. Load average before: {before}; "
             f"after: {load_average()}.\n")
    print(table)
    print(notes)
    command = COMMAND if (args.flushes, args.calls) == (300, "1,10,100,1000") else \
        f"{COMMAND} --flushes {args.flushes} --calls {args.calls}"
    write_section("live-cost", command, table, notes,
                  heading="### What the live figures cost Redis\n\n")


if __name__ == "__main__":
    main()
