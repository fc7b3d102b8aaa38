"""Multi-tenant flow control in numbers: a noisy neighbour, weighted shares, priority
bands, the same through three API replicas, and what flow control costs Redis.

    python -m bench.fairness [--part all|noisy|weights|priority|replicas|cost] [--seconds 60]

The HTTP parts run real processes: a private redis-server, two fake providers on two
nodes (capacity 4 each: 8 slots in all) that answer after a fixed service time
(``--service-ms``, 100), one worker per node and one API process (three in the
replicas part, the clients taking them in turn). Tenants are named keys (``api.keys``,
given by ``key_sha256``); a request's queue wait is the ``x-iop-queue-ms`` of its answer,
Redis time from submit to dispatch, so the load generator's own delays are not in it.

* noisy: tenant A sends ``--flood`` (1,000) requests at once, tenant B one every
  ``--interval-ms`` (200) for as long as A's flood lasts. B's waits under plain FIFO (A and
  B present the same key: one tenant, flow control off) and under fair queuing (two
  tenants, weight 1 each).
* weights: tenants of weight 3 and 1, 16 closed-loop clients each, so that both always
  have requests waiting (sampled from Redis every 250 ms); the answers each got in a
  ``--seconds`` window after a warm-up.
* priority: a batch tenant (band ``batch``) keeps 32 requests in the pool (its first 8
  clients start spread over one service time, as the slots of a busy pool free at
  different moments; a third run starts them together, so that the slots free in lockstep);
  an interactive tenant (band ``interactive``) sends one request every ``--interval-ms``
  for ``--probe-seconds``. Its waits under FIFO (one key, no bands) and with the bands.
* replicas: noisy (fair), weights and priority (bands) again through 3 API processes,
  against the one-process figures.
* cost: no HTTP; the scripts driven directly, as bench/queue_depth.py does. One provider
  of capacity 1 holds its slot and ``--depth`` (20,000) jobs wait, spread over 1, 100 or
  10,000 tenants (flow control on) or in one plain FIFO lane (flow control off). Then
  ``--calls`` submits by tenants taken in turn (cancelled afterwards, untimed), and as many
  ``finish`` calls, each of which releases the slot and dispatches the next job. Redis time
  per call is INFO commandstats' usec_per_call for EVALSHA; each figure is the median of
  ``--repeat`` (3) interleaved rounds.

Waits alone cannot tell the scheduler from the machine (a worker that gets no CPU frees its
slot late), so the noisy and priority parts also read every dispatch off the node streams
(plain XREAD beside the workers' group, before ``finish`` deletes the entry) and count,
for each probe request, the other tenant's dispatches between its submit and its own
dispatch: under FIFO the backlog ahead of it; under fair queuing no more than the probe
tenant's own requests waiting at the same time (its later ones share 1 : 1 with A's); with
bands, none.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import aiohttp
import uvloop
from redis.asyncio import Redis

from bench.stack import Stack, markdown_table, percentile, write_section
from dispatcher import config as cfg
from dispatcher import keys
from dispatcher.api_side import ApiSide
from dispatcher.events import Assignment
from dispatcher.plans import Plans
from dispatcher.redis_conn import connect, connect_fast
from dispatcher.script_calls import CancelReason, ScriptCalls
from dispatcher.scripts import Scripts
from dispatcher.tenants import Tenant
from dispatcher.worker_side import WorkerSide
from iop.processes import wait_port
from iop.redis_server import RedisServer, free_port

COMMAND = "python -m bench.fairness"
MODEL = "bench"
BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()


def body_of(tenant: str) -> bytes:
    """A request body that names its sender (``user``), so a dispatch can be told apart even
    when both senders present the same key."""
    return json.dumps({"model": MODEL, "user": tenant, "messages": [{"role": "user", "content": "hi"}]}).encode()
PARTS = ("noisy", "weights", "priority", "replicas", "cost")
SLOTS_PER_PROVIDER = 4  # two providers: 8 slots


def key_of(tenant: str) -> str:
    return f"bench-key-{tenant}"


def sha256_hex(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


# --- the processes ---------------------------------------------------------------------------


@dataclass
class FairStack(Stack):
    """Stack with named keys, priority bands, one node per fake and ``replicas`` API processes
    (each on its own port)."""

    tenants: list[dict[str, Any]] = field(default_factory=list)  # api.keys entries without the key
    priorities: list[str] = field(default_factory=list)
    replicas: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        self.api_ports = [self.api_port, *(free_port() for _ in range(self.replicas - 1))]
        self.api_urls = [f"http://127.0.0.1:{port}" for port in self.api_ports]

    def config(self) -> dict[str, Any]:
        api: dict[str, Any] = {"keys": [{**t, "key_sha256": sha256_hex(key_of(t["name"]))} for t in self.tenants]}
        if self.priorities:
            api["priorities"] = self.priorities
        return {
            "api": api,
            "queue": {"max_queue": 5000, "queue_timeout_ms": 600_000},
            "models": [{"id": MODEL, "providers": {f"p-{name}": f"served-{name}" for name in self.fakes}}],
            "nodes": [{"id": node, "providers": [
                {"id": f"p-{name}", "type": "vllm", "base_url": self.fake_url(name), "capacity": self.capacity,
                 "models": [f"served-{name}"]}]}
                for name, node in zip(self.fakes, self.nodes(), strict=True)],
        }

    def nodes(self) -> list[str]:
        return [f"n-{name}" for name in self.fakes]

    def __enter__(self) -> FairStack:
        cfg.parse(self.config())  # a config mistake fails here, not in a child process
        super().__enter__()
        return self

    def _start_iop(self, config_path: Path, env: dict[str, str]) -> None:
        for name in self.fakes:
            self._spawn(f"worker-{name}", ["worker", "--config", str(config_path), "--node", f"n-{name}",
                                           "--log-level", "warning"], env)  # n-<name>: see nodes()
        apis = [self._spawn(f"api-{i}", ["api", "--config", str(config_path), "--port", str(port), "--workers", "1",
                                         "--log-level", "warning"], env)
                for i, port in enumerate(self.api_ports)]
        for api, port in zip(apis, self.api_ports, strict=True):
            wait_port(api, "127.0.0.1", port)


def stack(service_ms: int, tenants: list[dict[str, Any]], priorities: list[str] | None = None,
          replicas: int = 1) -> FairStack:
    fake = ["--delay-ms", str(service_ms), "--tokens", "8"]
    return FairStack({"a": fake, "b": fake}, capacity=SLOTS_PER_PROVIDER, tenants=tenants,
                     priorities=priorities or [], replicas=replicas)


# --- the clients -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Answer:
    tenant: str
    sent: float  # seconds since the load started
    done: float
    status: int
    queue_ms: float  # x-iop-queue-ms


class Load:
    """HTTP clients over a stack's API processes (taken in turn), on one clock."""

    def __init__(self, session: aiohttp.ClientSession, urls: list[str]) -> None:
        self.session = session
        self.urls = [f"{u}/v1/chat/completions" for u in urls]
        self._turn = itertools.count()
        self.t0 = time.perf_counter()
        self.answers: list[Answer] = []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def call(self, tenant: str, key: str) -> Answer:
        url = self.urls[next(self._turn) % len(self.urls)]
        sent = self.now()
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        try:
            async with self.session.post(url, data=body_of(tenant), headers=headers) as resp:
                await resp.read()
                answer = Answer(tenant, sent, self.now(), resp.status,
                                float(resp.headers.get("x-iop-queue-ms", "nan")))
        except aiohttp.ClientError:  # counted as status 0: it did not get an answer
            answer = Answer(tenant, sent, self.now(), 0, math.nan)
        self.answers.append(answer)
        return answer

    async def closed_loop(self, tenant: str, key: str, stop: asyncio.Event, delay: float = 0.0) -> None:
        """One client: a request, its answer, the next request, until ``stop``."""
        await asyncio.sleep(delay)
        while not stop.is_set():
            await self.call(tenant, key)

    async def paced(self, tenant: str, key: str, interval: float, until: Callable[[], bool]) -> list[Answer]:
        """One request every ``interval`` seconds (whether or not the last one was answered)
        until ``until()``; their answers."""
        tasks = []
        start = time.perf_counter()
        for k in itertools.count(1):
            if until():
                break
            tasks.append(asyncio.create_task(self.call(tenant, key)))
            await asyncio.sleep(max(0.0, start + k * interval - time.perf_counter()))
        return list(await asyncio.gather(*tasks))

    def errors(self) -> Counter[int]:
        return Counter(a.status for a in self.answers if a.status != 200)


@dataclass(frozen=True, slots=True)
class Dispatch:
    sender: str
    fence: int  # dispatch order (one counter for the whole fleet)
    t0: int  # submitted, Redis ms
    t1: int  # dispatched


class DispatchLog:
    """Every dispatch, read off the node streams (plain XREAD, beside the workers' group)
    before the workers' ``finish`` deletes the entries: who was dispatched, in what order."""

    def __init__(self, url: str, nodes: list[str]) -> None:
        self.redis = Redis.from_url(url)
        self.last = {keys.node(n): "0-0" for n in nodes}
        self.seen: dict[str, Dispatch] = {}
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> DispatchLog:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.sleep(0.2)
        self._stop.set()
        if self._task is not None:
            await self._task
        await self.redis.aclose()

    def clear(self) -> None:
        self.seen.clear()

    async def _run(self) -> None:
        while not self._stop.is_set():
            got = cast(list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]],
                       await self.redis.xread(self.last, count=10_000, block=20))  # type: ignore[arg-type]
            for stream, entries in got:
                for entry_id, fields in entries:
                    self.last[stream.decode()] = entry_id.decode()
                    sender = json.loads(fields[b"body"]).get("user", "?")
                    self.seen[fields[b"job"].decode()] = Dispatch(
                        sender, int(fields[b"fence"]), int(fields[b"submitted_ms"]), int(fields[b"dispatched_ms"]))

    def overtaken(self, waiting: str, other: str) -> list[int]:
        """For each dispatch of ``waiting``: how many of ``other`` were dispatched after it was
        submitted (in a later millisecond) and before it."""
        mine = [d for d in self.seen.values() if d.sender == waiting]
        theirs = [d for d in self.seen.values() if d.sender == other]
        return [sum(1 for o in theirs if d.t0 < o.t1 and o.fence < d.fence) for d in mine]


def session() -> aiohttp.ClientSession:
    # Idle connections are dropped after 2 s, before the server's keep-alive timeout (uvicorn: 5 s)
    # can close one under a request.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0),
                                 timeout=aiohttp.ClientTimeout(total=None))


async def warm_up(load: Load, tenant_keys: list[str]) -> None:
    """A few answers per key first: connections, scripts and code paths warm."""
    await asyncio.gather(*(load.call("warm-up", k) for k in tenant_keys for _ in range(8)))
    load.answers.clear()


def waits(answers: list[Answer]) -> list[float]:
    return [a.queue_ms for a in answers if a.status == 200]


@dataclass
class Waits:
    """Queue waits of the probing tenant's requests (ms)."""

    values: list[float]
    errors: Counter[int]
    extra: float = math.nan  # the flood's drain time (noisy), batch answers/s (priority)
    overtaken: list[int] = field(default_factory=list)  # the other's dispatches while each one waited
    missed: int = 0  # dispatches the log did not see (the entry was gone before it read it)

    @property
    def p50(self) -> float:
        return percentile(self.values, 50)

    @property
    def p99(self) -> float:
        return percentile(self.values, 99)

    @property
    def max(self) -> float:
        return max(self.values, default=math.nan)


def report_errors(what: str, errors: Counter[int]) -> None:
    if errors:
        print(f"  !! {what}: answers that were not 200: {dict(errors)}")


# --- noisy neighbour -------------------------------------------------------------------------


async def noisy(args: argparse.Namespace, fair: bool, replicas: int = 1) -> Waits:
    tenants = [{"name": "a"}, {"name": "b"}] if fair else [{"name": "shared"}]
    key_a, key_b = (key_of("a"), key_of("b")) if fair else (key_of("shared"), key_of("shared"))
    with stack(args.service_ms, tenants, replicas=replicas) as s:
        async with session() as http, DispatchLog(s.redis_server.url, s.nodes()) as log:
            load = Load(http, s.api_urls)
            await warm_up(load, [key_a, key_b])
            log.clear()
            started = load.now()
            flood = asyncio.gather(*(load.call("a", key_a) for _ in range(args.flood)))
            b = await load.paced("b", key_b, args.interval_ms / 1000, flood.done)
            a = await flood
            drained = max(x.done for x in a) - started
    result = Waits(waits(b), load.errors(), drained, log.overtaken("b", "a"), len(a) + len(b) - len(log.seen))
    report_errors("noisy", result.errors)
    slowest = ", ".join(f"{x.queue_ms:.0f} ms sent at {x.sent - started:.1f} s"
                        for x in sorted(b, key=lambda x: -x.queue_ms)[:3])
    print(f"  noisy {'fair' if fair else 'FIFO'} x{replicas}: B n={len(result.values)} p50={result.p50:.0f} "
          f"p99={result.p99:.0f} max={result.max:.0f} ms (slowest: {slowest}); A's flood answered in "
          f"{drained:.1f} s; A dispatched while a B waited: max {max(result.overtaken, default=0)} "
          f"(dispatches not logged: {result.missed})")
    return result


# --- weights ---------------------------------------------------------------------------------


@dataclass
class Shares:
    done: dict[str, int]
    window: float
    fewest_waiting: dict[str, int]
    errors: Counter[int]

    @property
    def ratio(self) -> float:
        return self.done["heavy"] / self.done["light"] if self.done["light"] else math.inf

    @property
    def heavy_share(self) -> float:
        return self.done["heavy"] / max(1, self.done["heavy"] + self.done["light"])


async def weights(args: argparse.Namespace, replicas: int = 1, clients: int = 16) -> Shares:
    tenants = [{"name": "heavy", "weight": 3}, {"name": "light", "weight": 1}]
    with stack(args.service_ms, tenants, replicas=replicas) as s:
        redis = Redis.from_url(s.redis_server.url)
        async with session() as http:
            load = Load(http, s.api_urls)
            await warm_up(load, [key_of("heavy"), key_of("light")])
            stop = asyncio.Event()
            loops = [asyncio.create_task(load.closed_loop(t, key_of(t), stop))
                     for t in ("heavy", "light") for _ in range(clients)]
            await asyncio.sleep(3.0)  # both backlogged, the slots taken
            w0 = load.now()
            fewest = {"heavy": 10**9, "light": 10**9}
            while load.now() < w0 + args.seconds:
                raw = await redis.hmget(keys.TENANTS, ["q:heavy", "q:light"])
                for name, value in zip(("heavy", "light"), raw, strict=True):
                    fewest[name] = min(fewest[name], int(value or 0))
                await asyncio.sleep(0.25)
            w1 = load.now()
            stop.set()
            await asyncio.gather(*loops)
        await redis.aclose()
    done = Counter(a.tenant for a in load.answers if a.status == 200 and w0 <= a.done < w1)
    result = Shares({"heavy": done["heavy"], "light": done["light"]}, w1 - w0, fewest, load.errors())
    report_errors("weights", result.errors)
    print(f"  weights x{replicas}: {result.done} in {result.window:.1f} s, ratio {result.ratio:.3f}, "
          f"fewest waiting {fewest}")
    return result


# --- priority --------------------------------------------------------------------------------


async def priority(args: argparse.Namespace, banded: bool, replicas: int = 1, lockstep: bool = False,
                   clients: int = 32) -> Waits:
    if banded:
        tenants = [{"name": "web", "priority": "interactive"}, {"name": "batch", "priority": "batch"}]
        key_web, key_batch = key_of("web"), key_of("batch")
        bands = ["interactive", "standard", "batch"]
    else:
        tenants, bands = [{"name": "shared"}], []
        key_web = key_batch = key_of("shared")
    service = args.service_ms / 1000
    slots = 2 * SLOTS_PER_PROVIDER
    with stack(args.service_ms, tenants, bands, replicas) as s:
        async with session() as http, DispatchLog(s.redis_server.url, s.nodes()) as log:
            load = Load(http, s.api_urls)
            await warm_up(load, [key_web, key_batch])
            stop = asyncio.Event()
            # The first `slots` clients take the slots one after another over a service time
            # (or all at once: lockstep), the rest queue behind them.
            delays = [0.0 if lockstep else min(i, slots) * service / slots for i in range(clients)]
            loops = [asyncio.create_task(load.closed_loop("batch", key_batch, stop, d)) for d in delays]
            await asyncio.sleep(service + 1.0)
            log.clear()
            started = load.now()
            end = started + args.probe_seconds
            web = await load.paced("web", key_web, args.interval_ms / 1000, lambda: load.now() >= end)
            stopped = load.now()
            stop.set()
            await asyncio.gather(*loops)
    batch_rate = sum(1 for a in load.answers if a.tenant == "batch" and started <= a.done < stopped) / (
        stopped - started)
    overtaken = log.overtaken("web", "batch")
    missed = len(web) - sum(1 for d in log.seen.values() if d.sender == "web")
    result = Waits(waits(web), load.errors(), batch_rate, overtaken, missed)
    report_errors("priority", result.errors)
    print(f"  priority {'bands' if banded else 'FIFO'}{' lockstep' if lockstep else ''} x{replicas}: "
          f"web n={len(result.values)} p50={result.p50:.0f} p99={result.p99:.0f} max={result.max:.0f} ms; "
          f"batch {batch_rate:.1f} answers/s; batch dispatched while a web request waited: max "
          f"{max(overtaken, default=0)} (web dispatches not logged: {missed})")
    return result


# --- cost ------------------------------------------------------------------------------------


async def usec_per_call(redis: Redis) -> float:
    info = await redis.info("commandstats")
    return float(info["cmdstat_evalsha"]["usec_per_call"])


@dataclass
class Cost:
    submit_us: float  # Redis time per submit
    finish_us: float  # Redis time per finish that dispatches the next job
    submit_p50_us: float  # the client's round trip
    finish_p50_us: float


async def cost(active: int | None, depth: int, calls: int) -> Cost:
    """``active`` tenants with waiting jobs under flow control; None: flow control off."""
    names = [f"t{i}" for i in range(max(active or 1, 2))]
    data: dict[str, Any] = {
        "queue": {"max_queue": 10**7, "queue_timeout_ms": 3_600_000},
        "models": [{"id": "m", "providers": {"p": "s"}}],
        "nodes": [{"id": "n1", "providers": [
            {"id": "p", "type": "vllm", "base_url": "http://x", "capacity": 1, "models": ["s"]}]}],
    }
    if active is not None:  # every tenant a key of the config (at least two: flow control is on)
        data["api"] = {"keys": [{"name": n, "key_sha256": f"{i:064x}"} for i, n in enumerate(names)]}
    config = cfg.parse(data).config
    tenants: list[Tenant | None] = [Tenant(n, 0) for n in names[:active]] if active is not None else [None]

    def job(prefix: str, i: int) -> tuple[str, Tenant | None]:
        tenant = tenants[i % len(tenants)]
        return (tenant.job_id(f"{prefix}{i}") if tenant else f"{prefix}{i}"), tenant

    with RedisServer() as server:
        redis, fast = connect(server.url), connect_fast(server.url)
        scripts = Scripts(redis, fast)
        calls_ = ScriptCalls(scripts, config, Plans(config))
        assert calls_.plans.fair == (active is not None)
        api = ApiSide(calls_, redis, "bench")
        node = WorkerSide(lambda: calls_, redis, "n1", fast)
        lane = calls_.plans.main_lane("m")
        await scripts.load()
        await node.heartbeat("p", "available", [("capacity", 1)])
        holder, tenant = job("holder", 0)
        await api.submit(holder, lane, BODY, "chat/completions", False, tenant=tenant)
        for start in range(0, depth, 1000):  # a thousand submits per write
            await asyncio.gather(*(api.submit(j, lane, BODY, "chat/completions", False, tenant=t)
                                   for j, t in (job("q", i) for i in range(start, min(start + 1000, depth)))))
        assert await redis.zcard(lane.queue) == depth

        # The provider's heartbeat is renewed before each timed phase (it lives heartbeat_ttl_ms):
        # an expired one takes no dispatches.
        await node.heartbeat("p", "available", [("capacity", 1)])
        await redis.config_resetstat()
        submit_rt, sent = [], []
        for i in range(calls):
            j, t = job("s", i)
            began = time.perf_counter()
            await api.submit(j, lane, BODY, "chat/completions", False, tenant=t)
            submit_rt.append(time.perf_counter() - began)
            sent.append(j)
        submit_us = await usec_per_call(redis)
        for j in sent:
            await api.cancel(j, lane.queue, CancelReason.CLIENT)

        await node.heartbeat("p", "available", [("capacity", 1)])
        await redis.config_resetstat()
        finish_rt = []
        for _ in range(min(calls, depth)):
            entries = cast(list[tuple[bytes, dict[bytes, bytes]]], await redis.xrange(keys.node("n1"), count=1))
            assignment = Assignment.from_entry(*entries[0])
            began = time.perf_counter()
            await node.finish(assignment, b"")
            finish_rt.append(time.perf_counter() - began)
        finish_us = await usec_per_call(redis)
        await fast.close()
        await redis.aclose()
    return Cost(submit_us, finish_us, statistics.median(submit_rt) * 1e6, statistics.median(finish_rt) * 1e6)


# --- the tables ------------------------------------------------------------------------------


def ms(x: float) -> str:
    return f"{x:,.0f}"


def overtaken(w: Waits) -> str:
    if not w.overtaken:
        return "-"
    text = f"{percentile([float(n) for n in w.overtaken], 50):,.0f} / {max(w.overtaken):,}"
    return text + (f" ({w.missed} dispatches not seen)" if w.missed else "")


def pct(new: float, base: float) -> str:
    return f"{(new / base - 1) * 100:+.1f}%"


def verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


@dataclass
class Results:
    noisy: dict[tuple[str, int], Waits] = field(default_factory=dict)  # (FIFO|fair, replicas)
    weights: dict[int, Shares] = field(default_factory=dict)
    priority: dict[tuple[str, int], Waits] = field(default_factory=dict)  # (FIFO|bands|lockstep, replicas)
    cost: dict[int | None, Cost] = field(default_factory=dict)
    depth: int = 0


Row = list[str]


def noisy_table(r: Results, args: argparse.Namespace, targets: list[Row]) -> str:
    rows = [[mode, str(n), str(len(w.values)), ms(w.p50), ms(w.p99), ms(w.max), overtaken(w), f"{w.extra:.1f}"]
            for (mode, n), w in r.noisy.items()]
    if ("fair", 1) in r.noisy:
        p99, limit = r.noisy[("fair", 1)].p99, 2 * args.service_ms
        fifo = f" (FIFO: {ms(r.noisy[('FIFO', 1)].p99)} ms)" if ("FIFO", 1) in r.noisy else ""
        targets.append([f"noisy neighbour: B's p99 wait ≤ 2 service times ({limit} ms) with fair queuing",
                        f"{ms(p99)} ms{fifo}", verdict(p99 <= limit)])
    return (f"Noisy neighbour: A sends {args.flood:,} requests at once, B one every {args.interval_ms} ms while A's "
            f"flood lasts; 8 slots, {args.service_ms} ms per request.\n\n" + markdown_table(
                ["dispatch", "API processes", "B requests", "B wait p50 ms", "B wait p99 ms", "B wait max ms",
                 "A's dispatched while a B waited: p50 / max", "A's flood answered in s"], rows))


def weights_table(r: Results, targets: list[Row]) -> str:
    rows = [[str(n), f"{sh.window:.1f}", f"{sh.done['heavy']:,}", f"{sh.done['light']:,}",
             f"{sh.heavy_share * 100:.2f}%", f"{sh.ratio:.3f} : 1", pct(sh.ratio, 3.0),
             f"{sh.fewest_waiting['heavy']} / {sh.fewest_waiting['light']}"]
            for n, sh in r.weights.items()]
    if 1 in r.weights:
        ratio = r.weights[1].ratio
        targets.append(["weights 3 : 1 get slots within 5% of 3 : 1", f"{ratio:.3f} : 1 ({pct(ratio, 3.0)})",
                        verdict(abs(ratio / 3 - 1) <= 0.05)])
    return ("Weights: tenants of weight 3 and 1, 16 closed-loop clients each; answers in the window (and the fewest "
            "requests each had waiting, sampled every 250 ms).\n\n" + markdown_table(
                ["API processes", "window s", "weight 3 answered", "weight 1 answered", "weight 3's share", "ratio",
                 "off 3 : 1 by", "fewest waiting (w3 / w1)"], rows))


def priority_table(r: Results, args: argparse.Namespace, targets: list[Row]) -> str:
    rows = [[mode, str(n), str(len(w.values)), ms(w.p50), ms(w.p99), ms(w.max), overtaken(w), f"{w.extra:.1f}"]
            for (mode, n), w in r.priority.items()]
    if ("bands", 1) in r.priority:
        p99 = r.priority[("bands", 1)].p99
        fifo = f" (FIFO: {ms(r.priority[('FIFO', 1)].p99)} ms)" if ("FIFO", 1) in r.priority else ""
        targets.append([f"priority: interactive p99 wait ≤ one service time ({args.service_ms} ms)",
                        f"{ms(p99)} ms{fifo}", verdict(p99 <= args.service_ms)])
    return (f"Priority: a batch tenant keeps 32 requests in the pool; an interactive tenant sends one every "
            f"{args.interval_ms} ms for {args.probe_seconds:g} s.\n\n" + markdown_table(
                ["dispatch", "API processes", "interactive requests", "wait p50 ms", "wait p99 ms", "wait max ms",
                 "batch dispatched while one waited: p50 / max", "batch answers/s"], rows))


def replicas_table(r: Results, service_ms: int, targets: list[Row]) -> str:
    rows: list[Row] = []
    off: dict[str, float] = {}  # kind of figure -> largest relative difference
    off_service = 0.0  # largest difference of a wait, in service times

    def compare(kind: str, what: str, one: float, three: float, fmt: Callable[[float], str]) -> None:
        nonlocal off_service
        in_service = "-"
        if kind == "waits":
            off_service = max(off_service, abs(three - one) / service_ms)
            in_service = f"{abs(three - one) / service_ms * 100:.0f}%"
        rows.append([what, fmt(one), fmt(three), f"{fmt(three - one)} ({pct(three, one)})", in_service])
        off[kind] = max(off.get(kind, 0.0), abs(three / one - 1))

    share = "weights: weight 3's share"
    if 1 in r.weights and 3 in r.weights:
        compare("shares", share, r.weights[1].heavy_share, r.weights[3].heavy_share, lambda x: f"{x * 100:.2f}%")
    for part, mode, who in ((r.noisy, "fair", "noisy neighbour: B"), (r.priority, "bands", "priority: interactive")):
        if (mode, 1) in part and (mode, 3) in part:
            one, three = part[(mode, 1)], part[(mode, 3)]
            compare("waits", f"{who} wait p50 ms", one.p50, three.p50, ms)
            compare("waits", f"{who} wait p99 ms", one.p99, three.p99, ms)
    if not rows:
        return ""
    for kind, worst in off.items():
        extra = f" ({off_service * 100:.0f}% of a service time)" if kind == "waits" else ""
        targets.append([f"3 API replicas: the same {kind} (within 5%)",
                        f"largest difference {worst * 100:.1f}%{extra}", verdict(worst <= 0.05)])
    return "One API process against three (the clients take them in turn).\n\n" + markdown_table(
        ["figure", "1 API process", "3 API processes", "difference", "difference / service time"], rows)


def cost_table(r: Results, targets: list[Row]) -> str:
    base = r.cost.get(None)
    rows = []
    for active, c in r.cost.items():
        fair = base is not None and active is not None
        rows.append(["off (one FIFO lane)" if active is None else f"on, {active:,} tenants",
                     f"{c.submit_us:.1f}", pct(c.submit_us, base.submit_us) if base and fair else "-",
                     f"{c.finish_us:.1f}", pct(c.finish_us, base.finish_us) if base and fair else "-",
                     ms(c.submit_p50_us), ms(c.finish_p50_us)])
    over = [max(c.submit_us / base.submit_us, c.finish_us / base.finish_us) - 1
            for a, c in r.cost.items() if base and a is not None]
    if over:
        targets.append(["cost with 1 / 100 / 10,000 tenants within 20% of a single FIFO",
                        f"at most {max(over) * 100:+.0f}%", verdict(max(over) <= 0.20)])
    return (f"Cost: {r.depth:,} jobs waiting, spread over the active tenants; Redis time per script call (INFO "
            "commandstats), the median of the rounds.\n\n" + markdown_table(
                ["flow control", "submit µs in Redis", "vs FIFO", "finish + dispatch µs in Redis", "vs FIFO",
                 "submit p50 µs (client)", "finish p50 µs (client)"], rows))


def tables(r: Results, args: argparse.Namespace) -> str:
    targets: list[Row] = []
    out = [noisy_table(r, args, targets) if r.noisy else "",
           weights_table(r, targets) if r.weights else "",
           priority_table(r, args, targets) if r.priority else "",
           replicas_table(r, args.service_ms, targets),
           cost_table(r, targets) if r.cost else ""]
    failed = [f"{part} {mode}, {n} API process(es): {dict(errors)}"
              for part, runs in (("noisy", r.noisy), ("priority", r.priority))
              for (mode, n), errors in ((k, w.errors) for k, w in runs.items()) if errors]
    failed += [f"weights, {n} API process(es): {dict(sh.errors)}" for n, sh in r.weights.items() if sh.errors]
    if failed:  # status 0: no answer (a connection error)
        out.append("Answers that were not 200 (status: count): " + "; ".join(failed) + ".\n")
    return "\n".join([markdown_table(["target", "measured", ""], targets), *(t for t in out if t)])


async def main(args: argparse.Namespace) -> Results:
    parts = PARTS if args.part == "all" else (args.part,)
    r = Results(depth=args.depth)
    if "noisy" in parts:
        r.noisy[("FIFO", 1)] = await noisy(args, fair=False)
        r.noisy[("fair", 1)] = await noisy(args, fair=True)
    if "weights" in parts:
        r.weights[1] = await weights(args)
    if "priority" in parts:
        r.priority[("FIFO", 1)] = await priority(args, banded=False)
        r.priority[("bands", 1)] = await priority(args, banded=True)
        r.priority[("bands, slots in lockstep", 1)] = await priority(args, banded=True, lockstep=True)
    if "replicas" in parts:
        if ("fair", 1) not in r.noisy:
            r.noisy[("fair", 1)] = await noisy(args, fair=True)
        r.noisy[("fair", 3)] = await noisy(args, fair=True, replicas=3)
        if 1 not in r.weights:
            r.weights[1] = await weights(args)
        r.weights[3] = await weights(args, replicas=3)
        if ("bands", 1) not in r.priority:
            r.priority[("bands", 1)] = await priority(args, banded=True)
        r.priority[("bands", 3)] = await priority(args, banded=True, replicas=3)
    if "cost" in parts:
        runs: dict[int | None, list[Cost]] = {}
        for _ in range(args.repeat):  # interleaved rounds: the machine's noise falls on every row alike
            for active in (None, 1, 100, 10_000):
                runs.setdefault(active, []).append(c := await cost(active, args.depth, args.calls))
                print(f"  cost {'FIFO' if active is None else f'{active} tenants'}: submit {c.submit_us:.1f} µs, "
                      f"finish {c.finish_us:.1f} µs in Redis")
        r.cost = {active: Cost(*(statistics.median(getattr(c, f) for c in cs) for f in Cost.__dataclass_fields__))
                  for active, cs in runs.items()}
    return r


def command(args: argparse.Namespace) -> str:
    flags = [f"--part {args.part}"] if args.part != "all" else []
    if args.part in ("all", "weights", "replicas"):
        flags.append(f"--seconds {args.seconds:g}")
    return " ".join([COMMAND, *flags])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("all", *PARTS), default="all")
    parser.add_argument("--seconds", type=float, default=60.0, help="the weights window")
    parser.add_argument("--service-ms", type=int, default=100, help="the fake providers' service time")
    parser.add_argument("--flood", type=int, default=1000, help="noisy: requests tenant A sends at once")
    parser.add_argument("--interval-ms", type=int, default=200, help="noisy, priority: the probing tenant's pace")
    parser.add_argument("--probe-seconds", type=float, default=15.0, help="priority: how long the probing lasts")
    parser.add_argument("--depth", type=int, default=20_000, help="cost: jobs waiting")
    parser.add_argument("--calls", type=int, default=2000, help="cost: timed calls of each script")
    parser.add_argument("--repeat", type=int, default=3, help="cost: interleaved rounds (each figure their median)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = parser.parse_args()
    uvloop.install()
    results = asyncio.run(main(args))
    table = tables(results, args)
    print(table)
    if not args.no_write:
        write_section(
            "fairness", command(args), table,
            "Queue waits are the answers' `x-iop-queue-ms` (Redis time from submit to dispatch). Two fake "
            f"providers of 4 slots each answer after {args.service_ms} ms; a worker per node; the load generator, "
            "the fakes, the workers, the API processes and Redis share the machine's 2 cores.\n")
