"""Throughput with many clients, the CPU it costs, and Redis round trips per request.

    python -m bench.throughput [--clients 32] [--seconds 10] [--traced] [--litellm] [--client raw|aiohttp]

One API process and one worker in front of one fast fake provider (capacity 64). For
JSON answers and for 20-chunk streams: requests per second, CPU milliseconds per
request of each iop process (API, worker, Redis: /proc utime+stime), and Redis
commands per request from INFO commandstats. The machine-independent figures: the API's and
all of iop's CPU per request divided by the fake provider's in the same run.

Round trips per request count what clients send on the request path: every EVALSHA,
XREADGROUP, XREAD and XADD, less the XADDs scripts make themselves (one to the node
stream per dispatch, one final event per request, one first-output event per stream).
The XTRIM the reply reader sends with its next XREAD shares that write; commands that
scripts run inside Redis are not round trips. ``--verbose`` prints every command's count.

``--litellm`` measures LiteLLM's proxy (``.venv-servers/litellm``, installed by ``./dev
test``; one process, ``--num_workers 1``) in front of the same fake provider in the same run,
its runs alternating with iop's, and adds the two ratios issue 31 sets goals on: iop's JSON
throughput over LiteLLM's, and the API's CPU per JSON request over LiteLLM's. The load
generator (this process) shares the 2 cores: its own CPU per request is shown, since it
bounds iop's throughput (every process of iop's and the fake's share those cores) far more
than LiteLLM's (one process, held to one core by its own CPU per request). It is
bench/loadgen.py (httptools on kept-alive connections); ``--client aiohttp`` uses aiohttp's
client instead, the generator of the figures recorded before 2026-12-06, which spends
several times as much per request.

``--traced`` turns tracing on (dispatcher/tracing.py): the API and the worker export every
span over OTLP/HTTP to a receiver in this process that counts and discards them; the
figures go to their own section.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import aiohttp
import uvloop

from bench.loadgen import closed_loop
from bench.stack import Stack, cpu_seconds, markdown_table, write_section
from tests.realservers.servers import RealServer, start_litellm, unavailable

COMMAND = "python -m bench.throughput"
# What clients send on the request path; everything else in commandstats runs inside scripts
# (or is the once-a-second background: heartbeats, the reaper) and is not a round trip.
CLIENT_COMMANDS = ("evalsha", "eval", "xreadgroup", "xread", "xadd")


LOADGEN = {"raw": "bench/loadgen.py: httptools on kept-alive connections", "aiohttp": "aiohttp's client"}


def chat_body(stream: bool) -> bytes:
    return json.dumps({"model": "bench", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}).encode()


async def load(url: str, stream: bool, clients: int, seconds: float, client: str = "raw") -> tuple[int, float]:
    """``clients`` closed-loop clients for ``seconds``: requests answered, seconds taken.
    ``client``: ``raw`` (bench/loadgen.py) or ``aiohttp`` (this benchmark's generator until
    2026-12-06, spending several times the CPU per request on the cores it shares)."""
    if client == "raw":
        return await closed_loop(url, chat_body(stream), clients, seconds)
    return await aiohttp_load(url, stream, clients, seconds)


async def aiohttp_load(url: str, stream: bool, clients: int, seconds: float) -> tuple[int, float]:
    body = chat_body(stream)
    done = 0
    stop_at = 0.0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            async with session.post(url, data=body) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"status {resp.status}")
            done += 1

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector, headers={"Content-Type": "application/json"}) as session:
        stop_at = time.perf_counter() + seconds
        started = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(clients)))
        return done, time.perf_counter() - started


class DiscardingReceiver:
    """An OTLP/HTTP traces endpoint that counts the spans it is sent and keeps none."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.spans = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                data = self.rfile.read(int(self.headers.get("content-length", 0)))
                request = ExportTraceServiceRequest.FromString(data)
                receiver.spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        # One at a time: the two processes export a few batches a second.
        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def litellm_config(fake_url: str) -> Callable[[int], dict[str, Any]]:
    """LiteLLM's proxy serving the model ``bench`` from the stack's fake provider."""
    def config(port: int) -> dict[str, Any]:
        return {
            "model_list": [{"model_name": "bench", "litellm_params": {
                "model": "openai/served-a", "api_base": f"{fake_url}/v1", "api_key": "sk-unused"}}],
            "litellm_settings": {"telemetry": False, "drop_params": True},
        }
    return config


def median_run(runs: list[tuple[Any, ...]]) -> tuple[Any, ...]:
    """The run with the median rate: this machine's neighbours make single runs noisy."""
    return sorted(runs, key=lambda r: r[0])[len(runs) // 2]


async def main(clients: int, seconds: float, repeat: int = 3, verbose: bool = False,
               litellm: bool = False, client: str = "raw") -> str:
    rows, against = [], []
    with Stack({"a": ["--tokens", "20"]}) as stack:
        url = f"{stack.api_url}/v1/chat/completions"
        other: RealServer | None = None
        if litellm:
            why = unavailable("litellm")
            if why is not None:
                raise SystemExit(why)
            other = start_litellm(stack.dir, litellm_config(stack.fake_url("a")))
        try:
            for stream in (False, True):
                row, compared = await measure(stack, url, other, stream, clients, seconds, repeat, verbose, client)
                rows.append(row)
                if compared is not None:
                    against.append(compared)
        finally:
            if other is not None:
                other.stop()
    table = markdown_table(["request", "req/s", "API CPU ms/req", "worker CPU ms/req", "Redis CPU ms/req",
                            "iop CPU ms/req", "fake provider CPU ms/req", "API ÷ fake provider CPU",
                            "iop ÷ fake provider CPU", "Redis round trips/req"], rows)
    if against:
        table += "\n" + markdown_table(
            ["request", "iop req/s", "LiteLLM req/s", "iop ÷ LiteLLM req/s", "LiteLLM CPU ms/req",
             "LiteLLM ÷ fake provider CPU", "iop API CPU ÷ LiteLLM CPU",
             "iop CPU (API + worker + Redis) ÷ LiteLLM CPU", "load generator CPU ms/req (iop / LiteLLM)"],
            against)
    return table


async def measure(stack: Stack, url: str, other: RealServer | None, stream: bool, clients: int, seconds: float,
                  repeat: int, verbose: bool, client: str = "raw") -> tuple[list[str], list[str] | None]:
    """One kind of request: iop's row, and with ``other`` (LiteLLM) the comparison's row, the
    two measured in alternating runs."""
    other_url = f"{other.url}/v1/chat/completions" if other is not None else ""
    await load(url, stream, clients, min(2.0, seconds), client)  # warm-up
    if other is not None:
        await load(other_url, stream, clients, min(2.0, seconds), client)
    runs, other_runs = [], []
    for _ in range(repeat):
        cpu0, cmd0, mine0 = stack.cpu(), stack.commandstats(), time.process_time()
        n, elapsed = await load(url, stream, clients, seconds, client)
        runs.append((n / elapsed, n, elapsed, cpu0, stack.cpu(), cmd0, stack.commandstats(),
                     time.process_time() - mine0))
        if other is not None:
            fake0, own0, mine0 = stack.cpu()["fake-a"], cpu_seconds(other.proc.pid), time.process_time()
            m, took = await load(other_url, stream, clients, seconds, client)
            other_runs.append((m / took, m, took, stack.cpu()["fake-a"] - fake0, cpu_seconds(other.proc.pid) - own0,
                               time.process_time() - mine0))
    _, n, elapsed, cpu0, cpu1, cmd0, cmd1, mine = median_run(runs)
    per = {name: (cpu1[name] - cpu0[name]) * 1000 / n for name in cpu1}
    calls = {name: cmd1.get(name, 0) - cmd0.get(name, 0) for name in cmd1}
    script_xadds = n * (3 if stream else 2)
    client_calls = sum(calls.get(c, 0) for c in CLIENT_COMMANDS) - script_xadds
    iop_cpu = per["api"] + per["worker"] + per["redis"]
    if verbose:
        counts = {c: round(calls[c] / n, 3) for c in sorted(calls) if calls[c] > n // 100}
        print("Redis commands per request:", counts)
    fake = per["fake-a"]
    kind = "stream (20 chunks)" if stream else "JSON"
    row = [kind, f"{n / elapsed:,.0f}", f"{per['api']:.3f}", f"{per['worker']:.3f}", f"{per['redis']:.3f}",
           f"{iop_cpu:.3f}", f"{fake:.3f}", ratio(per["api"], fake), ratio(iop_cpu, fake), f"{client_calls / n:.2f}"]
    if other is None:
        return row, None
    rate, m, _, other_fake, own, other_mine = median_run(other_runs)
    own_ms, other_fake_ms = own * 1000 / m, other_fake * 1000 / m
    return row, [kind, f"{n / elapsed:,.0f}", f"{rate:,.0f}", f"{n / elapsed / rate:.1f}", f"{own_ms:.3f}",
                 ratio(own_ms, other_fake_ms), ratio(per["api"], own_ms), ratio(iop_cpu, own_ms),
                 f"{mine * 1000 / n:.3f} / {other_mine * 1000 / m:.3f}"]


def ratio(cpu: float, fake: float) -> str:
    """CPU per request over the fake provider's in the same run: a figure the machine's speed
    cancels out of (both run the same Python on the same cores), so a regression shows on any."""
    return f"{cpu / fake:.2f}" if fake > 0 else "-"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeat", type=int, default=3, help="runs per row; the median run is reported")
    parser.add_argument("--verbose", action="store_true", help="print every Redis command's calls per request")
    parser.add_argument("--litellm", action="store_true",
                        help="LiteLLM's proxy in front of the same fake provider, in alternating runs")
    parser.add_argument("--traced", action="store_true",
                        help="tracing on, every span exported (OTLP/HTTP) to a receiver here that discards it")
    parser.add_argument("--client", choices=("raw", "aiohttp"), default="raw",
                        help="the load generator: raw (bench/loadgen.py, the default) or aiohttp (the one used "
                             "until 2026-12-06, for comparison with older figures)")
    args = parser.parse_args()
    uvloop.install()
    receiver = None
    if args.traced:
        receiver = DiscardingReceiver()
        # The stack's processes inherit it; the batch schedule is the SDK's default (5 s, 512 spans).
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.url
    table = asyncio.run(main(args.clients, args.seconds, args.repeat, args.verbose, args.litellm, args.client))
    print(table)
    notes = (f"{args.clients} concurrent clients (keep-alive), {args.repeat} runs of {args.seconds:g} s per row "
             "(the median run shown), one API process, one worker, one fake provider answering at once; "
             f"the load generator ({LOADGEN[args.client]}) and the fake provider share the same 2 cores.\n")
    client_arg = "" if args.client == "raw" else f" --client {args.client}"
    if args.litellm:
        notes += ("The second table: LiteLLM's proxy (one process) in front of the same fake provider, its runs "
                  "alternating with iop's in the same run; each ratio is of the median runs.\n")
        write_section("throughput-litellm", f"{COMMAND} --clients {args.clients} --seconds {args.seconds:g} "
                      f"--repeat {args.repeat} --litellm{client_arg}", table, notes)
    elif receiver is None:
        write_section("throughput", f"{COMMAND} --clients {args.clients} --seconds {args.seconds:g}{client_arg}",
                      table, notes)
    else:
        print(f"spans received: {receiver.spans:,}")
        notes += (f"Tracing on: every request's three spans exported over OTLP/HTTP to a receiver in the load "
                  f"generator's process that discards them ({receiver.spans:,} spans received).\n")
        write_section("throughput-traced",
                      f"{COMMAND} --clients {args.clients} --seconds {args.seconds:g} --traced{client_arg}",
                      table, notes)
