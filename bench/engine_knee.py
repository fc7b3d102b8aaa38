"""Where a real engine's throughput stops growing: llama.cpp's llama-server with ``--parallel``
slots (4 by default) on the tiny GGUF of tests/realservers, called directly (no iop), at
each concurrency of ``--levels``.

    python -m bench.engine_knee [--parallel 4] [--levels 1 2 4 8 16] [--max-tokens 32]
                                [--requests 128] [--repeat 3] [--threads 1] [--url URL]

Needs the llama-server that ``./dev test`` builds into .venv-servers/llama-server (or
``--url`` of one already running). Each level keeps ``c`` streamed chat requests open at
once (short prompts, each its own, ``max_tokens`` tokens each: the tiny model never picks
its end token) until ``--requests`` (at least ``2 c``) have finished, after one warm-up round;
the median run of ``--repeat`` is shown. Past the slots, more concurrency only queues: the
server defers what finds no free slot (``llamacpp:requests_deferred``), and the most seen
deferred at once is shown beside the throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import uvloop

from bench.stack import command_line, cpu_seconds, markdown_table, percentile, write_section

COMMAND = "python -m bench.engine_knee"
DEFAULTS = {"parallel": 4, "levels": [1, 2, 4, 8, 16], "max_tokens": 32, "requests": 128, "repeat": 3, "threads": 1,
            "url": ""}
_METRIC = re.compile(r"^llamacpp:(\w+) (\S+)$", re.MULTILINE)


@dataclass(frozen=True)
class One:
    seconds: float
    first_token_s: float
    completion_tokens: int


@dataclass(frozen=True)
class Level:
    concurrency: int
    seconds: float
    requests: int
    completion_tokens: int
    latency_p50_s: float
    first_token_p50_s: float
    processing_max: int
    deferred_max: int
    # Generated tokens per llama_decode() call over the run: how many slots each step of the
    # engine advanced at once (prompt steps included), whatever else the machine was doing.
    tokens_per_decode: float
    # CPU seconds the server used (None: a server this process did not start).
    server_cpu_s: float | None

    @property
    def tokens_per_cpu_s(self) -> float | None:
        """Completion tokens per CPU-second of the server: its throughput had it a core to
        itself, which a shared machine's wall clock does not tell."""
        return self.completion_tokens / self.server_cpu_s if self.server_cpu_s else None

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds


async def one_stream(session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int) -> One:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first: float | None = None
    tokens = 0
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"llama-server answered {resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
    seconds = time.perf_counter() - start
    return One(seconds, first if first is not None else seconds, tokens)


async def metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """llama-server's ``/metrics``, by name without the ``llamacpp:`` prefix."""
    async with session.get(f"{url}/metrics") as resp:
        return {name: float(value) for name, value in _METRIC.findall(await resp.text())}


async def level(url: str, model: str, concurrency: int, total: int, max_tokens: int, run: int,
                pid: int | None) -> Level:
    results: list[One] = []
    next_index = 0
    processing_max = deferred_max = 0
    done = asyncio.Event()

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal next_index
        while next_index < total:
            index = next_index
            next_index += 1
            # Each prompt its own: no answer is one the cache already holds whole.
            results.append(await one_stream(session, url, model, f"run {run} request {index}: hello", max_tokens))

    async def watch(session: aiohttp.ClientSession) -> None:
        nonlocal processing_max, deferred_max
        while not done.is_set():
            now = await metrics(session, url)
            processing_max = max(processing_max, int(now["requests_processing"]))
            deferred_max = max(deferred_max, int(now["requests_deferred"]))
            await asyncio.sleep(0.05)

    # A connection per request: a pooled one may be one llama-server is just closing (seen
    # here under load: "Can not write request body"); iop's adapter makes such a call again
    # on a fresh connection, a measurement should not have to.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        before = await metrics(session, url)
        cpu_before = cpu_seconds(pid) if pid else 0.0
        watcher = asyncio.create_task(watch(session))
        start = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        seconds = time.perf_counter() - start
        cpu = cpu_seconds(pid) - cpu_before if pid else None
        done.set()
        await watcher
        after = await metrics(session, url)
    decodes = after["n_decode_total"] - before["n_decode_total"]
    generated = after["tokens_predicted_total"] - before["tokens_predicted_total"]
    return Level(concurrency, seconds, len(results), sum(r.completion_tokens for r in results),
                 percentile([r.seconds for r in results], 50), percentile([r.first_token_s for r in results], 50),
                 processing_max, deferred_max, generated / decodes if decodes else 0.0, cpu)


async def measure(url: str, model: str, levels: list[int], requests: int, max_tokens: int,
                  repeat: int, pid: int | None) -> list[Level]:
    await level(url, model, max(levels), max(levels), max_tokens, -1, pid)  # warm-up
    chosen = []
    for concurrency in levels:
        runs = [await level(url, model, concurrency, max(requests, 2 * concurrency), max_tokens, run, pid)
                for run in range(repeat)]
        median = statistics.median_low(r.tokens_per_s for r in runs)
        chosen.append(next(r for r in runs if r.tokens_per_s == median))
        print(f"concurrency {concurrency}: {chosen[-1].tokens_per_s:.0f} tokens/s", flush=True)
    return chosen


def table(levels: list[Level]) -> str:
    base = levels[0].tokens_per_s
    rows = [[str(v.concurrency), f"{v.tokens_per_s:.0f}", f"{v.tokens_per_s / base:.2f}", f"{v.requests_per_s:.1f}",
             f"{v.latency_p50_s * 1000:.0f}", f"{v.first_token_p50_s * 1000:.0f}",
             "-" if v.tokens_per_cpu_s is None else f"{v.tokens_per_cpu_s:.0f}", f"{v.tokens_per_decode:.2f}",
             str(v.processing_max), str(v.deferred_max)]
            for v in levels]
    return markdown_table(["concurrency", "completion tokens/s", "x concurrency 1", "requests/s",
                           "latency p50 ms", "first token p50 ms", "tokens per server CPU-s", "tokens per decode",
                           "processing (max)", "deferred (max)"], rows)


def served_model(url: str) -> str:
    async def ask() -> str:
        async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/models") as resp:
            return str((await resp.json())["data"][0]["id"])
    return asyncio.run(ask())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parallel", type=int, default=DEFAULTS["parallel"], help="llama-server's slots")
    parser.add_argument("--levels", type=int, nargs="+", default=DEFAULTS["levels"])
    parser.add_argument("--max-tokens", type=int, default=DEFAULTS["max_tokens"])
    parser.add_argument("--requests", type=int, default=DEFAULTS["requests"], help="finished requests per run")
    parser.add_argument("--repeat", type=int, default=DEFAULTS["repeat"])
    parser.add_argument("--threads", type=int, default=DEFAULTS["threads"], help="llama-server's --threads")
    parser.add_argument("--url", default=DEFAULTS["url"], help="a llama-server already running (then "
                        "--parallel and --threads are its own, not set here)")
    args = parser.parse_args()
    # The starter lives with the real-server tests: one way to run llama-server.
    from tests.realservers.servers import start_llama_server

    with tempfile.TemporaryDirectory(prefix="engine-knee-") as work:
        server = None if args.url else start_llama_server(Path(work), parallel=args.parallel, threads=args.threads)
        url = args.url or (server.url if server else "")
        try:
            model = served_model(url)
            levels = uvloop.run(measure(url, model, args.levels, args.requests, args.max_tokens, args.repeat,
                                        server.proc.pid if server else None))
        finally:
            if server is not None:
                server.stop()
    out = table(levels)
    print(out)
    if not args.url:
        notes = (f"\nllama-server `--parallel {args.parallel} --threads {args.threads}` on the tiny GGUF "
                 f"(tests/realservers/tiny_gguf.py), streamed chat, `max_tokens` {args.max_tokens}, called "
                 f"directly; the median of {args.repeat} runs. On a shared machine the wall-clock columns move "
                 "with whatever else runs; the engine's own counts do not: *tokens per decode* (generated "
                 "tokens per `llama_decode()` call, from its `/metrics`) is how many slots each step advanced, "
                 "and *processing* / *deferred* the most `llamacpp:requests_processing` / "
                 "`llamacpp:requests_deferred` seen. Past its slots no step advances more of them, and the "
                 "rest wait in its queue.\n")
        write_section("engine-knee", command_line(COMMAND, args, DEFAULTS), out, notes,
                      heading="## A real engine's knee: llama-server's slots (issue 30)\n\n")


if __name__ == "__main__":
    main()
