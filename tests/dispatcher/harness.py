"""The script harnesses the script tests of tests/dispatcher share: a config of providers on
one node, and the API and worker sides of the dispatch scripts against one Redis; with lanes
(providers that serve some endpoints only); with tenants (flow control)."""

from __future__ import annotations

import json
import uuid
from typing import Any

from redis.asyncio import Redis

from dispatcher import config as cfg
from dispatcher import events, keys
from dispatcher.api_side import ApiSide
from dispatcher.events import Assignment, Failed, decode_record
from dispatcher.exceptions import ProviderUnreachable
from dispatcher.plans import Lane, Plans
from dispatcher.script_calls import ScriptCalls
from dispatcher.scripts import Scripts
from dispatcher.tenants import Tenant, Tenants
from dispatcher.worker_side import WorkerSide


def make_config(providers: dict[str, int], models: dict[str, list[str]], **queue: Any) -> cfg.Config:
    """Providers (id -> capacity) on node n1, served as '<model>@<provider>'."""
    return cfg.parse(
        {
            "queue": queue,
            "nodes": [
                {
                    "id": "n1",
                    "providers": [
                        {
                            "id": pid,
                            "type": "vllm",
                            "base_url": "http://127.0.0.1:1",
                            "capacity": cap,
                            "models": [f"{m}@{pid}" for m, ps in models.items() if pid in ps],
                        }
                        for pid, cap in providers.items()
                    ],
                }
            ],
            "models": [{"id": m, "providers": {p: f"{m}@{p}" for p in ps}} for m, ps in models.items()],
        }
    ).config


class Harness:
    def __init__(self, redis: Redis, config: cfg.Config) -> None:
        self.redis = redis
        self.config = config
        scripts = Scripts(redis)
        plans = Plans(config)
        self.scripts = scripts
        self.calls = ScriptCalls(scripts, config, plans)
        self.api = ApiSide(self.calls, redis, "rep1")
        self.node = WorkerSide(lambda: self.calls, redis, "n1")

    async def up(self, pid: str, health: str = "available") -> None:
        prov = next(p for _, p in self.config.providers() if p.id == pid)
        await self.node.heartbeat(pid, health, [("capacity", prov.capacity), ("node", "n1")])

    async def submit(self, model: str, job: str | None = None) -> tuple[str, str]:
        job = job or uuid.uuid4().hex
        m = self.config.model(model)
        assert m is not None
        lane = self.calls.plans.main_lane(m.id)
        result = await self.api.submit(job, lane, b'{"model":"%s"}' % model.encode(), "chat/completions", False)
        return job, result.status

    async def assignments(self) -> list[Assignment]:
        entries = await self.redis.xrange(keys.node("n1"))
        return [Assignment.from_entry(eid, fields) for eid, fields in entries]

    async def assignment(self, job: str) -> Assignment:
        return next(a for a in await self.assignments() if a.job == job)

    async def in_flight(self, pid: str) -> int:
        return int(await self.redis.hget(keys.provider(pid), "in_flight") or 0)

    async def set_in_flight(self, pid: str, n: int) -> None:
        await self.redis.hset(keys.provider(pid), "in_flight", n)

    async def record(self, job: str) -> Any:
        raw = await self.redis.hget(keys.JOBS, job)
        return None if raw is None else decode_record(raw)

    async def queued(self, model: str) -> list[str]:
        return [j.decode() for j in await self.redis.zrange(keys.queue(model), 0, -1)]

    async def now_ms(self) -> int:
        """The server's clock, ms, as the scripts read it (lua/lib/jobs.lua now_ms)."""
        seconds, micros = await self.redis.time()
        return seconds * 1000 + micros // 1000

    async def backdate(self, job: str, field: str, ms: int) -> None:
        """Move the time ``field`` of ``job``'s record ``ms`` into the past, as if that long
        had gone by since a script wrote it: the scripts read the server's clock, which a
        test cannot move, and a real wait would race a loaded machine."""
        raw = await self.redis.hget(keys.JOBS, job)
        assert raw is not None, f"no record of {job}"
        rec = json.loads(raw)
        assert isinstance(rec.get(field), int), (field, rec)
        rec[field] -= ms
        await self.redis.hset(keys.JOBS, job, json.dumps(rec))


def lane_config(
    endpoints: dict[str, list[str] | None], capacity: int = 1, max_attempts: int = 3, hold_ms: int = 0
) -> cfg.Config:
    """Providers (id -> endpoints, None = the type's default) on node n1, all serving model m;
    ``hold_ms``: its queue.hold_when_unavailable_ms."""
    return cfg.parse({
        "dispatch": {"max_attempts": max_attempts},
        "queue": {"hold_when_unavailable_ms": hold_ms},
        "nodes": [{"id": "n1", "providers": [
            {"id": pid, "type": "vllm", "base_url": "http://127.0.0.1:1", "capacity": capacity,
             "models": [f"m@{pid}"], **({"endpoints": eps} if eps is not None else {})}
            for pid, eps in endpoints.items()
        ]}],
        "models": [{"id": "m", "providers": {pid: f"m@{pid}" for pid in endpoints}}],
    }).config


class LaneHarness(Harness):
    """A Harness that submits to a given lane and finishes jobs as done or failed."""

    async def submit_to(self, lane: Lane, pinned: bool = False, endpoint: str = "chat/completions") -> tuple[str, str]:
        job = uuid.uuid4().hex
        result = await self.api.submit(job, lane, b'{"model":"m"}', endpoint, False, pinned)
        return job, result.status

    async def fail(self, job: str) -> str:
        """The provider failed ``job`` before any output (workers/job_run.py: retry)."""
        a = await self.assignment(job)
        event = events.encode(Failed.from_error(ProviderUnreachable("provider answered 500")))
        return str(await self.node.finish(a, event, mode="retry"))

    async def done(self, job: str) -> str:
        return str(await self.node.finish(await self.assignment(job), b"", mode="done"))


class FairHarness(Harness):
    """A Harness with tenants: jobs sent as a tenant, in a band, under its limits."""

    def __init__(self, redis: Redis, config: cfg.Config) -> None:
        super().__init__(redis, config)
        self.tenants = Tenants(config)

    async def start(self) -> None:
        await self.scripts.load()
        limits = self.tenants.limits()
        if limits:
            await self.redis.hset(keys.TENANT_LIMITS, mapping=limits)  # type: ignore[arg-type]
        for _, prov in self.config.providers():
            await self.up(prov.id)

    async def send(self, tenant: str, band: int | None = None) -> tuple[str, str]:
        t: Tenant = self.tenants.by_name[tenant]
        plans: Plans = self.calls.plans
        lane = plans.banded(plans.main_lane("m"), t.band if band is None else band)
        job = t.job_id(uuid.uuid4().hex[:12])
        result = await self.api.submit(job, lane, b'{"model":"m"}', "chat/completions", False, tenant=t)
        return job, result.status

    async def running(self) -> list[str]:
        return [a.job for a in await self.assignments() if await self.record(a.job) is not None]

    async def finish_one(self, job: str) -> list[str]:
        """Finish ``job``; the jobs dispatched by the freed slot."""
        before = {a.job for a in await self.assignments()}
        await self.node.finish(await self.assignment(job), b"", mode="done")
        return [a.job for a in await self.assignments() if a.job not in before]

    async def counters(self) -> dict[str, int]:
        raw = await self.redis.hgetall(keys.TENANTS)
        return {k.decode(): int(v) for k, v in raw.items() if int(v)}


def tenant_of(job: str) -> str:
    return job.partition("~")[0]


async def drain(h: FairHarness, n: int) -> list[str]:
    """Finish running jobs one at a time, ``n`` times: the order the freed slots went in."""
    order: list[str] = []
    for _ in range(n):
        running = await h.running()
        assert running, "nothing running"
        order += [tenant_of(j) for j in await h.finish_one(running[0])]
    return order
