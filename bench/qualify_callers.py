"""Callers first (issue 32): callers' TTFT p90 while a qualification runs, against the same
load without one (goal: within 10%).

    python -m bench.qualify_callers [--callers 6] [--seconds 20] [--rounds 2]

One API process, one worker, one fake provider of capacity 8 (real processes,
bench/stack.py), the config's ``qualify`` section at ``share: 0.25`` -- a run holds at most 2
of the 8 slots. ``--callers`` clients keep the model busy (closed loop: each sends its next
streamed request when the last ends; TTFT to the first content chunk). Each round is a phase
without a run, then a phase with ``iop qualify`` started over and over for the whole phase;
rounds alternate so a drift of the machine's load falls on both. Prints a Markdown table and
the text for docs/BENCHMARKS.md; writes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from typing import Any

import aiohttp

from bench.stack import Stack, load_average, machine, markdown_table

COMMAND = "python -m bench.qualify_callers"
CAPACITY = 8
SHARE = 0.25


class QualifyStack(Stack):
    def config(self) -> dict[str, Any]:
        return {**super().config(), "qualify": {"share": SHARE, "max_seconds": 900, "max_tokens": 10**8}}


async def callers(url: str, n: int, seconds: float) -> list[float]:
    ttft: list[float] = []
    end = time.monotonic() + seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def caller() -> None:
            while time.monotonic() < end:
                t, _ = await _plain(session, url)
                ttft.append(t * 1000)
        await asyncio.gather(*(caller() for _ in range(n)))
    return ttft


async def _plain(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    body = {"model": "bench", "stream": True, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    started = time.perf_counter()
    first = None
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {(await resp.text())[:200]}")
        async for raw in resp.content:
            if first is None and raw.startswith(b"data:") and b'"content"' in raw:
                first = time.perf_counter() - started
    ended = time.perf_counter() - started
    return (first if first is not None else ended), ended


def qualify_loop(url: str, stop_at: float) -> int:
    """``iop qualify`` started again and again until ``stop_at``; how many runs finished."""
    runs = 0
    while time.monotonic() < stop_at:
        done = subprocess.run([sys.executable, "-m", "iop", "qualify", "--url", url, "--model", "bench", "--json",
                               "--requests", "16", "--max-tokens", "16"], capture_output=True, text=True,
                              timeout=600)
        if done.returncode not in (0, 2):
            raise RuntimeError(f"iop qualify failed: {done.stderr[-500:]}")
        runs += 1
    return runs


async def phase(url: str, n: int, seconds: float, qualify: bool) -> tuple[list[float], int]:
    if not qualify:
        return await callers(url, n, seconds), 0
    runner = asyncio.to_thread(qualify_loop, url, time.monotonic() + seconds)
    ttft, runs = await asyncio.gather(callers(url, n, seconds), runner)
    return ttft, runs


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[8]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--callers", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    without: list[float] = []
    with_run: list[float] = []
    runs = 0
    with QualifyStack({"a": ["--delay-ms", "100", "--tokens", "16", "--token-interval-ms", "10"]},
                      capacity=CAPACITY) as stack:
        asyncio.run(phase(stack.api_url, args.callers, 2.0, False))  # warm up
        for _ in range(args.rounds):
            without += asyncio.run(phase(stack.api_url, args.callers, args.seconds, False))[0]
            ttft, n = asyncio.run(phase(stack.api_url, args.callers, args.seconds, True))
            with_run += ttft
            runs += n
    a, b = p90(without), p90(with_run)
    rows = [["without a run", str(len(without)), f"{statistics.median(without):.1f}", f"{a:.1f}", "-"],
            ["with a run", str(len(with_run)), f"{statistics.median(with_run):.1f}", f"{b:.1f}",
             f"{(b - a) / a * 100:+.1f}%"]]
    print(markdown_table(["callers' load", "requests", "TTFT p50 (ms)", "TTFT p90 (ms)", "p90 vs without"], rows))
    print(f"{args.callers} callers on a provider of capacity {CAPACITY}, qualify.share {SHARE} "
          f"({int(SHARE * CAPACITY)} slots), {args.rounds} rounds of {args.seconds:.0f} s per phase, "
          f"{runs} qualification runs. Machine: {machine()}; load {load_average()}.")
    print(f"Command: {COMMAND} --callers {args.callers} --seconds {args.seconds:.0f} --rounds {args.rounds}")


if __name__ == "__main__":
    main()
