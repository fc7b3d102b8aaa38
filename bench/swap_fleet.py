"""Models that load and unload (issue 47): the fleet and demand that judge ``lifecycle: managed``.

    python -m bench.swap_fleet [--quick] [--shapes ...] [--targets ...] [--servers 3] [--models 8]
                               [--seconds 22] [--warmup 5] [--drain 10] [--slo-ms 0] [--zipf 1.0]
                               [--shift-by 2] [--managed-provider JSON] [--seed iop-47] [--write]

``--servers`` N simulated llama-servers in router mode (``bench/fleet_sim.py --models``: one
process each, holding K models at once, each loaded model a batch of its own, a load taking
seconds, the least recently used model unloaded -- busy or not -- when a request or a load
wants room) serve ``--models`` M models, M > N x K. Demand is Zipf-popular over the M models
(exponent ``--zipf``) and its ranking rotates every ``shift_s`` seconds by ``--shift-by`` places
(``shift_s`` 0: it holds still): the models worth holding change while the run goes on. The
load generator is prefix_fleet's (open loop, arrivals conditioned on their count, the same
seeded trace for every target of a shape, 32 tokens out, streamed). Each run starts its
servers and its target's processes afresh; after the last arrival the answers have
``--drain`` seconds, the rest are cut and reported *unanswered*.

Targets (``--targets``; a target iop's ``config check`` refuses, or that cannot start, is
reported as such and the others go on):

* ``iop-static``: iop as it is without lifecycle management: one ``llamacpp`` provider per
  server (``lifecycle: static``), each listing every model, so iop treats every model as
  loaded everywhere and the server swaps on every request for one it does not hold.
* ``iop-managed``: the same providers with ``lifecycle: managed``, ``max_loaded: K`` and
  ``load_s`` the servers' load time (``managed_fields``; ``--managed-provider`` JSON is merged
  over them): iop reads what each server holds and places loads itself.
* ``litellm``: LiteLLM's proxy (``.venv-servers/litellm``, installed by ``./dev test``'s set-up),
  ``routing_strategy: least-busy``, one deployment per server and model.
* ``static-best``: the best fixed placement for the whole run: each server preloaded with K
  models chosen from the whole trace's demand (``place``), iop ``lifecycle: static`` with each
  provider listing only its own; no load ever happens, and a model placed nowhere is not
  served (iop refuses it: not good).

The other targets' servers start holding ``place`` of the first shift's demand (what an
operator would load at start), static-best's that of the whole run: only static-best knows the
future. Every provider's ``capacity`` is K x the engines' batch (what a server runs with all
its K models busy).

Shapes (``--shapes``; every one is reported, one factor changed from *base* at a time): *base*
K=1, loads of 1 s, demand shifting every 10 s, 60% of the fleet's nominal capacity; *k2* K=2;
*load-4s* loads of 4 s; *still* no shift; *fast* a shift every 4 s; *heavy* 90%. Nominal
capacity: N x K x one engine's rate (prefix_fleet's cost model: every loaded model busy at
its batch, never loading). Each shape's SLO (``--slo-ms``; 0: per shape) is 2 x its load time
+ 1 s: a request that waits for one load still meets it.

Per target: goodput (requests of the measured window -- after ``--warmup`` -- answered whole
with TTFT within the SLO, per second of the window), answered per second, loads per minute
(every load the servers made, ``/sim/stats``, over the whole run), LRU unloads and requests
they cut off, TTFT p50/p90 (∞ for a request never answered), unanswered, errors (cut off,
refused).

Durations (2 vCPUs): a run is ``--seconds`` (22) of arrivals, up to ``--drain`` (10) more, and
5-15 s of start-up (LiteLLM's proxy is the slowest), 35-45 s in all; the default six shapes x
four targets take about 15 minutes; ``--quick`` (one shape, 12 s of arrivals per target) about
two. It prints its tables; ``--write`` puts them in docs/BENCHMARKS.md.

Simulated or left out: the servers are ``bench/fleet_sim.py`` (its docstring says what its
model swapping copies of llama-server's router and what it leaves out: the loaded models do
not share an accelerator there); all processes share the machine's cores (*late steps* says
how far the servers fell behind their own schedule); no client retries; one API process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgspec
import uvloop

from bench.capacity_fleet import ConfiguredStack, LiteLLM, Measured, Stream, errors, measure, ttfts_ms, unanswered
from bench.fleet_sim import SimConfig, SwapConfig, swap_args
from bench.prefix_fleet import (
    Arrival,
    Fleet,
    FleetStack,
    Iop,
    Run,
    Target,
    Words,
    Workload,
    chat_prompt_tokens,
    config_problems,
    fmt_ms,
    nominal_capacity,
)
from bench.stack import command_line, load_average, machine, markdown_table, write_section
from tests.realservers.servers import start_litellm

COMMAND: Final = "python -m bench.swap_fleet"
TARGETS: Final = ("iop-static", "iop-managed", "litellm", "static-best")

# Short prompts and answers: the machine's two cores carry the servers, iop and the load.
W: Final = Workload(tenants=1, users=1, prefix_tokens=(150, 250), query_tokens=(50, 100), output_tokens=32)
# One loaded model's engine (one child llama-server): batch 2, 40 ms steps.
ENGINE: Final = SimConfig(kv_blocks=400, max_batch=2, step_ms=40.0, prefill_ms_per_token=0.1, decode_ms_per_seq=0.5,
                          max_tokens=W.output_tokens, metrics="none")


@dataclass(frozen=True)
class Shape:
    name: str
    per_server: int  # K: models each server holds at once
    load_s: float  # one load's duration
    shift_s: float  # the popularity ranking rotates this often; 0: never
    load: float  # offered, of the fleet's nominal capacity

    def what(self) -> str:
        shift = f"demand shifting every {self.shift_s:g} s" if self.shift_s else "demand holding still"
        return f"K={self.per_server}, loads of {self.load_s:g} s, {shift}, {self.load:.0%} of nominal capacity"


SHAPES: Final = (
    Shape("base", 1, 1.0, 10.0, 0.6),
    Shape("k2", 2, 1.0, 10.0, 0.6),
    Shape("load-4s", 1, 4.0, 10.0, 0.6),
    Shape("still", 1, 1.0, 0.0, 0.6),
    Shape("fast", 1, 1.0, 4.0, 0.6),
    Shape("heavy", 1, 1.0, 10.0, 0.9),
)
QUICK: Final = Shape("quick", 1, 1.0, 5.0, 0.6)


# --------------------------------------------------------------------------- demand


@dataclass(frozen=True, slots=True)
class SwapArrival(Arrival):
    model: str = ""


def model_names(n: int) -> list[str]:
    return [f"m{i}" for i in range(n)]


def zipf_weights(n: int, exponent: float) -> list[float]:
    """The share of demand of each popularity rank (0 the most popular), Zipf's law."""
    raw = [1 / (rank + 1) ** exponent for rank in range(n)]
    return [r / sum(raw) for r in raw]


def epoch_of(at: float, shift_s: float) -> int:
    return int(at // shift_s) if shift_s > 0 else 0


def ranking(models: Sequence[str], epoch: int, shift_by: int) -> list[str]:
    """The models by popularity in ``epoch``: the first epoch's order rotated ``shift_by``
    places per epoch, so that the most popular models of one epoch fall to the tail of the next."""
    n = len(models)
    return [models[(rank + epoch * shift_by) % n] for rank in range(n)]


def make_swap_trace(models: Sequence[str], rate: float, seconds: float, shift_s: float, shift_by: int,
                    exponent: float, seed: str, w: Workload = W) -> list[SwapArrival]:
    """Open-loop arrivals at ``rate`` for ``seconds`` (a Poisson process conditioned on its
    count, as prefix_fleet's), each for a model drawn by the popularity ranking of its epoch.
    Times, prompts and ranks come from their own seeded streams, so traces that differ only in
    ``shift_s`` have the same arrivals, prompts and ranks: only which model a rank names moves."""
    words = Words(seed)
    times = random.Random(f"{seed}-times-{rate:.4f}-{seconds:g}")
    ranks = random.Random(f"{seed}-ranks-{rate:.4f}-{seconds:g}")
    texts = random.Random(f"{seed}-texts-{rate:.4f}-{seconds:g}")
    weights = zipf_weights(len(models), exponent)
    trace: list[SwapArrival] = []
    for i, at in enumerate(sorted(times.uniform(0, seconds) for _ in range(round(rate * seconds)))):
        rank = ranks.choices(range(len(models)), weights)[0]
        model = ranking(models, epoch_of(at, shift_s), shift_by)[rank]
        system = f"You are the assistant of request {i}. " + words.text(texts, texts.randint(*w.prefix_tokens) - 6)
        question = f"Question {i}: " + words.text(texts, texts.randint(*w.query_tokens) - 2)
        body = msgspec.json.encode({
            "model": model, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": w.output_tokens,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        })
        trace.append(SwapArrival(at, rank, body, i, chat_prompt_tokens(system, question), 0, model))
    return trace


def demand(trace: Sequence[SwapArrival], start: float = 0.0, end: float = math.inf) -> Counter[str]:
    """Requests per model among the arrivals in [start, end)."""
    return Counter(a.model for a in trace if start <= a.at < end)


def place(wanted: Mapping[str, float], servers: int, per_server: int) -> list[tuple[str, ...]]:
    """The best fixed placement for ``wanted`` (model -> demand): ``per_server`` models on each
    of ``servers`` servers.

    Water-filling (D'Hondt): each of the servers x per_server slots goes in turn to the model
    whose demand per copy would be highest with it (demand / (copies + 1)), at most one copy
    per server, models without demand never; so a model gets a second copy only when its
    demand per copy beats every model left out. Then the copies are dealt out, the models
    with the most copies first, each to the servers with the most free slots (the order that
    always fits: Gale-Ryser), ties to the server with the least demand so far, then the lowest
    index. Models of equal demand are taken in name order: the result is deterministic."""
    copies: Counter[str] = Counter()
    for _ in range(servers * per_server):
        open_ = [m for m, d in wanted.items() if d > 0 and copies[m] < servers]
        if not open_:
            break
        best = min(open_, key=lambda m: (-wanted[m] / (copies[m] + 1), m))
        copies[best] += 1
    held: list[list[str]] = [[] for _ in range(servers)]
    load = [0.0] * servers
    for m in sorted(copies, key=lambda m: (-copies[m], -wanted[m], m)):
        chosen = sorted(range(servers), key=lambda i: (-(per_server - len(held[i])), load[i], i))[:copies[m]]
        for i in chosen:
            held[i].append(m)
            load[i] += wanted[m] / copies[m]
    return [tuple(h) for h in held]


def placed_share(wanted: Mapping[str, float], placement: Sequence[Sequence[str]]) -> float:
    """The share of the demand whose model the placement holds somewhere."""
    total = sum(wanted.values())
    held = {m for models in placement for m in models}
    return sum(d for m, d in wanted.items() if m in held) / total if total else math.nan


def start_placement(trace: Sequence[SwapArrival], shape: Shape, servers: int) -> list[tuple[str, ...]]:
    """What the servers of the targets that move models hold at start: the best placement for
    the first shift's demand (the whole run's when demand holds still)."""
    first = demand(trace, 0.0, shape.shift_s if shape.shift_s else math.inf)
    return place(first, servers, shape.per_server)


# --------------------------------------------------------------------------- the fleet


class SwapFleet(Fleet):
    """prefix_fleet's fleet of simulated servers, each swapping models as its ``SwapConfig`` says."""

    def __init__(self, sims: Sequence[SimConfig], swaps: Sequence[SwapConfig], directory: Path) -> None:
        super().__init__(sims, directory)
        self.swaps = list(swaps)

    def server_args(self, i: int, sim: SimConfig) -> list[str]:
        return [*super().server_args(i, sim), *swap_args(self.swaps[i])]


def swap_configs(models: Sequence[str], shape: Shape, preload: Sequence[Sequence[str]]) -> list[SwapConfig]:
    return [SwapConfig(models=tuple(models), models_max=shape.per_server, load_ms=shape.load_s * 1000,
                       preload=tuple(p)) for p in preload]


# --------------------------------------------------------------------------- targets


def managed_fields(shape: Shape, extra: Mapping[str, Any]) -> dict[str, Any]:
    """The provider fields of ``iop-managed`` (``--managed-provider`` merged over them)."""
    return {"lifecycle": "managed", "max_loaded": shape.per_server, "load_s": shape.load_s, **extra}


def swap_iop_config(urls: Sequence[str], held: Sequence[Sequence[str]], capacity: int,
                    fields: Mapping[str, Any]) -> dict[str, Any]:
    """iop in front of the servers: one node, worker and ``llamacpp`` provider per server, each
    provider listing the models ``held`` says and carrying ``fields``; every model that some
    provider lists, served by those."""
    listed = sorted({m for models in held for m in models}, key=lambda m: (len(m), m))
    return {
        "queue": {"max_queue": 100_000, "queue_timeout_ms": 600_000},
        "models": [{"id": m, "providers": {f"p{i}": m for i, models in enumerate(held) if m in models}}
                   for m in listed],
        "nodes": [{"id": f"n{i}", "providers": [{"id": f"p{i}", "type": "llamacpp", "base_url": url,
                                                 "capacity": capacity, "models": list(models), **fields}]}
                  for i, (url, models) in enumerate(zip(urls, held, strict=True))],
    }


class SwapIop(Iop):
    def __init__(self, name: str, label: str, held: Sequence[Sequence[str]], capacity: int,
                 fields: Mapping[str, Any]) -> None:
        super().__init__(name, capacity)
        self.label = label
        self.held = [list(h) for h in held]
        self.fields = dict(fields)

    def config_for(self, urls: Sequence[str]) -> dict[str, Any]:
        return swap_iop_config(urls, self.held, self.capacity, self.fields)

    def skip_reason(self) -> str | None:
        dummy = [f"http://127.0.0.1:{9 + i}" for i in range(len(self.held))]
        problems = config_problems(self.config_for(dummy), sorted(self.fields))
        return "not available: " + "; ".join(problems) if problems else None

    def make_stack(self, fleet: Fleet) -> FleetStack:
        return ConfiguredStack({}, servers=fleet.urls, iop_yaml=self.config_for(fleet.urls))


def swap_litellm_config(urls: Sequence[str], models: Sequence[str]) -> dict[str, Any]:
    """LiteLLM's proxy: one deployment per server and model, least-busy among a model's."""
    return {
        "model_list": [{"model_name": m, "litellm_params": {"model": f"openai/{m}", "api_base": f"{u}/v1",
                                                            "api_key": "sk-unused"}} for m in models for u in urls],
        "router_settings": {"routing_strategy": "least-busy"},
        "litellm_settings": {"telemetry": False, "drop_params": True},
    }


class SwapLiteLLM(LiteLLM):
    name = "litellm"

    def __init__(self, directory: Path, models: Sequence[str]) -> None:
        super().__init__(directory)
        self.models = list(models)

    def start(self, fleet: Fleet) -> None:
        self.server = start_litellm(self.dir, lambda port: swap_litellm_config(fleet.urls, self.models))
        self.url = self.server.url


# --------------------------------------------------------------------------- figures


@dataclass(frozen=True)
class Figures:
    goodput: float  # req/s of the window answered whole within the SLO
    answered: float  # req/s of the window answered whole
    loads: int  # every load the servers made over the run (autoloads and API loads)
    loads_per_min: float
    lru_unloads: int
    cut_off: int  # requests the servers cut off when they unloaded their model
    killed_loads: int  # loads cut short by an unload (the requests that waited for them failed)
    ttft_p50: str
    ttft_p90: str
    unanswered: int
    errors: int  # cut off, refused, or broken
    late_steps: float


def figures(run: Run, server_stats: Sequence[Mapping[str, Any]], wall_s: float, slo_s: float) -> Figures:
    """A run's figures: from its requests (those sent after the warm-up) and its servers'
    ``/sim/stats`` (the whole run, warm-up included)."""
    measured = run.measured()
    answered = sum(1 for r in measured if r.status == 200) / run.window
    loads = sum(int(sum(s.get("loads", {}).values())) for s in server_stats)
    t = ttfts_ms(run)
    return Figures(goodput=run.goodput(slo_s), answered=answered, loads=loads,
                   loads_per_min=loads / (wall_s / 60) if wall_s > 0 else math.nan,
                   lru_unloads=sum(int(s.get("unloads", {}).get("lru", 0)) for s in server_stats),
                   cut_off=sum(int(s.get("cut_off", 0)) for s in server_stats),
                   killed_loads=sum(int(s.get("failed_loads", 0)) for s in server_stats),
                   ttft_p50=fmt_ms(t, 50), ttft_p90=fmt_ms(t, 90), unanswered=unanswered(run), errors=errors(run),
                   late_steps=run.late_steps())


HEADERS: Final = ["target", "goodput req/s", "answered req/s", "loads/min (loads)", "LRU unloads", "cut off",
                  "killed loads", "TTFT p50 ms", "TTFT p90 ms", "unanswered", "errors", "late steps"]


def row(label: str, f: Figures) -> list[str]:
    return [label, f"{f.goodput:.2f}", f"{f.answered:.2f}", f"{f.loads_per_min:.1f} ({f.loads})",
            str(f.lru_unloads), str(f.cut_off), str(f.killed_loads), f.ttft_p50, f.ttft_p90, str(f.unanswered),
            str(f.errors),
            "-" if math.isnan(f.late_steps) else f"{f.late_steps * 100:.1f}%"]


def unavailable_row(label: str, why: str) -> list[str]:
    return [label, why, *["-"] * (len(HEADERS) - 2)]


def slo_of(shape: Shape, slo_ms: float) -> float:
    """The shape's SLO in seconds: ``--slo-ms``, or with 0, 2 x its load time + 1 s."""
    return slo_ms / 1000 if slo_ms > 0 else 2 * shape.load_s + 1.0


def shown(placement: Sequence[Sequence[str]]) -> str:
    return " / ".join(",".join(p) or "-" for p in placement)  # not "|": it goes in tables


# --------------------------------------------------------------------------- runs


@dataclass
class ShapeOutcome:
    shape: Shape
    text: str
    rows: dict[str, Figures] = field(default_factory=dict)


def make_targets(names: Sequence[str], shape: Shape, models: Sequence[str], start: Sequence[tuple[str, ...]],
                 best: Sequence[tuple[str, ...]], args: argparse.Namespace,
                 directory: Path) -> list[tuple[Target, list[tuple[str, ...]]]]:
    """Each target asked for, with what its servers hold at start."""
    servers = len(start)
    everything = [list(models)] * servers
    capacity = shape.per_server * ENGINE.max_batch
    managed = managed_fields(shape, args.managed_provider)
    out: list[tuple[Target, list[tuple[str, ...]]]] = []
    for name in names:
        if name == "iop-static":
            out.append((SwapIop(name, f"iop, `lifecycle: static`, every model on every provider, capacity {capacity}",
                                everything, capacity, {"lifecycle": "static"}), list(start)))
        elif name == "iop-managed":
            out.append((SwapIop(name, f"iop, `{json.dumps(managed)}`, every model on every provider, capacity "
                                f"{capacity}", everything, capacity, managed), list(start)))
        elif name == "litellm":
            out.append((SwapLiteLLM(directory, models), list(start)))
        elif name == "static-best":
            out.append((SwapIop(name, f"static-best: iop, `lifecycle: static`, each provider only its placed "
                                f"models, capacity {capacity}", best, capacity, {"lifecycle": "static"}),
                        list(best)))
    return out


async def run_shape(shape: Shape, args: argparse.Namespace, directory: Path) -> ShapeOutcome:
    models = model_names(args.models)
    per_engine = nominal_capacity(ENGINE, 1, W, "unique", args.seed).per_server
    nominal = args.servers * shape.per_server * per_engine
    rate = shape.load * nominal
    trace = make_swap_trace(models, rate, args.seconds, shape.shift_s, args.shift_by, args.zipf, args.seed)
    start = start_placement(trace, shape, args.servers)
    whole = demand(trace)
    best = place(whole, args.servers, shape.per_server)
    slo = slo_of(shape, args.slo_ms)
    sims = [ENGINE] * args.servers
    heading = (f"*{shape.name}*: {shape.what()}: {rate:.2f} req/s ({len(trace):,} requests), SLO TTFT ≤ {slo:g} s")
    print(f"\n## {heading}", flush=True)
    outcome = ShapeOutcome(shape, "")
    rows: list[list[str]] = []
    failed: list[str] = []
    for target, preload in make_targets(args.targets, shape, models, start, best, args, directory):
        why = target.skip_reason()
        if why is not None:
            print(f"  {target.name}: {why}", flush=True)
            rows.append(unavailable_row(target.label, why))
            continue
        began = time.monotonic()
        try:
            with SwapFleet(sims, swap_configs(models, shape, preload), directory) as fleet:
                m: Measured = await measure(target, fleet, [Stream("load", list(trace))], args, args.seconds)
        except Exception as exc:  # one target that cannot start does not cost the others their runs
            failed.append(f"*{target.label}*: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            print(f"  {target.name}: FAILED: {exc!r}", flush=True)
            rows.append(unavailable_row(target.label, f"failed: {type(exc).__name__}"))
            continue
        f = figures(m.main, m.main.server_stats, m.wall_s, slo)
        outcome.rows[target.name] = f
        rows.append(row(target.label, f))
        print(f"  {target.name}: goodput {f.goodput:.2f}/s, answered {f.answered:.2f}/s, loads {f.loads} "
              f"({f.loads_per_min:.1f}/min), LRU unloads {f.lru_unloads}, cut off {f.cut_off}, TTFT p50/p90 "
              f"{f.ttft_p50}/{f.ttft_p90} ms, unanswered {f.unanswered}, errors {f.errors} "
              f"({time.monotonic() - began:.0f} s)", flush=True)
    offered = sum(1 for a in trace if a.at >= args.warmup) / (args.seconds - args.warmup)
    setting = (f"Nominal capacity {nominal:.2f} req/s ({args.servers} servers x K={shape.per_server} x "
             f"{per_engine:.2f} req/s per loaded model); {offered:.2f} req/s arrived in the measured window. "
             f"Servers start holding {shown(start)} (static-best: {shown(best)}, the models of "
             f"{placed_share(whole, best):.0%} of the run's requests).")
    table = markdown_table(HEADERS, rows)
    outcome.text = f"**{heading}.** {setting}\n\n{table}" + (
        "\nFailed to run: " + "; ".join(failed) + ".\n" if failed else "")
    print(f"\n{setting}\n\n{table}", flush=True)
    return outcome


def notes(args: argparse.Namespace) -> str:
    per_engine = nominal_capacity(ENGINE, 1, W, "unique", args.seed).per_server
    return (f"**Fleet.** {args.servers} simulated llama-servers in router mode (`bench/fleet_sim.py --models`), "
            f"{args.models} models (`m0`-`m{args.models - 1}`), each loaded model an engine of its own: batch "
            f"{ENGINE.max_batch}, {ENGINE.step_ms:g} ms per step + {ENGINE.prefill_ms_per_token:g} ms per prefilled "
            f"token + {ENGINE.decode_ms_per_seq:g} ms per decoding request ({per_engine:.2f} req/s); a load or an "
            f"autoload unloads the least recently used model, busy or not, cutting its requests off. "
            f"**Demand.** Zipf (exponent {args.zipf:g}) over the models, the ranking rotated by {args.shift_by} "
            f"places at every shift; prompts of {sum(W.prefix_tokens) // 2 + sum(W.query_tokens) // 2} tokens on "
            f"average, {W.output_tokens} tokens out, streamed; `--seed {args.seed}`. **Each run**: {args.seconds:g} "
            f"s of arrivals, the first {args.warmup:g} s not counted, then at most {args.drain:g} s for the answers "
            f"still due. Goodput: answered whole with TTFT within the shape's SLO, per second of the measured "
            f"window; *loads/min*: every load the servers made (autoloads and `/models/load`) over the whole run, "
            f"per minute of it; *cut off*: requests running or queued on a model the server unloaded; *killed "
            f"loads*: loads an unload cut short, failing the requests that waited for them (both among the "
            f"errors, with iop's refusals of a model no provider lists); "
            f"TTFT percentiles count a request never answered as ∞. Late steps: the servers' "
            f"steps that started more than 50 ms behind their schedule (the machine not keeping up).\n")


HEADING: Final = """## Models that load and unload (issue 47)

`python -m bench.swap_fleet` (`--quick` to check the harness): simulated llama-servers in
router mode (`bench/fleet_sim.py --models`), each holding K of M models, behind iop with
every model listed as always loaded (`lifecycle: static`), iop managing the loads
(`lifecycle: managed`), LiteLLM least-busy, and the best fixed placement for the whole
run; demand whose popularity rotates. The module docstring says what is measured and
what is simulated.
"""


def command(args: argparse.Namespace) -> str:
    if args.quick:
        return f"{COMMAND} --quick"
    defaults = {k: v for k, v in vars(parse_args([])).items() if k not in ("quick", "write")}
    return command_line(COMMAND, args, defaults)


async def main(args: argparse.Namespace) -> list[ShapeOutcome]:
    directory = Path(tempfile.mkdtemp(prefix="iop-swap-fleet-"))
    shapes = [QUICK] if args.quick else [s for s in SHAPES if s.name in args.shapes]
    outcomes = []
    try:
        for shape in shapes:
            outcomes.append(await run_shape(shape, args, directory))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return outcomes


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="check the harness: one shape (K=1, 1 s loads, a shift every 5 s), 12 s per target")
    parser.add_argument("--shapes", nargs="+", choices=[s.name for s in SHAPES], default=[s.name for s in SHAPES])
    parser.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS))
    parser.add_argument("--servers", type=int, default=3, help="N: simulated servers, one iop provider each")
    parser.add_argument("--models", type=int, default=8, help="M: models the servers serve (more than N x K)")
    parser.add_argument("--seconds", type=float, default=22.0, help="arrivals per run")
    parser.add_argument("--warmup", type=float, default=5.0, help="first seconds of each run not counted")
    parser.add_argument("--drain", type=float, default=10.0,
                        help="seconds after the last arrival for the answers; then the rest are unanswered")
    parser.add_argument("--slo-ms", type=float, default=0.0,
                        help="the TTFT goodput counts; 0: per shape, 2 x its load time + 1 s")
    parser.add_argument("--zipf", type=float, default=1.0, help="the popularity's Zipf exponent")
    parser.add_argument("--shift-by", type=int, default=2, help="places the ranking rotates at every shift")
    parser.add_argument("--managed-provider", type=json.loads, default={},
                        help="JSON merged over iop-managed's provider fields (lifecycle, max_loaded, load_s)")
    parser.add_argument("--seed", default="iop-47")
    parser.add_argument("--write", action="store_true", help="also write the tables to docs/BENCHMARKS.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.warmup, args.drain = 12.0, 3.0, 8.0
    if not isinstance(args.managed_provider, dict):
        parser.error("--managed-provider must be a JSON object of provider fields")
    if args.warmup >= args.seconds:
        parser.error("--warmup must be shorter than --seconds")
    shapes = [QUICK] if args.quick else [s for s in SHAPES if s.name in args.shapes]
    if any(args.models <= args.servers * s.per_server for s in shapes):
        parser.error("--models must be more than --servers x K of every shape run (else nothing needs to move)")
    return args


if __name__ == "__main__":
    arguments = parse_args()
    uvloop.install()
    began, before = time.monotonic(), load_average()
    results = asyncio.run(main(arguments))
    took = f"The run took {(time.monotonic() - began) / 60:.1f} min; load average before it {before}, after it " \
           f"{load_average()}. Machine: {machine()}.\n"
    print(took)
    if arguments.write and not arguments.quick:
        write_section("swap-fleet", command(arguments), "\n".join([notes(arguments), *(o.text for o in results)]),
                      "\n" + took, heading=HEADING)
