"""Submit and dispatch cost as the queue grows: 0, 10,000 and 100,000 jobs waiting.

    python -m bench.queue_depth [--calls 2000]

Straight against Redis with the real scripts (no HTTP): one provider of capacity 1
holds its slot, the queue of its model is filled to the depth, then
* submit: a job joins the full queue (it is cancelled again, untimed, so the depth
  stays put);
* dispatch: a worker's ``finish`` releases the slot and the pump hands it to the head
  of the queue (the queue shrinks by one per call).
Both are reported as the client's round trip (p50) and Redis's own time per script
call (INFO commandstats).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import cast

import uvloop
from redis.asyncio import Redis

from bench.stack import markdown_table, write_section
from dispatcher import config as cfg
from dispatcher import keys
from dispatcher.api_side import ApiSide
from dispatcher.events import Assignment
from dispatcher.plans import Plans
from dispatcher.redis_conn import connect, connect_fast
from dispatcher.script_calls import CancelReason, ScriptCalls
from dispatcher.scripts import Scripts
from dispatcher.worker_side import WorkerSide
from iop.redis_server import RedisServer

COMMAND = "python -m bench.queue_depth"
BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hello"}]}'


async def server_usec(redis: Redis) -> float:
    info = await redis.info("commandstats")
    return float(info["cmdstat_evalsha"]["usec_per_call"])


async def measure(depth: int, calls: int) -> list[str]:
    with RedisServer() as server:
        config = cfg.parse({
            "queue": {"max_queue": 10**7, "queue_timeout_ms": 3_600_000},
            "models": [{"id": "m", "providers": {"p": "s"}}],
            "nodes": [{"id": "n1", "providers": [
                {"id": "p", "type": "vllm", "base_url": "http://x", "capacity": 1, "models": ["s"]}]}],
        }).config
        redis, fast = connect(server.url), connect_fast(server.url)
        scripts = Scripts(redis, fast)
        script_calls = ScriptCalls(scripts, config, Plans(config))
        jobs = ApiSide(script_calls, redis, "bench")
        slots = WorkerSide(lambda: script_calls, redis, "n1", fast)
        model = script_calls.plans.main_lane(config.models[0].id)
        await scripts.load()
        await slots.heartbeat("p", "available", [("capacity", 1)])
        await jobs.submit("holder", model, BODY, "chat/completions", False)
        for start in range(0, depth, 1000):  # fill the queue, a thousand submits per write
            await asyncio.gather(*(jobs.submit(f"q{i}", model, BODY, "chat/completions", False)
                                   for i in range(start, min(start + 1000, depth))))
        assert await redis.zcard(keys.queue("m")) == depth

        await redis.config_resetstat()
        submit_rt = []
        for i in range(calls):
            started = time.perf_counter()
            await jobs.submit(f"s{i}", model, BODY, "chat/completions", False)
            submit_rt.append(time.perf_counter() - started)
            await jobs.cancel(f"s{i}", keys.queue("m"), CancelReason.CLIENT)
        submit_server = await server_usec(redis)  # submit and cancel, averaged

        dispatch_rt = []
        if depth:
            # Filling a deep queue on a slow machine can outlast the provider's heartbeat.
            await slots.heartbeat("p", "available", [("capacity", 1)])
            await redis.config_resetstat()
            for _ in range(min(calls, depth)):
                entries = cast(list[tuple[bytes, dict[bytes, bytes]]], await redis.xrange(keys.node("n1"), count=1))
                job = Assignment.from_entry(*entries[0])
                started = time.perf_counter()
                await slots.finish(job, b"")
                dispatch_rt.append(time.perf_counter() - started)
            dispatch_server = await server_usec(redis)
        await fast.close()
        await redis.aclose()
    row = [f"{depth:,}", f"{statistics.median(submit_rt) * 1e6:.0f}", f"{submit_server:.1f}"]
    if dispatch_rt:
        row += [f"{statistics.median(dispatch_rt) * 1e6:.0f}", f"{dispatch_server:.1f}"]
    else:
        row += ["-", "-"]
    return row


async def main(calls: int) -> str:
    rows = [await measure(depth, calls) for depth in (0, 10_000, 100_000)]
    return markdown_table(["jobs queued", "submit p50 µs (client)", "submit+cancel µs in Redis",
                           "dispatch p50 µs (client)", "dispatch µs in Redis"], rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    uvloop.install()
    table = asyncio.run(main(args.calls))
    print(table)
    write_section("queue-depth", f"{COMMAND} --calls {args.calls}", table,
                  "Dispatch at depth 0 has nothing to hand out. Redis time per call is INFO commandstats' "
                  "usec_per_call for EVALSHA; the submit column averages the submit and the cancel that "
                  "keeps the depth constant.\n")
