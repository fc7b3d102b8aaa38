"""Deadlines under saturation: refusing at once what cannot start in time (issue 20).

    python -m bench.deadlines [--quick] [--seconds 60] [--loads 1.0 1.2] [--no-write]

The simulated continuous-batching servers of ``bench/prefix_fleet.py`` (``bench/fleet_sim.py``,
one process each, 4 by default) behind iop without affinity, each provider's ``capacity``
the number of requests its server can run at once (so that what waits, waits in iop's queue,
where deadlines apply). An open-loop Poisson load at 100% and 120% of the fleet's nominal
capacity (``prefix_fleet.nominal_capacity``) on the ``unique`` trace of prefix_fleet (every
request its own 1,650-1,950-token prompt, no shared prefixes, 64 output tokens, streamed).
Per load, the same seeded trace runs twice, on a fresh iop (Redis, workers, API) and emptied
servers each time: once with every request carrying ``x-iop-deadline-ms: --deadline-ms``
(1,000), sent by the load generator, and once without. With the header iop refuses at once
(503 ``deadline_unmeetable``) a request whose wait, from its place in the queue and the
queue's measured drain interval, would exceed the deadline one time in twenty, and lets an
admitted one wait at most that long (then 503 ``queue_timeout``); without it, everything
queues (queue timeout 600 s).

Per run, over the requests sent after the ``--warmup`` seconds: offered, admitted (not
refused), refused, queue timeouts, goodput (admitted requests answered with a time to first
token within ``--slo-ms``, 2 s: the deadline plus a second for the prefill and the first
step), its share of the admitted (goal ≥ 95%), the share that started (``x-iop-queue-ms``)
within the deadline, TTFT p50/p90/p99 of the admitted (∞ for one not answered), how long a
refusal took to reach the caller (goal ≤ 50 ms), output tokens per second, and the
servers' late steps; and, to judge the prediction, the drain interval iop predicted with
(read from Redis every 50 ms while jobs waited) against the intervals it measures, as the
answers show them.

Simulated or left out: the servers are prefix_fleet's simulator (its module docstring says
what it models); the load generator, the servers and iop share the machine's cores; no
client retries after a refusal (a refused request is gone, so the offered load does not
grow with refusals); one model, one lane, one API process; no tenants or flow control; the
drain interval is learned from the run's own traffic (it starts each run unmeasured, and a
request is never refused before it is measured).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import aiohttp
import msgspec
import uvloop

from bench import prefix_fleet
from bench.fleet_sim import SimConfig
from bench.prefix_fleet import (
    Arrival,
    Capacity,
    Fleet,
    Iop,
    Result,
    Run,
    Workload,
    make_trace,
    nominal_capacity,
    prefix_working_set,
    run_trace,
)
from bench.prefix_fleet import fmt_ms as ms
from bench.stack import command_line, markdown_table, write_section
from dispatcher import keys

COMMAND: Final = "python -m bench.deadlines"
NAME: Final = "deadlines"
VARIANT: Final = "unique"  # no shared prefixes: the cache plays no part
DEADLINE_HEADER: Final = "x-iop-deadline-ms"
REFUSED: Final = "deadline_unmeetable"
TIMED_OUT: Final = "queue_timeout"
GOODPUT_GOAL: Final = 0.95  # of the admitted
REFUSAL_GOAL_MS: Final = 50.0
_OVER = re.compile(r"about ([\d.]+) s longer")


# --------------------------------------------------------------------------- the load


@dataclass(slots=True)
class Answer(Result):
    """prefix_fleet's result, read for what a refusal says."""

    @property
    def answer_ms(self) -> float:
        return (self.done - self.sent) * 1000

    @property
    def code(self) -> str:
        """The error's code (error.code of the body) when not 200."""
        return error_code(self.error)[0] if self.error else ""

    @property
    def over_ms(self) -> float:
        """A refusal's predicted wait beyond the deadline (its message, 0.1 s)."""
        return error_code(self.error)[1] if self.error else math.nan


def error_code(raw: bytes) -> tuple[str, float]:
    try:
        error = msgspec.json.decode(raw).get("error") or {}
    except (msgspec.DecodeError, AttributeError):
        return "", math.nan
    over = _OVER.search(str(error.get("message") or ""))
    return str(error.get("code") or ""), float(over.group(1)) * 1000 if over else math.nan


class DrainWatch:
    """Samples, every 50 ms while jobs wait, the drain interval submit's prediction uses
    (lua/lib/pump.lua drain_interval), from Redis, in a thread of its own."""

    def __init__(self, target: Iop, warmup: float, seconds: float) -> None:
        assert target.stack is not None
        self.redis = target.stack.redis
        self.window = (warmup, seconds)
        self.samples: list[float] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        queue, t0 = keys.queue(prefix_fleet.MODEL), time.monotonic()
        while not self.stopped.wait(0.05):
            with self.redis.pipeline(transaction=False) as pipe:
                pipe.hget(keys.QUEUE_RATES, queue)
                pipe.zcard(queue)
                raw, waiting = pipe.execute()
            interval = (raw or b"").decode().rpartition("|")[2]
            if waiting and interval and self.window[0] <= time.monotonic() - t0 <= self.window[1]:
                self.samples.append(float(interval))

    def stop(self) -> list[float]:
        self.stopped.set()
        self.thread.join()
        return self.samples


async def measure(target: Iop, fleet: Fleet, trace: Sequence[Arrival], deadline_ms: int, args: argparse.Namespace,
                  label: str) -> tuple[Run, list[float]]:
    """One run, and the drain intervals iop predicted with (sampled while jobs waited)."""
    run = Run(target.name, label, warmup=args.warmup, window=args.seconds - args.warmup)
    async with aiohttp.ClientSession() as http:
        await fleet.reset(http)
    headers = {"Content-Type": "application/json"}
    if deadline_ms:
        headers[DEADLINE_HEADER] = str(deadline_ms)
    target.start(fleet)
    watch = DrainWatch(target, args.warmup, args.seconds)
    try:
        run.results = list(await run_trace(target, trace, headers, Answer))
    finally:
        intervals = watch.stop()
        target.stop()
    async with aiohttp.ClientSession() as http:
        run.server_stats = await fleet.stats(http)
    run.server_requests = [s["requests"] for s in run.server_stats]
    return run, intervals


def backlog_gaps_ms(answers: Sequence[Answer]) -> list[float]:
    """The intervals between dispatches of jobs that waited, counted as note_drain counts them:
    from a dispatch after which a job still waited (the next one had been sent by then) to the
    next dispatch. Dispatch time: sent + x-iop-queue-ms (the load generator's clock plus
    Redis's measure)."""
    waited = sorted(((a.sent + a.queue_ms / 1000, a.sent) for a in answers if a.status == 200 and a.queue_ms >= 1),
                    key=lambda x: x[0])
    return [(d2 - d1) * 1000 for (d1, _), (d2, s2) in itertools.pairwise(waited) if s2 < d1]


# --------------------------------------------------------------------------- figures


@dataclass(frozen=True)
class Figures:
    load: float
    deadline_ms: int
    offered: int
    admitted: int
    refused: int
    timed_out: int
    other_errors: int
    good: int  # admitted, answered with TTFT within the SLO
    started: int  # admitted, answered, dispatched within the deadline
    window: float
    ttft_ms: list[float]  # of the admitted (inf: not answered)
    refusal_ms: list[float]
    queue_ms: list[float]  # of the answered
    over_ms: list[float]  # refusals' predicted excess
    predicted_interval_ms: list[float]  # iop's drain interval, sampled while jobs waited
    realized_gaps_ms: list[float]  # the intervals between dispatches with a backlog (backlog_gaps_ms)
    tokens_per_s: float
    late_steps: float

    @property
    def good_share(self) -> float:
        return self.good / self.admitted if self.admitted else math.nan

    @property
    def started_share(self) -> float:
        return self.started / self.admitted if self.admitted else math.nan


def figures(run: Run, intervals: list[float], load: float, deadline_ms: int, slo_s: float, start_s: float) -> Figures:
    measured = [r for r in run.measured() if isinstance(r, Answer)]
    refused = [r for r in measured if r.code == REFUSED]
    admitted = [r for r in measured if r.code != REFUSED]
    answered = [r for r in admitted if r.status == 200]
    timed_out = sum(1 for r in admitted if r.code == TIMED_OUT)
    return Figures(
        load=load, deadline_ms=deadline_ms, offered=len(measured), admitted=len(admitted), refused=len(refused),
        timed_out=timed_out, other_errors=len(admitted) - len(answered) - timed_out,
        good=sum(1 for r in answered if r.ttft <= slo_s),
        started=sum(1 for r in answered if r.queue_ms <= start_s * 1000),
        window=run.window,
        ttft_ms=[r.ttft * 1000 if r.status == 200 else math.inf for r in admitted],
        refusal_ms=[r.answer_ms for r in refused],
        queue_ms=[r.queue_ms for r in answered if not math.isnan(r.queue_ms)],
        over_ms=[r.over_ms for r in refused if not math.isnan(r.over_ms)],
        predicted_interval_ms=intervals, realized_gaps_ms=backlog_gaps_ms(measured),
        tokens_per_s=run.output_tokens_per_s(), late_steps=run.late_steps())


def pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 100:.1f}%"


def run_name(f: Figures) -> str:
    return f"{f.load:.0%}, " + (f"`{DEADLINE_HEADER}: {f.deadline_ms}`" if f.deadline_ms else "no deadline")


def results_table(all_figures: Sequence[Figures], slo_s: float, start_s: float) -> str:
    rows = []
    for f in all_figures:
        rows.append([
            run_name(f), f"{f.offered:,}", f"{f.admitted:,}", f"{f.refused:,} ({f.refused / f.offered:.0%})"
            if f.offered else "0", str(f.timed_out), str(f.other_errors),
            f"{f.good:,} ({pct(f.good_share)})", pct(f.started_share), f"{f.good / f.window:.2f}",
            ms(f.ttft_ms, 50), ms(f.ttft_ms, 90), ms(f.ttft_ms, 99),
            f"{ms(f.queue_ms, 50)} / {ms(f.queue_ms, 99)} / {ms(f.queue_ms, 100)}",
            f"{ms(f.refusal_ms, 50, 1)} / {ms(f.refusal_ms, 99, 1)} / {ms(f.refusal_ms, 100, 1)}",
            f"{f.tokens_per_s:,.0f}", pct(f.late_steps),
        ])
    return markdown_table(
        ["load, run", "offered", "admitted", "refused", "queue timeouts", "other errors",
         f"goodput (TTFT ≤ {slo_s:g} s), of admitted", f"started ≤ {start_s:g} s, of admitted", "goodput req/s",
         "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "queue wait p50 / p99 / max ms",
         "refusal answered in p50 / p99 / max ms", "output tokens/s", "late steps"], rows)


def goals_table(all_figures: Sequence[Figures]) -> str:
    rows = []
    by_load: dict[float, dict[bool, Figures]] = {}
    for f in all_figures:
        by_load.setdefault(f.load, {})[bool(f.deadline_ms)] = f
    for load, runs in by_load.items():
        d, n = runs.get(True), runs.get(False)
        if d is None:
            continue
        met = "**met**" if d.good_share >= GOODPUT_GOAL else "**missed**"
        rows.append([f"{load:.0%}: goodput ≥ {GOODPUT_GOAL:.0%} of admitted",
                     f"{met}: {pct(d.good_share)} ({d.good:,} of {d.admitted:,}; {d.refused:,} refused, "
                     f"{d.timed_out} queue timeouts)"])
        worst = max(d.refusal_ms) if d.refusal_ms else math.nan
        if not d.refusal_ms:
            verdict = "nothing refused"
        else:
            verdict = ("**met**" if worst <= REFUSAL_GOAL_MS else "**missed**") + \
                f": max {worst:.1f} ms, p99 {ms(d.refusal_ms, 99, 1)} ms over {len(d.refusal_ms):,} refusals"
        rows.append([f"{load:.0%}: every refusal answered in ≤ {REFUSAL_GOAL_MS:g} ms", verdict])
        if n is not None:
            rows.append([f"{load:.0%}: against no deadlines",
                         f"goodput {d.good / d.window:.2f} against {n.good / n.window:.2f} req/s; of admitted "
                         f"{pct(d.good_share)} against {pct(n.good_share)}; started within the deadline "
                         f"{pct(d.started_share)} against {pct(n.started_share)}; TTFT p99 {ms(d.ttft_ms, 99)} "
                         f"against {ms(n.ttft_ms, 99)} ms"])
        excess = f"the load beyond nominal capacity: {pct(max(0.0, 1 - 1 / load))}"
        if n is not None and n.offered:
            served = n.tokens_per_s / Workload().output_tokens  # every answer is that long
            offered = n.offered / n.window
            excess += (f"; beyond what the fleet served without deadlines, {served:.2f} of {offered:.2f} req/s: "
                       f"{pct(max(0.0, 1 - served / offered))}")
        rows.append([f"{load:.0%}: refused", f"{pct(d.refused / d.offered if d.offered else math.nan)} of offered, "
                     f"and {pct(d.timed_out / d.offered if d.offered else math.nan)} timed out in the queue "
                     f"({excess})"])
    return markdown_table(["goal (issue 20)", "result"], rows)


DRAIN_NOTE: Final = (
    "**The prediction.** iop's drain interval (`lua/lib/pump.lua` `drain_interval`: the mean interval of each "
    "block of 8 dispatches from the queue while it had a backlog moves it halfway; a request k places back is "
    "refused when (k + 1.65 sqrt(k)) intervals exceed its deadline), "
    "read from Redis every 50 ms while jobs waited, against the intervals it averages, taken from the answers "
    "(dispatch = sent + `x-iop-queue-ms`; an interval counts when the next job waiting had been sent by the "
    "earlier dispatch). A prediction below the realized mean admits requests that then time out in the queue; "
    "above it, refuses ones that would have started in time. A refusal's predicted excess is the wait beyond the "
    "deadline its message states (to 0.1 s).\n")


def drain_table(all_figures: Sequence[Figures]) -> str:
    rows = []
    for f in all_figures:
        p, g = f.predicted_interval_ms, f.realized_gaps_ms
        mean_p = sum(p) / len(p) if p else math.nan
        mean_g = sum(g) / len(g) if g else math.nan
        rows.append([run_name(f), f"{ms(p, 10)} / {ms(p, 50)} / {ms(p, 90)}", f"{mean_p:,.0f}",
                     f"{mean_g:,.0f} ({len(g):,} intervals)",
                     f"{mean_p / mean_g:.2f}" if p and g else "-",
                     f"{ms(f.over_ms, 50)} / {ms(f.over_ms, 90)} / {ms(f.over_ms, 100)}"])
    return markdown_table(["load, run", "predicted interval p10 / p50 / p90 ms", "predicted mean ms",
                           "realized mean interval ms", "predicted / realized",
                           "refusals' predicted excess p50 / p90 / max ms"], rows)


# --------------------------------------------------------------------------- main


def notes(args: argparse.Namespace, sim: SimConfig, w: Workload, cap: Capacity, capacity: int) -> str:
    return (
        f"**Setup.** {args.servers} simulated servers (`bench/fleet_sim.py`, prefix_fleet's fleet: KV "
        f"{sim.kv_blocks:,} blocks of {sim.block_tokens} tokens each, at most {sim.max_batch} running, "
        f"{sim.step_ms:g} ms per step + {sim.prefill_ms_per_token:g} ms per prefilled token + "
        f"{sim.decode_ms_per_seq:g} ms per decoding request) behind iop without affinity (one API process, one "
        f"worker per server, each provider's `capacity` {capacity}: what the server's KV lets it run at once, so "
        f"that requests wait in iop's queue, not in the servers'). Trace: prefix_fleet's *unique* variant (each "
        f"request its own {w.prefix_tokens[0]:,}-{w.prefix_tokens[1]:,}-token system prompt plus a "
        f"{w.query_tokens[0]}-{w.query_tokens[1]}-token question, {w.output_tokens} tokens out, streamed), "
        f"Poisson arrivals conditioned on their count, the same seeded trace (`--seed {args.seed}`) for both runs "
        f"of a load. Nominal capacity (prefix_fleet's `nominal_capacity`): "
        f"{cap.per_server * args.servers:.2f} req/s ({cap.batch} running per server, {cap.ms_per_request:.0f} "
        f"server-ms per request). Each run: {args.seconds:g} s of arrivals; the first {args.warmup:g} s are not "
        f"counted (iop's drain interval is learned during them). No client retries a refusal.\n\n"
        f"**Columns.** *Admitted*: not refused `{REFUSED}` (a `{TIMED_OUT}` counts as admitted and not good). "
        f"*Goodput*: admitted requests whose first token came within {args.slo_ms / 1000:g} s of sending (the "
        f"{args.deadline_ms / 1000:g} s deadline to start plus {(args.slo_ms - args.deadline_ms) / 1000:g} s for "
        f"the prefill, about {cap.uncached_tokens * sim.prefill_ms_per_token + sim.step_ms:.0f} ms here, and the "
        f"step it waits for). *Started ≤ {args.deadline_ms / 1000:g} s*: answered with `x-iop-queue-ms` (submit to "
        f"dispatch, Redis's clock) within the deadline. TTFT percentiles over the admitted, ∞ for one not "
        f"answered. *Refusal answered in*: sending to the end of the 503's body, at the load generator. Output "
        f"tokens/s: completion tokens of the counted answers over the time from the window's start to the last "
        f"answer. Late steps: the servers' steps that started > {sim.catch_up_ms:g} ms behind schedule (the "
        f"machine not keeping up with the simulation).\n")


def command(args: argparse.Namespace) -> str:
    if args.quick:
        return f"{COMMAND} --quick"
    return command_line(COMMAND, args, {"seconds": 60.0, "warmup": 10.0, "loads": [1.0, 1.2], "deadline_ms": 1000,
                                        "slo_ms": 2000.0, "servers": 4, "seed": "iop-20"})


async def main(args: argparse.Namespace) -> str:
    # prefix_fleet's fleet, with its defaults: KV sized from its tenants' prefixes (this trace shares none).
    pf = prefix_fleet.parse_args([])
    w = Workload(tenants=pf.tenants)
    working_set = prefix_working_set(w, pf.seed, SimConfig().block_tokens)
    sim = SimConfig(kv_blocks=math.ceil(working_set / pf.kv_fill / args.servers), max_tokens=w.output_tokens,
                    metrics="sglang")  # as iop's providers' type
    cap = nominal_capacity(sim, args.servers, w, VARIANT, args.seed)
    capacity = args.iop_capacity or cap.batch
    print(f"nominal capacity {cap.per_server * args.servers:.2f} req/s ({cap.batch} running per server, "
          f"{cap.ms_per_request:.0f} ms per request); iop capacity {capacity} per server", flush=True)
    directory = Path(tempfile.mkdtemp(prefix="iop-deadlines-"))
    out = [notes(args, sim, w, cap, capacity)]
    all_figures: list[Figures] = []
    started_at = time.monotonic()
    with Fleet([sim] * args.servers, directory) as fleet:
        for load in args.loads:
            rate = load * cap.per_server * args.servers
            trace = make_trace(w, VARIANT, rate, args.seconds, args.seed, sim.block_tokens)
            print(f"\n## {load:.0%} of nominal: {rate:.2f} req/s, {len(trace):,} requests", flush=True)
            for deadline_ms in (args.deadline_ms, 0):
                began = time.monotonic()
                target = Iop("iop", capacity)
                label = f"{DEADLINE_HEADER}: {deadline_ms}" if deadline_ms else "no deadline"
                run, intervals = await measure(target, fleet, trace, deadline_ms, args, label)
                f = figures(run, intervals, load, deadline_ms, args.slo_ms / 1000, args.deadline_ms / 1000)
                all_figures.append(f)
                print(f"  {label}: offered {f.offered}, refused {f.refused}, queue timeouts {f.timed_out}, "
                      f"errors {f.other_errors}, good {pct(f.good_share)} of admitted, started in time "
                      f"{pct(f.started_share)}, TTFT p50/p99 {ms(f.ttft_ms, 50)}/{ms(f.ttft_ms, 99)} ms, "
                      f"refusals p50/max {ms(f.refusal_ms, 50, 1)}/{ms(f.refusal_ms, 100, 1)} ms, "
                      f"queue wait p99 {ms(f.queue_ms, 99)} ms, late steps {pct(f.late_steps)} "
                      f"({time.monotonic() - began:.0f} s)", flush=True)
    shutil.rmtree(directory, ignore_errors=True)
    slo_s, start_s = args.slo_ms / 1000, args.deadline_ms / 1000
    results = results_table(all_figures, slo_s, start_s)
    goals = goals_table(all_figures)
    drain = drain_table(all_figures)
    elapsed = time.monotonic() - started_at
    print(f"\n{results}\n{goals}\n{drain}\nbenchmark took {elapsed:.0f} s", flush=True)
    out += [f"**Against the goals.**\n\n{goals}", results, DRAIN_NOTE, drain,
            f"The whole benchmark took {elapsed / 60:.1f} min.\n"]
    return "\n".join(s for s in out if s)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short run for development: 15 s per run")
    parser.add_argument("--seconds", type=float, default=60.0, help="arrivals per run")
    parser.add_argument("--warmup", type=float, default=10.0, help="first seconds of each run not counted")
    parser.add_argument("--loads", nargs="+", type=float, default=[1.0, 1.2], help="fractions of nominal capacity")
    parser.add_argument("--deadline-ms", type=int, default=1000, help="x-iop-deadline-ms of the deadline runs")
    parser.add_argument("--slo-ms", type=float, default=2000.0, help="the TTFT goodput counts")
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--iop-capacity", type=int, default=0,
                        help="each provider's capacity (0: the requests a server runs at once)")
    parser.add_argument("--seed", default="iop-20")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.warmup = 15.0, 3.0
    if args.warmup >= args.seconds:
        parser.error("--warmup must be shorter than --seconds")
    return args


HEADING: Final = """## Deadlines under saturation (issue 20)

`python -m bench.deadlines` (`--quick` for a short look): prefix_fleet's simulated servers
behind iop at 100% and 120% of their nominal capacity, every request with
`x-iop-deadline-ms: 1000` against none. Goals (issue 20): goodput (answered within the SLO)
≥ 95% of the admitted requests, and every refused request answered in ≤ 50 ms. The module
docstring says what is simulated and what is left out.
"""


def write(args: argparse.Namespace, text: str) -> None:
    write_section(NAME, command(args), text, heading=HEADING)


if __name__ == "__main__":
    arguments = parse_args()
    uvloop.install()
    text = asyncio.run(main(arguments))
    if not arguments.no_write:
        write(arguments, text)
