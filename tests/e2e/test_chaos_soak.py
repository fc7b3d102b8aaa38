"""A bounded soak with random faults: JSON and streamed requests from a pool of client
threads, through two API processes, to two nodes of two workers each, while a seeded
schedule SIGKILLs and restarts workers, API processes and Redis (AOF, same port, outages
shorter than two leases, at least a lease apart) and stalls the providers.

Every request carries a marker (its ``user`` field) that the fake providers log with
each execution and the caller's TCP port; a killed worker's connections are read from
/proc while it is stopped, just before the kill. So each repeated execution is either
explained by the death of the very worker that ran the previous one, or it is a
duplicate.

It ends with a table of outcomes and asserts, exactly: nothing lost (every request got
an answer or, if its API process was killed while it was open, a dropped connection),
nothing duplicated, no empty and no corrupt answer, every error explained by a fault
while the request was open (``worker_lost``: the worker running it was killed;
``redis_unavailable``: Redis was down and the request had not reached a provider; see
``unexplained``), every 200 backed by a completed provider call, no process dead except
by the schedule's hand, and afterwards no slot, lease, queued job or job state left and
no provider ever over its capacity.

``IOP_CHAOS_SEED`` replays a schedule; otherwise a fresh seed is drawn and printed.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
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
FAULT_KINDS = ("worker", "api", "redis", "stall")


@dataclass
class Fault:
    kind: str
    target: str
    start: float  # wall clock: just before the kill / stall
    end: float = 0.0  # back up (restarted and ready) / stall released
    ports: set[tuple[int, int]] = field(default_factory=set)  # a killed worker's (local, remote) ports


@dataclass
class Outcome:
    planned: Planned
    api_name: str
    opened: float
    closed: float = 0.0
    kind: str = ""  # ok | error | empty | corrupt | conn_error | lost
    code: str = ""
    detail: str = ""


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
        # Every kind twice, one more at random, in a random order.
        kinds = [*FAULT_KINDS, *FAULT_KINDS, rng.choice(FAULT_KINDS)]
        rng.shuffle(kinds)
        self.schedule = kinds
        self.faults: list[Fault] = []
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
    if not payloads:
        outcome.kind = "empty"
        return
    done = payloads[-1] == "[DONE]"
    try:
        chunks = [json.loads(p) for p in (payloads[:-1] if done else payloads)]
        errors = [c["error"]["code"] for c in chunks if "error" in c]
        contents = [c["choices"][0]["delta"].get("content") for c in chunks if "error" not in c]
    except (ValueError, KeyError, IndexError, TypeError):
        outcome.kind, outcome.detail = "corrupt", text[-300:]
        return
    said = [c for c in contents if c]
    if said != pieces[:len(said)] or payloads.count("[DONE]") > int(done):
        outcome.kind, outcome.detail = "corrupt", f"content {said}, expected {pieces}"
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
    elif contents == ["", *pieces, None]:
        outcome.kind = "ok"
    else:
        outcome.kind, outcome.detail = "corrupt", f"chunks {contents}, expected {['', *pieces, None]}"


def overlaps(outcome: Outcome, fault: Fault) -> bool:
    return fault.start <= outcome.closed and (fault.end == 0.0 or fault.end >= outcome.opened)


Runs = dict[str, list[tuple[str, dict[str, Any]]]]  # marker -> (provider, execution), by start


def runs_by_marker(executions: dict[str, list[dict[str, Any]]]) -> Runs:
    by_marker: Runs = defaultdict(list)
    for provider, runs in executions.items():
        for run in runs:
            by_marker[run["marker"]].append((provider, run))
    for runs in by_marker.values():
        runs.sort(key=lambda pr: pr[1]["started"])
    return by_marker


def unexplained(outcome: Outcome, faults: list[Fault], runs: Runs, fake_ports: dict[str, int]) -> str | None:
    """Why an answer that is not a success is not explained by a fault, or None.

    * a dropped connection: its API process was killed while it was open;
    * ``worker_lost``: a worker that was running it (one of its provider calls came from
      that worker's sockets) was killed while it was open;
    * ``redis_unavailable``: Redis was down while it was open, and it had not reached a
      provider before it was answered (a dispatched request outlives an outage).
    """
    if outcome.kind == "conn_error":
        if any(f.kind == "api" and f.target == outcome.api_name and overlaps(outcome, f) for f in faults):
            return None
        return "connection error, but its API process was not killed while it was open"
    if outcome.kind != "error":
        return None
    code = outcome.code.split(" ", 1)[1]
    mine = runs.get(outcome.planned.marker, [])
    if code == "worker_lost":
        ports = {(run["client_port"], fake_ports[provider]) for provider, run in mine}
        if any(f.kind == "worker" and overlaps(outcome, f) and ports & f.ports for f in faults):
            return None
        return "worker_lost, but no worker running it was killed while it was open"
    if code == "redis_unavailable":
        if not any(f.kind == "redis" and overlaps(outcome, f) for f in faults):
            return "redis_unavailable, but Redis was up all the time it was open"
        started = [run["started"] for _, run in mine if run["started"] < outcome.closed]
        if started:
            return (f"redis_unavailable, although it was running at a provider since "
                    f"{outcome.closed - min(started):.2f}s before that answer")
        return None
    return f"{outcome.code}: no fault explains it"


def duplicates(runs: Runs, fake_ports: dict[str, int], faults: list[Fault]) -> tuple[list[str], int]:
    """Markers run again at a provider although the worker of the previous run did not die
    (between that run's start and the next one's); and the number of re-runs such a death explains."""
    kills = [f for f in faults if f.kind == "worker"]
    bad: list[str] = []
    explained = 0
    for marker, mine in runs.items():
        for (provider, prev), (_, nxt) in itertools.pairwise(mine):
            port = (prev["client_port"], fake_ports[provider])
            if any(port in k.ports and prev["started"] <= k.start <= nxt["started"] for k in kills):
                explained += 1
            else:
                bad.append(f"{marker}: {[(p, r['outcome'], round(r['started'], 2)) for p, r in mine]}")
    return bad, explained


# --- the soak ----------------------------------------------------------------------------------------------


def test_chaos_soak(aof_system: System) -> None:
    system = aof_system
    print(f"\nchaos soak seed {SEED} (IOP_CHAOS_SEED={SEED} replays it)")
    rng = random.Random(SEED)
    configure(system)
    fakes = {p: system.fake(p, "--models", f"served-{p}") for p in NODES.values()}
    for fake in fakes.values():
        fake.hooks(track_executions=True, body_overrides=True)
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
    executions = {p: f.executions() for p, f in fakes.items()}
    fake_ports = {p: f.port for p, f in fakes.items()}
    runs = runs_by_marker(executions)
    dup, explained_reruns = duplicates(runs, fake_ports, chaos.faults)
    base = min([o.opened for o in outcomes] + [f.start for f in chaos.faults])

    def when(o: Outcome) -> str:
        kind = "stream" if o.planned.stream else "json"
        return f"{kind} via {o.api_name}, open +{o.opened - base:.2f}s..+{o.closed - base:.2f}s"

    def runs_of(marker: str) -> str:
        return ", ".join(f"{p} port {r['client_port']} +{r['started'] - base:.2f}s..+{(r['ended'] or 0) - base:.2f}s "
                         f"{r['outcome']}" for p, r in runs.get(marker, []))

    unexplained_answers = [f"{o.planned.marker} ({when(o)}; runs: {runs_of(o.planned.marker)}): {why}"
                           for o in outcomes if (why := unexplained(o, chaos.faults, runs, fake_ports))]
    executed = Counter(run["marker"] for log in executions.values() for run in log)
    completed = {run["marker"] for log in executions.values() for run in log if run["outcome"] == "completed"}
    ok_without_a_run = [o.planned.marker for o in outcomes if o.kind == "ok" and o.planned.marker not in completed]
    rows = [
        ("requests", requests), ("answered 200", counts["ok"]),
        *((f"error {code}", n) for code, n in sorted(codes.items())),
        ("connection errors", counts["conn_error"]), ("lost", counts["lost"]),
        ("empty answers", counts["empty"]), ("corrupt answers", counts["corrupt"]),
        ("provider executions", sum(executed.values())), ("re-runs after their worker's death", explained_reruns),
        ("duplicated executions", len(dup)), ("unexplained errors", len(unexplained_answers)),
        ("unexpected process deaths", len(chaos.unexpected_deaths)),
    ]
    faults = Counter(f.kind for f in chaos.faults)
    print(f"seed {SEED}: {traffic_s:.0f}s of traffic, faults {dict(faults)}")
    for fault in chaos.faults:
        print(f"  {fault.kind:<6} {fault.target:<14} at +{fault.start - base:5.2f}s until +{fault.end - base:5.2f}s"
              + (f", held ports {sorted(local for local, remote in fault.ports if remote in fake_ports.values())}"
                 if fault.kind == "worker" else ""))
    width = max(len(name) for name, _ in rows)
    for name, n in rows:
        print(f"  {name:<{width}}  {n:>5}")
    for line in [*unexplained_answers, *dup, *chaos.unexpected_deaths]:
        print(f"  ! {line}")

    context = f"seed {SEED}\n{system.logs()}"
    assert counts["lost"] == 0, ([(o.planned.marker, o.detail) for o in outcomes if o.kind == "lost"], context)
    assert dup == [], (dup, context)
    assert counts["empty"] == 0, ([o.planned.marker for o in outcomes if o.kind == "empty"], context)
    assert counts["corrupt"] == 0, ([(o.planned.marker, o.detail) for o in outcomes if o.kind == "corrupt"],
                                    context)
    assert unexplained_answers == [], (unexplained_answers, context)
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
        assert stats["max_in_flight"] <= CAPACITY, (name, stats, context)
    dead = [p.name for p in [*workers, *apis, *(f.proc for f in fakes.values())] if not p.alive()]
    assert dead == [], context
