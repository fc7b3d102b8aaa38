"""The reaper against real Redis: expired leases, dead replicas, orphaned jobs."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from dispatcher import events, keys
from dispatcher.events import Failed, Meta, Requeued, Start
from dispatcher.reaper import ORPHAN_GRACE_MS, Reaper, Reconciled, gone
from dispatcher.script_calls import Abort, AbortReason, CancelReason, Correction
from tests.dispatcher.harness import Harness, make_config

pytestmark = pytest.mark.anyio


def reaper_of(h: Harness, owner: str = "reaper-1") -> Reaper:
    return Reaper(h.calls, h.redis, owner)


async def reap(reaper: Reaper) -> dict[str, int]:
    """The lease step of a round, with the round marker fresh as if rounds had been running."""
    now = await reaper.now_ms()
    await reaper.redis.hset(keys.REAPER_SEEN, mapping={"ms": now})
    return await reaper.reap_leases(now)


async def expire_lease(h: Harness, job: str) -> None:
    await h.redis.zadd(keys.LEASES, {job: 1})


async def reply_events(h: Harness) -> list[tuple[str, events.Event]]:
    entries = await h.redis.xrange(keys.reply("rep1"))
    return [(f[b"job"].decode(), events.decode(f[b"event"])) for _, f in entries]


@pytest.fixture
def h(any_redis: Redis) -> Harness:
    # Held: some jobs here wait with no provider up.
    return Harness(any_redis, make_config({"a": 1}, {"m": ["a"]}, hold_when_unavailable_ms=3_600_000))


async def test_live_lease_is_left_alone(h: Harness) -> None:
    await h.up("a")
    await h.submit("m")
    reaper = reaper_of(h)
    assert await reap(reaper) == {}
    assert await h.in_flight("a") == 1


async def test_lost_job_without_output_goes_back_to_its_place(h: Harness) -> None:
    await h.up("a")
    first, _ = await h.submit("m")
    later, _ = await h.submit("m")
    lost = await h.assignment(first)
    await expire_lease(h, first)
    reaper = reaper_of(h)
    assert await reap(reaper) == {"requeued": 1}
    # Requeued ahead of the job submitted after it, and dispatched again at once.
    (again,) = await h.assignments()
    assert again.job == first
    assert again.attempt == 2
    assert again.fence != lost.fence
    assert await h.queued("m") == [later]
    assert await h.in_flight("a") == 1
    # The dead worker's late writes are refused.
    assert await h.node.emit(lost, b"late") == "stale"
    assert await h.node.finish(lost, b"late") == "stale"
    assert await h.in_flight("a") == 1
    # Its API learns at once that it waits again (and re-arms its queue deadline).
    assert await reply_events(h) == [(first, Requeued())]


async def test_lost_job_after_output_fails_with_worker_lost(h: Harness) -> None:
    await h.up("a")
    job, _ = await h.submit("m")
    a = await h.assignment(job)
    start = Start(Meta("a", "n1", a.target, 0), 200, [b"{}"])
    assert await h.node.emit(a, events.encode(start)) == "ok"
    await expire_lease(h, job)
    reaper = reaper_of(h)
    assert await reap(reaper) == {"failed": 1}
    evs = await reply_events(h)
    assert [j for j, _ in evs] == [job, job]
    assert evs[0][1] == start
    final = evs[1][1]
    assert isinstance(final, Failed)
    assert (final.status, final.code) == (502, "worker_lost")
    assert await h.record(job) is None
    assert await h.in_flight("a") == 0
    assert await h.redis.xlen(keys.node("n1")) == 0


async def test_attempts_are_bounded(h: Harness) -> None:
    await h.up("a")
    job, _ = await h.submit("m")
    reaper = reaper_of(h)
    outcomes = []
    for _ in range(3):
        if not await h.redis.zscore(keys.LEASES, job):
            break
        await expire_lease(h, job)
        outcomes.append(await reap(reaper))
    # max_attempts defaults to 2: one redispatch, then the client is told.
    assert outcomes == [{"requeued": 1}, {"failed": 1}]
    (_, requeued), (_, final) = await reply_events(h)
    assert requeued == Requeued()
    assert isinstance(final, Failed)
    assert final.code == "worker_lost"
    assert await h.in_flight("a") == 0


async def test_lost_cancelled_job_is_dropped_silently(h: Harness) -> None:
    await h.up("a")
    job, _ = await h.submit("m")
    assert (await h.api.cancel(job, keys.queue("m"), CancelReason.CLIENT)).outcome == "cancelling"
    await expire_lease(h, job)
    reaper = reaper_of(h)
    assert await reap(reaper) == {"dropped": 1}
    assert await reply_events(h) == []
    assert await h.record(job) is None
    assert await h.in_flight("a") == 0


async def test_one_round_per_interval_across_processes(h: Harness) -> None:
    first, second = reaper_of(h, "r1"), reaper_of(h, "r2")
    assert await first.run_once() is not None
    assert await second.run_once() is None


async def test_dead_replica_jobs_are_cancelled(h: Harness) -> None:
    await h.up("a")
    running, _ = await h.submit("m")
    waiting, _ = await h.submit("m")
    await h.api.heartbeat()
    await h.redis.zadd(keys.REPLICAS, {"rep1": 1})  # its liveness ran out
    reaper = reaper_of(h)
    assert await reaper.reap_replicas(await reaper.now_ms()) == 1
    assert await h.queued("m") == []
    assert await h.record(waiting) is None
    assert (await h.record(running)).state == "c"
    # Its worker learns at the next renewal (or on the cancel channel) and releases.
    a = await h.assignment(running)
    assert await h.node.renew([(running, a.fence)]) == [Abort(running, a.fence, AbortReason.CANCELLED)]
    await h.node.finish(a, None)
    assert await h.in_flight("a") == 0
    assert await reaper.reap_replicas(await reaper.now_ms()) == 1
    assert await h.redis.zscore(keys.REPLICAS, "rep1") is None


async def test_orphans_long_past_their_deadline_are_removed(h: Harness) -> None:
    job, status = await h.submit("m")  # no provider is up: it waits
    assert status == "queued"
    reaper = reaper_of(h)
    now = await reaper.now_ms()
    assert await reaper.reap_orphans(now) == 0
    await h.redis.zadd(keys.DEADLINES, {job: now - ORPHAN_GRACE_MS - 1})
    assert await reaper.reap_orphans(now) == 1
    assert await h.queued("m") == []
    assert await h.record(job) is None
    assert await h.redis.hlen(keys.BODIES) == 0


async def test_reconcile_sets_in_flight_to_the_live_leases(h: Harness) -> None:
    await h.up("a")
    await h.submit("m")
    await h.set_in_flight("a", 5)
    await h.redis.zadd(keys.LEASES, {"ghost-job": 10**15})  # a lease no record backs
    reaper = reaper_of(h)
    assert await reaper.reconcile() == Reconciled([Correction("a", 5, 1)], [])
    assert await h.in_flight("a") == 1
    assert await h.redis.zscore(keys.LEASES, "ghost-job") is None
    assert await reaper.reconcile() == Reconciled([], [])


# --- gaps in the fleet's view of Redis --------------------------------------------------------


async def test_after_a_gap_expiries_get_a_fresh_period_instead_of_a_verdict(h: Harness) -> None:
    await h.up("a")
    job, _ = await h.submit("m")
    await h.api.heartbeat()
    reaper = reaper_of(h)
    assert await reaper.run_once() is not None  # the first round ever: a gap too
    now = await reaper.now_ms()
    # Redis was away for ten gap lengths: nobody could renew or heartbeat meanwhile.
    await h.redis.hset(keys.REAPER_SEEN, "ms", now - 10 * h.config.dispatch.observation_gap_ms)
    await expire_lease(h, job)
    await h.redis.zadd(keys.REPLICAS, {"rep1": 1})
    await h.redis.delete(keys.REAPER_LOCK)
    stats = await reaper.run_once()
    assert stats is not None
    assert stats.gap_ms >= 10 * h.config.dispatch.observation_gap_ms
    assert stats.leases == {}
    assert stats.replicas == 0
    lease = await h.redis.zscore(keys.LEASES, job)
    assert lease is not None
    assert lease >= now + h.config.dispatch.lease_ms - 100
    replica = await h.redis.zscore(keys.REPLICAS, "rep1")
    assert replica is not None
    assert replica >= now + h.config.dispatch.replica_ttl_ms - 100
    assert await h.in_flight("a") == 1
    assert (await h.record(job)).state == "d"


async def test_a_round_that_lost_sight_of_redis_judges_no_lease(h: Harness) -> None:
    await h.up("a")
    job, _ = await h.submit("m")
    reaper = reaper_of(h)
    now = await reaper.now_ms()
    await h.redis.hset(keys.REAPER_SEEN, "ms", now - 2 * h.config.dispatch.observation_gap_ms)
    await expire_lease(h, job)
    assert await reaper.reap_leases(now) == {"skip": 1}
    assert await h.in_flight("a") == 1


async def test_a_new_server_refreshes_expiries_and_reconciles(h: Harness) -> None:
    await h.up("a")
    job, _ = await h.submit("m")
    reaper = reaper_of(h)
    assert await reaper.run_once() is not None
    # A failover or restart: the marker was written by another server.
    await h.redis.hset(keys.REAPER_SEEN, "run", "another-server")
    await expire_lease(h, job)
    await h.set_in_flight("a", 0)  # the new primary missed an increment
    await h.redis.delete(keys.REAPER_LOCK)
    stats = await reaper.run_once()
    assert stats is not None
    assert stats.new_server
    assert stats.gap_ms == 0
    assert stats.leases == {}
    assert stats.corrected == Reconciled([Correction("a", 0, 1)], [])
    assert await h.in_flight("a") == 1


async def test_after_a_failover_no_reaper_judges_providers_by_heartbeats_for_a_ttl(any_redis: Redis) -> None:
    """Every process runs reaper rounds, and the first after a failover is the one that sees
    the new server. The next round, in another process, must not take the heartbeats that
    could not land across the failover for dead workers (as a waiting request answered 503
    no_provider_available would): the wait is the fleet's, kept in Redis, not the first
    reaper's."""
    h = Harness(any_redis, make_config({"a": 1, "b": 1}, {"m": ["a"], "n": ["b"]}))
    await h.up("a")
    await h.submit("m")
    waiting, status = await h.submit("m")
    assert status == "queued"
    first, second = reaper_of(h, "api-1"), reaper_of(h, "worker-n1")
    assert await first.run_once() is not None
    await h.redis.delete(keys.REAPER_LOCK)
    assert await second.run_once() is not None
    # A failover: the marker was written by the old master; across it no heartbeat landed.
    await h.redis.hset(keys.REAPER_SEEN, "run", "the-old-master")
    await h.redis.hset(keys.provider("a"), "hb_exp", 1)
    await h.redis.delete(keys.REAPER_LOCK)
    stats = await first.run_once()
    assert stats is not None
    assert (stats.new_server, stats.refused) == (True, 0)
    await h.redis.delete(keys.REAPER_LOCK)
    stats = await second.run_once()
    assert stats is not None
    assert (stats.new_server, stats.gap_ms, stats.refused) == (False, 0, 0)
    assert await h.queued("m") == [waiting]
    # A heartbeat TTL later (moved into the past, not waited for), with no worker heard since
    # the failover: the whole fleet may still be cut off from the new server. Nobody is judged.
    await h.redis.hset(keys.REAPER_SEEN, "judge", 0)
    await h.redis.delete(keys.REAPER_LOCK)
    stats = await second.run_once()
    assert stats is not None
    assert stats.refused == 0
    assert await h.queued("m") == [waiting]
    # Another worker reaches it (b's heartbeat): a's silence is its own, and it is dead.
    await h.up("b")
    await h.redis.delete(keys.REAPER_LOCK)
    stats = await second.run_once()
    assert stats is not None
    assert stats.refused == 1
    assert await h.queued("m") == []
    assert await h.redis.hget(keys.REAPER_SEEN, "quiet") is None

async def test_a_provider_is_gone_when_a_reload_removed_it_or_its_worker_is_silent(h: Harness) -> None:
    # What decides whether a job pinned to a provider no lane serves is answered (rehome_queue).
    assert await gone(h.redis, "a")  # never heard of
    await h.up("a")
    assert not await gone(h.redis, "a")
    await h.redis.hset(keys.provider("a"), "removed", 1)
    assert await gone(h.redis, "a")  # heartbeat fresh, but its worker's reload removed it
    await h.redis.hset(keys.provider("a"), mapping={"removed": "", "hb_exp": 1})
    assert await gone(h.redis, "a")  # its heartbeat ran out
