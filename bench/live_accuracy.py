"""Accurate live figures (issue 32): the live 5-minute TTFT p50 that ``/catalog`` shows for a
provider against the p50 a client measured over the same requests (goal: within 5%).

    python -m bench.live_accuracy [--requests 1000] [--concurrency 8]

One API process, one worker, one fake provider (real processes, bench/stack.py). Each request
asks the fake, through its ``body_overrides`` hook, for a time to first token drawn from a
log-normal (median 150 ms, from 20 ms to 2 s), so the p50 is a figure of a spread and not of a
constant; 8 tokens follow 10 ms apart. The client times each streamed request from its send
to its first content chunk, as ``iop qualify`` does; the live figure is the worker's, from its
call to the provider to the first chunk, kept in 5%-wide histogram bins (lua/lib/live_figures.lua).
The gap between them is iop's own path (API, Redis, worker and back) plus the bins' width.
Prints a Markdown table and the text for docs/BENCHMARKS.md; writes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import aiohttp
import httpx

from bench.stack import Stack, load_average, machine, markdown_table
from dispatcher.live import FLUSH_S

COMMAND = "python -m bench.live_accuracy"
MEDIAN_MS = 150.0
SIGMA = 0.6  # of the log: p10 about 70 ms, p90 about 325 ms


def delays(n: int, seed: int = 32) -> list[int]:
    rng = random.Random(seed)
    return [int(min(2000.0, max(20.0, rng.lognormvariate(0, SIGMA) * MEDIAN_MS))) for _ in range(n)]


async def one(session: aiohttp.ClientSession, url: str, delay_ms: int) -> tuple[float, float]:
    body = {"model": "bench", "stream": True, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
            "fake": {"delay_ms": delay_ms}}
    started = time.perf_counter()
    first = None
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {(await resp.text())[:200]}")
        async for raw in resp.content:
            line = raw.strip()
            if first is None and line.startswith(b"data:") and line != b"data: [DONE]":
                doc = json.loads(line[5:])
                if any((c.get("delta") or {}).get("content") for c in doc.get("choices") or []):
                    first = time.perf_counter() - started
    ended = time.perf_counter() - started
    return (first if first is not None else ended), ended


async def load(url: str, plan: list[int], concurrency: int) -> tuple[list[float], list[float]]:
    ttft: list[float] = []
    e2e: list[float] = []
    queue = list(reversed(plan))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def worker() -> None:
            while queue:
                t, e = await one(session, url, queue.pop())
                ttft.append(t * 1000)
                e2e.append(e * 1000)
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ttft, e2e


def p(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    plan = delays(args.requests)
    with Stack({"a": ["--tokens", "8", "--token-interval-ms", "10"]}, capacity=4 * args.concurrency) as stack:
        httpx.post(f"{stack.fake_url('a')}/_fake/hooks", json={"body_overrides": True}, timeout=5).raise_for_status()
        wall = time.monotonic()
        ttft, e2e = asyncio.run(load(stack.api_url, plan, args.concurrency))
        wall = time.monotonic() - wall
        time.sleep(2 * FLUSH_S)  # the worker writes what it tallied about once a second
        cat = httpx.get(f"{stack.api_url}/catalog", timeout=10).json()
    live = next(pr for pr in cat["providers"] if pr["id"] == "p-a")["live"]["5m"]
    rows = []
    for name, client, lv in (("TTFT", ttft, live["ttft_ms"]), ("end to end", e2e, live["e2e_ms"])):
        for q in (50, 90):
            c = p(client, q)
            v = lv[f"p{q}"]
            rows.append([f"{name} p{q}", f"{c:.1f}", f"{v:.1f}", f"{(v - c) / c * 100:+.1f}%"])
    asked = sorted(plan)
    print(markdown_table(["figure", "client (ms)", "live 5m (ms)", "live vs client"], rows))
    print(f"{args.requests} streamed requests, {args.concurrency} at a time, in {wall:.1f} s; live requests "
          f"counted {live['requests']}, errors {live['errors']}; the fake was asked for a TTFT of p50 "
          f"{statistics.median(asked):.0f} ms. Machine: {machine()}; load {load_average()}.")
    print(f"Command: {COMMAND} --requests {args.requests} --concurrency {args.concurrency}")


if __name__ == "__main__":
    main()
