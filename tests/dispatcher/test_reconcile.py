"""Reconcile puts flow control's tenant counters back in step with the job records
(lua/reconcile.lua), against real Redis servers, and leaves counters that are right alone."""

from __future__ import annotations

import json
import uuid
from collections import Counter

import pytest
from redis.asyncio import Redis

from dispatcher import config as cfg
from dispatcher import keys
from dispatcher.reaper import Reaper, Reconciled
from dispatcher.script_calls import CancelReason, Correction
from tests.dispatcher.harness import FairHarness

pytestmark = pytest.mark.anyio


def two_models() -> cfg.Config:
    """Tenants a and b; models m and n on one provider with two slots."""
    return cfg.parse({
        "api": {"keys": [{"name": "a", "key_sha256": "1" * 64}, {"name": "b", "key_sha256": "2" * 64}]},
        "nodes": [{"id": "n1", "providers": [
            {"id": "p0", "type": "vllm", "base_url": "http://127.0.0.1:1", "capacity": 2, "models": ["s"]}]}],
        "models": [{"id": "m", "providers": {"p0": "s"}}, {"id": "n", "providers": {"p0": "s"}}],
    }).config


class Pool(FairHarness):
    async def send_to(self, tenant: str, model: str) -> str:
        t = self.tenants.by_name[tenant]
        job = t.job_id(uuid.uuid4().hex[:12])
        lane = self.calls.plans.main_lane(model)
        await self.api.submit(job, lane, b'{"model":"%s"}' % model.encode(), "chat/completions", False, tenant=t)
        return job

    async def raw_counters(self) -> dict[str, str]:
        raw = await self.redis.hgetall(keys.TENANTS)
        return {k.decode(): v.decode() for k, v in raw.items()}

    async def from_records(self) -> dict[str, int]:
        """What the counters must say, worked out here from the records and leases alone."""
        want: Counter[str] = Counter()
        leased = {j.decode() for j in await self.redis.zrange(keys.LEASES, 0, -1)}
        for job, raw in (await self.redis.hgetall(keys.JOBS)).items():
            rec = json.loads(raw)
            kind = "r" if job.decode() in leased else "q" if rec["state"] == "q" else None
            if kind:
                want.update([f"{kind}:{rec['tenant']}", f"{kind}:{rec['tenant']}:{rec['model']}"])
        return dict(want)


@pytest.fixture
async def pool(any_redis: Redis) -> Pool:
    """Every state a job's record can be in, reached through the scripts themselves: a and b
    each run one job (b's is being cancelled: 'c'), two wait ('q'), one expired ('x')."""
    h = Pool(any_redis, two_models())
    await h.start()
    running_a = await h.send_to("a", "m")
    running_b = await h.send_to("b", "n")
    expired = await h.send_to("a", "m")
    await h.send_to("b", "m")
    await h.send_to("a", "n")
    await h.send_to("b", "n")
    assert (await h.api.cancel(running_b, keys.queue("n"), CancelReason.CLIENT)).outcome == "cancelling"
    # a's waiting job (first in line: a's tag ties b's, and 'a~' sorts first) passes its
    # deadline: the pump that runs when a slot frees expires it, and runs b's job instead.
    await h.redis.zadd(keys.DEADLINES, {expired: 1})
    await h.node.finish(await h.assignment(running_a), b"", mode="done")
    states = Counter(json.loads(raw)["state"] for raw in (await h.redis.hgetall(keys.JOBS)).values())
    assert states == {"d": 1, "c": 1, "q": 2, "x": 1}, states
    return h


def reaper_of(h: Pool) -> Reaper:
    return Reaper(h.calls, h.redis, "reaper-1")


async def test_counters_kept_by_the_scripts_are_left_alone(pool: Pool) -> None:
    before = await pool.raw_counters()
    assert "0" in before.values(), "no counter back at 0: the case proves less than it should"
    assert await pool.counters() == await pool.from_records()
    assert await reaper_of(pool).reconcile() == Reconciled([], [])
    # Not rewritten either: a field the scripts left at 0 is still there, as it was.
    assert await pool.raw_counters() == before


async def test_counters_out_of_step_are_rebuilt_from_the_job_records(pool: Pool) -> None:
    right = await pool.counters()
    # The freed slot went to b's job of m (a's, first in line, had expired: it counts
    # nowhere); b's cancelling job still runs.
    assert right == {"q:a": 1, "q:a:n": 1, "q:b": 1, "q:b:n": 1, "r:b": 2, "r:b:m": 1, "r:b:n": 1}
    assert right == await pool.from_records()
    await pool.redis.hset(keys.TENANTS, mapping={
        "q:a": 7,  # too many waiting
        "r:b:n": 0,  # a running job not counted
        "r:a": 5,  # running jobs that ended long ago
        "q:ghost": 2, "q:ghost:m": 2,  # a tenant with no job at all
    })
    await pool.redis.hdel(keys.TENANTS, "q:a:n")  # a counter lost
    fixes = await reaper_of(pool).reconcile()
    assert fixes == Reconciled([], [
        Correction("q:a", 7, 1),
        Correction("q:a:n", 0, 1),
        Correction("q:ghost", 2, 0),
        Correction("q:ghost:m", 2, 0),
        Correction("r:a", 5, 0),
        Correction("r:b:n", 0, 1),
    ])
    assert await pool.counters() == right
    assert "q:ghost" not in await pool.raw_counters()
    assert await reaper_of(pool).reconcile() == Reconciled([], [])


async def test_counters_and_in_flight_are_corrected_in_the_same_run(pool: Pool) -> None:
    await pool.set_in_flight("p0", 0)
    await pool.redis.hset(keys.TENANTS, "r:b", 4)
    assert await reaper_of(pool).reconcile() == Reconciled([Correction("p0", 0, 2)], [Correction("r:b", 4, 2)])


async def test_without_flow_control_no_counter_is_kept(any_redis: Redis) -> None:
    """Jobs that name no tenant count nowhere (lib/jobs.lua), so leftovers of a config that
    had flow control go."""
    config = cfg.parse({
        "nodes": [{"id": "n1", "providers": [
            {"id": "p0", "type": "vllm", "base_url": "http://127.0.0.1:1", "capacity": 1, "models": ["s"]}]}],
        "models": [{"id": "m", "providers": {"p0": "s"}}],
    }).config
    h = Pool(any_redis, config)
    await h.start()
    await h.submit("m")
    await h.submit("m")
    await h.redis.hset(keys.TENANTS, mapping={"q:a": 1, "r:a": 0})
    assert await reaper_of(h).reconcile() == Reconciled([], [Correction("q:a", 1, 0)])
    assert await h.raw_counters() == {"r:a": "0"}
