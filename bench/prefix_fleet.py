"""Prefix-cache-aware dispatch over a fleet of simulated inference servers (issue 23).

    python -m bench.prefix_fleet [--quick] [--seconds 45] [--targets ...] [--variants ...] [--loads ...]

A fleet of simulated continuous-batching servers with prefix caches (bench/fleet_sim.py,
one process each) is driven by an open-loop Poisson load through each *target* in turn;
every target gets the same seeded trace, and the servers start each run with an empty
cache. Per target and load: time to first token (p50/p90/p99), goodput (requests per
second whose TTFT met the SLO), output tokens per second, and the fleet's cache hit rate
(cached prompt tokens / prompt tokens, from the servers' ``usage``).

Workload, shaped like llm-d's B2B prefix test, scaled down: ``--tenants`` (24) tenants,
each with a system prompt of 1,400-1,600 tokens (words, for the simulator's tokenizer) and
5 users; every request is the tenant's system prompt plus a unique 250-350-token question,
and asks for 64 tokens, streamed. The servers' KV memory (``--kv-blocks`` each) is sized so
that the tenants' shared prefixes need ``--kv-fill`` (72%) of the fleet's KV: they fit when
each tenant stays on one server, they do not when every server sees every tenant. Variants:
``equal`` (tenants equally busy), ``skewed`` (one tenant sends 30% of the traffic), ``unique``
(no shared prefixes: every request's system prompt is its own). Loads are fractions of the
fleet's nominal capacity, computed from the simulator's cost model for perfect prefix
routing (every shared prefix cached; see ``nominal_capacity``).

Targets (``--targets``):

* ``rr``: round robin in the load generator, straight to the servers.
* ``chash``: consistent hashing with bounded load in the load generator (Mirrokni et al.):
  the first 1,024 characters of the prompt hashed onto a ring of 100 points per server;
  the request goes to the first server clockwise whose in-flight requests (counted by the
  load generator), with this one, stay within ceil((1 + eps) x mean), eps = ``--epsilon``
  (0.25).
* ``iop``: iop's real processes (a private redis-server, one worker per node with one
  ``sglang`` provider per server, capacity ``--iop-capacity``, one API process), no
  affinity.
* ``iop-prefix``, ``iop-prefix-x3``: the same with ``affinity: {mode: prefix, load_bound:
  1.25}`` on the model (its other settings at their defaults), through one or three API
  processes (the load generator takes them in turn); ``--affinity`` (JSON) overrides its
  settings.
* ``iop-prefix-deep``: ``iop-prefix`` with each provider's capacity 4x ``--iop-capacity``:
  the servers queue what they cannot run yet, as behind sglang-router, and affinity places
  every request on arrival.
* ``sglang-router``, ``sglang-router-x3``: the real sglang-router from PyPI (pinned
  below), policy ``cache_aware`` with its defaults, installed on first use into
  ``.venv-servers/sglang-router`` as ``./dev`` installs the real servers; one router, or
  three behind a round-robin split in the load generator (each learns its own tree).

Each run starts its target's processes afresh (iop's Redis and the routers' trees start
empty, like the servers' caches) and stops them afterwards; a target that fails to start
is reported and the others go on. Scenarios: ``equal`` at every ``--loads`` (50/80/100%),
the other variants at the middle load. Duration: a run is ``--seconds`` of arrivals plus
the time to answer what is still queued and a few seconds of start-up; the full default
(5 scenarios x 7 targets) takes about half an hour, ``--quick`` (equal tenants at 80%,
10 s per run) about a minute and a half.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import hashlib
import itertools
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final, TypeVar

import aiohttp
import msgspec
import uvloop
import yaml

from bench.fleet_sim import SimConfig, command_args
from bench.stack import Stack, command_line, markdown_table, percentile, write_section
from iop.processes import Child, stop_all, wait_http, wait_port
from iop.redis_server import free_port

COMMAND: Final = "python -m bench.prefix_fleet"
ROOT: Final = Path(__file__).resolve().parent.parent
MODEL: Final = "bench"  # the model id callers (and iop) use
SERVED: Final = "sim"  # what the simulated servers serve

# The real router, in a virtualenv of its own (its pins are not iop's). 0.3.2 is the version
# issue 23 names and the newest on PyPI when this was written.
ROUTER_PACKAGES: Final = ("sglang-router==0.3.2",)
ROUTER_VENV: Final = ROOT / ".venv-servers" / "sglang-router"

VARIANTS: Final = ("equal", "skewed", "unique")
TARGETS: Final = ("rr", "chash", "iop", "iop-prefix", "iop-prefix-x3", "iop-prefix-deep", "sglang-router",
                   "sglang-router-x3")
HOT_SHARE: Final = 0.30  # the skewed variant's busiest tenant
CHASH_POINTS: Final = 100  # ring points per server
KEY_CHARS: Final = 1024  # prompt characters the consistent-hashing reference hashes
AFFINITY: Final = {"mode": "prefix", "load_bound": 1.25}


# --------------------------------------------------------------------------- the workload


@dataclass(frozen=True)
class Workload:
    tenants: int = 24
    users: int = 5  # per tenant; named in the body's ``user``
    prefix_tokens: tuple[int, int] = (1400, 1600)  # a tenant's system prompt, drawn once per tenant
    query_tokens: tuple[int, int] = (250, 350)  # each request's own question
    output_tokens: int = 64


@dataclass(frozen=True, slots=True)
class Arrival:
    at: float  # seconds after the run's start
    tenant: int
    body: bytes
    key: int  # the consistent-hashing reference's ring position (hash of the prompt's start)
    prompt_tokens: int  # as the simulator counts them
    shared_blocks: int  # full KV blocks of the tenant's shared prefix (0 in the unique variant)


class Words:
    """Deterministic prompt text: words drawn from a fixed random vocabulary."""

    def __init__(self, seed: str) -> None:
        rng = random.Random(f"{seed}-vocabulary")
        letters = "abcdefghijklmnopqrstuvwxyz"
        self.vocabulary = ["".join(rng.choices(letters, k=rng.randint(3, 8))) for _ in range(5000)]

    def text(self, rng: random.Random, n: int) -> str:
        return " ".join(rng.choices(self.vocabulary, k=n))


def system_prompts(w: Workload, words: Words, seed: str) -> list[str]:
    rng = random.Random(f"{seed}-tenants")
    # The tenant's name first: two tenants' prompts differ from their first block on.
    return [f"You are the assistant of tenant {t}. " + words.text(rng, rng.randint(*w.prefix_tokens) - 6)
            for t in range(w.tenants)]


def chat_prompt_tokens(system: str, user: str) -> int:
    # bench.fleet_sim.chat_tokens: a role token per message, the words, an <|assistant|> token.
    return len(system.split()) + len(user.split()) + 3


def make_trace(w: Workload, variant: str, rate: float, seconds: float, seed: str, block_tokens: int,
               model: str = MODEL) -> list[Arrival]:
    """Poisson arrivals at ``rate`` per second for ``seconds``, asking for ``model``; the same
    for every target.

    A Poisson process conditioned on its count: ``round(rate x seconds)`` arrival times drawn
    uniformly and sorted, so that every run offers exactly its load (a short run of a plain
    Poisson process is often 10-20% off)."""
    words = Words(seed)
    prompts = system_prompts(w, words, seed)
    rng = random.Random(f"{seed}-{variant}-{rate:.4f}-{seconds:g}")
    trace: list[Arrival] = []
    for at in sorted(rng.uniform(0, seconds) for _ in range(round(rate * seconds))):
        if variant == "skewed" and rng.random() < HOT_SHARE:
            tenant = 0
        elif variant == "skewed":
            tenant = rng.randrange(1, w.tenants)
        else:
            tenant = rng.randrange(w.tenants)
        user = rng.randrange(w.users)
        if variant == "unique":  # a system prompt of the same length, shared with nobody
            system = f"You are the assistant of request {len(trace)}. " + words.text(
                rng, rng.randint(*w.prefix_tokens) - 6)
            shared = 0
        else:
            system = prompts[tenant]
            # <|system|>, the prompt, <|user|>, "Question": the tokens every request of the tenant starts with.
            shared = (len(system.split()) + 3) // block_tokens
        question = f"Question {len(trace)} from user {user}: " + words.text(rng, rng.randint(*w.query_tokens) - 5)
        body = msgspec.json.encode({
            "model": model, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": w.output_tokens, "user": f"tenant-{tenant}-user-{user}",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        })
        key = int.from_bytes(hashlib.blake2b((system + question)[:KEY_CHARS].encode(), digest_size=8).digest())
        trace.append(Arrival(at, tenant, body, key, chat_prompt_tokens(system, question), shared))
    return trace


def prefix_working_set(w: Workload, seed: str, block_tokens: int) -> int:
    """KV blocks that hold every tenant's shared prefix once."""
    return sum((len(p.split()) + 3) // block_tokens for p in system_prompts(w, Words(seed), seed))


@dataclass(frozen=True)
class Capacity:
    per_server: float  # requests per second
    batch: int  # running requests the KV allows (at most max_batch)
    uncached_tokens: float  # prefill per request
    ms_per_request: float


def nominal_capacity(sim: SimConfig, servers: int, w: Workload, variant: str, seed: str) -> Capacity:
    """Requests per second the fleet serves with perfect prefix routing, from the simulator's
    cost model: every tenant's shared prefix cached on one server (a quarter of the
    tenants each), only the rest of each prompt prefilled.

    A server keeps ``B`` requests running, ``B`` = max_batch or fewer if the KV left beside
    its share of the prefixes cannot hold that many requests' own blocks. A request costs
    the server ``prefill_ms_per_token x U`` (U: its uncached prompt tokens) plus its share of
    the ``output - 1`` decode steps it takes part in (the step that ends its prefill gives
    the first token), each ``step_ms + decode_ms_per_seq x B`` shared by ``B`` requests:
    ``ms = c_p x U + (output - 1) x (step_ms + c_d x B) / B``, capacity = 1000 / ms per server.
    """
    bt = sim.block_tokens
    trace = make_trace(w, variant, 20.0, 50.0, seed, bt)  # a sample of the prompts
    prompt = sum(a.prompt_tokens for a in trace) / len(trace)
    shared = sum(a.shared_blocks for a in trace) / len(trace)
    uncached = prompt - shared * bt
    own_blocks = math.ceil((prompt + w.output_tokens) / bt) - shared
    resident = prefix_working_set(w, seed, bt) / servers if variant != "unique" else 0
    batch = max(1, min(sim.max_batch, int((sim.kv_blocks - resident) // own_blocks)))
    ms = sim.prefill_ms_per_token * uncached + (w.output_tokens - 1) * (
        sim.step_ms + sim.decode_ms_per_seq * batch) / batch
    return Capacity(1000 / ms, batch, uncached, ms)


# --------------------------------------------------------------------------- the fleet


class Fleet:
    """The simulated servers, one process each with its own settings, started once for the
    whole benchmark."""

    def __init__(self, sims: Sequence[SimConfig], directory: Path) -> None:
        self.sims = list(sims)
        self.ports = [free_port() for _ in self.sims]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.dir = directory
        self.procs: list[Child] = []

    def server_args(self, i: int, sim: SimConfig) -> list[str]:
        """Server ``i``'s command-line arguments besides its port (a fleet of another kind adds its own)."""
        return command_args(replace(sim, model=SERVED))

    def __enter__(self) -> Fleet:
        try:
            for i, (sim, port) in enumerate(zip(self.sims, self.ports, strict=True)):
                args = ["--port", str(port), *self.server_args(i, sim)]
                child = Child(f"sim-{i}", [sys.executable, "-m", "bench.fleet_sim", *args], dict(os.environ),
                              log_path=self.dir / f"sim-{i}.log")
                self.procs.append(child.start())
            for child, port in zip(self.procs, self.ports, strict=True):
                wait_port(child, "127.0.0.1", port)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        stop_all(self.procs, timeout=10)

    async def stats(self, http: aiohttp.ClientSession) -> list[dict[str, Any]]:
        out = []
        for url in self.urls:
            async with http.get(f"{url}/sim/stats") as resp:
                out.append(await resp.json())
        return out

    async def reset(self, http: aiohttp.ClientSession) -> None:
        """Empty caches and counters and restore the servers' start-up settings, once every
        request has left them."""
        deadline = time.monotonic() + 120
        for url in self.urls:
            while True:
                async with http.post(f"{url}/sim/reset") as resp:
                    if resp.status == 200:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{url} still runs requests")
                await asyncio.sleep(0.2)


# --------------------------------------------------------------------------- targets


class Target:
    """Where the load generator sends each request."""

    name = ""
    label = ""

    def skip_reason(self) -> str | None:
        return None

    def start(self, fleet: Fleet) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        pass

    def route(self, arrival: Arrival) -> tuple[str, int | None]:
        """The base URL for this request, and the server's index when it goes straight to one."""
        raise NotImplementedError

    def finished(self, server: int | None) -> None:
        pass


class RoundRobin(Target):
    name, label = "rr", "round robin (load generator, direct)"

    def start(self, fleet: Fleet) -> None:
        self.urls = fleet.urls
        self.turn = itertools.count()

    def route(self, arrival: Arrival) -> tuple[str, int | None]:
        i = next(self.turn) % len(self.urls)
        return self.urls[i], i


class ConsistentHash(Target):
    name = "chash"

    def __init__(self, epsilon: float) -> None:
        self.epsilon = epsilon
        self.label = f"consistent hash, bounded load ε={epsilon:g} (load generator, direct)"

    def start(self, fleet: Fleet) -> None:
        self.urls = fleet.urls
        points = sorted((int.from_bytes(hashlib.blake2b(f"{i}-{k}".encode(), digest_size=8).digest()), i)
                        for i in range(len(self.urls)) for k in range(CHASH_POINTS))
        self.ring = [p for p, _ in points]
        self.owner = [i for _, i in points]
        self.in_flight = [0] * len(self.urls)

    def route(self, arrival: Arrival) -> tuple[str, int | None]:
        n = len(self.urls)
        bound = math.ceil((1 + self.epsilon) * (sum(self.in_flight) + 1) / n)
        start = bisect.bisect(self.ring, arrival.key)
        for step in range(len(self.ring)):
            i = self.owner[(start + step) % len(self.ring)]
            if self.in_flight[i] + 1 <= bound:
                break
        self.in_flight[i] += 1
        return self.urls[i], i

    def finished(self, server: int | None) -> None:
        assert server is not None
        self.in_flight[server] -= 1


def iop_config(servers: Sequence[str], capacity: int, affinity: dict[str, Any] | None) -> dict[str, Any]:
    model: dict[str, Any] = {"id": MODEL, "providers": {f"p{i}": SERVED for i in range(len(servers))}}
    if affinity is not None:
        model["affinity"] = affinity
    return {
        "queue": {"max_queue": 100_000, "queue_timeout_ms": 600_000},
        "models": [model],
        "nodes": [{"id": f"n{i}", "providers": [{"id": f"p{i}", "type": "sglang", "base_url": url,
                                                 "capacity": capacity, "models": [SERVED]}]}
                  for i, url in enumerate(servers)],
    }


@dataclass
class FleetStack(Stack):
    """iop in front of the simulated servers: one node (and worker) per server, ``replicas``
    API processes on ports of their own."""

    servers: list[str] = field(default_factory=list)
    affinity: dict[str, Any] | None = None
    replicas: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        self.api_ports = [self.api_port, *(free_port() for _ in range(self.replicas - 1))]
        self.api_urls = [f"http://127.0.0.1:{port}" for port in self.api_ports]

    def config(self) -> dict[str, Any]:
        return iop_config(self.servers, self.capacity, self.affinity)

    def _start_iop(self, config_path: Path, env: dict[str, str]) -> None:
        # No fakes: Stack's wait for them passes at once, so the providers are waited for here.
        for i in range(len(self.servers)):
            self._spawn(f"worker-{i}", ["worker", "--config", str(config_path), "--node", f"n{i}",
                                        "--log-level", os.environ.get("IOP_BENCH_WORKER_LOG", "warning")], env)
        apis = [self._spawn(f"api-{k}", ["api", "--config", str(config_path), "--port", str(port), "--workers", "1",
                                         "--log-level", "warning"], env)
                for k, port in enumerate(self.api_ports)]
        for api, port in zip(apis, self.api_ports, strict=True):
            wait_port(api, "127.0.0.1", port)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all(self.redis.hget(f"{{iop}}:p:p{i}", "health") == b"available" for i in range(len(self.servers))):
                return
            time.sleep(0.05)
        raise TimeoutError("iop's providers did not become available")


_config_checks: dict[str, list[str]] = {}


def config_problems(config: dict[str, Any], fields: Sequence[str]) -> list[str]:
    """The lines in which ``iop config check`` refuses ``config`` because of one of ``fields``
    (a feature this branch of iop may not have yet); none when it takes the config. A config
    refused for anything else is this benchmark's mistake: RuntimeError."""
    key = repr(config)
    if key not in _config_checks:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "iop.yaml"
            path.write_text(yaml.safe_dump(config))
            done = subprocess.run([sys.executable, "-m", "iop", "config", "check", str(path)],
                                  capture_output=True, text=True, timeout=120)
        lines = [line.strip() for line in (done.stdout + done.stderr).splitlines()]
        _config_checks[key] = [] if done.returncode == 0 else [line for line in lines if line.startswith("$.")]
        if done.returncode != 0 and not _config_checks[key]:
            raise RuntimeError(f"iop config check failed:\n{done.stdout}{done.stderr}")
    problems = _config_checks[key]
    ours = [line for line in problems if any(f in line for f in fields)]
    if problems and not ours:  # a mistake in this benchmark's config, not the missing feature
        raise RuntimeError("iop config check refuses the benchmark's config: " + "; ".join(problems))
    return ours


def iop_rejects(affinity: dict[str, Any]) -> str | None:
    """Why ``iop config check`` refuses the affinity field, or None when it takes it."""
    problems = config_problems(iop_config(["http://127.0.0.1:9"], 8, affinity), ("affinity",))
    return "`iop config check` rejects it: " + "; ".join(problems) if problems else None


class Iop(Target):
    def __init__(self, name: str, capacity: int, affinity: dict[str, Any] | None = None, replicas: int = 1) -> None:
        self.name = name
        self.capacity = capacity
        self.affinity = affinity
        self.replicas = replicas
        mode = ("affinity " + ", ".join(f"{k} {v}" if k != "mode" else str(v) for k, v in affinity.items())
                if affinity else "no affinity")
        api = "1 API process" if replicas == 1 else f"{replicas} API processes, taken in turn"
        api += f", capacity {capacity}"
        self.label = f"iop, {mode} ({api})"
        self.stack: FleetStack | None = None
        self.decisions: dict[str, int] = {}  # the model's affinity decisions in the last run

    def skip_reason(self) -> str | None:
        return iop_rejects(self.affinity) if self.affinity is not None else None

    def make_stack(self, fleet: Fleet) -> FleetStack:
        return FleetStack({}, capacity=self.capacity, servers=fleet.urls, affinity=self.affinity,
                          replicas=self.replicas)

    def start(self, fleet: Fleet) -> None:
        stack = self.make_stack(fleet)
        stack.__enter__()
        self.stack = stack
        self.urls = stack.api_urls
        self.turn = itertools.count()

    def stop(self) -> None:
        if self.stack is not None:
            if self.affinity is not None:
                try:
                    with urllib.request.urlopen(self.urls[0] + "/catalog", timeout=5) as answer:
                        models = msgspec.json.decode(answer.read())["models"]
                    self.decisions = next(m["affinity"]["decisions"] for m in models if m.get("affinity"))
                except (OSError, KeyError, StopIteration, msgspec.DecodeError) as exc:
                    print(f"{self.name}: no affinity decisions from /catalog: {exc!r}", flush=True)
            self.stack.__exit__()
            if os.environ.get("IOP_BENCH_KEEP"):
                print(f"{self.name}: its config and logs kept in {self.stack.dir}", flush=True)
            else:
                shutil.rmtree(self.stack.dir, ignore_errors=True)  # a failed start quotes its log
            self.stack = None

    def route(self, arrival: Arrival) -> tuple[str, int | None]:
        return self.urls[next(self.turn) % len(self.urls)], None


def router_python() -> tuple[Path | None, str]:
    """The router's virtualenv, installed on first use the way ``./dev`` installs the real
    servers (a recipe stamp in ``<kind>.ok``; a failure remembered in ``<kind>.failed`` and
    not retried until the recipe changes or the file is deleted); (python, "") or (None, why)."""
    base = ROUTER_VENV.parent
    ok, failed, log = (base / f"{ROUTER_VENV.name}.{ext}" for ext in ("ok", "failed", "log"))
    python = ROUTER_VENV / "bin" / "python"
    version = subprocess.run([sys.executable, "-V"], capture_output=True, text=True).stdout.strip()
    recipe = hashlib.sha256("\n".join([ROUTER_VENV.name, *ROUTER_PACKAGES, version]).encode()).hexdigest()[:16]
    if ok.exists() and ok.read_text().strip() == recipe and python.exists():
        return python, ""
    if failed.exists() and failed.read_text().splitlines()[:1] == [recipe]:
        return None, f"{' '.join(ROUTER_PACKAGES)} could not be installed (see {log.relative_to(ROOT)})"
    shutil.rmtree(ROUTER_VENV, ignore_errors=True)
    base.mkdir(exist_ok=True)
    print(f"installing {' '.join(ROUTER_PACKAGES)} into {ROUTER_VENV.relative_to(ROOT)} (log in "
          f"{log.relative_to(ROOT)})", flush=True)
    with log.open("w") as out:
        steps = [[sys.executable, "-m", "venv", str(ROUTER_VENV)],
                 [str(python), "-m", "pip", "install", "--upgrade", "pip"],
                 [str(python), "-m", "pip", "install", *ROUTER_PACKAGES]]
        if all(subprocess.run(s, stdout=out, stderr=subprocess.STDOUT).returncode == 0 for s in steps):
            ok.write_text(recipe + "\n")
            return python, ""
    shutil.rmtree(ROUTER_VENV, ignore_errors=True)
    failed.write_text(recipe + "\n")
    return None, f"{' '.join(ROUTER_PACKAGES)} could not be installed (see {log.relative_to(ROOT)})"


class SglangRouter(Target):
    def __init__(self, name: str, replicas: int, directory: Path) -> None:
        self.name = name
        self.replicas = replicas
        self.dir = directory
        split = "" if replicas == 1 else f" x{replicas}, round-robin split in the load generator"
        self.label = f"sglang-router {ROUTER_PACKAGES[0].split('==')[1]} cache_aware{split}"
        self.procs: list[Child] = []

    def skip_reason(self) -> str | None:
        python, why = router_python()
        return None if python is not None else why

    def command(self, python: Path, port: int, metrics_port: int, workers: Sequence[str]) -> list[str]:
        # Its defaults otherwise: cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold 1.5.
        return [str(python), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *workers, "--policy", "cache_aware", "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(metrics_port), "--log-level", "warn",
                "--worker-startup-check-interval", "1"]

    def start(self, fleet: Fleet) -> None:
        python, why = router_python()
        if python is None:
            raise RuntimeError(why)
        stop_all(self.procs, timeout=10)  # a start that failed left them: they are not this run's
        self.procs = []
        ports = [free_port() for _ in range(self.replicas)]
        env = dict(os.environ)
        for k, port in enumerate(ports):
            child = Child(f"router-{k}", self.command(python, port, free_port(), fleet.urls), env,
                          log_path=self.dir / f"{self.name}-{k}.log")
            self.procs.append(child.start())
        for child, port in zip(self.procs, ports, strict=True):
            wait_http(child, f"http://127.0.0.1:{port}/readiness", timeout=60)
            # Ready with the first workers it checked: wait until it has checked them all.
            deadline = time.monotonic() + 60
            while True:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readiness", timeout=5) as resp:
                    ready = msgspec.json.decode(resp.read())
                if ready.get("healthy_workers") == len(fleet.urls):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sglang-router sees {ready} of {len(fleet.urls)} servers")
                time.sleep(0.5)
        self.urls = [f"http://127.0.0.1:{port}" for port in ports]
        self.turn = itertools.count()

    def stop(self) -> None:
        stop_all(self.procs, timeout=10)
        self.procs = []

    def route(self, arrival: Arrival) -> tuple[str, int | None]:
        return self.urls[next(self.turn) % len(self.urls)], None


def make_targets(names: Sequence[str], args: argparse.Namespace, directory: Path) -> list[Target]:
    affinity = {**AFFINITY, **args.affinity}
    makers: dict[str, Callable[[], Target]] = {
        "rr": RoundRobin,
        "chash": lambda: ConsistentHash(args.epsilon),
        "iop": lambda: Iop("iop", args.iop_capacity),
        "iop-prefix": lambda: Iop("iop-prefix", args.iop_capacity, affinity),
        "iop-prefix-x3": lambda: Iop("iop-prefix-x3", args.iop_capacity, affinity, replicas=3),
        "iop-prefix-deep": lambda: Iop("iop-prefix-deep", args.iop_capacity * 4, affinity),
        "sglang-router": lambda: SglangRouter("sglang-router", 1, directory),
        "sglang-router-x3": lambda: SglangRouter("sglang-router-x3", 3, directory),
    }
    return [makers[n]() for n in names]


# --------------------------------------------------------------------------- the load


@dataclass(slots=True)
class Result:
    sent: float  # seconds after the run's start
    ttft: float  # seconds; inf without a first token
    done: float
    status: int  # 0: no answer (a connection error or a broken stream); UNANSWERED: none by the end of the drain
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    queue_ms: float = math.nan  # x-iop-queue-ms of an answer through iop: submit to dispatch
    error: bytes = b""  # the body of an answer that was not 200


_Chunk = dict[str, Any]
R = TypeVar("R", bound=Result)
UNANSWERED: Final = -1  # Result.status of a request cancelled, still unanswered, when run_trace's drain time ran out
JSON_HEADERS: Final = {"Content-Type": "application/json"}


async def send(http: aiohttp.ClientSession, url: str, arrival: Arrival, t0: float,
               headers: dict[str, str] = JSON_HEADERS, result: type[R] = Result) -> R:  # type: ignore[assignment]
    """One streamed request, as ``result``: when it left, its first token, its end, its usage."""
    sent = time.perf_counter() - t0
    ttft = math.inf
    usage: dict[str, Any] | None = None
    queue_ms = math.nan
    try:
        async with http.post(f"{url}/v1/chat/completions", data=arrival.body, headers=headers) as resp:
            if resp.status != 200:
                return result(sent, ttft, time.perf_counter() - t0, resp.status, error=await resp.read())
            queue_ms = float(resp.headers.get("x-iop-queue-ms", "nan"))
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    break
                chunk: _Chunk = msgspec.json.decode(payload)
                if ttft == math.inf:
                    choices = chunk.get("choices") or [{}]
                    if (choices[0].get("delta") or {}).get("content"):
                        ttft = time.perf_counter() - t0 - sent
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (TimeoutError, aiohttp.ClientError, msgspec.DecodeError, ValueError):
        return result(sent, ttft, time.perf_counter() - t0, 0, queue_ms=queue_ms)
    except asyncio.CancelledError:  # run_trace's drain ran out: what came of it so far, its first token
        return result(sent, ttft, math.inf, UNANSWERED, queue_ms=queue_ms)
    done = time.perf_counter() - t0
    if usage is None:  # the stream ended without its usage chunk
        return result(sent, ttft, done, 0, queue_ms=queue_ms)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return result(sent, ttft, done, 200, usage["prompt_tokens"], cached, usage["completion_tokens"],
                  queue_ms=queue_ms)


async def run_trace(target: Target, trace: Sequence[Arrival], headers: dict[str, str] = JSON_HEADERS,
                    result: type[R] = Result, drain: float | None = None) -> list[R]:  # type: ignore[assignment]
    """Open loop: each request leaves at its time, whether or not earlier ones were answered.
    ``drain``: once the last has left, how long the others have to finish; those still
    running then are cancelled (the client hangs up) and come back with status UNANSWERED
    (with their time to first token if one came)."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        t0 = time.perf_counter()

        async def one(arrival: Arrival) -> R:
            url, server = target.route(arrival)
            try:
                return await send(http, url, arrival, t0, headers, result)
            finally:
                target.finished(server)

        tasks = []
        for arrival in trace:
            delay = t0 + arrival.at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(arrival)))
        if drain is None or not tasks:
            return list(await asyncio.gather(*tasks))
        _, pending = await asyncio.wait(tasks, timeout=drain)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return [result(a.at, math.inf, math.inf, UNANSWERED) if t.cancelled() else t.result()
                for a, t in zip(trace, tasks, strict=True)]


@dataclass
class Run:
    target: str
    label: str
    results: list[Result] = field(default_factory=list)
    window: float = 0.0  # the measured arrival window, seconds
    warmup: float = 0.0
    server_requests: list[int] = field(default_factory=list)
    server_stats: list[dict[str, Any]] = field(default_factory=list)
    skipped: str | None = None
    decisions: dict[str, int] = field(default_factory=dict)  # iop's affinity decisions (whole run)

    def measured(self) -> list[Result]:
        return [r for r in self.results if r.sent >= self.warmup]

    def ttfts_ms(self) -> list[float]:
        return [r.ttft * 1000 for r in self.measured() if r.status == 200]

    def goodput(self, slo_s: float) -> float:
        return sum(1 for r in self.measured() if r.status == 200 and r.ttft <= slo_s) / self.window

    def output_tokens_per_s(self) -> float:
        m = [r for r in self.measured() if r.status == 200]
        if not m:
            return 0.0
        return sum(r.completion_tokens for r in m) / (max(r.done for r in m) - self.warmup)

    def hit_rate(self) -> float:
        m = [r for r in self.measured() if r.status == 200]
        prompt = sum(r.prompt_tokens for r in m)
        return sum(r.cached_tokens for r in m) / prompt if prompt else math.nan

    def errors(self) -> int:
        return sum(1 for r in self.measured() if r.status != 200)

    def busiest_share(self) -> float:
        total = sum(self.server_requests)
        return max(self.server_requests) / total if total else math.nan

    def late_steps(self) -> float:
        """The servers' steps that started more than catch_up_ms late: how far the machine kept
        up with the simulation (a few per cent is noise; more, and the servers ran slower than
        their model)."""
        steps = sum(s["steps"] for s in self.server_stats)
        return sum(s["late_steps"] for s in self.server_stats) / steps if steps else math.nan


async def measure(target: Target, fleet: Fleet, trace: Sequence[Arrival], warmup: float, seconds: float) -> Run:
    run = Run(target.name, target.label, warmup=warmup, window=seconds - warmup)
    async with aiohttp.ClientSession() as http:
        await fleet.reset(http)
    target.start(fleet)
    try:
        run.results = await run_trace(target, trace)
    finally:
        target.stop()
    run.decisions = dict(getattr(target, "decisions", {}))
    async with aiohttp.ClientSession() as http:
        run.server_stats = await fleet.stats(http)
    run.server_requests = [s["requests"] for s in run.server_stats]
    return run


# --------------------------------------------------------------------------- tables


def fmt_ms(values: list[float], q: float, digits: int = 0) -> str:
    """The ``q``th percentile of ``values`` (100: the largest), ∞ for a request never answered."""
    if not values:
        return "-"
    v = max(values) if q == 100 else percentile(values, q)
    return "∞" if v == math.inf else f"{v:,.{digits}f}"


def scenario_table(runs: Sequence[Run], slo_s: float) -> str:
    rows = []
    for r in runs:
        if r.skipped is not None:
            continue
        t = r.ttfts_ms()
        rows.append([r.label, f"{len(r.measured()):,}", fmt_ms(t, 50), fmt_ms(t, 90), fmt_ms(t, 99),
                     f"{r.goodput(slo_s):.2f}", f"{r.output_tokens_per_s():,.0f}", f"{r.hit_rate() * 100:.1f}%",
                     f"{r.busiest_share() * 100:.0f}%", str(r.errors()), f"{r.late_steps() * 100:.1f}%"])
    return markdown_table(["target", "requests", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms",
                           f"goodput req/s (TTFT ≤ {slo_s:g} s)", "output tokens/s", "cache hit rate",
                           "busiest server's requests", "errors", "late steps"], rows)


@dataclass(frozen=True)
class Scenario:
    variant: str
    load: float  # fraction of the nominal capacity

    @property
    def title(self) -> str:
        names = {"equal": "equal tenants", "skewed": f"skewed tenants (one sends {HOT_SHARE:.0%})",
                 "unique": "no shared prefixes"}
        return f"{names[self.variant]}, {self.load:.0%} of nominal capacity"


def hit_ceiling(trace: Sequence[Arrival], block_tokens: int) -> float:
    """The cache hit rate of perfect routing with warm caches: every shared prefix block a hit."""
    return sum(a.shared_blocks * block_tokens for a in trace) / sum(a.prompt_tokens for a in trace)


def scenarios(variants: Sequence[str], loads: Sequence[float]) -> list[Scenario]:
    """Every load for ``equal``; the other variants at the middle load given (80% by default)."""
    out = [Scenario("equal", load) for load in loads] if "equal" in variants else []
    middle = sorted(loads)[len(loads) // 2]
    out += [Scenario(v, middle) for v in variants if v != "equal"]
    return out


def workload_notes(args: argparse.Namespace, sim: SimConfig, w: Workload, working_set: int,
                   caps: dict[str, Capacity]) -> str:
    fleet_kv = sim.kv_blocks * args.servers
    cap_lines = "; ".join(
        f"{v}: {c.per_server * args.servers:.1f} req/s ({c.per_server:.2f} per server, {c.batch} running, "
        f"{c.uncached_tokens:.0f} uncached prompt tokens, {c.ms_per_request:.0f} server-ms per request)"
        for v, c in caps.items())
    return (
        f"**Workload.** {w.tenants} tenants x {w.users} users; each tenant has a system prompt of "
        f"{w.prefix_tokens[0]:,}-{w.prefix_tokens[1]:,} tokens, each request adds its own "
        f"{w.query_tokens[0]}-{w.query_tokens[1]}-token question and asks for {w.output_tokens} tokens, streamed "
        f"(`stream_options.include_usage`). Poisson arrivals (conditioned on their count, so that a run offers "
        f"exactly its load), the same seeded trace (`--seed {args.seed}`) for "
        f"every target; each run lasts {args.seconds:g} s of arrivals, of which the first {args.warmup:g} s warm the "
        f"caches and are not counted (the servers start every run empty). Variants: *equal* (tenants equally "
        f"busy), *skewed* (one tenant sends {HOT_SHARE:.0%} of the requests), *unique* (every request's system "
        f"prompt is its own: nothing to share).\n\n"
        f"**Fleet.** {args.servers} simulated servers (`bench/fleet_sim.py`): KV {sim.kv_blocks:,} blocks of "
        f"{sim.block_tokens} tokens each ({fleet_kv:,} in the fleet); the tenants' shared prefixes take "
        f"{working_set:,} blocks, {working_set / fleet_kv:.0%} of the fleet's KV. A step costs {sim.step_ms:g} ms + "
        f"{sim.prefill_ms_per_token:g} ms per prefilled (uncached) token + {sim.decode_ms_per_seq:g} ms per "
        f"decoding request; at most {sim.prefill_budget:,} prefill tokens per step (chunked prefill) and "
        f"{sim.max_batch} running requests; FIFO admission; LRU eviction of unpinned blocks. Absolute figures "
        f"are the simulator's, not a GPU's; the load generator, the servers and the gateways share the "
        f"machine's 2 cores.\n\n"
        f"**Nominal capacity** (computed from the simulator's cost model, for perfect prefix routing: every "
        f"shared prefix cached on one server, only the rest of each prompt prefilled; "
        f"ms/request = prefill_ms * uncached tokens + (output - 1) * (step_ms + decode_ms * B) / B with B running "
        f"requests, as many as max_batch and the KV beside the server's share of the prefixes allow): "
        f"{cap_lines}. Loads are fractions of the variant's figure.\n\n"
        f"**Columns.** TTFT from sending the request to its first content chunk, as the load generator saw it; "
        f"goodput: requests of the measured window answered with TTFT ≤ {args.slo_ms / 1000:g} s, per second of "
        f"the window; output tokens/s: their completion tokens over the time from the window's start to the last "
        f"answer; cache hit rate: Σ cached_tokens / Σ prompt_tokens of their `usage`; busiest server: its share "
        f"of all the run's requests (1/{args.servers} = {1 / args.servers:.0%} is even); late steps: the servers' "
        f"steps that started more than {sim.catch_up_ms:g} ms behind their schedule because the machine was busy "
        f"(a simulation that did not keep up with its own model).\n")


def command(args: argparse.Namespace) -> str:
    if args.quick:
        return f"{COMMAND} --quick"
    return command_line(COMMAND, args, {
        "seconds": 45.0, "warmup": 10.0, "targets": list(TARGETS), "variants": list(VARIANTS),
        "loads": [0.5, 0.8, 1.0], "iop_capacity": SimConfig().max_batch, "affinity": {}})


# --------------------------------------------------------------------------- main


async def main(args: argparse.Namespace) -> str:
    w = Workload(tenants=args.tenants)
    base = SimConfig(max_tokens=w.output_tokens)
    working_set = prefix_working_set(w, args.seed, base.block_tokens)
    kv_blocks = args.kv_blocks or math.ceil(working_set / args.kv_fill / args.servers)
    sim = SimConfig(kv_blocks=kv_blocks, max_tokens=w.output_tokens, metrics="sglang")  # as its providers' type
    variants = [v for v in VARIANTS if v in args.variants]
    caps = {v: nominal_capacity(sim, args.servers, w, v, args.seed) for v in variants}
    for v, c in caps.items():
        print(f"nominal capacity, {v}: {c.per_server * args.servers:.2f} req/s ({c.batch} running per server, "
              f"{c.uncached_tokens:.0f} uncached prompt tokens, {c.ms_per_request:.0f} ms per request)")
    print(f"KV: {kv_blocks} blocks per server; shared prefixes {working_set} blocks = "
          f"{working_set / (kv_blocks * args.servers):.0%} of the fleet")
    directory = Path(tempfile.mkdtemp(prefix="iop-prefix-fleet-"))
    targets = make_targets(args.targets, args, directory)
    skipped: dict[str, str] = {}
    for t in targets:
        why = t.skip_reason()
        if why is not None:
            skipped[t.label] = why
            print(f"skipping {t.name}: {why}")
    out = [workload_notes(args, sim, w, working_set, caps)]
    probes: dict[str, int] = {}
    routers = 0
    failed: list[str] = []
    with Fleet([sim] * args.servers, directory) as fleet:
        for sc in scenarios(variants, args.loads):
            rate = sc.load * caps[sc.variant].per_server * args.servers
            trace = make_trace(w, sc.variant, rate, args.seconds, args.seed, sim.block_tokens)
            ceiling = hit_ceiling(trace, sim.block_tokens)
            offered = sum(1 for a in trace if a.at >= args.warmup) / (args.seconds - args.warmup)
            heading = (f"{sc.title}: {rate:.2f} req/s ({len(trace):,} requests; {offered:.2f} req/s arrived in the "
                       f"measured window); perfect routing's cache hit rate {ceiling:.1%}")
            print(f"\n## {heading}", flush=True)
            runs = []
            for t in targets:
                if t.label in skipped:
                    continue
                started = time.monotonic()
                try:
                    run = await measure(t, fleet, trace, args.warmup, args.seconds)
                except Exception as exc:  # one target that cannot start does not cost the others their runs
                    failed.append(f"*{t.label}* in *{sc.title}*: {type(exc).__name__}: {str(exc).splitlines()[0]}")
                    print(f"  {t.name}: FAILED: {exc!r}", flush=True)
                    continue
                runs.append(run)
                if isinstance(t, SglangRouter):
                    routers += t.replicas
                    for s in run.server_stats:
                        for path, n in s["paths"].items():
                            if not path.startswith(("POST /v1/", "GET /sim/", "POST /sim/")):
                                probes[path] = probes.get(path, 0) + n
                print(f"  {t.name}: {len(run.measured())} measured, TTFT p50 {fmt_ms(run.ttfts_ms(), 50)} ms, "
                      f"hit rate {run.hit_rate() * 100:.1f}%, goodput {run.goodput(args.slo_ms / 1000):.2f}/s, "
                      f"errors {run.errors()}, late steps {run.late_steps() * 100:.1f}% "
                      f"({time.monotonic() - started:.0f} s)", flush=True)
            table = scenario_table(runs, args.slo_ms / 1000)
            decided = [f"{r.label}: " + ", ".join(f"{k} {v:,}" for k, v in sorted(r.decisions.items()))
                       for r in runs if r.decisions]
            if decided:
                table += "\nAffinity decisions over the whole run (warm-up included): " + "; ".join(decided) + ".\n"
            print(f"\n{heading}\n\n{table}", flush=True)
            out.append(f"**{heading}**\n\n{table}")
    if skipped:
        out.append("Skipped: " + "; ".join(f"*{label}*: {why}" for label, why in skipped.items()) + ".\n")
    if failed:
        out.append("Failed to run: " + "; ".join(failed) + ".\n")
    if probes:
        out.append(f"What sglang-router asked of the servers besides the requests, per server, over the {routers} "
                   "router processes of these runs: "
                   + ", ".join(f"`{p}` {n / args.servers:g}" for p, n in sorted(probes.items())) + ".\n")
    shutil.rmtree(directory, ignore_errors=True)
    return "\n".join(out)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a short run for development: equal tenants at 80%%, 10 s per target")
    parser.add_argument("--seconds", type=float, default=45.0, help="arrivals per run")
    parser.add_argument("--warmup", type=float, default=10.0, help="first seconds of each run not counted")
    parser.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS))
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--loads", nargs="+", type=float, default=[0.5, 0.8, 1.0],
                        help="fractions of nominal capacity (equal tenants; other variants at the middle one)")
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--tenants", type=int, default=24)
    parser.add_argument("--kv-fill", type=float, default=0.72,
                        help="the fraction of the fleet's KV the shared prefixes need (sizes --kv-blocks)")
    parser.add_argument("--kv-blocks", type=int, default=0, help="per server; 0: from --kv-fill")
    parser.add_argument("--epsilon", type=float, default=0.25, help="the consistent-hashing reference's load bound")
    parser.add_argument("--iop-capacity", type=int, default=SimConfig().max_batch,
                        help="each iop provider's capacity (default: the servers' max batch)")
    parser.add_argument("--affinity", type=json.loads, default={},
                        help="iop-prefix's affinity settings over the defaults, as JSON")
    parser.add_argument("--slo-ms", type=float, default=2000.0, help="the TTFT goodput counts")
    parser.add_argument("--seed", default="iop-23")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.warmup, args.variants, args.loads = 10.0, 3.0, ["equal"], [0.8]
    if args.warmup >= args.seconds:
        parser.error("--warmup must be shorter than --seconds")
    return args


HEADING: Final = """## Cache-aware dispatch over a simulated fleet (issue 23)

`python -m bench.prefix_fleet` (`--quick` for a one-minute look): simulated inference
servers with prefix caches (`bench/fleet_sim.py`) behind round robin, a consistent-hashing
reference, iop with and without prefix affinity, and sglang-router's `cache_aware` policy,
on the same traces. The module docstrings say what is simulated and what is left out.
"""


def write(args: argparse.Namespace, text: str) -> None:
    write_section("prefix-fleet", command(args), text, heading=HEADING)


if __name__ == "__main__":
    arguments = parse_args()
    uvloop.install()
    text = asyncio.run(main(arguments))
    if not arguments.no_write:
        write(arguments, text)
