"""The Redis client on the request path: redis-py's asyncio client against
``dispatcher.fastredis``, for the call iop makes most (EVALSHA, 9 keys, 14 arguments).

    python -m bench.redis_client [--calls 3000]

In series (one call at a time: latency and client CPU per call) and with 32 callers at
once (throughput and client CPU per call, where auto-pipelining batches writes).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import uvloop

from bench.stack import markdown_table, write_section
from dispatcher.redis_conn import connect, connect_fast
from iop.redis_server import RedisServer

COMMAND = "python -m bench.redis_client"
KEYS = [f"{{iop}}:k{i}" for i in range(9)]
ARGS = ["x" * 10] * 14


async def measure(call: Callable[[], Awaitable[Any]], calls: int) -> list[str]:
    for _ in range(200):
        await call()
    times = []
    cpu = time.process_time()
    for _ in range(calls):
        started = time.perf_counter()
        await call()
        times.append(time.perf_counter() - started)
    serial_cpu = (time.process_time() - cpu) / calls

    per_caller = max(calls // 32, 1)

    async def caller() -> None:
        for _ in range(per_caller):
            await call()

    cpu, started = time.process_time(), time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(32)))
    elapsed = time.perf_counter() - started
    busy_cpu = (time.process_time() - cpu) / (per_caller * 32)
    return [f"{statistics.median(times) * 1000:.3f}", f"{serial_cpu * 1e6:.0f}",
            f"{per_caller * 32 / elapsed:,.0f}", f"{busy_cpu * 1e6:.0f}"]


async def main(calls: int) -> str:
    with RedisServer() as server:
        redis, fast = connect(server.url), connect_fast(server.url)
        sha = await redis.script_load("return 1")
        rows = [
            ["redis-py (asyncio, hiredis)", *await measure(lambda: redis.evalsha(sha, len(KEYS), *KEYS, *ARGS), calls)],
            ["dispatcher.fastredis", *await measure(lambda: fast.evalsha(sha, "return 1", KEYS, ARGS), calls)],
        ]
        await fast.close()
        await redis.aclose()
    return markdown_table(["client", "in series p50 ms", "in series client µs/call", "32 callers calls/s",
                           "32 callers client µs/call"], rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    uvloop.install()
    table = asyncio.run(main(args.calls))
    print(table)
    write_section("redis-client", f"{COMMAND} --calls {args.calls}", table,
                  "A script that returns at once, so the figures are the clients' own cost and one round trip.\n")
