"""Memory of an API process and a worker while they hold many concurrent streams.

    python -m bench.memory [--streams 1000]

One API process and one worker relay ``--streams`` concurrent streamed answers from a
fake provider that takes about ten seconds per answer (200 chunks, 50 ms apart); the
resident set size (RSS) of each process is sampled idle and at the peak.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp
import uvloop

from bench.stack import Stack, markdown_table, rss_mib, write_section

COMMAND = "python -m bench.memory"


async def main(streams: int) -> str:
    with Stack({"a": ["--tokens", "200", "--token-interval-ms", "50"]}, capacity=streams) as stack:
        api, worker = stack.pid("api"), stack.pid("worker")
        await asyncio.sleep(1)
        idle = (rss_mib(api), rss_mib(worker))
        body = json.dumps({"model": "bench", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
        started = asyncio.Event()
        first_bytes = 0

        async def one(session: aiohttp.ClientSession) -> int:
            nonlocal first_bytes
            async with session.post(f"{stack.api_url}/v1/chat/completions", data=body) as resp:
                got = 0
                async for chunk in resp.content.iter_any():
                    if got == 0:
                        first_bytes += 1
                        if first_bytes == streams:
                            started.set()
                    got += len(chunk)
                return resp.status

        connector = aiohttp.TCPConnector(limit=streams)
        async with aiohttp.ClientSession(connector=connector, headers={"Content-Type": "application/json"},
                                         timeout=aiohttp.ClientTimeout(total=300)) as session:
            tasks = [asyncio.create_task(one(session)) for _ in range(streams)]
            await asyncio.wait_for(started.wait(), timeout=120)
            peak = (0.0, 0.0)
            held = 0
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                peak = (max(peak[0], rss_mib(api)), max(peak[1], rss_mib(worker)))
                held = max(held, int(stack.redis.hget("{iop}:p:p-a", "in_flight") or 0))
                await asyncio.sleep(0.2)
            statuses = await asyncio.gather(*tasks)
        assert statuses == [200] * streams, set(statuses)
    rows = [
        ["API process", f"{idle[0]:.0f}", f"{peak[0]:.0f}", f"{(peak[0] - idle[0]) * 1024 / streams:.1f}"],
        ["worker", f"{idle[1]:.0f}", f"{peak[1]:.0f}", f"{(peak[1] - idle[1]) * 1024 / streams:.1f}"],
    ]
    return markdown_table(["process", "idle RSS MiB", f"RSS MiB with {held} streams", "KiB per stream"], rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--streams", type=int, default=1000)
    args = parser.parse_args()
    uvloop.install()
    table = asyncio.run(main(args.streams))
    print(table)
    write_section("memory", f"{COMMAND} --streams {args.streams}", table,
                  "Every stream was open at once (the provider's in_flight in Redis is the count shown).\n")
