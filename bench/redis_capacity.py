"""How far one Redis shard goes: Redis CPU per request, and what ``WAIT`` after a submit costs.

    python -m bench.redis_capacity [--seconds 8] [--callers 128] [--chunks 20] [--no-stack]
    python -m bench.redis_capacity --dispatch-cost [--cost-calls 2000] [--cost-repeat 3]

iop keeps every key under the hash tag ``{iop}``, so the whole fleet lives on one Redis
shard and every Lua script runs on that shard's one main thread. This benchmark drives
the real request path straight from Python -- no HTTP, no provider -- so that Redis is
the thing measured:

1. **Redis CPU per request.** Simulated API processes (each with its own request-path
   connection and a ``ReplyReader`` on its reply stream: the API's code) and simulated
   node workers (each reading its node stream with ``XREADGROUP`` and writing through
   ``RedisSink`` and ``WorkerSide``: the worker's code) make many requests at once:
   ``submit`` (which dispatches when a slot is free), the worker's read of the dispatch,
   then ``finish`` with the JSON answer -- or, for a stream, ``emit`` with the first chunk,
   one ``XADD`` per later chunk event, then ``finish``. The redis-server's user+system CPU
   (INFO cpu) over the run, divided by the requests completed, is the Redis CPU per
   request; ``1e6 /`` that is what one shard core serves at 100%. INFO commandstats over
   the same run splits the time spent inside commands by command, and a separate pass
   sends jobs through one step at a time to give each script's own ``usec_per_call``.
2. **WAIT.** A primary and one replica (``--replicaof``, loopback): submit latency
   (client side, p50/p99) one at a time and with many callers, submits/s, and the CPU of
   both servers -- without ``WAIT``, with ``WAIT 1 <timeout>`` after every submit, and with
   one ``WAIT`` after every pipelined batch of submits (a group commit).
3. **Cross-check** (unless ``--no-stack``): the whole stack of ``bench.throughput`` (API,
   worker and fake provider over HTTP) and the Redis CPU it used per request.

With ``--dispatch-cost`` it measures, instead of all that, what one script call costs
Redis as the number of lanes a provider is in grows (issue 19) -- Redis commands per call
and the script's µs per call, from INFO commandstats around batches of identical calls:

4. ``submit`` that dispatches at once (a free slot) and ``submit`` that queues (no free
   slot); ``finish`` with nothing waiting and ``finish`` that hands the freed slot to a
   waiting job -- for 1 / 10 / 100 lanes (``--cost-lanes``), and finish with nothing
   waiting also at 240 (``--cost-idle-lanes``). N lanes: one provider serving N models
   (each model a lane of its own, the provider in all of them, so its ``finish`` pumps
   them all). With flow control on (tenant keys): ``finish`` that hands the slot to a
   waiting job of one of 1 / 100 / 10,000 backlogged tenants (``--cost-tenants``).

Results go to the console and to the ``redis-capacity`` section of docs/BENCHMARKS.md
(``--dispatch-cost``: its ``dispatch-cost`` section). They describe the machine they were
measured on, which is printed with them.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import shutil
import statistics
import subprocess
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import msgspec
import uvloop
from redis import Redis as SyncRedis
from redis.asyncio import Redis
from redis.exceptions import ConnectionError

from api.ratelimits import limits_for
from api.waiting import ReplyReader
from bench.stack import Stack, load_average, machine, markdown_table, percentile, write_section
from dispatcher import config as cfg
from dispatcher import events, keys
from dispatcher.api_side import ApiSide
from dispatcher.events import Assignment, Done, End, Failed, Meta
from dispatcher.fastredis import Arg, FastRedis
from dispatcher.plans import Lane, Plans
from dispatcher.redis_conn import BLOCK_MS, blocking_timeout, connect, connect_fast
from dispatcher.script_calls import FinishOutcome, ScriptCalls, SubmitStatus
from dispatcher.scripts import Scripts
from dispatcher.tenants import Tenant
from dispatcher.worker_side import WorkerSide
from iop.redis_server import RedisServer
from workers.sink import RedisSink
from workers.worker import READ_BATCH

COMMAND = "python -m bench.redis_capacity"


def request_body(size: int) -> bytes:
    """A chat request of about ``size`` bytes (the prompt pads it)."""
    empty = len(msgspec.json.encode({"model": "m0", "messages": [{"role": "user", "content": ""}]}))
    content = "x" * max(size - empty, 0)
    return msgspec.json.encode({"model": "m0", "messages": [{"role": "user", "content": content}]})


def answer_body(size: int) -> bytes:
    """A chat.completion answer of about ``size`` bytes."""

    def shell(content: str) -> bytes:
        return msgspec.json.encode({
            "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "served",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 100, "completion_tokens": 200, "total_tokens": 300},
        })

    return shell("y" * max(size - len(shell("")), 0))


def chunk_payload(i: int) -> bytes:
    """One SSE event of a chat stream, as a provider sends it per token (~190 bytes)."""
    return (b'{"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,"model":"served",'
            b'"choices":[{"index":0,"delta":{"content":"tok%d "},"logprobs":null,"finish_reason":null}]}' % i)


def redis_cpu(info: dict[str, Any]) -> float:
    """Seconds of CPU the redis-server process has used (INFO cpu, microsecond resolution)."""
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


# --- the fleet: API processes and node workers, simulated in one event loop -----------------------


@dataclass(frozen=True)
class Topology:
    apis: int = 4  # API processes: a request connection and a reply reader each
    nodes: int = 4  # a worker (two connections) and one provider each
    models: int = 1  # node i's provider serves model i % models
    callers: int = 128  # requests at once, spread over the API processes and the models
    capacity: int = 10**6  # per provider
    chunks: int = 0  # chunk events per request; 0: JSON
    body: bytes = b""
    answer: bytes = b""

    def describe(self) -> str:
        per_model = self.nodes // self.models
        return f"{self.apis} / {self.nodes} / {per_model}"


def fleet_config(top: Topology) -> cfg.Config:
    return cfg.parse({
        "queue": {"max_queue": 10**7, "queue_timeout_ms": 3_600_000},
        "models": [{"id": f"m{m}", "providers": {f"p{i}": "served" for i in range(m, top.nodes, top.models)}}
                   for m in range(top.models)],
        "nodes": [{"id": f"n{i}", "providers": [
            {"id": f"p{i}", "type": "vllm", "base_url": "http://x", "capacity": top.capacity, "models": ["served"]}]}
            for i in range(top.nodes)],
    }).config


def script_calls(redis: Redis, fast: FastRedis | None, config: cfg.Config) -> ScriptCalls:
    return ScriptCalls(Scripts(redis, fast), config, Plans(config))


class SimulatedApi:
    """What one API process does for a request, with the API's own Redis clients and reply reader."""

    def __init__(self, url: str, config: cfg.Config, replica_id: str) -> None:
        self.redis = connect(url)
        self.fast = connect_fast(url)
        self.jobs = ApiSide(script_calls(self.redis, self.fast, config), self.redis, replica_id)
        self.replies = ReplyReader(connect_fast(url), keys.reply(replica_id))
        self.models = config.models
        self.replica_id = replica_id
        self.ids = itertools.count()

    async def request(self, body: bytes, stream: bool) -> None:
        n = next(self.ids)
        job_id = f"{self.replica_id}-{n}"
        waiter = self.replies.register(job_id)
        try:
            model = self.models[n % len(self.models)]
            lane = self.jobs.calls.plans.main_lane(model.id)
            submitted = await self.jobs.submit(job_id, lane, body, "chat/completions", stream)
            if submitted.status not in ("dispatched", "queued"):
                raise RuntimeError(f"submit answered {submitted.status}")
            while True:
                event = await waiter.next(None)
                if isinstance(event, Failed):
                    raise RuntimeError(f"job failed: {event.message}")
                if isinstance(event, Done | End):
                    return
        finally:
            self.replies.unregister(job_id)

    async def close(self) -> None:
        await self.fast.close()
        await self.replies.conn.close()
        await self.redis.aclose()


class SimulatedWorker:
    """One node's worker: reads its node stream, answers every job at once through ``RedisSink``."""

    def __init__(self, url: str, config: cfg.Config, node_id: str, top: Topology) -> None:
        self.redis = connect(url)
        self.fast = connect_fast(url)
        self.stream_conn = connect_fast(url)  # XREADGROUP BLOCK holds its connection, as in the worker
        calls = script_calls(self.redis, self.fast, config)
        self.slots = WorkerSide(lambda: calls, self.redis, node_id, self.fast)
        self.node_id = node_id
        self.provider_id = next(node.providers[0].id for node in config.nodes if node.id == node_id)
        self.top = top
        self.payloads = [chunk_payload(i) for i in range(top.chunks)]
        self.tasks: set[asyncio.Task[None]] = set()
        self.errors: list[BaseException] = []

    async def heartbeat(self) -> None:
        await self.slots.heartbeat(self.provider_id, "available", [("capacity", self.top.capacity)])

    async def consume(self) -> None:
        await self.slots.ensure_group()
        while True:
            batch: list[tuple[bytes, list[tuple[bytes, list[bytes]]]]] | None = await self.stream_conn.execute(
                "XREADGROUP", "GROUP", keys.NODE_GROUP, f"{self.node_id}-bench", "COUNT", READ_BATCH,
                "BLOCK", BLOCK_MS, "STREAMS", self.slots.node_key, ">", reply_within=blocking_timeout(BLOCK_MS),
            )
            for _stream, entries in batch or []:
                for entry_id, fields in entries:
                    task = asyncio.create_task(self.run(Assignment.from_entry(entry_id, fields)))
                    self.tasks.add(task)
                    task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.errors.append(exc)

    async def run(self, job: Assignment) -> None:
        sink = RedisSink(self.slots, job, self.node_id)
        await sink.start(200)
        if job.stream:
            for payload in self.payloads:  # one event per token, as a provider streams them
                await sink.chunks([payload])
        else:
            await sink.done(200, self.top.answer, "application/json")
        outcome = await self.slots.finish(job, events.encode(sink.final_event()))
        if outcome != "released":
            raise RuntimeError(f"finish answered {outcome}")

    async def close(self) -> None:
        for conn in (self.fast, self.stream_conn):
            await conn.close()
        await self.redis.aclose()


@dataclass
class RunResult:
    requests: int
    seconds: float
    redis_cpu_s: float
    replica_cpu_s: float | None
    commands: dict[str, tuple[int, int]]  # command -> (calls, µs) over the run, INFO commandstats

    @property
    def per_s(self) -> float:
        return self.requests / self.seconds

    @property
    def us_per_request(self) -> float:
        return self.redis_cpu_s * 1e6 / self.requests


async def commandstats(redis: Redis) -> dict[str, tuple[int, int]]:
    info = await redis.info("commandstats")
    return {name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for name, v in info.items()}


async def run_fleet(url: str, top: Topology, seconds: float, warmup: float, *, stream: bool,
                    replica_url: str | None = None) -> RunResult:
    """Requests from ``top.callers`` callers for ``seconds`` after a warm-up; Redis CPU over that window."""
    config = fleet_config(top)
    admin = connect(url)
    await Scripts(admin).load()
    apis = [SimulatedApi(url, config, f"api{i}") for i in range(top.apis)]
    workers = [SimulatedWorker(url, config, f"n{i}", top) for i in range(top.nodes)]
    for worker in workers:
        await worker.heartbeat()
    background = [asyncio.create_task(api.replies.run()) for api in apis]
    background += [asyncio.create_task(worker.consume()) for worker in workers]

    async def heartbeats() -> None:  # what every worker does every 2 s; part of the load
        while True:
            await asyncio.sleep(2)
            for worker in workers:
                await worker.heartbeat()

    background.append(asyncio.create_task(heartbeats()))
    done = 0
    stop = False

    async def caller(api: SimulatedApi) -> None:
        nonlocal done
        while not stop:
            await api.request(top.body, stream)
            done += 1

    callers = [asyncio.create_task(caller(apis[i % len(apis)])) for i in range(top.callers)]
    replica = connect(replica_url) if replica_url else None
    try:
        await asyncio.sleep(warmup)
        n0, t0, cpu0, cmd0 = done, time.perf_counter(), redis_cpu(await admin.info("cpu")), await commandstats(admin)
        rcpu0 = redis_cpu(await replica.info("cpu")) if replica else 0.0
        await asyncio.sleep(seconds)
        n1, t1, cpu1, cmd1 = done, time.perf_counter(), redis_cpu(await admin.info("cpu")), await commandstats(admin)
        if replica:
            await replica_caught_up(admin, replica)
        rcpu1 = redis_cpu(await replica.info("cpu")) if replica else 0.0
        stop = True
        try:
            await asyncio.wait_for(asyncio.gather(*callers), timeout=60)
        finally:
            for worker in workers:
                if worker.errors:
                    raise RuntimeError(f"a simulated worker failed: {worker.errors[0]!r}")
    finally:
        stop = True
        for task in [*callers, *background]:
            task.cancel()
        await asyncio.gather(*callers, *background, return_exceptions=True)
        for api in apis:
            await api.close()
        for worker in workers:
            await worker.close()
        await admin.aclose()
        if replica:
            await replica.aclose()
    commands = {name: (calls - cmd0.get(name, (0, 0))[0], usec - cmd0.get(name, (0, 0))[1])
                for name, (calls, usec) in cmd1.items()}
    return RunResult(n1 - n0, t1 - t0, cpu1 - cpu0, rcpu1 - rcpu0 if replica else None, commands)


class Servers:
    """A private primary and, optionally, one replica of it, on loopback; or a primary that
    speaks TLS only (a self-signed certificate made with ``openssl``)."""

    def __init__(self, replica: bool, aof: bool = False, tls: bool = False) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="iop-bench-tls-")) if tls else None
        certs = None
        if self.dir is not None:
            cert, key = self.dir / "cert.pem", self.dir / "key.pem"
            subprocess.run(
                ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                 "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                check=True, capture_output=True,
            )
            certs = (str(cert), str(key))
        self.primary = RedisServer(appendonly=aof, tls=certs, extra_args=["--repl-diskless-sync-delay", "0"])
        self.replica = RedisServer(extra_args=["--replicaof", self.primary.host, str(self.primary.port)]) \
            if replica else None
        self.url = f"{self.primary.url}?ssl_ca_certs={certs[0]}" if certs else self.primary.url

    def __enter__(self) -> Servers:
        self.primary.start()
        if self.replica is not None:
            self.replica.start()
            wait_replica_streaming(self.url)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.replica is not None:
            self.replica.close()
        self.primary.close()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)

    def flush(self) -> None:
        """An empty dataset and fresh command statistics (FLUSHALL reaches the replica too)."""
        client = SyncRedis.from_url(self.url)
        try:
            client.flushall()
            client.config_resetstat()
        finally:
            client.close()


def wait_replica_streaming(url: str, timeout: float = 30) -> None:
    """Until the replica acknowledges a write. Its being 'online' is not enough: after a
    diskless full sync the primary holds the replication stream back until the replica's
    first ACK (sent once a second, or when a WAIT asks for one)."""
    client = SyncRedis.from_url(url)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            client.set("{iop}:bench-probe", 1)
            if client.wait(1, 1000) >= 1:
                client.delete("{iop}:bench-probe")
                return
    finally:
        client.close()
    raise TimeoutError("the replica did not acknowledge a write")


async def replica_caught_up(primary: Redis, replica: Redis) -> None:
    """Until the replica has applied everything the primary sent (so its CPU for it is counted)."""
    async with asyncio.timeout(30):
        while True:
            sent = int((await primary.info("replication"))["master_repl_offset"])
            applied = int((await replica.info("replication"))["slave_repl_offset"])
            if applied >= sent:
                return
            await asyncio.sleep(0.01)


# --- part 1: Redis CPU per request ----------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    label: str
    top: Topology
    stream: bool
    replica: bool = False  # a replica attached: the primary also feeds the replication stream
    aof: bool = False  # appendonly yes, appendfsync everysec (docs/DEPLOY.md's settings)
    tls: bool = False  # clients connect over TLS, as to most managed Redis


def cases(args: argparse.Namespace) -> list[Case]:
    base = Topology(apis=args.apis, nodes=args.nodes, callers=args.callers, body=request_body(args.body_bytes),
                    answer=answer_body(args.answer_bytes))
    streamed = replace(base, chunks=args.chunks)
    # Slots for half the callers: every other request waits, and a finish dispatches it.
    queued = replace(base, capacity=max(args.callers // 2 // args.nodes, 1))
    fleet = replace(base, apis=4 * args.apis, nodes=8 * args.nodes, models=2 * args.nodes)
    one_group = replace(base, apis=4 * args.apis, nodes=8 * args.nodes)
    return [
        Case("JSON", base, stream=False),
        Case("JSON, queued first", queued, stream=False),
        Case(f"stream, {args.chunks} chunk events", streamed, stream=True),
        Case(f"stream, {5 * args.chunks} chunk events", replace(base, chunks=5 * args.chunks), stream=True),
        Case("JSON, 1 replica attached", base, stream=False, replica=True),
        Case(f"stream, {args.chunks} chunk events, 1 replica attached", streamed, stream=True, replica=True),
        Case("JSON, AOF everysec", base, stream=False, aof=True),
        Case(f"stream, {args.chunks} chunk events, AOF everysec", streamed, stream=True, aof=True),
        Case("JSON, TLS", base, stream=False, tls=True),
        Case(f"stream, {args.chunks} chunk events, TLS", streamed, stream=True, tls=True),
        Case("JSON, bigger fleet", fleet, stream=False),
        Case(f"stream, {args.chunks} chunk events, bigger fleet", replace(fleet, chunks=args.chunks), stream=True),
        Case(f"stream, {5 * args.chunks} chunk events, bigger fleet", replace(fleet, chunks=5 * args.chunks),
             stream=True),
        Case("JSON, one model on every provider", one_group, stream=False),
    ]


async def measure_case(case: Case, args: argparse.Namespace) -> RunResult:
    runs = []
    with Servers(case.replica, case.aof, case.tls) as servers:
        for _ in range(args.repeat):
            servers.flush()
            runs.append(await run_fleet(servers.url, case.top, args.seconds, args.warmup, stream=case.stream,
                                        replica_url=servers.replica.url if servers.replica else None))
    # The median run: this machine's neighbours make single runs noisy.
    return sorted(runs, key=lambda r: r.us_per_request)[len(runs) // 2]


def capacity_row(case: Case, run: RunResult) -> list[str]:
    return [case.label, case.top.describe(), f"{run.per_s:,.0f}", f"{run.redis_cpu_s / run.seconds:.0%}",
            f"{run.us_per_request:.1f}", f"{1e6 / run.us_per_request:,.0f}",
            f"{run.replica_cpu_s * 1e6 / run.requests:.1f}" if run.replica_cpu_s is not None else "-"]


# Commands the request path sends itself; the others in commandstats run inside scripts
# (their time is part of the script's) or are the benchmark's own INFO calls.
TOP_LEVEL = ("evalsha", "xadd", "xreadgroup", "xread", "xtrim")


def command_rows(runs: Sequence[tuple[RunResult, int]]) -> list[list[str]]:
    """Calls and Redis µs per request of each command the request path sends, for each run;
    ``int`` is the XADDs scripts make per request (counted in commandstats too)."""
    rows: dict[str, list[str]] = {name: [name.upper() if name != "xadd" else "XADD (chunk events)"]
                                  for name in TOP_LEVEL}
    rows["total"] = ["all commands"]
    rows["cpu"] = ["Redis CPU (INFO cpu)"]
    for run, script_xadds in runs:
        n = run.requests
        inside = 0.0
        for name in TOP_LEVEL:
            calls, usec = run.commands.get(name, (0, 0))
            if name == "xadd":  # only the worker's own appends; a script's XADD is inside its time
                per_call = usec / calls if calls else 0.0
                calls = max(calls - script_xadds * n, 0)
                usec = round(per_call * calls)
            inside += usec / n
            rows[name] += [f"{calls / n:.2f}", f"{usec / calls:.1f}" if calls else "-", f"{usec / n:.1f}"]
        cpu = run.us_per_request
        rows["total"] += ["", "", f"{inside:.1f}"]
        rows["cpu"] += ["", "", f"{cpu:.1f}"]
    return list(rows.values())


async def script_costs(url: str, top: Topology, jobs_n: int) -> list[list[str]]:
    """Each step alone: ``jobs_n`` jobs through it, ``top.callers`` at once, INFO commandstats around it."""
    config = fleet_config(top)
    admin = connect(url)
    await Scripts(admin).load()
    api = SimulatedApi(url, config, "api0")
    worker = SimulatedWorker(url, config, "n0", replace(top, chunks=max(top.chunks, 2)))
    await worker.heartbeat()
    await worker.slots.ensure_group()
    rows: list[list[str]] = []

    async def step(label: str, command: str, calls: Sequence[Callable[[], Awaitable[Any]]]) -> None:
        await admin.config_resetstat()
        for start in range(0, len(calls), top.callers):
            await asyncio.gather(*(call() for call in calls[start:start + top.callers]))
        stats = await commandstats(admin)
        n, usec = stats[command]
        rows.append([label, command.upper(), f"{n:,}", f"{usec / n:.1f}"])

    def submit(job_id: str, stream: bool) -> Callable[[], Awaitable[Any]]:
        lane = api.jobs.calls.plans.main_lane(config.models[0].id)
        return lambda: api.jobs.submit(job_id, lane, top.body, "chat/completions", stream)

    async def assignments(count: int) -> list[tuple[Assignment, RedisSink]]:
        found: list[tuple[Assignment, RedisSink]] = []
        while len(found) < count:
            batch = await worker.stream_conn.execute(
                "XREADGROUP", "GROUP", keys.NODE_GROUP, "bench", "COUNT", 1000, "STREAMS", worker.slots.node_key, ">")
            for _stream, entries in batch or []:
                for entry_id, fields in entries:
                    job = Assignment.from_entry(entry_id, fields)
                    found.append((job, RedisSink(worker.slots, job, "n0")))
        return found

    def finish(job: Assignment, sink: RedisSink, usage: bool = False) -> Callable[[], Awaitable[Any]]:
        if usage:  # a limited tenant's tokens settled against the estimate it reserved
            return lambda: worker.slots.finish(job, events.encode(sink.final_event()), tokens=64, prompt=300)
        return lambda: worker.slots.finish(job, events.encode(sink.final_event()))

    # A tenant with every limit (none ever reached): what admission adds to a submit and a finish.
    limited = Tenant("bench", 0, limits=cfg.KeyLimits(requests_per_minute=10**9, tokens_per_minute=10**12,
                                                      tokens_per_day=10**15))

    def submit_limited(job_id: str) -> Callable[[], Awaitable[Any]]:
        lane = api.jobs.calls.plans.main_lane(config.models[0].id)
        return lambda: api.jobs.submit(job_id, lane, top.body, "chat/completions", False, tenant=limited,
                                       limits=limits_for(limited, top.body, True))

    def chunk(sink: RedisSink, i: int) -> Callable[[], Awaitable[Any]]:
        return lambda: sink.chunks([worker.payloads[i]])

    try:
        # Every submit finds a free slot (the provider's capacity is huge) and dispatches at once.
        await step("submit, dispatching at once", "evalsha", [submit(f"j{i}", False) for i in range(jobs_n)])
        json_jobs = await assignments(jobs_n)
        for _job, sink in json_jobs:
            await sink.done(200, top.answer, "application/json")
        await step("finish, JSON answer", "evalsha", [finish(job, sink) for job, sink in json_jobs])
        await step("submit, a tenant with rate limits and a budget", "evalsha",
                   [submit_limited(f"l{i}") for i in range(jobs_n)])
        limited_jobs = await assignments(jobs_n)
        for _job, sink in limited_jobs:
            await sink.done(200, top.answer, "application/json")
        await step("finish, settling its tokens", "evalsha", [finish(job, sink, True) for job, sink in limited_jobs])
        await step("submit (stream)", "evalsha", [submit(f"s{i}", True) for i in range(jobs_n)])
        stream_jobs = await assignments(jobs_n)
        await step("emit, first chunk", "evalsha", [chunk(sink, 0) for _job, sink in stream_jobs])
        await step("a later chunk event", "xadd", [chunk(sink, 1) for _job, sink in stream_jobs])
        await step("finish, stream end", "evalsha", [finish(job, sink) for job, sink in stream_jobs])
        # No free slot: a submit only queues; a finish then hands its slot to the head of the queue.
        for node in config.nodes:
            await admin.hset(keys.provider(node.providers[0].id), "capacity", 0)
        await step("submit, queueing", "evalsha", [submit(f"q{i}", False) for i in range(jobs_n)])
    finally:
        await api.close()
        await worker.close()
        await admin.aclose()
    return rows


# --- part 2: WAIT after submit --------------------------------------------------------------------


class WaitEach(FastRedis):
    """Sends ``WAIT numreplicas timeout`` right after every script call, on the same connection."""

    def __init__(self, url: str, numreplicas: int, timeout_ms: int) -> None:
        super().__init__(url)
        self.wait = ("WAIT", numreplicas, timeout_ms)
        self.unacked = 0

    async def evalsha(
        self, sha: str, source: str, keys: Sequence[Arg], args: Sequence[Arg], reply_within: float | None = None
    ) -> Any:
        reply, acked = await self.execute_many([("EVALSHA", sha, len(keys), *keys, *args), self.wait])
        for value in (reply, acked):
            if isinstance(value, Exception):
                raise value
        if acked < self.wait[1]:
            self.unacked += 1
        return reply


class WaitBatch(FastRedis):
    """Group commit: the script calls of one event-loop turn leave together, followed by one
    ``WAIT`` that covers them all; each caller is answered once that WAIT returns."""

    def __init__(self, url: str, numreplicas: int, timeout_ms: int) -> None:
        super().__init__(url)
        self.wait = ("WAIT", numreplicas, timeout_ms)
        self.unacked = 0
        self._pending: list[tuple[tuple[Arg, ...], asyncio.Future[Any]]] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def evalsha(
        self, sha: str, source: str, keys: Sequence[Arg], args: Sequence[Arg], reply_within: float | None = None
    ) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._send)
        self._pending.append((("EVALSHA", sha, len(keys), *keys, *args), future))
        reply = await future
        if isinstance(reply, Exception):
            raise reply
        return reply

    def _send(self) -> None:
        batch, self._pending = self._pending, []
        task = asyncio.create_task(self._commit(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _commit(self, batch: list[tuple[tuple[Arg, ...], asyncio.Future[Any]]]) -> None:
        try:
            replies = await self.execute_many([*(command for command, _ in batch), self.wait])
        except Exception as exc:
            for _, future in batch:
                future.set_result(exc)
            return
        acked = replies[-1]
        if isinstance(acked, Exception) or acked < self.wait[1]:
            self.unacked += len(batch)
        for (_, future), reply in zip(batch, replies, strict=False):
            future.set_result(reply)


WAIT_MODES = ("none", "each", "batch")


async def submit_load(servers: Servers, mode: str, args: argparse.Namespace) -> list[str]:
    """Submits that each dispatch at once (a request's whole start: record, body, queue,
    lease, node stream entry), with or without WAIT; one caller, then ``args.callers``."""
    assert servers.replica is not None
    servers.flush()
    config = fleet_config(Topology(nodes=1))
    redis, replica = connect(servers.url), connect(servers.replica.url)
    fast: FastRedis
    if mode == "each":
        fast = WaitEach(servers.url, 1, args.wait_timeout_ms)
    elif mode == "batch":
        fast = WaitBatch(servers.url, 1, args.wait_timeout_ms)
    else:
        fast = connect_fast(servers.url)
    await Scripts(redis).load()
    jobs = ApiSide(script_calls(redis, fast, config), redis, "api0")
    worker_calls = script_calls(redis, None, config)
    slots = WorkerSide(lambda: worker_calls, redis, "n0")
    await slots.heartbeat("p0", "available", [("capacity", 10**6)])
    body = request_body(args.body_bytes)
    ids = itertools.count()

    async def submit() -> float:
        started = time.perf_counter()
        lane = jobs.calls.plans.main_lane(config.models[0].id)
        result = await jobs.submit(f"j{next(ids)}", lane, body, "chat/completions", False)
        elapsed = time.perf_counter() - started
        if result.status != "dispatched":
            raise RuntimeError(f"submit answered {result.status}")
        return elapsed

    async def timed(count: int, concurrency: int) -> tuple[list[float], float, float, float]:
        latencies: list[float] = []

        async def one_caller() -> None:
            for _ in range(count // concurrency):
                latencies.append(await submit())

        cpu0, rcpu0 = redis_cpu(await redis.info("cpu")), redis_cpu(await replica.info("cpu"))
        started = time.perf_counter()
        await asyncio.gather(*(one_caller() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
        cpu1 = redis_cpu(await redis.info("cpu"))
        await replica_caught_up(redis, replica)
        rcpu1 = redis_cpu(await replica.info("cpu"))
        n = len(latencies)
        return latencies, n / elapsed, (cpu1 - cpu0) * 1e6 / n, (rcpu1 - rcpu0) * 1e6 / n

    try:
        for _ in range(500):  # warm-up
            await submit()
        serial, _, _, _ = await timed(args.wait_serial, 1)
        busy, rate, cpu_us, replica_us = await timed(args.wait_submits, args.callers)
        unacked = getattr(fast, "unacked", 0)
    finally:
        await fast.close()
        await redis.aclose()
        await replica.aclose()
    label = {"none": "no WAIT", "each": f"`WAIT 1 {args.wait_timeout_ms}` after every submit",
             "batch": f"`WAIT 1 {args.wait_timeout_ms}` after every pipelined batch"}[mode]
    return [label, f"{percentile(serial, 50) * 1000:.3f}", f"{percentile(serial, 99) * 1000:.3f}",
            f"{rate:,.0f}", f"{percentile(busy, 50) * 1000:.2f}", f"{percentile(busy, 99) * 1000:.2f}",
            f"{cpu_us:.1f}", f"{replica_us:.1f}", str(unacked)]


async def wait_table(args: argparse.Namespace) -> str:
    rows = []
    for mode in WAIT_MODES:
        with Servers(replica=True) as servers:
            runs = [await submit_load(servers, mode, args) for _ in range(args.repeat)]
        # The run with the median throughput: this machine's neighbours make single runs noisy.
        rows.append(sorted(runs, key=lambda row: float(row[3].replace(",", "")))[len(runs) // 2])
    c = args.callers
    return markdown_table(["submit", "1 caller p50 ms", "1 caller p99 ms", f"{c} callers submits/s",
                           f"{c} callers p50 ms", f"{c} callers p99 ms", "primary CPU µs/submit",
                           "replica CPU µs/submit", "WAITs that timed out"], rows)


# --- part 3: the whole stack ----------------------------------------------------------------------


async def stack_table(seconds: float, clients: int) -> str:
    from bench.throughput import load

    rows = []
    # A 1 ms pause between tokens makes the worker read (and relay) most tokens alone, as it
    # would from a real model.
    with Stack({"a": ["--tokens", "20", "--token-interval-ms", "1"]}) as stack:
        url = f"{stack.api_url}/v1/chat/completions"
        for stream in (False, True):
            await load(url, stream, clients, min(2.0, seconds))  # warm-up
            cpu0, cmd0, info0 = stack.cpu(), stack.commandstats(), stack.redis.info("cpu")
            n, elapsed = await load(url, stream, clients, seconds)
            cpu1, cmd1, info1 = stack.cpu(), stack.commandstats(), stack.redis.info("cpu")
            redis_s = redis_cpu(info1) - redis_cpu(info0)
            total_s = sum(cpu1[k] - cpu0[k] for k in cpu1)
            # Every XADD but the dispatch's and the final event's (both by scripts) is a chunk event.
            chunk_events = (cmd1.get("xadd", 0) - cmd0.get("xadd", 0)) / n - 2
            rows.append([
                "stream, 20 tokens 1 ms apart" if stream else "JSON", f"{n / elapsed:,.0f}",
                f"{chunk_events:.1f}" if stream else "-", f"{redis_s / elapsed:.0%}",
                f"{redis_s / total_s:.0%}", f"{redis_s * 1e6 / n:.0f}",
            ])
    return markdown_table(["request, whole stack over HTTP", "req/s", "chunk events/req", "Redis CPU busy",
                           "Redis share of all CPU used", "Redis CPU µs/req"], rows)


# --- part 4 (--dispatch-cost): Redis commands and µs per script call, by lanes and tenants --------

COST_PROVIDER, COST_NODE, COST_REPLICA = "p0", "n0", "api0"
SUBMIT_DISPATCH = "submit, dispatching at once (a free slot)"
SUBMIT_QUEUE = "submit, queueing (no free slot)"
FINISH_IDLE = "finish, nothing waiting"
FINISH_HANDOFF = "finish, handing the slot to a waiting job"
FINISH_FAIR = "finish, fair hand-off (flow control on)"
COST_CALLS = (SUBMIT_DISPATCH, SUBMIT_QUEUE, FINISH_IDLE, FINISH_HANDOFF, FINISH_FAIR)
# In commandstats but not the scripts' work: the measured EVALSHAs themselves, and the INFO
# that reads the counters.
NOT_SCRIPT_WORK = ("evalsha", "evalsha_ro", "info")
FREE = 10**6  # "a free slot": a capacity no batch fills


@dataclass(frozen=True)
class Batch:
    """``calls`` script calls of one kind (one EVALSHA each), as INFO commandstats saw them."""

    calls: int
    commands: dict[str, int]  # command -> its calls inside the scripts over the batch (TIME included)
    usec: int  # EVALSHA's usec over the batch: the scripts' time in Redis

    @property
    def total(self) -> int:
        return sum(self.commands.values())


@dataclass(frozen=True)
class DispatchCost:
    call: str  # one of COST_CALLS
    lanes: int  # lanes the provider is in (what its finish pumps)
    tenants: int | None  # flow control on, this many tenants with jobs waiting; None: off
    batches: tuple[Batch, ...]

    @property
    def commands_per_call(self) -> float:
        return statistics.median(b.total / b.calls for b in self.batches)

    @property
    def us_per_call(self) -> float:
        return statistics.median(b.usec / b.calls for b in self.batches)

    @property
    def us_range(self) -> tuple[float, float]:
        """The lowest and the highest batch's µs per call."""
        per_call = [b.usec / b.calls for b in self.batches]
        return min(per_call), max(per_call)

    def top_commands(self, n: int = 4) -> list[tuple[str, float]]:
        """The ``n`` commands the calls ran most, with their calls per script call (all batches)."""
        calls = sum(b.calls for b in self.batches)
        totals: Counter[str] = Counter()
        for b in self.batches:
            totals.update(b.commands)
        top = sorted(totals.items(), key=lambda item: (-item[1], item[0]))[:n]
        return [(name, count / calls) for name, count in top]


def lanes_config(lanes: int, tenants: int | None = None) -> cfg.Config:
    """One provider on one node serving ``lanes`` models. Each model is a lane of its own (its
    one provider serves every endpoint), and the provider is in all of them: its finish pumps
    every one (``dispatcher/plans.py``). ``tenants``: flow control on, with that many tenant
    keys (at least two, or there is nothing to control)."""
    data: dict[str, Any] = {
        "queue": {"max_queue": 10**7, "queue_timeout_ms": 3_600_000},
        # A heartbeat that outlives the longest batch: a provider heard from too long ago takes no work.
        "dispatch": {"heartbeat_ttl_ms": 3_600_000},
        "models": [{"id": f"m{i}", "providers": {COST_PROVIDER: f"s{i}"}} for i in range(lanes)],
        "nodes": [{"id": COST_NODE, "providers": [
            {"id": COST_PROVIDER, "type": "vllm", "base_url": "http://x", "capacity": 1,
             "models": [f"s{i}" for i in range(lanes)]}]}],
    }
    if tenants is not None:
        data["api"] = {"keys": [{"name": f"t{i}", "key_sha256": f"{i:064x}"} for i in range(max(tenants, 2))]}
    return cfg.parse(data).config


class CostRig:
    """The real scripts, called one at a time the way the API (``ApiSide``) and a worker
    (``WorkerSide``) call them, through the request path's client, against one provider
    in ``lanes`` lanes; with ``tenants``, flow control on and submits by that many tenants
    in turn."""

    def __init__(self, url: str, lanes: int, tenants: int | None = None) -> None:
        config = lanes_config(lanes, tenants)
        self.admin = connect(url)
        self.fast = connect_fast(url)
        calls = script_calls(self.admin, self.fast, config)
        self.calls = calls
        plans = calls.plans
        assert plans.fair == (tenants is not None)
        assert sum(len(ls) for ls in plans.lanes_by_model.values()) == lanes
        self.api = ApiSide(calls, self.admin, COST_REPLICA)
        self.node = WorkerSide(lambda: calls, self.admin, COST_NODE, self.fast)
        self.lanes: list[Lane] = [plans.main_lane(model.id) for model in config.models]
        self.tenants = [Tenant(f"t{i}", 0) for i in range(tenants)] if tenants is not None else []
        self.body = request_body(1024)
        self.answer = answer_body(1024)
        self.ids = itertools.count()

    async def close(self) -> None:
        await self.fast.close()
        await self.admin.aclose()

    async def reset(self, capacity: int) -> None:
        """An empty dataset (the scripts stay loaded) and a provider of ``capacity`` slots."""
        await self.admin.flushall()
        await self.calls.write_plans()  # else the first call of each plan would write it
        await self.heartbeat(capacity)

    async def heartbeat(self, capacity: int) -> None:
        await self.node.heartbeat(COST_PROVIDER, "available", [("capacity", capacity)])

    async def submit(self, expect: SubmitStatus) -> None:
        """One submit, to the lanes in turn (under flow control: by the tenants in turn)."""
        n = next(self.ids)
        lane = self.lanes[n % len(self.lanes)]
        tenant = self.tenants[n % len(self.tenants)] if self.tenants else None
        job = tenant.job_id(f"j{n}") if tenant else f"j{n}"
        submitted = await self.api.submit(job, lane, self.body, "chat/completions", False, tenant=tenant)
        if submitted.status != expect:
            raise RuntimeError(f"submit answered {submitted.status}, not {expect}")

    async def submit_many(self, count: int, expect: SubmitStatus) -> None:
        """Unmeasured set-up: a thousand submits per write."""
        for start in range(0, count, 1000):
            await asyncio.gather(*(self.submit(expect) for _ in range(min(1000, count - start))))

    async def running(self, count: int) -> list[Assignment]:
        """The first ``count`` entries of the node stream: jobs that hold slots (one XRANGE)."""
        entries = await self.fast.execute("XRANGE", keys.node(COST_NODE), "-", "+", "COUNT", count)
        if len(entries) != count:
            raise RuntimeError(f"{len(entries)} jobs running, not {count}")
        return [Assignment.from_entry(entry_id, fields) for entry_id, fields in entries]

    async def finish(self, job: Assignment) -> None:
        """The worker's finish of a JSON answer (the final event carries the 1 KiB body)."""
        meta = Meta(job.provider, COST_NODE, job.target, job.queue_ms, job.attempt)
        outcome = await self.node.finish(job, events.encode(Done(meta, 200, self.answer)))
        if outcome != FinishOutcome.RELEASED:
            raise RuntimeError(f"finish answered {outcome}")

    async def handoffs(self, count: int) -> Counter[str]:
        """``count`` finishes, each of the job the one before dispatched; returns the commands
        sent besides them (an XRANGE each, to learn which job holds the slot)."""
        last = None
        for _ in range(count):
            [job] = await self.running(1)
            if job.job == last:
                raise RuntimeError("a finish handed its slot to nobody")
            await self.finish(job)
            last = job.job
        return Counter(xrange=count)

    async def measure(self, calls: int, run: Callable[[], Awaitable[Counter[str]]]) -> Batch:
        """INFO commandstats around ``run``, which makes ``calls`` script calls and returns the
        commands it sent itself besides them (taken off: they are not the scripts' work)."""
        before = await commandstats(self.admin)
        own = await run()
        after = await commandstats(self.admin)
        delta = {name: n - before.get(name, (0, 0))[0] for name, (n, _) in after.items()}
        if delta.get("evalsha", 0) != calls:
            raise RuntimeError(f"{delta.get('evalsha', 0)} EVALSHA in a batch of {calls} script calls")
        commands = {name: n - own.get(name, 0) for name, n in delta.items() if name not in NOT_SCRIPT_WORK}
        if any(n < 0 for n in commands.values()):
            raise RuntimeError(f"fewer commands than the batch sent itself: {commands}")
        usec = after["evalsha"][1] - before.get("evalsha", (0, 0))[1]
        return Batch(calls, {name: n for name, n in commands.items() if n}, usec)

    async def check(self, running: int, waiting: int) -> None:
        """What a batch must leave behind: the slots held and the jobs waiting in all the lanes."""
        async with self.admin.pipeline(transaction=False) as pipe:
            pipe.hget(keys.provider(COST_PROVIDER), "in_flight")
            for lane in self.lanes:
                pipe.zcard(lane.queue)
            in_flight, *queued = await pipe.execute()
        if int(in_flight or 0) != running or sum(queued) != waiting:
            raise RuntimeError(f"{int(in_flight or 0)} running and {sum(queued)} waiting after a batch, "
                               f"not {running} and {waiting}")

    async def backlogged(self) -> int:
        """Tenants with jobs waiting (the q:<tenant> counters of the tenants hash)."""
        counters = cast(dict[bytes, bytes], await self.admin.hgetall(keys.TENANTS))
        return sum(1 for name, n in counters.items() if name.startswith(b"q:") and name.count(b":") == 1
                   and int(n) > 0)


async def free_slot_round(rig: CostRig, k: int) -> tuple[Batch, Batch]:
    """``k`` submits that each dispatch at once, then the ``k`` finishes of those jobs with
    every queue empty."""
    await rig.reset(FREE)

    async def submits() -> Counter[str]:
        for _ in range(k):
            await rig.submit(SubmitStatus.DISPATCHED)
        return Counter()

    dispatching = await rig.measure(k, submits)
    jobs = await rig.running(k)

    async def finishes() -> Counter[str]:
        for job in jobs:
            await rig.finish(job)
        return Counter()

    idle = await rig.measure(k, finishes)
    await rig.check(running=0, waiting=0)
    return dispatching, idle


async def no_free_slot_round(rig: CostRig, k: int) -> tuple[Batch, Batch]:
    """One slot, held: ``k`` submits that queue (to the lanes in turn), then ``k`` finishes
    that each hand the slot to the oldest waiting job, every lane still holding one at the last."""
    await rig.reset(1)
    await rig.submit(SubmitStatus.DISPATCHED)

    async def submits() -> Counter[str]:
        for _ in range(k):
            await rig.submit(SubmitStatus.QUEUED)
        return Counter()

    queueing = await rig.measure(k, submits)
    await rig.submit_many(len(rig.lanes), SubmitStatus.QUEUED)  # dispatched last: one per lane
    handoff = await rig.measure(k, lambda: rig.handoffs(k))
    await rig.check(running=1, waiting=len(rig.lanes))
    return queueing, handoff


async def fair_round(rig: CostRig, k: int) -> Batch:
    """Flow control on, one slot, held: ``T * (ceil(k / T) + 2)`` jobs waiting from the T tenants in
    turn, then ``k`` finishes that each hand the slot to the fair choice. A tenant gets at most
    one slot per round of all T, and the holder's tenant starts a round behind: every tenant
    still has a job waiting at the last finish."""
    tenants = len(rig.tenants)
    await rig.reset(1)
    await rig.submit(SubmitStatus.DISPATCHED)
    depth = tenants * (-(-k // tenants) + 2)
    await rig.submit_many(depth, SubmitStatus.QUEUED)
    handoff = await rig.measure(k, lambda: rig.handoffs(k))
    await rig.check(running=1, waiting=depth - k)
    if (left := await rig.backlogged()) != tenants:
        raise RuntimeError(f"{left} tenants still waiting after the batch, not {tenants}")
    return handoff


async def dispatch_costs(url: str, *, calls: int, repeat: int, lanes: Sequence[int], idle_lanes: Sequence[int],
                         tenants: Sequence[int]) -> list[DispatchCost]:
    """Every row of the dispatch-cost table: ``repeat`` batches of ``calls`` calls each,
    interleaved (every row's first batch, then every row's second, ...) so that a noisy
    moment of the machine does not land on one row alone. ``idle_lanes``: lane counts
    measured for the finish with nothing waiting only."""
    admin = connect(url)
    try:
        await Scripts(admin).load()  # FLUSHALL keeps them
    finally:
        await admin.aclose()
    lane_rigs = {n: CostRig(url, n) for n in sorted({*lanes, *idle_lanes})}
    fair_rigs = {t: CostRig(url, 1, t) for t in sorted(set(tenants))}
    found: dict[tuple[str, int, int | None], list[Batch]] = defaultdict(list)
    try:
        for i in range(repeat):
            started = time.perf_counter()
            for n, rig in lane_rigs.items():
                dispatching, idle = await free_slot_round(rig, calls)
                found[(FINISH_IDLE, n, None)].append(idle)
                if n in lanes:
                    found[(SUBMIT_DISPATCH, n, None)].append(dispatching)
                    queueing, handoff = await no_free_slot_round(rig, calls)
                    found[(SUBMIT_QUEUE, n, None)].append(queueing)
                    found[(FINISH_HANDOFF, n, None)].append(handoff)
            for t, rig in fair_rigs.items():
                found[(FINISH_FAIR, 1, t)].append(await fair_round(rig, calls))
            print(f"  round {i + 1}/{repeat}: {time.perf_counter() - started:.1f} s", flush=True)
    finally:
        for rig in [*lane_rigs.values(), *fair_rigs.values()]:
            await rig.close()
    order = sorted(found, key=lambda key: (COST_CALLS.index(key[0]), key[2] or 0, key[1]))
    return [DispatchCost(call, n, t, tuple(found[(call, n, t)])) for call, n, t in order]


def checkout() -> str:
    """The commit measured, and whether the scripts' working tree differs from it."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout

    try:
        commit = git("rev-parse", "--short", "HEAD").strip()
        changed = git("--no-optional-locks", "status", "--porcelain", "--", "lua", "dispatcher").splitlines()
    except (OSError, subprocess.CalledProcessError):
        return "an unknown commit (no git)"
    if not changed:
        return f"commit {commit} (`git rev-parse --short HEAD`; lua/ and dispatcher/ as committed)"
    files = ", ".join(line[3:] for line in changed)
    return f"commit {commit} (`git rev-parse --short HEAD`) with uncommitted changes to {files}"


def dispatch_cost_table(costs: Sequence[DispatchCost]) -> str:
    rows = []
    for c in costs:
        # The row this one is compared with: the same call at the fewest lanes (tenants).
        ref = min((o for o in costs if o.call == c.call), key=lambda o: (o.lanes, o.tenants or 0))
        rows.append([
            c.call, str(c.lanes), "-" if c.tenants is None else f"{c.tenants:,}",
            f"{c.commands_per_call:,.1f}", f"{c.us_per_call:,.1f} ({c.us_range[0]:,.0f}-{c.us_range[1]:,.0f})",
            "-" if ref is c else f"{(c.us_per_call / ref.us_per_call - 1) * 100:+.0f}%",
            ", ".join(f"{name.upper()} {per:,.3g}" for name, per in c.top_commands()),
        ])
    return markdown_table(["call", "lanes", "tenants with jobs waiting (flow control on)", "Redis commands per call",
                           "µs per call in Redis (batches' range)", "µs vs the 1-lane (1-tenant) row",
                           "most frequent commands, per call"], rows)


def dispatch_cost_target(costs: Sequence[DispatchCost], lanes: int = 240) -> str:
    """Issue 19's target: a finish with every queue empty at ``lanes`` lanes costs within 10%
    of the one-lane figure."""
    idle = {c.lanes: c for c in costs if c.call == FINISH_IDLE}
    if 1 not in idle or lanes not in idle:
        return ""
    one, many = idle[1], idle[lanes]
    growth = many.us_per_call / one.us_per_call - 1
    return (f"Target (issue 19): a finish with every queue empty at {lanes} lanes within 10% of the one-lane "
            f"cost. Measured: {many.us_per_call:.1f} µs vs {one.us_per_call:.1f} µs ({growth * 100:+.0f}%), "
            f"{many.commands_per_call:,.1f} vs {one.commands_per_call:,.1f} Redis commands: "
            f"**{'met' if growth <= 0.10 else 'missed'}**.\n")


def dispatch_cost_report(costs: Sequence[DispatchCost], args: argparse.Namespace, before: str) -> str:
    k, r = args.cost_calls, args.cost_repeat
    return "\n".join([
        f"Scripts of {checkout()}. Machine: {machine()}. Load average before the run: {before}; after: "
        f"{load_average()}.\n",
        f"Each row: batches of {k:,} calls of one kind, one at a time, each call one EVALSHA of the real script "
        "(`ApiSide.submit`, `WorkerSide.finish` through the request path's client), against a private "
        "redis-server on loopback, with INFO commandstats read before and after each batch. **Redis commands per "
        "call**: the calls of every command in that difference except EVALSHA, EVALSHA_RO and INFO (so the "
        "commands the script ran, TIME included), less the batch's own reads (an XRANGE per hand-off, to learn "
        f"the job that holds the slot), over {k:,}; not always a whole number, since a dispatch also SETs the "
        "fence counter when it is behind the server's clock (`lua/lib/pump.lua`). **µs per call**: EVALSHA's "
        f"usec over {k:,}, the wall-clock time Redis spent in the script (not the network, not the client). "
        f"Median of {r} batches per row, interleaved (every row's first batch, then every row's second, ...). "
        "One call at a time, Redis idles between calls and each script runs on cold caches: these µs are "
        "several times the same script's under a steady load (the redis-capacity section), and a busy machine "
        "inflates them (wall-clock time); compare the rows with each other. The commands per call do not "
        "depend on the machine.\n",
        "N lanes: one provider on one node serving N models, each model a lane of its own with that one provider "
        "(`dispatcher/plans.py`), so the provider's `finish` pumps all N. Submits (a 1 KiB chat body) go to the "
        "lanes in turn; a finish writes a JSON answer's final event (1 KiB body) to the reply stream. *Free "
        f"slot*: capacity {FREE:,}; the finishes are those of the submitted jobs, every queue empty. *No free "
        f"slot*: capacity 1, held; the submits queue, then {k:,} + N jobs wait and each finish hands the slot "
        "to the oldest (every lane still has a job waiting at the last finish). *Flow control*: one model (one "
        "lane), tenant keys (at least two, so flow control is on), capacity 1, held; T * (ceil(K / T) + 2) jobs wait "
        "from the T tenants in turn, so all T are still backlogged at the last of the K finishes, each of which "
        "hands the slot to the fair choice. The 240-lane row is the finish with nothing waiting only.\n",
        dispatch_cost_table(costs),
        dispatch_cost_target(costs),
    ])


async def dispatch_cost_main(args: argparse.Namespace) -> str:
    asyncio.get_running_loop().set_exception_handler(quiet_closed_connections)
    before = load_average()
    with Servers(replica=False) as servers:
        costs = await dispatch_costs(servers.url, calls=args.cost_calls, repeat=args.cost_repeat,
                                     lanes=args.cost_lanes, idle_lanes=args.cost_idle_lanes,
                                     tenants=args.cost_tenants)
    report = dispatch_cost_report(costs, args, before)
    print(report, flush=True)
    return report


# --- the report -----------------------------------------------------------------------------------




def quiet_closed_connections(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """A blocking read still waiting when its connection is closed at the end of a run fails
    with 'client closed', and nobody reads that: not worth a traceback."""
    if isinstance(context.get("exception"), ConnectionError):
        return
    loop.default_exception_handler(context)


async def main(args: argparse.Namespace) -> str:
    asyncio.get_running_loop().set_exception_handler(quiet_closed_connections)
    out: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        out.append(text)

    say(f"Machine: {machine()}; the load generator shares its cores with Redis. Load average before the "
        f"run: {load_average()}; the benchmark itself keeps about 2 processes busy.\n")
    say(f"Request body {len(request_body(args.body_bytes))} bytes, JSON answer "
        f"{len(answer_body(args.answer_bytes))} bytes, chunk event {len(chunk_payload(10))} bytes; "
        f"{args.callers} requests at once. Fleet: API processes / nodes (a worker and a provider each) / "
        "providers serving each model.\n")

    # 1. Redis CPU per request.
    rows, runs = [], {}
    for case in cases(args):
        run = await measure_case(case, args)
        runs[case.label] = run
        rows.append(capacity_row(case, run))
        print("  ", " | ".join(rows[-1]), flush=True)
    say(markdown_table(["request", "fleet", "req/s reached", "Redis CPU busy", "Redis CPU µs/req",
                        "req/s per Redis core (1e6 / µs)", "replica CPU µs/req"], rows))

    json_run, stream_run = runs["JSON"], runs[f"stream, {args.chunks} chunk events"]
    say("Where the Redis time goes (INFO commandstats over the JSON and stream runs above):\n")
    say(markdown_table(["command", "JSON calls/req", "µs/call", "µs/req", "stream calls/req", "µs/call", "µs/req"],
                       command_rows([(json_run, 2), (stream_run, 3)])))

    base = cases(args)[0].top
    with Servers(replica=False) as servers:
        steps = await script_costs(servers.url, base, args.step_jobs)
    say(f"Each step alone ({args.step_jobs:,} jobs, {base.callers} at once; one provider has the slots):\n")
    say(markdown_table(["step", "command", "calls", "Redis µs/call (usec_per_call)"], steps))

    # How the cost per request depends on the load: fewer requests at once, less batching.
    rows = []
    for callers in args.sweep:
        for stream in (False, True):
            top = replace(base, callers=callers, chunks=args.chunks if stream else 0)
            with Servers(replica=False) as servers:
                run = await run_fleet(servers.url, top, min(args.seconds, 4.0), args.warmup, stream=stream)
            rows.append([str(callers), f"stream, {args.chunks} chunk events" if stream else "JSON",
                         f"{run.per_s:,.0f}", f"{run.redis_cpu_s / run.seconds:.0%}", f"{run.us_per_request:.1f}"])
    say("The same with fewer or more requests at once:\n")
    say(markdown_table(["requests at once", "request", "req/s reached", "Redis CPU busy", "Redis CPU µs/req"], rows))

    # 2. WAIT.
    say(f"`WAIT` after submit: primary + 1 replica on loopback; {args.wait_serial:,} submits one at a time, "
        f"then {args.wait_submits:,} from {args.callers} callers:\n")
    say(await wait_table(args))

    # 3. Cross-check.
    if args.stack:
        say(f"Cross-check, the whole stack (bench.throughput's processes, {args.stack_clients} HTTP clients):\n")
        say(await stack_table(args.stack_seconds, args.stack_clients))
    say(f"Load average at the end: {load_average()}.\n")
    return "\n".join(out)


def command_line(args: argparse.Namespace) -> str:
    parts = [COMMAND]
    defaults = parser().parse_args([])
    for name, value in vars(args).items():
        if value == getattr(defaults, name):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parts.append(flag if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, list):
            parts.append(f"{flag} {','.join(str(v) for v in value)}")
        else:
            parts.append(f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}")
    return " ".join(parts)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=8.0, help="measured seconds per capacity run")
    p.add_argument("--warmup", type=float, default=1.5, help="seconds of load before each measured run")
    p.add_argument("--repeat", type=int, default=3, help="runs per row; the median is shown")
    p.add_argument("--callers", type=int, default=128, help="requests at once")
    p.add_argument("--apis", type=int, default=4, help="simulated API processes")
    p.add_argument("--nodes", type=int, default=4, help="simulated nodes (a worker and a provider each)")
    p.add_argument("--chunks", type=int, default=20, help="chunk events per streamed request")
    p.add_argument("--body-bytes", type=int, default=1024, help="size of each request body")
    p.add_argument("--answer-bytes", type=int, default=1024, help="size of each JSON answer")
    p.add_argument("--step-jobs", type=int, default=5000, help="jobs through each step of the per-script pass")
    p.add_argument("--sweep", type=lambda v: [int(x) for x in v.split(",")], default=[4, 16, 64, 256],
                   help="requests at once for the load sweep (comma-separated)")
    p.add_argument("--wait-serial", type=int, default=5000, help="submits one at a time, per WAIT mode")
    p.add_argument("--wait-submits", type=int, default=20_000, help="submits from --callers callers, per WAIT mode")
    p.add_argument("--wait-timeout-ms", type=int, default=100)
    p.add_argument("--stack", action=argparse.BooleanOptionalAction, default=True,
                   help="cross-check with the whole stack over HTTP")
    p.add_argument("--stack-seconds", type=float, default=8.0)
    p.add_argument("--stack-clients", type=int, default=32)
    p.add_argument("--dispatch-cost", action="store_true",
                   help="instead of the above: Redis commands and µs per submit / finish, by lanes and tenants")
    p.add_argument("--cost-calls", type=int, default=2000, help="dispatch cost: calls per batch")
    p.add_argument("--cost-repeat", type=int, default=3, help="dispatch cost: batches per row; the median is shown")
    p.add_argument("--cost-lanes", type=int_list, default=[1, 10, 100], help="dispatch cost: lanes (comma-separated)")
    p.add_argument("--cost-idle-lanes", type=int_list, default=[240],
                   help="dispatch cost: more lanes, for the finish with nothing waiting only")
    p.add_argument("--cost-tenants", type=int_list, default=[1, 100, 10_000],
                   help="dispatch cost: backlogged tenants under flow control (comma-separated)")
    p.add_argument("--write", action=argparse.BooleanOptionalAction, default=True,
                   help="write the results into docs/BENCHMARKS.md")
    return p


def int_list(value: str) -> list[int]:
    return [int(x) for x in value.split(",") if x]


if __name__ == "__main__":
    arguments = parser().parse_args()
    command = command_line(arguments)
    print(f"$ {command}\n")
    uvloop.install()
    if arguments.dispatch_cost:
        section, report = "dispatch-cost", asyncio.run(dispatch_cost_main(arguments))
    else:
        section, report = "redis-capacity", asyncio.run(main(arguments))
    if arguments.write:
        write_section(section, command, report)
