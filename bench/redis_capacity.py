"""How far one Redis shard goes: Redis CPU per request, and what ``WAIT`` after a submit costs.

    python -m bench.redis_capacity [--seconds 8] [--callers 128] [--chunks 20] [--no-stack]

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

Results go to the console and to the ``redis-capacity`` section of docs/BENCHMARKS.md.
They describe the machine they were measured on, which is printed with them.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import msgspec
import uvloop
from redis import Redis as SyncRedis
from redis.asyncio import Redis
from redis.exceptions import ConnectionError

from api.waiting import ReplyReader
from bench.stack import Stack, markdown_table, percentile, write_section
from dispatcher import config as cfg
from dispatcher import events, keys
from dispatcher.api_side import ApiSide
from dispatcher.events import Assignment, Done, End, Failed
from dispatcher.fastredis import Arg, FastRedis
from dispatcher.plans import Plans
from dispatcher.protocol import ScriptCalls
from dispatcher.redis_conn import BLOCK_MS, blocking_timeout, connect, connect_fast
from dispatcher.scripts import Scripts
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
        self.slots = WorkerSide(script_calls(self.redis, self.fast, config), self.redis, node_id, self.fast)
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

    def finish(job: Assignment, sink: RedisSink) -> Callable[[], Awaitable[Any]]:
        return lambda: worker.slots.finish(job, events.encode(sink.final_event()))

    def chunk(sink: RedisSink, i: int) -> Callable[[], Awaitable[Any]]:
        return lambda: sink.chunks([worker.payloads[i]])

    try:
        # Every submit finds a free slot (the provider's capacity is huge) and dispatches at once.
        await step("submit, dispatching at once", "evalsha", [submit(f"j{i}", False) for i in range(jobs_n)])
        json_jobs = await assignments(jobs_n)
        for _job, sink in json_jobs:
            await sink.done(200, top.answer, "application/json")
        await step("finish, JSON answer", "evalsha", [finish(job, sink) for job, sink in json_jobs])
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
    slots = WorkerSide(script_calls(redis, None, config), redis, "n0")
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


# --- the report -----------------------------------------------------------------------------------


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    return (f"{os.cpu_count()} vCPUs ({cpu}), Linux {platform.release()}, Redis {redis_version()}, "
            f"Python {platform.python_version()}")


def load_average() -> str:
    return " / ".join(Path("/proc/loadavg").read_text().split()[:3]) + " (1 / 5 / 15 min)"


def redis_version() -> str:
    return RedisServer(data_dir=tempfile.gettempdir()).version()  # no server started, no directory made


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
    return p


if __name__ == "__main__":
    arguments = parser().parse_args()
    command = command_line(arguments)
    print(f"$ {command}\n")
    uvloop.install()
    report = asyncio.run(main(arguments))
    write_section("redis-capacity", command, report)
