"""Added latency: one client in series, the fake provider called directly and through iop.

    python -m bench.latency [--requests 1000] [--repeat 3]

Chat JSON answers and 20-chunk chat streams, and 20-delta Responses and Anthropic
Messages streams (typed ``event:`` SSE); p50/p99 of the whole answer and, for streams,
of the time to the first byte of the body. "Added" is iop minus direct.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp
import uvloop

from bench.stack import Stack, markdown_table, percentile, write_section

COMMAND = "python -m bench.latency"


HI = [{"role": "user", "content": "hi"}]
# (row label, endpoint, body without model, streamed)
KINDS: list[tuple[str, str, dict[str, object], bool]] = [
    ("chat JSON", "chat/completions", {"messages": HI}, False),
    ("chat stream (20 chunks)", "chat/completions", {"messages": HI, "stream": True}, True),
    ("Responses stream (20 deltas)", "responses", {"input": "hi", "stream": True}, True),
    ("Messages stream (20 deltas)", "messages", {"messages": HI, "max_tokens": 20, "stream": True}, True),
]


async def series(url: str, model: str, payload: dict[str, object], n: int) -> tuple[list[float], list[float]]:
    body = json.dumps({"model": model, **payload}).encode()
    totals: list[float] = []
    firsts: list[float] = []
    async with aiohttp.ClientSession(headers={"Content-Type": "application/json"}) as session:
        for _ in range(n):
            start = time.perf_counter()
            async with session.post(url, data=body) as resp:
                first = None
                async for _chunk in resp.content.iter_any():
                    if first is None:
                        first = time.perf_counter() - start
                assert resp.status == 200, resp.status
            totals.append(time.perf_counter() - start)
            firsts.append(first or totals[-1])
    return totals, firsts


def ms(x: float) -> str:
    return f"{x * 1000:.2f}"


async def main(requests: int, repeat: int) -> str:
    rows = []
    with Stack({"a": ["--tokens", "20"]}) as stack:
        for kind, endpoint, payload, stream in KINDS:
            direct_url = f"{stack.fake_url('a')}/v1/{endpoint}"
            iop_url = f"{stack.api_url}/v1/{endpoint}"
            warm = max(requests // 10, 50)
            await series(direct_url, "served-a", payload, warm)
            await series(iop_url, "bench", payload, warm)
            d_total, d_first, i_total, i_first = [], [], [], []
            for _ in range(repeat):  # interleaved, so both see the same machine
                total, first = await series(direct_url, "served-a", payload, requests)
                d_total += total
                d_first += first
                total, first = await series(iop_url, "bench", payload, requests)
                i_total += total
                i_first += first
            for what, direct, via in (("whole answer", d_total, i_total), ("first byte", d_first, i_first)):
                if not stream and what == "first byte":
                    continue
                p50d, p99d = percentile(direct, 50), percentile(direct, 99)
                p50i, p99i = percentile(via, 50), percentile(via, 99)
                rows.append([kind, what, ms(p50d), ms(p99d), ms(p50i), ms(p99i), ms(p50i - p50d), ms(p99i - p99d)])
    table = markdown_table(
        ["request", "measured", "direct p50 ms", "direct p99 ms", "via iop p50 ms", "via iop p99 ms",
         "added p50 ms", "added p99 ms"], rows)
    return table


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3, help="interleaved rounds of --requests each")
    args = parser.parse_args()
    uvloop.install()
    table = asyncio.run(main(args.requests, args.repeat))
    print(table)
    write_section("latency", f"{COMMAND} --requests {args.requests} --repeat {args.repeat}", table,
                  f"One client in series, {args.repeat} interleaved rounds of {args.requests} requests per row "
                  "after a warm-up; the fake provider answers at once (20 tokens, no delay).\n")
