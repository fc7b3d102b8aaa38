"""A worker's side of its node stream (workers/node_stream.py), against a private
redis-server: jobs read through the consumer group, the entries handed back at shutdown
and after a lost finish, leaving the group, waiting for Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from dispatcher import keys
from dispatcher.config import parse
from dispatcher.events import Assignment
from dispatcher.fastredis import FastRedis
from dispatcher.redis_conn import connect_fast
from dispatcher.scripts import Scripts
from dispatcher.worker_side import WorkerSide
from iop.redis_server import RedisServer
from tests.waiting import EVENTUALLY_S, eventually
from workers.leases import Runs
from workers.node_stream import NodeStream, wait_for_redis
from workers.runtime import NodeRuntime

pytestmark = pytest.mark.anyio

NODE = "n1"
CONSUMER = "worker-a"
LEASE_MS = 900  # a short blocking read (a third of it): the reads end soon after a stop


def fields(job: str) -> dict[str, str | int]:
    """A node stream entry as lua/lib/pump.lua writes it."""
    return {"job": job, "fence": 1, "provider": "p", "target": "t", "model": "m", "lane": "", "replica": "r1",
            "endpoint": "chat/completions", "stream": 0, "attempt": 1, "submitted_ms": 0, "dispatched_ms": 0,
            "body": "{}"}


@dataclass
class Jobs:
    """What the stream started: jobs run, jobs handed back."""

    ran: list[str] = field(default_factory=list)
    handed_back: list[str] = field(default_factory=list)

    async def run(self, job: Assignment) -> None:
        self.ran.append(job.job)

    async def hand_back(self, job: Assignment) -> None:
        self.handed_back.append(job.job)


@dataclass
class Stream:
    stream: NodeStream
    side: WorkerSide
    runs: Runs
    jobs: Jobs
    redis: Redis


@pytest.fixture
async def node_stream(redis_server: RedisServer, redis: Redis) -> AsyncIterator[Stream]:
    config = parse({
        "redis": {"url": redis_server.url},
        "models": [{"id": "m", "providers": {"p": "t"}}],
        "nodes": [{"id": NODE, "providers": [{"id": "p", "type": "openai_api", "base_url": "http://127.0.0.1:9",
                                               "models": ["t"], "capacity": 1}]}],
        "dispatch": {"lease_ms": LEASE_MS},
    }).config
    control = Redis.from_url(redis_server.url)
    blocking: FastRedis = connect_fast(redis_server.url)
    runtime = NodeRuntime.build(config, NODE, Scripts(control))
    assert runtime is not None
    side = WorkerSide(lambda: runtime.calls, control, NODE)
    runs = Runs(keep_s=60)
    jobs = Jobs()
    stream = NodeStream(side, blocking, control, CONSUMER, LEASE_MS, runs, run=jobs.run, hand_back=jobs.hand_back)
    try:
        yield Stream(stream, side, runs, jobs, redis)
    finally:
        await blocking.close()
        await control.aclose()


async def add(redis: Redis, job: str) -> str:
    entry_id: bytes = await redis.xadd(keys.node(NODE), fields(job))  # type: ignore[arg-type]
    return entry_id.decode()



async def pending(redis: Redis, consumer: str = CONSUMER) -> list[str]:
    found = await redis.xpending_range(keys.node(NODE), keys.NODE_GROUP, "-", "+", 100, consumername=consumer)
    return [p["message_id"].decode() for p in found]


async def test_consume_starts_each_job_read_and_ends_at_stop(node_stream: Stream) -> None:
    s = node_stream
    await s.side.ensure_group()
    async with anyio.create_task_group() as tg:
        tg.start_soon(s.stream.consume, tg)
        for name in ("a", "b", "c"):
            await add(s.redis, name)
        await eventually(lambda: len(s.jobs.ran) == 3)
        s.stream.stop()  # consume returns: the task group ends
    assert s.jobs.ran == ["a", "b", "c"]
    assert s.jobs.handed_back == []
    assert len(await pending(s.redis)) == 3  # read as this consumer: pending until each finishes


async def test_consume_makes_the_group_when_it_is_missing(node_stream: Stream) -> None:
    """A Redis that lost the group (a restart without persistence): it is made again."""
    s = node_stream
    async with anyio.create_task_group() as tg:
        tg.start_soon(s.stream.consume, tg)
        await add(s.redis, "a")
        await eventually(lambda: s.jobs.ran == ["a"])
        s.stream.stop()


async def test_a_stopped_stream_reads_nothing(node_stream: Stream) -> None:
    s = node_stream
    await s.side.ensure_group()
    await add(s.redis, "a")
    s.stream.stop()
    with anyio.fail_after(EVENTUALLY_S):
        async with anyio.create_task_group() as tg:
            await s.stream.consume(tg)
    assert s.jobs.ran == []
    assert await pending(s.redis) == []


async def test_at_shutdown_what_was_never_started_is_handed_back(node_stream: Stream) -> None:
    s = node_stream
    await s.side.ensure_group()
    running_entry = await add(s.redis, "running")
    await add(s.redis, "delivered")
    # Both delivered to this consumer; only the first one runs here.
    await s.redis.xreadgroup(keys.NODE_GROUP, CONSUMER, {keys.node(NODE): ">"})
    s.runs.start(Assignment.from_entry(running_entry, {k.encode(): str(v).encode() for k, v in
                                                        fields("running").items()}))
    await add(s.redis, "new")  # dispatched here after the worker stopped reading
    async with anyio.create_task_group() as tg:
        await s.stream.hand_back_unstarted(tg)
    assert sorted(s.jobs.handed_back) == ["delivered", "new"]
    assert s.jobs.ran == []


async def test_entries_pending_here_that_do_not_run_are_handed_back(node_stream: Stream) -> None:
    """A finish a failover lost: the entry stays pending here with nobody to renew it."""
    s = node_stream
    await s.side.ensure_group()
    ghost = await add(s.redis, "ghost")
    running_entry = await add(s.redis, "running")
    deleted = await add(s.redis, "deleted")
    young = await add(s.redis, "young")
    await s.redis.xreadgroup(keys.NODE_GROUP, CONSUMER, {keys.node(NODE): ">"})
    s.runs.start(Assignment.from_entry(running_entry, {k.encode(): str(v).encode() for k, v in
                                                        fields("running").items()}))
    await s.redis.xdel(keys.node(NODE), deleted)
    # Pending long enough to be a ghost (all but the young one), without waiting for it.
    await s.redis.xclaim(keys.node(NODE), keys.NODE_GROUP, CONSUMER, 0, [ghost, running_entry, deleted], idle=60_000)
    await s.redis.xclaim(keys.node(NODE), keys.NODE_GROUP, CONSUMER, 0, [young], idle=0)
    await s.stream.settle_ghosts()
    assert s.jobs.handed_back == ["ghost"]
    left = await pending(s.redis)
    assert deleted not in left  # its entry is gone: acknowledged
    assert {running_entry, young} <= set(left)


async def test_a_worker_leaves_the_group_only_when_it_holds_nothing(node_stream: Stream) -> None:
    s = node_stream
    await s.side.ensure_group()
    entry = await add(s.redis, "a")
    await s.redis.xreadgroup(keys.NODE_GROUP, CONSUMER, {keys.node(NODE): ">"})

    async def consumers() -> list[str]:
        found = await s.redis.xinfo_consumers(keys.node(NODE), keys.NODE_GROUP)
        return [c["name"].decode() for c in found]

    await s.stream.leave_group()
    assert await consumers() == [CONSUMER]  # it still holds an entry
    await s.redis.xack(keys.node(NODE), keys.NODE_GROUP, entry)
    await s.stream.leave_group()
    assert await consumers() == []


async def test_wait_for_redis_returns_once_redis_answers() -> None:
    class Flaky:
        def __init__(self) -> None:
            self.pings = 0

        async def ping(self) -> bool:
            self.pings += 1
            if self.pings < 3:
                raise RedisConnectionError("not yet")
            return True

    flaky = Flaky()
    with anyio.fail_after(EVENTUALLY_S):
        await wait_for_redis(flaky)  # type: ignore[arg-type]
    assert flaky.pings == 3
