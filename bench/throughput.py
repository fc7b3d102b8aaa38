"""Throughput with many clients, the CPU it costs, and Redis round trips per request.

    python -m bench.throughput [--clients 32] [--seconds 10] [--traced]

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
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import aiohttp
import uvloop

from bench.stack import Stack, markdown_table, write_section

COMMAND = "python -m bench.throughput"
# What clients send on the request path; everything else in commandstats runs inside scripts
# (or is the once-a-second background: heartbeats, the reaper) and is not a round trip.
CLIENT_COMMANDS = ("evalsha", "eval", "xreadgroup", "xread", "xadd")


async def load(url: str, stream: bool, clients: int, seconds: float) -> tuple[int, float]:
    body = json.dumps({"model": "bench", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}).encode()
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


async def main(clients: int, seconds: float, repeat: int = 3, verbose: bool = False) -> str:
    rows = []
    with Stack({"a": ["--tokens", "20"]}) as stack:
        url = f"{stack.api_url}/v1/chat/completions"
        for stream in (False, True):
            await load(url, stream, clients, min(2.0, seconds))  # warm-up
            runs = []
            for _ in range(repeat):
                cpu0, cmd0 = stack.cpu(), stack.commandstats()
                n, elapsed = await load(url, stream, clients, seconds)
                runs.append((n / elapsed, n, elapsed, cpu0, stack.cpu(), cmd0, stack.commandstats()))
            # The run with the median rate: this machine's neighbours make single runs noisy.
            _, n, elapsed, cpu0, cpu1, cmd0, cmd1 = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
            per = {name: (cpu1[name] - cpu0[name]) * 1000 / n for name in cpu1}
            calls = {name: cmd1.get(name, 0) - cmd0.get(name, 0) for name in cmd1}
            script_xadds = n * (3 if stream else 2)
            client_calls = sum(calls.get(c, 0) for c in CLIENT_COMMANDS) - script_xadds
            iop_cpu = per["api"] + per["worker"] + per["redis"]
            if verbose:
                counts = {c: round(calls[c] / n, 3) for c in sorted(calls) if calls[c] > n // 100}
                print("Redis commands per request:", counts)
            fake = per["fake-a"]
            rows.append([
                "stream (20 chunks)" if stream else "JSON", f"{n / elapsed:,.0f}",
                f"{per['api']:.3f}", f"{per['worker']:.3f}", f"{per['redis']:.3f}", f"{iop_cpu:.3f}",
                f"{fake:.3f}", ratio(per["api"], fake), ratio(iop_cpu, fake), f"{client_calls / n:.2f}",
            ])
    return markdown_table(["request", "req/s", "API CPU ms/req", "worker CPU ms/req", "Redis CPU ms/req",
                           "iop CPU ms/req", "fake provider CPU ms/req", "API ÷ fake provider CPU",
                           "iop ÷ fake provider CPU", "Redis round trips/req"], rows)


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
    parser.add_argument("--traced", action="store_true",
                        help="tracing on, every span exported (OTLP/HTTP) to a receiver here that discards it")
    args = parser.parse_args()
    uvloop.install()
    receiver = None
    if args.traced:
        receiver = DiscardingReceiver()
        # The stack's processes inherit it; the batch schedule is the SDK's default (5 s, 512 spans).
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.url
    table = asyncio.run(main(args.clients, args.seconds, args.repeat, args.verbose))
    print(table)
    notes = (f"{args.clients} concurrent clients (keep-alive), {args.repeat} runs of {args.seconds:g} s per row "
             "(the median run shown), one API process, one worker, one fake provider answering at once; "
             "the load generator and the fake provider share the same 2 cores.\n")
    if receiver is None:
        write_section("throughput", f"{COMMAND} --clients {args.clients} --seconds {args.seconds:g}", table, notes)
    else:
        print(f"spans received: {receiver.spans:,}")
        notes += (f"Tracing on: every request's three spans exported over OTLP/HTTP to a receiver in the load "
                  f"generator's process that discards them ({receiver.spans:,} spans received).\n")
        write_section("throughput-traced", f"{COMMAND} --clients {args.clients} --seconds {args.seconds:g} --traced",
                      table, notes)
