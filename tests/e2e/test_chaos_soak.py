"""A bounded soak with random faults: JSON and streamed requests from a pool of client
threads, through two API processes, to two nodes of two workers each, while a seeded
schedule SIGKILLs and restarts workers, fake providers, API processes and Redis (AOF, same
port, outages shorter than two leases, at least a lease apart) and stalls the providers.
The faults come one at a time, so the model always keeps a provider (both of type
``vllm``, which can continue a stream).

Every request carries a marker (its ``user`` field) that the fake providers log with
each execution and the caller's TCP port; a killed worker's connections are read from
/proc while it is stopped, just before the kill. A fake provider is killed by asking it
(SIGUSR1) to write what it ran and then SIGKILL itself, at once: the calls it was running
at that instant are the ones the kill cut (its log in memory dies with it, and it comes
back with its test hooks on from its first request: ``FAKE_BOOT``). So each repeated
execution is either explained by the death of the very worker or provider that ran the
previous one, or it is a duplicate; and a re-run whose request carries the answer so far
(a trailing assistant message) is a continuation.

A stream cut after its output began (its worker or provider killed) goes on as a
*continuation* on a provider of the model (issue 49): the caller's stream must be whole --
every piece once, in order, one role chunk, the same id on every chunk, one ``[DONE]``, the
finish chunk's ``iop`` member counting the continuations as the ``: iop continued`` comments
do. A stream cut by a fault that ends with its error is explained only when it could not go
on (Redis was down while it was open, or its continuations were used up).

It ends with a table of outcomes and asserts, exactly: nothing lost (every request got
an answer or, if its API process was killed while it was open, a dropped connection),
nothing duplicated (nor any request run twice at once), no empty and no corrupt answer,
every error explained by a fault while the request was open (``worker_lost``: the worker
running it was killed; ``provider_error``: a provider kill cut one of its calls;
``redis_unavailable``: Redis was down and the request had not reached a provider; see
``unexplained``), every 200 backed by a completed provider call, every continuation a
re-run explained by a kill, no process dead except by the schedule's hand, and afterwards
no slot, lease, queued job or job state left and no provider ever over its capacity (nor
any killed provider process before its kill).

``IOP_CHAOS_SEED`` replays a schedule; otherwise a fresh seed is drawn and printed.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import signal
import sys
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis import Redis

from iop.processes import wait_port
from tests.e2e.system import (
    Fake,
    Planned,
    Proc,
    System,
    expected_pieces,
    fast_dispatch,
    http_provider,
    leftovers,
    sse_payloads,
)

SEED = int(os.environ.get("IOP_CHAOS_SEED") or random.SystemRandom().randrange(1 << 32))
LEASE_MS = 3000
NODES = {"n1": "p1", "n2": "p2"}  # node -> its provider
CAPACITY = 4  # per provider
CLIENTS = 10
MAX_REQUESTS = 1000
QUEUE_TIMEOUT_MS = 20_000
PROVIDER_TIMEOUT_S = 20
# A request silent this long is lost: far beyond its queue deadline plus its longest run.
CLIENT_READ_TIMEOUT_S = 45.0
FAULT_KINDS = ("worker", "provider", "api", "redis", "stall")
MAX_ATTEMPTS = 3  # dispatch.max_attempts
MAX_CONTINUATIONS = 2  # models[].max_continuations, its default
# A fake provider as ``python -m iop fake-provider ...`` runs it, with its test hooks on from
# its first request (one started again after a kill is sent work as soon as it answers its
# probe) and SIGUSR1 making it write what it ran (executions, requests, stats) to the file
# named by its first argument, then SIGKILL itself: so what a kill cut is known exactly.
FAKE_BOOT = """
import os, signal, sys
import msgspec
from iop.fake_provider import _server
dump = sys.argv.pop(1)
_init = _server._FakeProvider.__init__
def _hooked(self, options):
    _init(self, options)
    self.hooks.track_executions = self.hooks.body_overrides = True
    def die(signum, frame):
        with open(dump, "wb") as f:
            f.write(msgspec.json.encode({"executions": list(self.executions), "requests": list(self.requests),
                                         "stats": self.stats}))
        os.kill(os.getpid(), signal.SIGKILL)
    signal.signal(signal.SIGUSR1, die)
_server._FakeProvider.__init__ = _hooked
from iop.cli import main
sys.exit(main(sys.argv[1:]))
"""


@dataclass
class Fault:
    kind: str
    target: str
    start: float  # wall clock: just before the kill / stall
    end: float = 0.0  # back up (restarted and ready) / stall released
    # A killed worker's (local, remote) ports; a killed provider's calls' (client, provider) ports.
    ports: set[tuple[int, int]] = field(default_factory=set)


@dataclass
class Outcome:
    planned: Planned
    api_name: str
    opened: float
    closed: float = 0.0
    kind: str = ""  # ok | error | empty | corrupt | conn_error | lost
    code: str = ""
    detail: str = ""
    continued: int = 0  # a stream's ": iop continued" comments: continuations that took it on
    providers: list[str] = field(default_factory=list)  # an ok continued stream's iop.providers


def configure(system: System) -> None:
    system.write_config({
        "dispatch": fast_dispatch(LEASE_MS, max_attempts=3),
        # Its faults take providers away and bring them back: requests wait for them rather
        # than being answered no_provider_available while every provider is down.
        "queue": {"max_queue": MAX_REQUESTS, "queue_timeout_ms": QUEUE_TIMEOUT_MS,
                  "hold_when_unavailable_ms": QUEUE_TIMEOUT_MS},
        "models": [{"id": "m", "providers": {p: f"served-{p}" for p in NODES.values()}}],
        "nodes": [
            {"id": node, "providers": [http_provider(p, "vllm", system.port(p), CAPACITY, [f"served-{p}"],
                                                     timeout_s=PROVIDER_TIMEOUT_S)]}
            for node, p in NODES.items()
        ],
    })


def start_fake(system: System, name: str) -> Fake:
    """Fake provider ``name`` (serving ``served-<name>``) as ``System.fake`` starts one, through ``FAKE_BOOT``."""
    port = system.port(name)
    argv = [sys.executable, "-c", FAKE_BOOT, str(system.dir / f"fake-{name}.dump"),
            "fake-provider", "--port", str(port), "--models", f"served-{name}"]
    proc = Proc(f"fake-{name}", argv, system.env, system.dir).start()
    system.procs.append(proc)
    wait_port(proc, "127.0.0.1", port)
    fake = Fake(proc, port)
    system.fakes[name] = fake
    return fake


# --- which sockets a worker holds --------------------------------------------------------------


def tcp_ports(pid: int) -> set[tuple[int, int]]:
    """(local port, remote port) of every TCP connection process ``pid`` holds."""
    inodes: set[str] = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            link = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    ports: set[tuple[int, int]] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[9] in inodes:
                ports.add((int(cols[1].rsplit(":", 1)[1], 16), int(cols[2].rsplit(":", 1)[1], 16)))
    return ports


# --- the fault schedule ------------------------------------------------------------------------------


class Chaos:
    """Runs a seeded schedule of faults, one at a time, while traffic flows; restarts
    whatever dies outside the schedule and records it.

    Run it in the test's own thread: redis-server is started with PR_SET_PDEATHSIG, which
    fires when the *thread* that started it ends."""

    def __init__(self, system: System, workers: list[Proc], apis: list[Proc], fakes: dict[str, Fake],
                 rng: random.Random) -> None:
        self.system = system
        self.workers = workers
        self.apis = apis
        self.fakes = fakes
        self.rng = rng
        # Every kind twice (so at least two provider kills), one more at random, in a random order.
        kinds = [*FAULT_KINDS, *FAULT_KINDS, rng.choice(FAULT_KINDS)]
        rng.shuffle(kinds)
        self.schedule = kinds
        self.faults: list[Fault] = []
        # What each killed fake provider process had run: executions (those running at the kill
        # marked "killed", with the fault's index), requests, stats.
        self.dumps: dict[str, list[dict[str, Any]]] = {name: [] for name in fakes}
        self.unexpected_deaths: list[str] = []
        self.apis_down: set[str] = set()
        self.lock = threading.Lock()

    def api_choices(self) -> list[str]:
        with self.lock:
            return [a.name for a in self.apis if a.name not in self.apis_down]

    def run(self) -> None:
        for kind in self.schedule:
            time.sleep(self.rng.uniform(0.8, 2.0))
            self.check_alive()
            getattr(self, f"fault_{kind}")()
            self.check_alive()

    def check_alive(self) -> None:
        for proc in [*self.workers, *self.apis, *(f.proc for f in self.fakes.values())]:
            if not proc.alive():
                self.unexpected_deaths.append(f"{proc.name} (exit {proc.proc.returncode if proc.proc else None})")
                proc.start()

    def fault_worker(self) -> None:
        victim = self.rng.choice(self.workers)
        old_id = self.system.worker_id(victim)
        # Stopped first, so the sockets read are exactly those it holds when it dies.
        victim.signal(signal.SIGSTOP)
        ports = tcp_ports(victim.pid)
        fault = Fault("worker", victim.name, time.time(), ports=ports)
        victim.kill()
        self.faults.append(fault)
        time.sleep(self.rng.uniform(0.2, 1.5))
        victim.start()
        self.system.wait_until(f"{victim.name} serving again", lambda: self.system.worker_id(victim) != old_id)
        fault.end = time.time()

    def serving(self, provider: str) -> bool:
        """Is ``provider`` available in Redis and to every worker of its node? Each of them
        heartbeats its own view of it into the provider's hash, and one that saw it fail may
        see it back only seconds after another one does (while it is busy, its probes are
        seldom): until then its health there flips between the two."""
        if self.system.provider(provider).get("health") != "available":
            return False
        node = next(n for n, p in NODES.items() if p == provider)
        for worker in self.workers:
            if worker.name.startswith(f"worker-{node}-"):
                said = re.findall(rf"provider {provider} is (available|unavailable)", worker.log())
                if not said or said[-1] != "available":
                    return False
        return True

    def fault_provider(self) -> None:
        name = self.rng.choice(sorted(self.fakes))
        fake = self.fakes[name]
        # Never both at once: the faults come one at a time, and the other one is serving.
        for other in self.fakes:
            if other != name:
                self.system.wait_until(f"{other} serving", lambda other=other: self.serving(other))
        dump = self.system.dir / f"fake-{name}.dump"
        dump.unlink(missing_ok=True)
        fault = Fault("provider", name, time.time())
        fake.proc.signal(signal.SIGUSR1)  # it writes what it ran, then SIGKILLs itself
        returncode = fake.proc.wait(timeout=10)
        assert returncode == -signal.SIGKILL, f"fake-{name} ended {returncode}, not by its SIGKILL"
        ran = json.loads(dump.read_bytes())
        dump.unlink()
        for run in ran["executions"]:
            if run["outcome"] == "running":
                run["outcome"], run["fault"], run["ended"] = "killed", len(self.faults), fault.start
                fault.ports.add((run["client_port"], fake.port))
        self.dumps[name].append(ran)
        self.faults.append(fault)
        time.sleep(self.rng.uniform(0.2, 1.5))
        fake.proc.start()
        wait_port(fake.proc, "127.0.0.1", fake.port)
        self.system.wait_until(f"{name} serving again", lambda: self.serving(name))
        fault.end = time.time()

    def fault_api(self) -> None:
        victim = self.rng.choice(self.apis)
        with self.lock:
            self.apis_down.add(victim.name)
        fault = Fault("api", victim.name, time.time())
        victim.kill()
        self.faults.append(fault)
        time.sleep(self.rng.uniform(0.2, 1.0))
        victim.start()
        self.system.wait_api_ready(victim)
        fault.end = time.time()
        with self.lock:
            self.apis_down.discard(victim.name)

    def fault_redis(self) -> None:
        # Two outages are two when Redis is up for a lease between them (back-to-back ones
        # are test_redis_outage.py::test_two_outages_in_quick_succession).
        last_end = max((f.end for f in self.faults if f.kind == "redis"), default=0.0)
        time.sleep(max(0.0, last_end + LEASE_MS / 1000 - time.time()))
        outage = self.rng.uniform(0.3, 2 * LEASE_MS / 1000 - 0.5)
        fault = Fault("redis", f"{outage:.1f}s", time.time())
        self.system.redis_server.stop(kill=True)
        self.faults.append(fault)
        time.sleep(outage)
        self.system.redis_server.start()
        fault.end = time.time()
        self.system.redis.close()
        self.system.redis = Redis.from_url(self.system.redis_server.url)

    def fault_stall(self) -> None:
        name = self.rng.choice(sorted(self.fakes))
        stall = self.rng.uniform(1.0, 3.0)
        fault = Fault("stall", f"{name} {stall:.1f}s", time.time())
        self.fakes[name].control(hang=True)  # new calls are held, then answered normally
        self.faults.append(fault)
        time.sleep(stall)
        self.fakes[name].control(hang=False)
        fault.end = time.time()


# --- classifying answers ------------------------------------------------------------------------------


def classify(outcome: Outcome, status: int, text: str) -> None:
    planned = outcome.planned
    pieces = expected_pieces(planned.tokens)
    if status != 200:
        outcome.kind = "error"
        try:
            outcome.code = f"{status} {json.loads(text)['error']['code']}"
        except (ValueError, KeyError, TypeError):
            outcome.code = f"{status} (not an OpenAI error)"
        return
    if not planned.stream:
        try:
            content = json.loads(text)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            outcome.kind, outcome.detail = "corrupt", text[:200]
            return
        if not content:
            outcome.kind = "empty"
        elif content == "".join(pieces):
            outcome.kind = "ok"
        else:
            outcome.kind, outcome.detail = "corrupt", text[:200]
        return
    payloads = sse_payloads(text)
    # A continuation is spliced in after an SSE comment ": iop continued on <provider> after <code>".
    outcome.continued = sum(line.startswith(": iop continued on ") for line in text.splitlines())
    if not payloads:
        outcome.kind = "empty"
        return
    done = payloads[-1] == "[DONE]"
    try:
        chunks = [json.loads(p) for p in (payloads[:-1] if done else payloads)]
        errors = [c["error"]["code"] for c in chunks if "error" in c]
        answer = [c for c in chunks if "error" not in c]
        contents = [c["choices"][0]["delta"].get("content") for c in answer]
        finishes = [c["choices"][0].get("finish_reason") for c in answer]
        ids = {c["id"] for c in answer}
        marks = [c["iop"] for c in answer if "iop" in c]
    except (ValueError, KeyError, IndexError, TypeError):
        outcome.kind, outcome.detail = "corrupt", text[-300:]
        return
    said = [c for c in contents if c]
    if said != pieces[:len(said)] or payloads.count("[DONE]") > int(done):
        outcome.kind, outcome.detail = "corrupt", f"content {said}, expected {pieces}"
    elif len(ids) > 1:
        outcome.kind, outcome.detail = "corrupt", f"chunks of several ids: {sorted(ids)}"
    elif not done:
        # Output had started and the stream was cut: exactly one error event, at its end.
        if len(errors) == 1 and "error" in chunks[-1]:
            outcome.kind, outcome.code = "error", f"200-stream {errors[0]}"
        else:
            outcome.kind, outcome.detail = "corrupt", f"stream ends without [DONE] or one error: {payloads[-2:]}"
    elif errors:
        outcome.kind, outcome.detail = "corrupt", f"error events before [DONE]: {errors}"
    elif not said:
        outcome.kind = "empty"
    elif contents != ["", *pieces, None] or finishes[-1] != "stop" or any(finishes[:-1]):
        outcome.kind, outcome.detail = "corrupt", f"chunks {contents} ending {finishes[-1]!r}, expected " \
            f"{['', *pieces, None]} ending 'stop'"
    elif not outcome.continued and not marks:
        outcome.kind = "ok"
    elif (len(marks) == 1 and "iop" in answer[-1] and marks[0].get("continued") == outcome.continued
          and isinstance(marks[0].get("providers"), list) and len(marks[0]["providers"]) == outcome.continued + 1):
        # A continued stream: one role chunk, the content, the finish chunk naming its providers.
        outcome.kind, outcome.providers = "ok", marks[0]["providers"]
    else:
        outcome.kind, outcome.detail = "corrupt", (f"{outcome.continued} continuation comment(s), iop members "
                                                   f"{marks} (the finish chunk's: {'iop' in answer[-1]})")


def overlaps(outcome: Outcome, fault: Fault) -> bool:
    return fault.start <= outcome.closed and (fault.end == 0.0 or fault.end >= outcome.opened)


Runs = dict[str, list[tuple[str, dict[str, Any]]]]  # marker -> (provider, execution), by start


def runs_by_marker(executions: dict[str, list[dict[str, Any]]]) -> Runs:
    by_marker: Runs = defaultdict(list)
    for provider, runs in executions.items():
        for run in runs:
            by_marker[run["marker"]].append((provider, run))
    for mine in by_marker.values():
        mine.sort(key=lambda pr: pr[1]["started"])
    return by_marker


def cutters(outcome: Outcome, faults: list[Fault], mine: list[tuple[str, dict[str, Any]]],
            fake_ports: dict[str, int]) -> list[Fault]:
    """The kills, while it was open, of a worker or a provider running one of its calls."""
    ports = {(run["client_port"], fake_ports[provider]) for provider, run in mine}
    return [f for i, f in enumerate(faults) if overlaps(outcome, f) and (
        (f.kind == "worker" and ports & f.ports) or (f.kind == "provider" and any(run.get("fault") == i
                                                                                   for _, run in mine)))]


def could_not_go_on(outcome: Outcome, faults: list[Fault], mine: list[tuple[str, dict[str, Any]]]) -> str | None:
    """Why an answer cut by a fault could not go on -- a stream whose output began as a
    continuation, an answer not begun on another attempt --; None when it could have."""
    if any(f.kind == "redis" and overlaps(outcome, f) for f in faults):
        return "Redis was down while it was open"
    if outcome.code.startswith("200-stream"):
        if outcome.continued >= MAX_CONTINUATIONS:
            return f"its {MAX_CONTINUATIONS} continuations were used up"
    elif sum(run["outcome"] in ("killed", "disconnected") for _, run in mine) >= MAX_ATTEMPTS:
        return f"its {MAX_ATTEMPTS} attempts were used up"
    return None


def unexplained(outcome: Outcome, faults: list[Fault], runs: Runs, fake_ports: dict[str, int],
                prefilled: Counter[str] | None) -> str | None:
    """Why an answer that is not a plain success is not explained by a fault, or None.

    * a dropped connection: its API process was killed while it was open;
    * ``worker_lost``: a worker that was running it (one of its provider calls came from
      that worker's sockets) was killed while it was open; ``provider_error``: a provider
      kill cut one of its calls while it was open; and either, for a stream whose output had
      begun, only when it could not be continued, for an answer not begun that ends
      ``provider_error``, only when it could not be tried again (``could_not_go_on``);
    * ``redis_unavailable``: Redis was down while it was open, and it had not reached a
      provider before it was answered (a dispatched request outlives an outage);
    * a continued stream (``ok``): a kill cut one of its calls while it was open, each
      continuation ran at a provider with the answer so far (``prefilled``: such runs of
      each marker; None when the fakes' request logs were not whole), and the providers its
      ``iop`` member names ran it.
    """
    mine = runs.get(outcome.planned.marker, [])
    if outcome.kind == "conn_error":
        if any(f.kind == "api" and f.target == outcome.api_name and overlaps(outcome, f) for f in faults):
            return None
        return "connection error, but its API process was not killed while it was open"
    if outcome.kind == "ok" and outcome.continued:
        if not cutters(outcome, faults, mine, fake_ports):
            return f"continued {outcome.continued} time(s), but no kill cut it"
        if prefilled is not None and prefilled[outcome.planned.marker] < outcome.continued:
            return (f"continued {outcome.continued} time(s), but only {prefilled[outcome.planned.marker]} "
                    f"of its calls carried the answer so far")
        if not set(outcome.providers) <= {provider for provider, _ in mine}:
            return f"its iop member names providers {outcome.providers}, but it ran at {[p for p, _ in mine]}"
        return None
    if outcome.kind != "error":
        return None
    code = outcome.code.split(" ", 1)[1]
    if code in ("worker_lost", "provider_error"):
        killed = "worker" if code == "worker_lost" else "provider"
        if not any(f.kind == killed for f in cutters(outcome, faults, mine, fake_ports)):
            return f"{code}, but no {killed} running it was killed while it was open"
        streamed = outcome.code.startswith("200-stream")
        if (streamed or code == "provider_error") and could_not_go_on(outcome, faults, mine) is None:
            return (f"{code} after its output began, though it could have been continued" if streamed
                    else f"{code}, though it could have been tried again")
        return None
    if code == "redis_unavailable":
        if not any(f.kind == "redis" and overlaps(outcome, f) for f in faults):
            return "redis_unavailable, but Redis was up all the time it was open"
        started = [run["started"] for _, run in mine if run["started"] < outcome.closed]
        if started:
            return (f"redis_unavailable, although it was running at a provider since "
                    f"{outcome.closed - min(started):.2f}s before that answer")
        return None
    return f"{outcome.code}: no fault explains it"


def killed_by(provider: str, prev: dict[str, Any], nxt: dict[str, Any], fake_ports: dict[str, int],
              faults: list[Fault]) -> str | None:
    """Whose death, between ``prev``'s start and ``nxt``'s, explains running it again: "worker"
    (the worker holding ``prev``'s connection), "provider" (its provider's kill cut ``prev``), or None."""
    if "fault" in prev and faults[prev["fault"]].start <= nxt["started"]:
        return "provider"
    port = (prev["client_port"], fake_ports[provider])
    if any(f.kind == "worker" and port in f.ports and prev["started"] <= f.start <= nxt["started"] for f in faults):
        return "worker"
    return None


def duplicates(runs: Runs, fake_ports: dict[str, int], faults: list[Fault]) -> tuple[list[str], Counter[str]]:
    """Markers run again at a provider although neither the worker nor the provider of the
    previous run died (between that run's start and the next one's), or while the previous run
    was still running (a job never runs twice at once, nor its continuations); and the re-runs
    such a death explains, by whose death ("worker", "provider") and by marker."""
    bad: list[str] = []
    explained: Counter[str] = Counter()
    for marker, mine in runs.items():
        listing = [(p, r["outcome"], round(r["started"], 2), round(r["ended"] or 0, 2)) for p, r in mine]
        for (provider, prev), (_, nxt) in itertools.pairwise(mine):
            cause = killed_by(provider, prev, nxt, fake_ports, faults)
            if prev["ended"] is None or nxt["started"] < prev["ended"]:
                bad.append(f"{marker} ran twice at once: {listing}")
            elif cause is not None:
                explained[cause] += 1
                explained[marker] += 1
            else:
                bad.append(f"{marker}: {listing}")
    return bad, explained


def prefill_problem(body: dict[str, Any], tokens: int) -> str | None:
    """None when a continuation's request carries a faithful answer so far: the first k
    (0 < k < tokens) pieces of the answer as a trailing assistant message, vLLM's flags set."""
    pieces = expected_pieces(tokens)
    so_far = body["messages"][-1].get("content")
    if not any(so_far == "".join(pieces[:k]) for k in range(1, tokens)):
        return f"answer so far {so_far!r} is not a beginning of {''.join(pieces)!r}"
    if body.get("continue_final_message") is not True or body.get("add_generation_prompt") is not False:
        return f"continue_final_message {body.get('continue_final_message')!r}, " \
               f"add_generation_prompt {body.get('add_generation_prompt')!r}"
    return None


# --- the soak ----------------------------------------------------------------------------------------------


def test_chaos_soak(aof_system: System) -> None:
    system = aof_system
    print(f"\nchaos soak seed {SEED} (IOP_CHAOS_SEED={SEED} replays it)")
    rng = random.Random(SEED)
    configure(system)
    fakes = {p: start_fake(system, p) for p in NODES.values()}
    for fake in fakes.values():
        assert fake.hooks() == {"track_executions": True, "body_overrides": True}
    workers = [system.worker(node, f"worker-{node}-{i}") for node in NODES for i in (1, 2)]
    apis = [system.api(f"api-{i}") for i in (1, 2)]
    system.wait_available(*NODES.values())
    for worker in workers:
        system.wait_serving(worker)

    chaos = Chaos(system, workers, apis, fakes, random.Random(rng.getrandbits(32)))
    traffic_rng = random.Random(rng.getrandbits(32))
    plans = []
    for i in range(MAX_REQUESTS):
        stream = traffic_rng.random() < 0.5
        if stream:
            plans.append((f"r{i}", True, traffic_rng.randint(0, 300), traffic_rng.randint(3, 12),
                          traffic_rng.randint(30, 150), traffic_rng.random()))
        else:
            plans.append((f"r{i}", False, traffic_rng.randint(50, 600), traffic_rng.randint(2, 6), 0,
                          traffic_rng.random()))
    outcomes: list[Outcome] = []
    outcomes_lock = threading.Lock()
    next_index = iter(range(MAX_REQUESTS))
    index_lock = threading.Lock()
    stop_traffic = threading.Event()

    def client() -> None:
        while not stop_traffic.is_set():
            with index_lock:
                i = next(next_index, None)
            if i is None:
                return
            marker, stream, delay, tokens, interval, pick = plans[i]
            opened = time.time()
            choices = chaos.api_choices() or [a.name for a in apis]
            api_name = choices[int(pick * len(choices))]
            planned = Planned(marker, system.api_url_of(api_name), stream, delay, tokens, interval)
            outcome = Outcome(planned, api_name, opened)
            try:
                status, text = planned.send(timeout=CLIENT_READ_TIMEOUT_S)
            except httpx.TimeoutException as exc:
                outcome.closed = time.time()
                outcome.kind, outcome.detail = "lost", repr(exc)
            except httpx.TransportError as exc:
                outcome.closed = time.time()
                outcome.kind, outcome.detail = "conn_error", repr(exc)
            else:
                outcome.closed = time.time()
                classify(outcome, status, text)
            with outcomes_lock:
                outcomes.append(outcome)
            if outcome.kind in ("error", "conn_error"):
                time.sleep(0.3)  # as a client honouring Retry-After would, briefly

    started = time.monotonic()
    with ThreadPoolExecutor(CLIENTS) as pool:
        futures = [pool.submit(client) for _ in range(CLIENTS)]
        try:
            chaos.run()
            time.sleep(1.0)  # a little traffic after the last fault too
        finally:
            stop_traffic.set()
        for future in futures:
            future.result()
    traffic_s = time.monotonic() - started
    chaos.check_alive()

    # --- the table ---------------------------------------------------------------------------------------
    requests = len(outcomes)
    counts = Counter(o.kind for o in outcomes)
    codes = Counter(o.code for o in outcomes if o.kind == "error")
    # What every fake provider process ran: those killed (their dumps), then the one serving now.
    executions = {p: [*(run for ran in chaos.dumps[p] for run in ran["executions"]), *f.executions()]
                  for p, f in fakes.items()}
    request_logs = [[r["body"] for r in ran["requests"]] for p in fakes for ran in chaos.dumps[p]]
    request_logs += [[r["body"] for r in f.requests()] for f in fakes.values()]
    stats_seen = [(p, ran["stats"]) for p in fakes for ran in chaos.dumps[p]]
    stats_seen += [(p, f.stats()) for p, f in fakes.items()]
    fake_ports = {p: f.port for p, f in fakes.items()}
    runs = runs_by_marker(executions)
    dup, explained_reruns = duplicates(runs, fake_ports, chaos.faults)
    # Continuations: calls whose request carries the answer so far, a trailing assistant message
    # (exact while no fake process's request log reached its limit of 1,000 requests).
    tokens_of = {plan[0]: plan[3] for plan in plans}
    continuation_bodies = [body for log in request_logs for body in log if isinstance(body, dict)
                           and body.get("messages") and body["messages"][-1].get("role") == "assistant"]
    logs_whole = all(len(log) < 1000 for log in request_logs)
    prefilled = Counter(body["user"] for body in continuation_bodies)
    bad_prefills = [f"{body['user']}: {why}" for body in continuation_bodies
                    if (why := prefill_problem(body, tokens_of[body["user"]]))]
    # A continuation is a re-run: one explained by the death of its previous run's worker or provider.
    unexplained_continuations = [f"{marker}: {n} call(s) with the answer so far, {explained_reruns[marker]} "
                                 f"explained re-run(s)"
                                 for marker, n in prefilled.items() if n > explained_reruns[marker]]
    base = min([o.opened for o in outcomes] + [f.start for f in chaos.faults])

    def when(o: Outcome) -> str:
        kind = "stream" if o.planned.stream else "json"
        return f"{kind} via {o.api_name}, open +{o.opened - base:.2f}s..+{o.closed - base:.2f}s"

    def runs_of(marker: str) -> str:
        return ", ".join(f"{p} port {r['client_port']} +{r['started'] - base:.2f}s..+{(r['ended'] or 0) - base:.2f}s "
                         f"{r['outcome']}" for p, r in runs.get(marker, []))

    counted = prefilled if logs_whole else None
    unexplained_answers = [f"{o.planned.marker} ({when(o)}; runs: {runs_of(o.planned.marker)}): {why}"
                           for o in outcomes if (why := unexplained(o, chaos.faults, runs, fake_ports, counted))]
    # Streams whose output had begun when a fault cut them: continued (to their end, or cut
    # again and ended with the error), or ended with the error at the cut.
    cut = [o for o in outcomes if o.planned.stream and (o.continued or (
        o.kind == "error" and o.code in ("200-stream worker_lost", "200-stream provider_error")))]
    cut_ok = [o for o in cut if o.kind == "ok"]
    cut_failed = [o for o in cut if o.kind != "ok"]
    cut_stuck = [o for o in cut_failed if o.kind == "error"
                 and could_not_go_on(o, chaos.faults, runs.get(o.planned.marker, [])) is not None]
    executed = Counter(run["marker"] for log in executions.values() for run in log)
    completed = {run["marker"] for log in executions.values() for run in log if run["outcome"] == "completed"}
    ok_without_a_run = [o.planned.marker for o in outcomes if o.kind == "ok" and o.planned.marker not in completed]
    rows = [
        ("requests", requests), ("answered 200", counts["ok"]),
        *((f"error {code}", n) for code, n in sorted(codes.items())),
        ("connection errors", counts["conn_error"]), ("lost", counts["lost"]),
        ("empty answers", counts["empty"]), ("corrupt answers", counts["corrupt"]),
        ("streams cut by a fault after output began", len(cut)),
        ("  continued to their end", len(cut_ok)),
        (f"  ({sum(o.continued for o in cut_ok)} continuations, at most "
         f"{max((o.continued for o in cut_ok), default=0)} in one)", None),
        ("  ended with an error", len(cut_failed)),
        ("    of them after a continuation", sum(o.continued > 0 for o in cut_failed)),
        ("    could not go on: Redis down or continuations used up", len(cut_stuck)),
        ("provider executions", sum(executed.values())),
        ("re-runs after their worker's death", explained_reruns["worker"]),
        ("re-runs after their provider's death", explained_reruns["provider"]),
        (f"continuations after a kill{'' if logs_whole else ' (at least: a request log was full)'}",
         len(continuation_bodies)),
        ("continuations with a wrong answer so far", len(bad_prefills)),
        ("continuations not explained by a kill", len(unexplained_continuations)),
        ("duplicated executions", len(dup)), ("unexplained answers", len(unexplained_answers)),
        ("  provider_error after a kill, not continued (should not happen)",
         sum(o.kind == "error" and o.code.endswith("provider_error") and o.continued < MAX_CONTINUATIONS
             for o in outcomes)),
        ("unexpected process deaths", len(chaos.unexpected_deaths)),
    ]
    faults = Counter(f.kind for f in chaos.faults)
    print(f"seed {SEED}: {traffic_s:.0f}s of traffic, faults {dict(faults)}")
    for fault in chaos.faults:
        print(f"  {fault.kind:<8} {fault.target:<14} at +{fault.start - base:5.2f}s until +{fault.end - base:5.2f}s"
              + (f", held ports {sorted(local for local, remote in fault.ports if remote in fake_ports.values())}"
                 if fault.kind == "worker" else "")
              + (f", cut calls from ports {sorted(client for client, _ in fault.ports)}"
                 if fault.kind == "provider" else ""))
    width = max(len(name) for name, _ in rows)
    for name, n in rows:
        print(f"  {name:<{width}}  {'' if n is None else n:>5}")
    for line in [*unexplained_answers, *dup, *bad_prefills, *unexplained_continuations, *chaos.unexpected_deaths]:
        print(f"  ! {line}")

    context = f"seed {SEED}\n{system.logs()}"
    assert counts["lost"] == 0, ([(o.planned.marker, o.detail) for o in outcomes if o.kind == "lost"], context)
    assert dup == [], (dup, context)
    assert counts["empty"] == 0, ([o.planned.marker for o in outcomes if o.kind == "empty"], context)
    assert counts["corrupt"] == 0, ([(o.planned.marker, o.detail) for o in outcomes if o.kind == "corrupt"],
                                    context)
    assert unexplained_answers == [], (unexplained_answers, context)
    assert bad_prefills == [], (bad_prefills, context)
    assert unexplained_continuations == [], (unexplained_continuations, context)
    assert ok_without_a_run == [], (ok_without_a_run, context)
    assert chaos.unexpected_deaths == [], (chaos.unexpected_deaths, context)

    # --- and afterwards -------------------------------------------------------------------------------------
    providers, models = list(NODES.values()), ["m"]
    try:
        system.wait_until("nothing left in Redis", lambda: not any(leftovers(system, providers, models).values()),
                          timeout=30)
    except TimeoutError:
        pytest.fail(f"left behind: {leftovers(system, providers, models)}\n{context}")
    for name, fake in fakes.items():
        stats = fake.stats()
        assert stats["in_flight"] == 0, (name, stats)
    for name, stats in stats_seen:  # every process of it, the killed ones up to their kill
        assert stats["max_in_flight"] <= CAPACITY, (name, stats, context)
    dead = [p.name for p in [*workers, *apis, *(f.proc for f in fakes.values())] if not p.alive()]
    assert dead == [], context
