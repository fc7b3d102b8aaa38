"""Capacity that iop learns (issue 30): the fleets and loads that judge ``capacity: auto``.

    python -m bench.capacity_fleet [--quick] [--seconds 60] [--scenarios ...] [--targets ...]
                                   [--loads ...] [--auto-provider JSON] [--no-write]
                                   [--shapes ...] [--affinity JSON]

Simulated continuous-batching servers (``bench/fleet_sim.py``, one process each, serving
vLLM's or SGLang's engine metrics at ``/metrics``) are driven by open-loop Poisson loads
(``bench.prefix_fleet``'s load generator: arrivals conditioned on their count, the same
seeded trace for every target, streamed answers of 64 tokens) through each *target* in turn.
Every run starts its target's processes afresh and the servers emptied, at their start-up
settings. After the last arrival, requests have ``--drain`` seconds (20) to finish; those
still unanswered then are cancelled and reported as *unanswered* (and count as not good).
Goodput: requests of the measured window (after ``--warmup`` seconds) whose time to first
token met the SLO (``--slo-ms``, 1 s), per second of the window. TTFT percentiles count a
request that was never answered as ∞. With ``IOP_BENCH_REASONS=1`` in the environment, every
move of a learned limit the catalog samples saw is printed with its reason, as it happens.

Targets (``--targets``; each scenario runs those of its own list that are asked for):

* ``iop-batch``: iop (a private redis-server, one node and worker per server with one
  provider, one API process), each provider's ``capacity`` = its server's batch.
* ``iop-4x``: capacity = 4x the batch; ``iop-16``: every capacity ``--generous`` (16).
* ``iop-batch-blind``: capacity = batch with the servers' metrics off: iop as it was before
  it read engines, seeing only its own requests (the baseline of *external*).
* ``iop-auto``: every provider with ``AUTO_PROVIDER`` (``{"capacity": "auto"}``; the one place
  that names the provider fields of a learned capacity, ``--auto-provider`` JSON overrides it
  for a run); ``iop-auto-latency``: the same with the servers' metrics off (their
  ``/metrics`` answers 404), so that only latency is left to learn from. A target whose
  config ``iop config check`` refuses is reported as ``not available: <iop's line>`` and the
  run goes on.
* ``litellm``: LiteLLM's proxy (``.venv-servers/litellm``, installed by ``./dev test``; one
  deployment per server, ``routing_strategy: least-busy``).
* ``rr``: round robin in the load generator, straight to the servers.
* ``sglang-router``: sglang-router's ``cache_aware`` policy (prefix_fleet's, installed on first
  use into ``.venv-servers/sglang-router``).

For iop targets the providers' ``capacity`` in ``/catalog`` is sampled during the run
(every second; every 250 ms in *settling*) and read once more at the end.

Scenarios (``--scenarios``):

* ``hetero``: 3 servers with batches 8 / 4 / 2 and steps of 20 / 30 / 45 ms (prefill 0.1 /
  0.15 / 0.225 ms per token: one GPU 1.5x and one 2.25x slower than the first), metrics as
  vLLM / SGLang / vLLM; no shared prefixes (prefix_fleet's *unique* trace: 1,650-1,950-token
  prompts); at 80% and 100% of the fleet's nominal capacity (the sum of each server's, from
  the simulator's cost model: ``prefix_fleet.nominal_capacity``). Targets: iop-batch, iop-16,
  iop-auto, iop-auto-latency, litellm, rr.
* ``shapes``: three prefix fleets (``SHAPES``: step cost, prefill cost, KV size, batch and
  the number of servers varied) with prefix_fleet's shared-prefix workload (24 tenants,
  1,400-1,600-token system prompts) at 50 / 80 / 100% of their nominal capacity (perfect
  prefix routing), iop with prefix affinity (``load_bound`` 1.25) at capacity = batch, 4x
  batch and auto, and sglang-router. Goodput and cache hit rate, every shape and load.
  ``--shapes`` runs some of them; ``--affinity`` JSON is merged over the affinity section
  every iop target gets (to measure another ``max_wait_ms`` or ``look_ahead``, say).
* ``external``: the hetero fleet; another client (in the load generator) sends 40% of the
  fast server's capacity straight to it, while iop takes the rest of 80% of the fleet's
  capacity. iop's TTFT with fixed capacities against auto; what each lost. ``--repeat N``
  runs every target on N seeded traces and pools their requests: its p90 is judged over N
  times as many.
* ``settling``: the hetero fleet at 50% load; after ``--settle-before`` (30) seconds the fast
  server is slowed 3x (``POST /sim/control`` ``slowdown``), or, second variant, its batch
  halves (8 to 4); ``--settle-after`` (30) seconds more. Each limit at the change against its
  server's batch, and when the changed server's limit moved and settled.
* ``fairness``: one server of batch 2; tenant A floods it (open loop at ``--flood-load``, 2x
  its capacity), tenant B sends ``--probe-rate`` (0.25) requests a second, for
  ``--fairness-seconds`` (90). B's TTFT with
  capacity 2 (iop-batch), 8 (iop-4x) and auto: a limit far above the batch moves the queue
  into the engine, where iop's fair queuing cannot reorder it.
* ``cost``: the hetero fleet; each worker's CPU (``/proc/<pid>/stat``, one provider per
  worker) over ``--cost-seconds`` (60) idle and as many busy at 80%, fixed against auto.

Simulated or left out: the servers are ``bench/fleet_sim.py`` (its docstring says what it
models: continuous batching, a prefix cache, the engines' metrics and how often they are
refreshed); the load generator, the servers, iop and the other gateways share the
machine's cores (each table says how many of the servers' steps ran late because of it);
no client retries; one API process. Absolute figures are the simulator's, not a GPU's.
Durations (2 vCPUs): see the figures' sections in docs/BENCHMARKS.md; ``--quick`` runs every
scenario briefly (one load, 12 s of arrivals) to check the harness.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp
import uvloop

from bench.fairness import key_of, sha256_hex
from bench.fleet_sim import SimConfig
from bench.prefix_fleet import (
    AFFINITY,
    JSON_HEADERS,
    MODEL,
    SERVED,
    UNANSWERED,
    Arrival,
    Fleet,
    FleetStack,
    Iop,
    Result,
    RoundRobin,
    Run,
    SglangRouter,
    Target,
    Workload,
    config_problems,
    fmt_ms,
    iop_config,
    make_trace,
    nominal_capacity,
    prefix_working_set,
    run_trace,
)
from bench.stack import (
    command_line,
    cpu_seconds,
    load_average,
    machine,
    markdown_table,
    percentile,
    write_section,
)
from tests.realservers.servers import RealServer, python_of, start_litellm, unavailable

COMMAND: Final = "python -m bench.capacity_fleet"
SCENARIOS: Final = ("hetero", "shapes", "external", "settling", "fairness", "cost")
TARGETS: Final = ("iop-batch", "iop-batch-blind", "iop-4x", "iop-16", "iop-auto", "iop-auto-latency", "litellm",
                   "rr", "sglang-router")
SCENARIO_TARGETS: Final[dict[str, tuple[str, ...]]] = {
    "hetero": ("iop-batch", "iop-16", "iop-auto", "iop-auto-latency", "litellm", "rr"),
    "shapes": ("iop-batch", "iop-4x", "iop-auto", "sglang-router"),
    "external": ("iop-batch-blind", "iop-batch", "iop-16", "iop-auto"),
    "settling": ("iop-batch", "iop-auto", "iop-auto-latency"),
    "fairness": ("iop-batch", "iop-4x", "iop-auto"),
    "cost": ("iop-batch", "iop-auto"),
}
FIXED: Final = ("iop-batch", "iop-batch-blind", "iop-4x", "iop-16")
METRICS_OFF: Final = ("iop-batch-blind", "iop-auto-latency")  # the servers' /metrics answer 404
DEFAULT_LOADS: Final[dict[str, tuple[float, ...]]] = {"hetero": (0.8, 1.0), "shapes": (0.5, 0.8, 1.0)}
QUICK_LOADS: Final[dict[str, tuple[float, ...]]] = {"hetero": (1.0,), "shapes": (0.8,)}

# The provider fields of an iop target whose capacity iop learns: the one place that names
# them (--auto-provider overrides it for a run).
AUTO_PROVIDER: Final[dict[str, Any]] = {"capacity": "auto"}

W: Final = Workload()  # prefix_fleet's prompts and answers: 64 tokens out, streamed
TENANTS: Final = ("tenant-a", "tenant-b")
EXTERNAL_SHARE: Final = 0.4  # of the fast server's capacity, sent straight to it
EXTERNAL_LOAD: Final = 0.8  # the whole offered load (iop's and the other client's), of the fleet's capacity
SETTLE_LOAD: Final = 0.5
SLOWDOWN: Final = 3.0
SETTLED_WITHIN: Final = 0.25  # a limit has settled once it stays within ±25% of where it ends


def _server(batch: int, step_ms: float, prefill_ms: float, metrics: str, kv_blocks: int = 1200) -> SimConfig:
    # KV for the batch's requests (a 1,950-token prompt and its answer: 126 blocks) and a
    # queue beside them: the batch is what limits these servers, not their memory.
    return SimConfig(kv_blocks=kv_blocks, max_batch=batch, step_ms=step_ms, prefill_ms_per_token=prefill_ms,
                     decode_ms_per_seq=0.5, max_tokens=W.output_tokens, model=SERVED, metrics=metrics)


HETERO: Final = (_server(8, 20.0, 0.1, "vllm"), _server(4, 30.0, 0.15, "sglang"), _server(2, 45.0, 0.225, "vllm"))
FAIRNESS_SERVER: Final = _server(2, 20.0, 0.1, "vllm", kv_blocks=600)


@dataclass(frozen=True)
class Shape:
    """A prefix fleet: ``servers`` alike, their KV sized so that the tenants' shared prefixes
    fill ``kv_fill`` of the fleet's."""

    name: str
    what: str
    servers: int
    max_batch: int
    step_ms: float
    prefill_ms_per_token: float
    decode_ms_per_seq: float
    kv_fill: float
    metrics: str

    def sims(self, w: Workload, seed: str) -> list[SimConfig]:
        working_set = prefix_working_set(w, seed, SimConfig().block_tokens)
        sim = SimConfig(kv_blocks=math.ceil(working_set / self.kv_fill / self.servers), max_batch=self.max_batch,
                        step_ms=self.step_ms, prefill_ms_per_token=self.prefill_ms_per_token,
                        decode_ms_per_seq=self.decode_ms_per_seq, max_tokens=w.output_tokens, model=SERVED,
                        metrics=self.metrics)
        return [sim] * self.servers


SHAPES: Final = (
    Shape("base", "prefix_fleet's fleet", 4, 8, 20.0, 0.1, 0.5, 0.72, "sglang"),
    Shape("slow-small-kv", "slower steps, a costlier prefill, a smaller KV", 4, 4, 40.0, 0.3, 1.0, 0.9, "vllm"),
    Shape("wide", "two servers with wide batches and a large KV", 2, 16, 30.0, 0.05, 1.0, 0.4, "sglang"),
)


# --------------------------------------------------------------------------- capacity and traces


def server_rates(sims: Sequence[SimConfig], w: Workload, variant: str, seed: str) -> list[float]:
    """Each server's nominal capacity in requests per second (prefix_fleet's cost model; the
    ``unique`` variant prefills every prompt whole), each with its own batch and costs."""
    n = len(sims)
    return [nominal_capacity(sim, n if variant != "unique" else 1, w, variant, seed).per_server for sim in sims]


def batches(sims: Sequence[SimConfig]) -> str:
    return "/".join(str(s.max_batch) for s in sims)


# --------------------------------------------------------------------------- iop's config


def engine_type(sim: SimConfig) -> str:
    """The iop provider type of a server: the engine whose metrics it serves."""
    return "sglang" if sim.metrics == "sglang" else "vllm"


def fleet_config(urls: Sequence[str], sims: Sequence[SimConfig], settings: Sequence[dict[str, Any]],
                 affinity: dict[str, Any] | None, tenants: Sequence[str] = (),
                 queue: dict[str, Any] | None = None) -> dict[str, Any]:
    """prefix_fleet's iop config (one node, worker and provider per server) with each
    provider's type and ``settings`` (its capacity fields), named tenant keys, and ``queue``
    merged over its queue section."""
    config = iop_config(urls, 1, affinity)
    config["queue"] = {**config["queue"], **(queue or {})}
    for node, sim, extra in zip(config["nodes"], sims, settings, strict=True):
        node["providers"][0].update(type=engine_type(sim), **extra)
    if tenants:
        config["api"] = {"keys": [{"name": t, "key_sha256": sha256_hex(key_of(t))} for t in tenants]}
    return config


def tenant_headers(tenant: str) -> dict[str, str]:
    return {**JSON_HEADERS, "Authorization": f"Bearer {key_of(tenant)}"}


@dataclass
class ConfiguredStack(FleetStack):
    """prefix_fleet's stack in front of the servers, with the config it is given."""

    iop_yaml: dict[str, Any] = field(default_factory=dict)

    def config(self) -> dict[str, Any]:
        return self.iop_yaml


def settings_for(name: str, sims: Sequence[SimConfig], generous: int, auto: dict[str, Any]) -> list[dict[str, Any]]:
    """The provider fields of iop target ``name``, per server."""
    if name in ("iop-batch", "iop-batch-blind"):
        return [{"capacity": s.max_batch} for s in sims]
    if name == "iop-4x":
        return [{"capacity": 4 * s.max_batch} for s in sims]
    if name == "iop-16":
        return [{"capacity": generous} for _ in sims]
    return [dict(auto) for _ in sims]


class CapacityIop(Iop):
    def __init__(self, name: str, sims: Sequence[SimConfig], settings: list[dict[str, Any]],
                 affinity: dict[str, Any] | None = None, metrics_off: bool = False,
                 tenants: Sequence[str] = (), queue: dict[str, Any] | None = None) -> None:
        super().__init__(name, 0, affinity)
        self.queue = queue or {}
        self.sims = list(sims)
        self.settings = settings
        self.metrics_off = metrics_off
        self.tenants = tuple(tenants)
        if name in FIXED:
            what = "capacity " + "/".join(str(s["capacity"]) for s in settings)
            what += {"iop-batch": " (= batch)", "iop-batch-blind": " (= batch)",
                     "iop-4x": " (= 4x batch)"}.get(name, "")
            if metrics_off:
                what += ", servers' metrics off (iop sees only its own requests)"
        else:
            what = f"`{json.dumps(settings[0])}`" + (", servers' metrics off (latency only)" if metrics_off else "")
        self.label = f"iop, {what}" + (", prefix affinity" if affinity else "")
        if self.queue:
            self.label += f", queue `{json.dumps(self.queue)}`"

    def config_for(self, urls: Sequence[str]) -> dict[str, Any]:
        return fleet_config(urls, self.sims, self.settings, self.affinity, self.tenants, self.queue)

    def skip_reason(self) -> str | None:
        fields = sorted({k for s in self.settings for k in s})
        dummy = [f"http://127.0.0.1:{9 + i}" for i in range(len(self.sims))]
        problems = config_problems(self.config_for(dummy), fields)
        return "not available: " + "; ".join(problems) if problems else None

    def make_stack(self, fleet: Fleet) -> FleetStack:
        return ConfiguredStack({}, servers=fleet.urls, iop_yaml=self.config_for(fleet.urls))

    def catalog_headers(self) -> dict[str, str]:
        """With named keys, /catalog wants one of them too."""
        return {"Authorization": f"Bearer {key_of(self.tenants[0])}"} if self.tenants else {}

    def worker_pids(self) -> dict[str, int]:
        assert self.stack is not None
        return {p.name: p.pid for p in self.stack.procs if p.name.startswith("worker-")}


def litellm_version() -> str:
    code = "import importlib.metadata as m; print(m.version('litellm'))"
    done = subprocess.run([str(python_of("litellm")), "-c", code], capture_output=True, text=True, timeout=60)
    return done.stdout.strip() or "?"


def litellm_config(urls: Sequence[str]) -> Callable[[int], dict[str, Any]]:
    def config(port: int) -> dict[str, Any]:
        return {
            "model_list": [{"model_name": MODEL, "litellm_params": {"model": f"openai/{SERVED}", "api_base": f"{u}/v1",
                                                                    "api_key": "sk-unused"}} for u in urls],
            "router_settings": {"routing_strategy": "least-busy"},
            "litellm_settings": {"telemetry": False, "drop_params": True},
        }
    return config


class LiteLLM(Target):
    name = "litellm"

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.label = "LiteLLM proxy, routing_strategy least-busy"
        self.server: RealServer | None = None

    def skip_reason(self) -> str | None:
        why = unavailable("litellm")
        if why is None:
            self.label = f"LiteLLM {litellm_version()} proxy, routing_strategy least-busy"
            return None
        return "not available: " + why.removeprefix("real-server tests: ")

    def start(self, fleet: Fleet) -> None:
        self.server = start_litellm(self.dir, litellm_config(fleet.urls))
        self.url = self.server.url

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def route(self, arrival: Arrival) -> tuple[str, int | None]:
        return self.url, None


class Direct(Target):
    """Another client: straight to one server."""

    name, label = "direct", "another client, straight to the server"

    def __init__(self, url: str) -> None:
        self.url = url

    def route(self, arrival: Arrival) -> tuple[str, int | None]:
        return self.url, None


def make_target(name: str, sims: Sequence[SimConfig], args: argparse.Namespace, directory: Path,
                affinity: dict[str, Any] | None = None, tenants: Sequence[str] = ()) -> Target:
    if name == "rr":
        return RoundRobin()
    if name == "litellm":
        return LiteLLM(directory)
    if name == "sglang-router":
        return SglangRouter("sglang-router", 1, directory)
    settings = settings_for(name, sims, args.generous, args.auto_provider)
    return CapacityIop(name, sims, settings, affinity, metrics_off=name in METRICS_OFF, tenants=tenants,
                       queue=args.queue)


# --------------------------------------------------------------------------- a run


@dataclass
class Stream:
    """One open-loop stream of requests in a run: through the run's target, or ``direct``
    to a server."""

    name: str
    trace: list[Arrival]
    headers: dict[str, str] = field(default_factory=lambda: dict(JSON_HEADERS))
    direct: str | None = None


@dataclass(frozen=True)
class Change:
    """At ``at`` seconds into the run, ``POST /sim/control`` ``settings`` to server ``server``."""

    at: float
    server: int
    settings: dict[str, Any]


Samples = list[tuple[float, dict[str, int]]]  # (seconds into the run, provider -> capacity in /catalog)


@dataclass
class Measured:
    target: Target
    runs: dict[str, Run] = field(default_factory=dict)  # per stream
    samples: Samples = field(default_factory=list)
    final: dict[str, int] = field(default_factory=dict)
    cpu_s: dict[str, float] = field(default_factory=dict)  # per worker, over the arrivals
    seconds: float = 0.0  # of arrivals
    gateway_cpu: float = math.nan  # the target's processes' CPU over the run, in cores
    wall_s: float = math.nan  # from the first arrival to the last answer (or the end of the drain)

    def gateway(self) -> str:
        return "-" if math.isnan(self.gateway_cpu) else f"{self.gateway_cpu * 100:.0f}%"

    @property
    def main(self) -> Run:
        return next(iter(self.runs.values()))


async def read_capacities(http: aiohttp.ClientSession, target: CapacityIop,
                          reasons: dict[str, str] | None = None) -> dict[str, int]:
    async with http.get(f"{target.urls[0]}/catalog", headers=target.catalog_headers(),
                        timeout=aiohttp.ClientTimeout(total=5)) as resp:
        catalog = await resp.json()
    if reasons is not None:
        reasons.update({p["id"]: p.get("capacity_reason") or "" for p in catalog["providers"]})
    return {p["id"]: p["capacity"] for p in catalog["providers"]}


# IOP_BENCH_REASONS=1: print every move of a learned limit the samples saw, with its reason
# (the catalog keeps only the last one), to tell where a limit went and why.
PRINT_REASONS = os.environ.get("IOP_BENCH_REASONS") == "1"


async def watch(target: CapacityIop, interval: float, samples: Samples, t0: float) -> None:
    """Sample the providers' capacities from ``/catalog`` until cancelled."""
    seen: dict[str, str] = {}
    async with aiohttp.ClientSession() as http:
        while True:
            try:
                now: dict[str, str] = {}
                samples.append((time.perf_counter() - t0, await read_capacities(http, target, now)))
                for pid, why in now.items():
                    if PRINT_REASONS and why and seen.get(pid) != why:
                        print(f"  {time.perf_counter() - t0:6.1f} s {pid}: {why}", flush=True)
                seen = now
            except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as exc:
                print(f"  /catalog: {exc!r}", flush=True)
            await asyncio.sleep(interval)


async def control(url: str, settings: dict[str, Any]) -> None:
    async with aiohttp.ClientSession() as http, http.post(f"{url}/sim/control", json=settings) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}/sim/control {settings}: {resp.status} {await resp.text()}")


async def apply_changes(fleet: Fleet, changes: Sequence[Change], t0: float) -> None:
    for change in changes:
        await asyncio.sleep(max(0.0, t0 + change.at - time.perf_counter()))
        await control(fleet.urls[change.server], change.settings)
        print(f"  {change.at:g} s: server {change.server} {change.settings}", flush=True)


def gateway_pids(target: Target) -> list[int]:
    """The processes of a target that runs its own (iop: API, workers, Redis)."""
    if isinstance(target, CapacityIop) and target.stack is not None:
        redis = target.stack.redis_server.proc
        return [p.pid for p in target.stack.procs] + ([redis.pid] if redis is not None else [])
    if isinstance(target, LiteLLM) and target.server is not None:
        return [target.server.proc.pid]
    if isinstance(target, SglangRouter):
        return [p.pid for p in target.procs]
    return []


async def measure(target: Target, fleet: Fleet, streams: Sequence[Stream], args: argparse.Namespace,
                  seconds: float, watch_s: float = 1.0, changes: Sequence[Change] = ()) -> Measured:
    """One run of ``streams`` (the first through ``target``; ``seconds`` of arrivals) on the
    emptied servers."""
    out = Measured(target, seconds=seconds)
    async with aiohttp.ClientSession() as http:
        await fleet.reset(http)
    if isinstance(target, CapacityIop) and target.metrics_off:
        for url in fleet.urls:
            await control(url, {"metrics": "none"})
    target.start(fleet)
    tasks: list[asyncio.Task[None]] = []
    try:
        t0 = time.perf_counter()
        if isinstance(target, CapacityIop):
            tasks.append(asyncio.create_task(watch(target, watch_s, out.samples, t0)))
            cpu0 = {name: cpu_seconds(pid) for name, pid in target.worker_pids().items()}
        if changes:
            tasks.append(asyncio.create_task(apply_changes(fleet, changes, t0)))
        pids = gateway_pids(target)
        gateway0 = sum(cpu_seconds(pid) for pid in pids)
        results: list[list[Result]] = await asyncio.gather(*(
            run_trace(Direct(s.direct) if s.direct else target, s.trace, s.headers, drain=args.drain)
            for s in streams))
        out.wall_s = time.perf_counter() - t0
        if pids:
            out.gateway_cpu = (sum(cpu_seconds(pid) for pid in pids) - gateway0) / out.wall_s
        if isinstance(target, CapacityIop):
            out.cpu_s = {name: cpu_seconds(pid) - cpu0[name] for name, pid in target.worker_pids().items()}
            async with aiohttp.ClientSession() as http:
                out.final = await read_capacities(http, target)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        target.stop()
    async with aiohttp.ClientSession() as http:
        stats = await fleet.stats(http)
    for stream, result in zip(streams, results, strict=True):
        run = Run(target.name, target.label, list(result), warmup=args.warmup, window=seconds - args.warmup)
        run.server_stats = stats
        run.server_requests = [s["requests"] for s in stats]
        out.runs[stream.name] = run
    return out


# --------------------------------------------------------------------------- figures


def ttfts_ms(run: Run) -> list[float]:
    """TTFT of every measured request, ∞ for one whose first token never came (an answer cut
    short by the drain keeps the time of its first token)."""
    return [r.ttft * 1000 for r in run.measured()]


def unanswered(run: Run) -> int:
    return sum(1 for r in run.measured() if r.status == UNANSWERED)


def errors(run: Run) -> int:
    return sum(1 for r in run.measured() if r.status not in (200, UNANSWERED))


def best_fixed(goodputs: dict[str, float]) -> tuple[str, float] | None:
    """The fixed-capacity iop target with the highest goodput, among ``goodputs`` (target -> req/s)."""
    fixed = [(name, g) for name, g in goodputs.items() if name in FIXED]
    return max(fixed, key=lambda x: x[1]) if fixed else None


def limits(m: Measured, after: float = 0.0) -> str:
    """The capacities at the end, and their range over the samples from ``after`` on."""
    if not m.final:
        return "-"
    providers = sorted(m.final)
    end = "/".join(str(m.final[p]) for p in providers)
    seen = [s for t, s in m.samples if t >= after]
    if not seen:
        return end
    ranges = []
    for p in providers:
        values = [s[p] for s in seen if p in s]
        ranges.append(f"{min(values)}-{max(values)}" if values and min(values) != max(values) else
                      str(values[0]) if values else "?")
    return f"{end} (window {'/'.join(ranges)})"


def limit_series(samples: Samples, provider: str) -> list[tuple[float, int]]:
    return [(t, s[provider]) for t, s in samples if provider in s]


def value_at(series: Sequence[tuple[float, int]], t: float) -> int | None:
    """The last sampled value at or before ``t``."""
    before = [v for at, v in series if at <= t]
    return before[-1] if before else None


def first_move(series: Sequence[tuple[float, int]], t: float) -> float | None:
    """Seconds after ``t`` until the value first differs from the one at ``t``."""
    start = value_at(series, t)
    return next((at - t for at, v in series if at > t and v != start), None)


def settled_after(series: Sequence[tuple[float, int]], t: float, tail_s: float = 5.0,
                  within: float = SETTLED_WITHIN) -> tuple[float | None, float]:
    """When, in seconds after ``t``, the value came within ``within`` of where it ends (the
    median of the last ``tail_s`` seconds) and stayed there; and that final value."""
    after = [(at, v) for at, v in series if at > t]
    if not after:
        return None, math.nan
    end = after[-1][0]
    final = statistics.median(v for at, v in after if at >= end - tail_s)
    inside = [abs(v - final) <= within * final for _, v in after]
    if not inside[-1]:
        return None, final
    k = len(inside)
    while k > 0 and inside[k - 1]:
        k -= 1
    return after[k][0] - t, final


def skipped_row(label: str, why: str, columns: int) -> list[str]:
    return [label, why, *["-"] * (columns - 2)]


# --------------------------------------------------------------------------- scenarios


@dataclass
class Outcome:
    """What a scenario adds to docs/BENCHMARKS.md, and how long it took."""

    text: str
    seconds: float = 0.0
    load: str = ""  # the machine's load average before and after: other work on it slows the gateways


class Runner:
    """Runs each scenario's targets, keeping going past one that cannot run."""

    def __init__(self, args: argparse.Namespace, directory: Path) -> None:
        self.args = args
        self.dir = directory
        self.failed: list[str] = []

    def targets(self, scenario: str, sims: Sequence[SimConfig], affinity: dict[str, Any] | None = None,
                tenants: Sequence[str] = ()) -> list[tuple[Target, str | None]]:
        """The scenario's targets asked for, each with why it cannot run (None: it can)."""
        out: list[tuple[Target, str | None]] = []
        for name in SCENARIO_TARGETS[scenario]:
            if name in self.args.targets:
                t = make_target(name, sims, self.args, self.dir, affinity, tenants)
                why = t.skip_reason()
                if why is not None:
                    print(f"  {name}: {why}", flush=True)
                out.append((t, why))
        return out

    async def run(self, title: str, target: Target, fleet: Fleet, streams: Sequence[Stream], seconds: float,
                  watch_s: float = 1.0, changes: Sequence[Change] = ()) -> Measured | None:
        began = time.monotonic()
        try:
            m = await measure(target, fleet, streams, self.args, seconds, watch_s, changes)
        except Exception as exc:  # one target that cannot start does not cost the others their runs
            self.failed.append(f"*{target.label}* in *{title}*: {type(exc).__name__}: {str(exc).splitlines()[0]}")
            print(f"  {target.name}: FAILED: {exc!r}", flush=True)
            return None
        r = m.main
        # Where affinity sent the requests (the whole run's decisions, from /catalog at its end).
        decided = getattr(target, "decisions", None) or {}
        print(f"  {target.name}: {len(r.measured())} measured, goodput {r.goodput(self.args.slo_ms / 1000):.2f}/s, "
              f"TTFT p50/p90 {fmt_ms(ttfts_ms(r), 50)}/{fmt_ms(ttfts_ms(r), 90)} ms, unanswered {unanswered(r)}, "
              f"errors {errors(r)}, limits {limits(m, self.args.warmup)}, late steps {r.late_steps() * 100:.1f}% "
              f"({time.monotonic() - began:.0f} s)"
              + "".join(f", {k} {v:,}" for k, v in sorted(decided.items()))
              # Blocks the servers' caches evicted to admit requests (the whole run).
              + f", KV blocks evicted {'/'.join(str(s.get('kv_evictions', '?')) for s in r.server_stats)}",
              flush=True)
        return m

    def loads(self, scenario: str) -> Sequence[float]:
        if self.args.loads:
            return list(self.args.loads)
        return QUICK_LOADS[scenario] if self.args.quick else DEFAULT_LOADS[scenario]

    def trace(self, rate: float, seconds: float, variant: str = "unique", seed: str = "") -> list[Arrival]:
        return make_trace(W, variant, rate, seconds, self.args.seed + seed, SimConfig().block_tokens)

    # ----- hetero

    async def hetero(self) -> Outcome:
        a, slo = self.args, self.args.slo_ms / 1000
        rates = server_rates(HETERO, W, "unique", a.seed)
        nominal = sum(rates)
        targets = self.targets("hetero", HETERO)
        out = [hetero_notes(a, rates)]
        goals: list[list[str]] = []
        with Fleet(HETERO, self.dir) as fleet:
            for load in self.loads("hetero"):
                trace = self.trace(load * nominal, a.seconds)
                heading = f"{load:.0%} of nominal capacity: {load * nominal:.2f} req/s, {len(trace):,} requests"
                print(f"\n## hetero, {heading}", flush=True)
                rows, goodput, lost, refused = [], {}, {}, {}
                for target, why in targets:
                    if why is not None:
                        rows.append(skipped_row(target.label, why, 12))
                        continue
                    m = await self.run(f"hetero, {load:.0%}", target, fleet, [Stream("load", trace)], a.seconds)
                    if m is None:
                        continue
                    r = m.main
                    goodput[target.name] = r.goodput(slo)
                    lost[target.name] = unanswered(r)
                    refused[target.name] = errors(r)
                    t = ttfts_ms(r)
                    rows.append([target.label, f"{len(r.measured()):,}", f"{goodput[target.name]:.2f}",
                                 fmt_ms(t, 50), fmt_ms(t, 90), fmt_ms(t, 99), str(unanswered(r)), str(errors(r)),
                                 "/".join(map(str, r.server_requests)), limits(m, a.warmup), m.gateway(),
                                 f"{r.late_steps() * 100:.1f}%"])
                out.append(f"**{heading}.**\n\n" + markdown_table(
                    ["target", "requests", f"goodput req/s (TTFT ≤ {slo:g} s)", "TTFT p50 ms", "TTFT p90 ms",
                     "TTFT p99 ms", "unanswered", "errors", "finished per server", "limits at the end (window's range)",
                     "gateway CPU", "late steps"], rows))
                goals += hetero_goals(load, goodput, lost, refused)
        out.insert(1, "**Against issue 30's goals.**\n\n" + markdown_table(["load", "goal", "result"], goals))
        return Outcome("\n".join(out))

    # ----- shapes

    async def shapes(self) -> Outcome:
        a, slo = self.args, self.args.slo_ms / 1000
        out = [shapes_notes(a)]
        goals: list[list[str]] = []
        affinity = {**AFFINITY, **a.affinity}
        for shape in (s for s in SHAPES if s.name in a.shapes):
            sims = shape.sims(W, a.seed)
            cap = nominal_capacity(sims[0], shape.servers, W, "equal", a.seed)
            nominal = cap.per_server * shape.servers
            targets = self.targets("shapes", sims, affinity)
            out.append(f"**Shape *{shape.name}*: {shape.what}.** {shape_line(shape, sims[0], cap.batch, nominal)}\n")
            with Fleet(sims, self.dir) as fleet:
                for load in self.loads("shapes"):
                    trace = self.trace(load * nominal, a.seconds, "equal")
                    heading = f"{shape.name}, {load:.0%}: {load * nominal:.2f} req/s, {len(trace):,} requests"
                    print(f"\n## shapes, {heading}", flush=True)
                    rows, seen = [], {}
                    for target, why in targets:
                        if why is not None:
                            rows.append(skipped_row(target.label, why, 10))
                            continue
                        m = await self.run(f"shape {shape.name}, {load:.0%}", target, fleet, [Stream("load", trace)],
                                           a.seconds)
                        if m is None:
                            continue
                        r = m.main
                        seen[target.name] = (r.goodput(slo), r.hit_rate())
                        t = ttfts_ms(r)
                        rows.append([target.label, f"{seen[target.name][0]:.2f}", f"{r.hit_rate() * 100:.1f}%",
                                     fmt_ms(t, 50), fmt_ms(t, 90), str(unanswered(r)), str(errors(r)),
                                     limits(m, a.warmup), m.gateway(), f"{r.late_steps() * 100:.1f}%"])
                    out.append(f"*{heading}.*\n\n" + markdown_table(
                        ["target", f"goodput req/s (TTFT ≤ {slo:g} s)", "cache hit rate", "TTFT p50 ms",
                         "TTFT p90 ms", "unanswered", "errors", "limits at the end (window's range)", "gateway CPU",
                         "late steps"], rows))
                    goals += shape_goals(f"{shape.name}, {load:.0%}", seen)
        out.insert(1, "**Against issue 30's goals.**\n\n" + markdown_table(["shape, load", "goal", "result"], goals))
        return Outcome("\n".join(out))

    # ----- external

    async def external(self) -> Outcome:
        a, slo = self.args, self.args.slo_ms / 1000
        rates = server_rates(HETERO, W, "unique", a.seed)
        other = EXTERNAL_SHARE * rates[0]
        mine = EXTERNAL_LOAD * sum(rates) - other
        print(f"\n## external: iop {mine:.2f} req/s, the other client {other:.2f} req/s to server 0", flush=True)
        # Each repeat is another seeded trace, run by every target in turn; a target's figures
        # pool its requests over the repeats (the p90 of 122 requests moves by 100-200 ms
        # between runs of the same code).
        runs: dict[str, list[Measured]] = {}
        targets = self.targets("external", HETERO)
        with Fleet(HETERO, self.dir) as fleet:
            for k in range(a.repeat):
                suffix = f"-r{k}" if k else ""
                streams = [Stream("iop", self.trace(mine, a.seconds, seed=suffix)),
                           Stream("other", self.trace(other, a.seconds, seed=suffix + "-external"),
                                  direct=fleet.urls[0])]
                if a.repeat > 1:
                    print(f"  repeat {k + 1} of {a.repeat}", flush=True)
                for target, why in targets:
                    if why is None:
                        m = await self.run("external", target, fleet, streams, a.seconds)
                        if m is not None:
                            runs.setdefault(target.name, []).append(m)
        rows, p90, lost = [], {}, {}
        for target, why in targets:
            if why is not None:
                rows.append(skipped_row(target.label, why, 11 if a.repeat > 1 else 10))
                continue
            ms = runs.get(target.name)
            if ms:
                row, p90[target.name], lost[target.name] = external_row(target.label, ms, slo, a.warmup,
                                                                        per_run=a.repeat > 1)
                rows.append(row)
        per_run = ["iop TTFT p90 ms, each run"] if a.repeat > 1 else []
        table = markdown_table(
            ["target", f"iop's goodput req/s (TTFT ≤ {slo:g} s)", "iop TTFT p50 ms", "iop TTFT p90 ms",
             "iop TTFT p99 ms", *per_run, "iop's lost (unanswered + errors)", "other client's TTFT p50 / p90 ms",
             "other client's lost", "limits at the end (window's range)", "late steps"], rows)
        return Outcome(external_notes(a, rates, mine, other) + "\n" + external_goal(p90, lost) + "\n" + table)

    # ----- settling

    async def settling(self) -> Outcome:
        a = self.args
        rates = server_rates(HETERO, W, "unique", a.seed)
        seconds = a.settle_before + a.settle_after
        trace = self.trace(SETTLE_LOAD * sum(rates), seconds)
        variants: dict[str, dict[str, Any]] = {
            f"the fast server slowed {SLOWDOWN:g}x": {"slowdown": SLOWDOWN},
            f"the fast server's batch halved ({HETERO[0].max_batch} to {HETERO[0].max_batch // 2})":
                {"max_batch": HETERO[0].max_batch // 2},
        }
        out = [settling_notes(a, rates, seconds)]
        with Fleet(HETERO, self.dir) as fleet:
            targets = self.targets("settling", HETERO)
            for title, settings in variants.items():
                print(f"\n## settling: {title} at {a.settle_before:g} s", flush=True)
                rows = []
                for target, why in targets:
                    if why is not None:
                        rows.append(skipped_row(target.label, why, 8))
                        continue
                    m = await self.run(f"settling, {title}", target, fleet, [Stream("load", trace)], seconds,
                                       watch_s=0.25, changes=[Change(a.settle_before, 0, settings)])
                    if m is not None:
                        rows.append(settling_row(m, a.settle_before, a.slo_ms / 1000))
                out.append(f"**{title} after {a.settle_before:g} s.**\n\n" + markdown_table(
                    ["target", "limits at the change (÷ batch)", "fast server's limit: at the change → end",
                     "moved after", "settled after (±25% of its end)", "its limit every 2 s after the change",
                     "goodput req/s before / after", "TTFT p90 ms before / after"], rows))
        return Outcome("\n".join(out))

    # ----- fairness

    async def fairness(self) -> Outcome:
        a = self.args
        (rate,) = server_rates([FAIRNESS_SERVER], W, "unique", a.seed)
        flood = self.trace(a.flood_load * rate, a.fairness_seconds, seed="-a")
        probe = self.trace(a.probe_rate, a.fairness_seconds, seed="-b")
        print(f"\n## fairness: A {a.flood_load * rate:.2f} req/s, B {a.probe_rate:.2f} req/s", flush=True)
        rows: list[list[str]] = []
        b_ttft: dict[str, list[float]] = {}
        with Fleet([FAIRNESS_SERVER], self.dir) as fleet:
            for target, why in self.targets("fairness", [FAIRNESS_SERVER], tenants=TENANTS):
                if why is not None:
                    rows.append(skipped_row(target.label, why, 8))
                    continue
                streams = [Stream("B", probe, tenant_headers(TENANTS[1])),
                           Stream("A", flood, tenant_headers(TENANTS[0]))]
                m = await self.run("fairness", target, fleet, streams, a.fairness_seconds)
                if m is None:
                    continue
                b, flooder = m.runs["B"], m.runs["A"]
                b_ttft[target.name] = ttfts_ms(b)
                answered = sum(1 for r in flooder.measured() if r.status == 200) / flooder.window
                base = b_ttft.get("iop-batch")
                rows.append([target.label, f"{len(b.measured())}", fmt_ms(b_ttft[target.name], 50),
                             fmt_ms(b_ttft[target.name], 90),
                             ratio_text(b_ttft[target.name], base) if base else "-",
                             str(unanswered(b) + errors(b)), f"{answered:.2f}", limits(m, a.warmup)])
        table = markdown_table(
            ["target", "B's requests", "B's TTFT p50 ms", "B's TTFT p90 ms", "B's p50 / p90 against capacity 2",
             "B's lost", "A's answers/s", "limit at the end (window's range)"], rows)
        return Outcome(fairness_notes(a, rate) + "\n" + table)

    # ----- cost

    async def cost(self) -> Outcome:
        a = self.args
        rates = server_rates(HETERO, W, "unique", a.seed)
        rows = []
        means: dict[tuple[str, str], float] = {}
        phases = (("idle", 0.0), ("busy, 80%", 0.8 * sum(rates)))
        with Fleet(HETERO, self.dir) as fleet:
            for target, why in self.targets("cost", HETERO):
                if why is not None:
                    rows.append(skipped_row(target.label, why, 5))
                    continue
                for phase, rate in phases:
                    trace = self.trace(rate, a.cost_seconds) if rate else []
                    m = await self.cost_run(target, fleet, trace)
                    if m is None or not m.cpu_s:
                        continue
                    per = [100 * m.cpu_s[k] / m.wall_s for k in sorted(m.cpu_s)]
                    means[(target.name, phase)] = statistics.mean(per)
                    rows.append([target.label, phase, " / ".join(f"{p:.2f}%" for p in per),
                                 f"{means[(target.name, phase)]:.2f}%", limits(m)])
        for phase, _ in phases:
            if ("iop-auto", phase) in means and ("iop-batch", phase) in means:
                extra = means[("iop-auto", phase)] - means[("iop-batch", phase)]
                rows.append(["auto - fixed (the signals' cost)", phase, "-",
                             f"**{'met' if extra <= 2.0 else 'missed'}**: {extra:+.2f}% (goal ≤ 2%)", "-"])
        table = markdown_table(["target", "phase", "each worker's CPU, % of a core (1 provider each)",
                                "mean per provider", "limits at the end"], rows)
        return Outcome(cost_notes(a) + "\n" + table)

    async def cost_run(self, target: Target, fleet: Fleet, trace: list[Arrival]) -> Measured | None:
        """A busy run of ``trace``, or, with none, ``--cost-seconds`` of nothing with iop up."""
        if trace:
            return await self.run("cost", target, fleet, [Stream("load", trace)], self.args.cost_seconds)
        assert isinstance(target, CapacityIop)
        async with aiohttp.ClientSession() as http:
            await fleet.reset(http)
        target.start(fleet)
        try:
            await asyncio.sleep(3.0)  # past start-up
            before = {name: cpu_seconds(pid) for name, pid in target.worker_pids().items()}
            await asyncio.sleep(self.args.cost_seconds)
            m = Measured(target, seconds=self.args.cost_seconds, wall_s=self.args.cost_seconds)
            m.cpu_s = {name: cpu_seconds(pid) - before[name] for name, pid in target.worker_pids().items()}
            async with aiohttp.ClientSession() as http:
                m.final = await read_capacities(http, target)
            return m
        finally:
            target.stop()


def ratio_text(values: list[float], base: list[float]) -> str:
    """``values``' p50 and p90 against ``base``'s."""
    parts = []
    for q in (50, 90):
        v, b = percentile(values, q), percentile(base, q)
        parts.append("∞" if math.isinf(v) else f"{v / b:.2f}x" if b and not math.isinf(b) else "-")
    return " / ".join(parts)


# --------------------------------------------------------------------------- goals and notes


def hetero_goals(load: float, goodput: dict[str, float], lost: dict[str, int],
                 refused: dict[str, int] | None = None) -> list[list[str]]:
    """The verdicts at one load. ``lost``: requests left unanswered (what the goal forbids);
    ``refused``: answered with an error (a refusal, when iop sheds load: an answer)."""
    refused = refused or {}

    def said(name: str) -> str:
        return f"lost {lost[name]}" + (f", refused {refused[name]}" if refused.get(name) else "")

    rows = []
    best = best_fixed(goodput)
    ref = f"the best fixed setting, {best[0]}: {best[1]:.2f} req/s" if best else "no fixed setting measured"
    for name, share in (("iop-auto", 0.97), ("iop-auto-latency", 0.90)):
        goal = f"{name} ≥ {share:.0%} of the best fixed setting's goodput" + (
            ", nothing unanswered" if name == "iop-auto" else "")
        if name not in goodput:
            rows.append([f"{load:.0%}", goal, f"not measured ({ref})"])
        elif best is None or not best[1]:
            rows.append([f"{load:.0%}", goal, f"{goodput[name]:.2f} req/s; {ref}"])
        else:
            ratio = goodput[name] / best[1]
            ok = ratio >= share and (name != "iop-auto" or lost[name] == 0)
            rows.append([f"{load:.0%}", goal, f"**{'met' if ok else 'missed'}**: {goodput[name]:.2f} req/s, "
                         f"{ratio:.0%} of {ref}; {said(name)}"])
    fixed = ", ".join(f"{n} {g:.2f} ({said(n)})" for n, g in goodput.items() if n in FIXED)
    others = ", ".join(f"{n} {g:.2f} ({said(n)})" for n, g in goodput.items() if n not in FIXED)
    rows.append([f"{load:.0%}", "for reference", f"fixed: {fixed or '-'}; others: {others or '-'}"])
    return rows


def shape_goals(where: str, seen: dict[str, tuple[float, float]]) -> list[list[str]]:
    auto = seen.get("iop-auto")
    fixed = {n: v for n, v in seen.items() if n in FIXED}
    ref = ", ".join(f"{n} {g:.2f} req/s, {h * 100:.1f}%" for n, (g, h) in fixed.items())
    router = seen.get("sglang-router")
    if auto is None:
        return [[where, "auto ≥ the better fixed (goodput and hit rate), goodput ≥ sglang-router's",
                 f"not measured; fixed: {ref or '-'}" + (f"; sglang-router {router[0]:.2f} req/s, "
                                                          f"{router[1] * 100:.1f}%" if router else "")]]
    g_ok = all(auto[0] >= g for g, _ in fixed.values())
    h_ok = all(auto[1] >= h for _, h in fixed.values())
    r_ok = router is None or auto[0] >= router[0]
    return [[where, "auto ≥ the better fixed (goodput and hit rate), goodput ≥ sglang-router's",
             f"**{'met' if g_ok and h_ok and r_ok else 'missed'}**: auto {auto[0]:.2f} req/s, {auto[1] * 100:.1f}%; "
             f"{ref}" + (f"; sglang-router {router[0]:.2f} req/s" if router else "")]]


def external_row(label: str, ms: Sequence[Measured], slo: float, warmup: float,
                 per_run: bool = False) -> tuple[list[str], float, int]:
    """A target's row of *external* over its runs (one per repeat), pooling their requests:
    TTFT percentiles over all of them (``per_run``: each run's p90 too), goodput the runs'
    mean, lost their sum, limits its last run's. Returns the row, the pooled p90 and what iop lost."""
    t = [x for m in ms for x in ttfts_ms(m.runs["iop"])]
    to = [x for m in ms for x in ttfts_ms(m.runs["other"])]
    lost = sum(unanswered(m.runs["iop"]) + errors(m.runs["iop"]) for m in ms)
    other_lost = sum(unanswered(m.runs["other"]) + errors(m.runs["other"]) for m in ms)
    goodput = sum(m.runs["iop"].goodput(slo) for m in ms) / len(ms)
    row = [label, f"{goodput:.2f}", fmt_ms(t, 50), fmt_ms(t, 90), fmt_ms(t, 99)]
    if per_run:
        row.append(" / ".join(fmt_ms(ttfts_ms(m.runs["iop"]), 90) for m in ms))
    row += [str(lost), f"{fmt_ms(to, 50)} / {fmt_ms(to, 90)}", str(other_lost), limits(ms[-1], warmup),
            f"{max(m.runs['iop'].late_steps() for m in ms) * 100:.1f}%"]
    return row, percentile(t, 90), lost


def external_goal(p90: dict[str, float], lost: dict[str, int]) -> str:
    """Auto's p90 against each fixed setting's; the goal is judged against the blind one
    (capacity = batch, iop seeing only its own requests: what it did before it read engines)."""
    goal = "**Goal** (auto's TTFT p90 ≤ 0.7x the fixed capacities', nothing lost)"
    others = ", ".join(f"{n} {fmt_p(v)} ms" for n, v in p90.items() if n != "iop-auto")
    if "iop-auto" not in p90:
        return f"{goal}: not measured; fixed: {others or '-'}.\n"
    auto = p90["iop-auto"]
    ratios = "; ".join(f"{auto / v:.2f}x {n}'s" for n, v in p90.items() if n != "iop-auto" and v > 0)
    verdict = ""
    if "iop-batch-blind" in p90 and p90["iop-batch-blind"] > 0:
        ok = auto <= 0.7 * p90["iop-batch-blind"] and lost.get("iop-auto", 1) == 0
        verdict = f"**{'met' if ok else 'missed'}** against the blind fixed capacities (iop-batch-blind); "
    return (f"{goal}: {verdict}auto p90 {fmt_p(auto)} ms against {others} ({ratios}); "
            f"auto lost {lost.get('iop-auto')}.\n")


def fmt_p(ms: float) -> str:
    return "-" if math.isnan(ms) else "∞" if math.isinf(ms) else f"{ms:,.0f}"


def settling_row(m: Measured, change_at: float, slo_s: float) -> list[str]:
    providers = sorted(m.final)
    sims = HETERO
    at_change = []
    for p, sim in zip(providers, sims, strict=False):
        v = value_at(limit_series(m.samples, p), change_at)
        at_change.append(f"{v} ({v / sim.max_batch:.2f})" if v is not None else "?")
    fast = limit_series(m.samples, providers[0]) if providers else []
    before = value_at(fast, change_at)
    moved = first_move(fast, change_at)
    settled, final = settled_after(fast, change_at)
    every = [value_at(fast, change_at + k) for k in range(2, int(m.seconds - change_at) + 1, 2)]
    r = m.main
    pre = [x for x in r.measured() if x.sent < change_at]
    post = [x for x in r.measured() if x.sent >= change_at]

    def good(rs: list[Any], seconds: float) -> str:
        return f"{sum(1 for x in rs if x.status == 200 and x.ttft <= slo_s) / seconds:.2f}" if seconds > 0 else "-"

    def p90(rs: list[Any]) -> str:
        return fmt_ms([x.ttft * 1000 for x in rs], 90)

    return [m.target.label, " / ".join(at_change), f"{before} → {m.final.get(providers[0]) if providers else '?'}",
            f"{moved:.2f} s" if moved is not None else "never",
            f"{settled:.2f} s (at {final:g})" if settled is not None else "not settled",
            " ".join(str(v) for v in every), f"{good(pre, change_at - r.warmup)} / {good(post, m.seconds - change_at)}",
            f"{p90(pre)} / {p90(post)}"]


def costs(sim: SimConfig) -> str:
    return (f"batch {sim.max_batch}, {sim.step_ms:g} ms per step + {sim.prefill_ms_per_token:g} ms per prefilled "
            f"token + {sim.decode_ms_per_seq:g} ms per decoding request")


def fleet_lines(sims: Sequence[SimConfig], rates: Sequence[float]) -> str:
    return "; ".join(f"server {i}: {costs(s)}, KV {s.kv_blocks:,} blocks, {s.metrics} metrics, {r:.2f} req/s"
                     for i, (s, r) in enumerate(zip(sims, rates, strict=True)))


def run_notes(args: argparse.Namespace) -> str:
    return (f"Each run: {args.seconds:g} s of arrivals, the first {args.warmup:g} s not counted, then at most "
            f"{args.drain:g} s for the answers still due (the rest are cancelled: *unanswered*). Goodput: answered "
            f"whole with TTFT ≤ {args.slo_ms / 1000:g} s, per second of the measured window. TTFT from sending to "
            f"the first content chunk (also of an answer the drain cut short), ∞ when none came. *Limits*: each "
            f"provider's `capacity` in `/catalog` at the end of the run and its range over the measured window (iop "
            f"targets). *Finished per server*: the requests each server completed in the whole run (warm-up "
            f"included). *Gateway CPU*: the target's own processes (iop's API, workers and Redis; LiteLLM's proxy; "
            f"sglang-router) over the run, 100% = one core. Late steps: the servers' steps that started more than "
            f"50 ms behind their schedule (the machine not keeping up).")


def hetero_notes(args: argparse.Namespace, rates: Sequence[float]) -> str:
    return (f"**Fleet.** {fleet_lines(HETERO, rates)}; nominal capacity {sum(rates):.2f} req/s (prefix_fleet's cost "
            f"model per server: ms/request = prefill_ms x prompt + 63 x (step_ms + decode_ms x B) / B). Trace: "
            f"prefix_fleet's *unique* prompts ({W.prefix_tokens[0] + W.query_tokens[0]:,}-"
            f"{W.prefix_tokens[1] + W.query_tokens[1]:,} tokens, no shared prefixes), {W.output_tokens} tokens out, "
            f"Poisson (`--seed {args.seed}`). {run_notes(args)}\n")


def shape_line(shape: Shape, sim: SimConfig, batch: int, nominal: float) -> str:
    return (f"{shape.servers} servers, {costs(sim)} ({batch} running as the KV beside their prefixes allows), KV "
            f"{sim.kv_blocks:,} blocks each (the shared prefixes fill {shape.kv_fill:.0%} of the fleet's), "
            f"{sim.metrics} metrics; nominal capacity {nominal:.2f} req/s (perfect prefix routing).")


def shapes_notes(args: argparse.Namespace) -> str:
    return (f"**Workload.** prefix_fleet's *equal* tenants ({W.tenants} tenants x {W.users} users, "
            f"{W.prefix_tokens[0]:,}-{W.prefix_tokens[1]:,}-token system prompts, {W.query_tokens[0]}-"
            f"{W.query_tokens[1]}-token questions, {W.output_tokens} tokens out). iop with `affinity: "
            f"{json.dumps({**AFFINITY, **args.affinity})}`, capacity = each server's batch (its `max_batch`), 4x "
            "that, and auto. The "
            f"servers' caches start empty and the warm-up seconds fill them. {run_notes(args)}\n")


def external_notes(args: argparse.Namespace, rates: Sequence[float], mine: float, other: float) -> str:
    return (f"**Setup.** The hetero fleet ({fleet_lines(HETERO, rates)}). Another client sends {other:.2f} req/s "
            f"({EXTERNAL_SHARE:.0%} of server 0's capacity) straight to server 0, where iop does not see it; iop "
            f"takes {mine:.2f} req/s, the rest of {EXTERNAL_LOAD:.0%} of the fleet's {sum(rates):.2f} req/s. "
            f"{run_notes(args)}{repeat_notes(args)}\n")


def repeat_notes(args: argparse.Namespace) -> str:
    if args.repeat <= 1:
        return ""
    return (f" Each target ran {args.repeat} traces (seeds `{args.seed}`, `{args.seed}-r1`, ...; the targets in turn "
            f"within each), and its figures pool their requests: TTFT percentiles over all of them, goodput the "
            f"runs' mean, lost their sum, limits those of its last run.")


def settling_notes(args: argparse.Namespace, rates: Sequence[float], seconds: float) -> str:
    return (f"**Setup.** The hetero fleet ({fleet_lines(HETERO, rates)}) at {SETTLE_LOAD:.0%} of its "
            f"{sum(rates):.2f} req/s for {seconds:g} s; at {args.settle_before:g} s server 0 changes (`POST "
            f"/sim/control`). Each provider's `capacity` is read from `/catalog` every 250 ms. *Moved after*: "
            f"until the fast server's limit first differs from its value at the change; *settled after*: until it "
            f"comes within ±{SETTLED_WITHIN:.0%} of where it ends (the median of the last 5 s) and stays there. "
            f"Goodput and TTFT before the change (after the {args.warmup:g} s warm-up) and after it. At most "
            f"{args.drain:g} s for the last answers.\n")


def fairness_notes(args: argparse.Namespace, rate: float) -> str:
    return (f"**Setup.** One server: {costs(FAIRNESS_SERVER)}, {rate:.2f} req/s nominal. Two named tenants "
            f"(`api.keys`, weight 1 each): A sends {args.flood_load:g}x the server's capacity "
            f"({args.flood_load * rate:.2f} req/s) for {args.fairness_seconds:g} s, B {args.probe_rate:g} req/s "
            f"(a light load, but its requests may still wait for each other: with both tenants backlogged B gets "
            f"half the slots). Rows: iop with capacity 2 (the batch), 8 (4x it: six of A's requests wait in the "
            f"engine's FIFO, out of reach of fair queuing) and auto. B's TTFT over its requests after the "
            f"{args.warmup:g} s warm-up; A's backlog is cancelled after {args.drain:g} s.\n")


def cost_notes(args: argparse.Namespace) -> str:
    return (f"**Setup.** The hetero fleet behind iop, one worker per server (one provider each). CPU from "
            f"`/proc/<pid>/stat` (user + system, the worker and its children) over {args.cost_seconds:g} s idle "
            f"(3 s after start-up), and from the first of {args.cost_seconds:g} s of arrivals at 80% of the fleet's "
            f"capacity to the last answer. The goal: reading the signals costs each worker ≤ 2% of a core per "
            f"provider (auto against fixed).\n")


# --------------------------------------------------------------------------- main


HEADING: Final = """## Capacity that iop learns (issue 30)

`python -m bench.capacity_fleet` (`--quick` to check the harness): simulated servers
(`bench/fleet_sim.py`, with vLLM's or SGLang's engine metrics) behind iop with fixed
capacities and `capacity: auto`, LiteLLM least-busy, round robin and sglang-router, in six
scenarios: a heterogeneous fleet, three prefix-fleet shapes, load iop does not see,
settling after a change, fairness on a small server, and the worker's cost. The module
docstring says what each measures and what is simulated. The auto targets' provider
fields are `AUTO_PROVIDER` in `bench/capacity_fleet.py` (`--auto-provider` JSON for one
run); a target whose config iop refuses is shown as *not available* with iop's own line.
"""

SECTIONS: Final = {
    "hetero": "### Heterogeneous fleet: batches 8 / 4 / 2, different speeds\n",
    "shapes": "### Prefix fleets of three shapes, with affinity\n",
    "external": "### Load iop does not see\n",
    "settling": "### Settling, and following a change\n",
    "fairness": "### Fairness on a batch-2 server\n",
    "cost": "### What reading the signals costs the worker\n",
}


def command(args: argparse.Namespace, scenario: str) -> str:
    if args.quick:
        return f"{COMMAND} --quick --scenarios {scenario}"
    defaults = {k: v for k, v in vars(parse_args([])).items() if k not in ("quick", "no_write")}
    return command_line(COMMAND, args, defaults)


def section_of(args: argparse.Namespace, scenario: str) -> str:
    """The docs section a run writes: a run with load shedding (``--queue`` with
    ``refuse_predicted_over_ms``) has its own beside the scenario's, so both stay."""
    return f"capacity-{scenario}" + ("-shed" if "refuse_predicted_over_ms" in args.queue else "")


def write(args: argparse.Namespace, scenario: str, outcome: Outcome, setting: str) -> None:
    doc = Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md"
    heading = "" if HEADING.splitlines()[0] in doc.read_text() else HEADING + "\n"
    notes = f"\n{setting} The scenario took {outcome.seconds / 60:.1f} min; {outcome.load}.\n"
    write_section(section_of(args, scenario), command(args, scenario), outcome.text, notes,
                  heading=heading + SECTIONS[scenario])


async def main(args: argparse.Namespace) -> dict[str, Outcome]:
    directory = Path(tempfile.mkdtemp(prefix="iop-capacity-fleet-"))
    runner = Runner(args, directory)
    outcomes: dict[str, Outcome] = {}
    for scenario in [s for s in SCENARIOS if s in args.scenarios]:
        began, before = time.monotonic(), load_average()
        outcome: Outcome = await getattr(runner, scenario)()
        outcome.seconds = time.monotonic() - began
        outcome.load = f"load average before it {before}, after it {load_average()}"
        if runner.failed:
            outcome.text += "\nFailed to run: " + "; ".join(runner.failed) + ".\n"
            runner.failed = []
        print(f"\n{outcome.text}\n{scenario} took {outcome.seconds:.0f} s", flush=True)
        outcomes[scenario] = outcome
    shutil.rmtree(directory, ignore_errors=True)
    return outcomes


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="check the harness: one load per scenario, 12 s of arrivals, short settling and cost")
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS),
                        help="of each scenario's targets, those to run")
    parser.add_argument("--loads", nargs="+", type=float, default=[],
                        help="fractions of nominal capacity for hetero and shapes (default: 0.8 1.0 and 0.5 0.8 1.0)")
    parser.add_argument("--seconds", type=float, default=60.0, help="arrivals per run")
    parser.add_argument("--warmup", type=float, default=10.0, help="first seconds of each run not counted")
    parser.add_argument("--drain", type=float, default=20.0,
                        help="seconds after the last arrival for the answers; then the rest are unanswered")
    parser.add_argument("--auto-provider", type=json.loads, default=AUTO_PROVIDER,
                        help="the provider fields of iop-auto and iop-auto-latency, as JSON")
    parser.add_argument("--queue", type=json.loads, default={},
                        help="JSON merged over the queue section every iop target gets (e.g. load shedding: "
                             '\'{"refuse_predicted_over_ms": 1000}\')')
    parser.add_argument("--affinity", type=json.loads, default={},
                        help="shapes: JSON merged over the affinity section every iop target gets")
    parser.add_argument("--shapes", nargs="+", choices=[s.name for s in SHAPES], default=[s.name for s in SHAPES],
                        help="shapes: the fleet shapes to run")
    parser.add_argument("--generous", type=int, default=16, help="iop-16's capacity for every provider")
    parser.add_argument("--slo-ms", type=float, default=1000.0, help="the TTFT goodput counts")
    parser.add_argument("--settle-before", type=float, default=30.0, help="settling: seconds of load before the change")
    parser.add_argument("--settle-after", type=float, default=30.0, help="settling: and after it")
    parser.add_argument("--flood-load", type=float, default=2.0, help="fairness: tenant A's rate, of the capacity")
    parser.add_argument("--probe-rate", type=float, default=0.25, help="fairness: tenant B's requests per second")
    parser.add_argument("--fairness-seconds", type=float, default=90.0,
                        help="fairness: arrivals per run (B's few requests need a longer run)")
    parser.add_argument("--cost-seconds", type=float, default=60.0, help="cost: each of the idle and busy windows")
    parser.add_argument("--seed", default="iop-30")
    parser.add_argument("--repeat", type=int, default=1,
                        help="external: run every target on this many seeded traces and pool their requests")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = parser.parse_args(argv)
    if not isinstance(args.auto_provider, dict):
        parser.error("--auto-provider must be a JSON object of provider fields")
    if args.quick:
        args.seconds, args.warmup, args.drain = 12.0, 3.0, 10.0
        args.settle_before = args.settle_after = 10.0
        args.fairness_seconds = 20.0
        args.cost_seconds = 10.0
        args.loads = args.loads[:1]
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.warmup >= min(args.seconds, args.settle_before, args.fairness_seconds):
        parser.error("--warmup must be shorter than --seconds, --settle-before and --fairness-seconds")
    return args


if __name__ == "__main__":
    arguments = parse_args()
    uvloop.install()
    results = asyncio.run(main(arguments))
    if not arguments.no_write:
        setting = f"Machine: {machine()}."
        for name, result in results.items():
            write(arguments, name, result, setting)
