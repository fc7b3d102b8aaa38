"""Maintenance that keeps Redis honest when processes die: expired leases, dead API
replicas, and waiting jobs nobody will ever collect.

It runs inside every API and worker process; a short lock lets one of them do a round
per interval. Each round reads candidates with plain commands, then hands every one to
a script that checks it again before acting, so a round that races with normal
traffic -- or with another round -- changes nothing it should not.

A round never judges liveness across a gap in the fleet's view of Redis: ``reap_round``
opens it, and when the last round is too long ago (Redis was down or restored) or ran on
another server (a restart or a failover), it first gives every lease and replica a fresh
period, and the round then reconciles in_flight with the leases the server holds (and the
tenant counters with its job records). Silent workers are judged dead only a heartbeat TTL
after the gap, and only once some worker has been heard since it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import anyio
from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from dispatcher import events, keys, wire
from dispatcher.config import Config
from dispatcher.events import Failed, decode_record
from dispatcher.exceptions import WorkerLost
from dispatcher.plans import Lane
from dispatcher.script_calls import CancelReason, Correction, ReapOutcome, Round, ScriptCalls

log = logging.getLogger("iop.reaper")

BATCH = 200
# A live API cancels its own expired jobs at their deadline; this is the backstop for
# one that could not (Redis was away at that moment).
ORPHAN_GRACE_MS = 30_000
# Rounds between the slower checks: in_flight against leases, tenant counters against job
# records, and departed consumers.
RECONCILE_EVERY = 30
# A consumer (worker process) idle this long with nothing pending is gone: a live worker
# reads at least every third of a lease, and one removed by mistake is recreated by its
# next read, so the threshold only needs to be safely above a read.
CONSUMER_IDLE_MS = 60_000


@dataclass(frozen=True, slots=True)
class Reconciled:
    """What a reconcile corrected: providers' in_flight, and flow control's tenant counters
    (there ``provider`` is the counter's field of ``keys.TENANTS``, e.g. ``r:acme:qwen``)."""

    in_flight: list[Correction]
    counters: list[Correction]


@dataclass
class ReapStats:
    leases: dict[str, int]
    gap_ms: int = 0  # > 0: time since the last round; -1: no round was ever recorded
    new_server: bool = False
    replicas: int = 0
    orphans: int = 0
    refused: int = 0
    rehomed: int = 0
    corrected: Reconciled | None = None


class Reaper:
    """``calls``: the script calls of the config in force, or how to get them at each use (a
    process whose reload swaps them: workers/worker.py); a round's period is the first
    config's (``dispatch`` changes only at a restart)."""

    def __init__(self, calls: ScriptCalls | Callable[[], ScriptCalls], redis: Redis, owner: str) -> None:
        self.redis = redis
        self.owner = owner
        self.rounds = 0
        self._quiet_logged = 0  # the gap whose quiet fleet was last logged
        self._calls: Callable[[], ScriptCalls] = calls if callable(calls) else (lambda: calls)
        self._lost_event = events.encode(
            Failed.from_error(WorkerLost("the worker running this request was lost"))
        )

    def use(self, calls: ScriptCalls) -> None:
        """Work from ``calls``' config from now on (a reload, in a process that hands the
        reaper its script calls: api/gateway.py)."""
        self._calls = lambda: calls

    @property
    def calls(self) -> ScriptCalls:
        return self._calls()

    @property
    def config(self) -> Config:
        return self.calls.config

    @property
    def provider_ids(self) -> list[str]:
        return [p.id for _, p in self.config.providers()]

    async def run_forever(self) -> None:
        """A round every ``reap_period_ms`` (when this process wins the lock), for good."""
        period = self.config.dispatch.reap_period_ms / 1000
        while True:
            await anyio.sleep(period)
            try:
                await self.run_once()
            except RedisError as exc:
                log.warning("reaper round failed: %s", exc)

    async def run_once(self) -> ReapStats | None:
        """One round, if no other process holds the round lock; None when skipped."""
        interval = self.config.dispatch.reap_period_ms
        if not await self.redis.set(keys.REAPER_LOCK, self.owner, nx=True, px=interval):
            return None
        round_ = await self.open_round()
        now, gap_ms, new_server = round_.now_ms, round_.gap_ms, round_.new_server
        if gap_ms > 0 or new_server:
            log.warning("%s: every lease and replica gets a fresh period before anyone is judged",
                        "Redis is a new server (restart or failover)" if new_server
                        else f"no reaper round for {gap_ms} ms")
        elif gap_ms < 0:
            log.info("first reaper round on this Redis")
        stats = ReapStats(leases=await self.reap_leases(now), gap_ms=gap_ms, new_server=new_server)
        stats.replicas = await self.reap_replicas(now)
        stats.orphans = await self.reap_orphans(now)
        stats.rehomed = await self.rehome()
        # Not sooner after a gap, whichever process saw it: heartbeats could not be written
        # across it either, and a provider looks stale until its worker's next one, which
        # must not answer its waiting jobs. Nor while no worker at all has been heard since
        # (lua/reap_round.lua): the fleet may be cut off as a whole.
        if now >= round_.judge_from_ms and not round_.quiet_since_ms:
            stats.refused = await self.refuse_unavailable(now)
        elif now >= round_.judge_from_ms and round_.quiet_since_ms != self._quiet_logged:
            self._quiet_logged = round_.quiet_since_ms
            log.warning("no worker has reached Redis since the gap %.1fs ago: its silent workers "
                        "are not taken for dead ones, and the jobs waiting for them wait",
                        (now - round_.quiet_since_ms) / 1000)
        if self.rounds % RECONCILE_EVERY == 0 or gap_ms or new_server:
            stats.corrected = await self.reconcile()
            await self.forget_departed_consumers()
        self.rounds += 1
        return stats

    async def rehome(self) -> int:
        """Waiting jobs in lane queues no plan of this config pumps (a reload renamed their lane,
        or a replica not yet reloaded queued them there): moved to the lane each belongs in
        now. Returns how many moved. During a rolling reload a process still on the old config
        may move some back; each move keeps the job's place, and the last config wins.
        A lane of one provider that only jobs pinned to it belong in is looked at too: a
        reload that added a provider to the providers of an endpoint only that one served
        turned its lane into the pinned lane, and the endpoint's jobs waiting there since
        belong in the new lane of both."""
        moved = 0
        known, pinned_only = self.calls.plans.by_queue, self.calls.plans.pinned_only
        async for raw_key in self.redis.scan_iter(match=keys.queue("*"), count=1000):
            queue = raw_key.decode() if isinstance(raw_key, bytes) else str(raw_key)
            if queue in known and queue not in pinned_only:
                continue
            moved += await rehome_queue(self.calls, queue, BATCH)
        return moved

    async def refuse_unavailable(self, opened_ms: int) -> int:
        """Waiting jobs whose lanes have no provider that can take work (its worker died, or a
        model's hold ran out): answered 503 no_provider_available now, not at their deadline.
        ``opened_ms``: the round's server time (``ScriptCalls.refuse``)."""
        refused = await self.calls.refuse(opened_ms)
        if refused:
            log.warning("%d waiting requests answered no_provider_available: no provider of theirs is up", refused)
        return refused

    async def reconcile(self) -> Reconciled:
        """Set in_flight to the live leases of every configured provider, and the tenant
        counters to the job records; the corrections."""
        in_flight, counters = await self.calls.reconcile(self.provider_ids)
        for fix in in_flight:
            log.warning("in_flight of %s was %d, live leases say %d: corrected", fix.provider, fix.old, fix.new)
        for fix in counters:
            log.warning("tenant counter %s was %d, job records say %d: corrected", fix.provider, fix.old, fix.new)
        return Reconciled(in_flight, counters)

    async def forget_departed_consumers(self) -> int:
        """Drop consumer-group members (old worker processes) that hold nothing and went quiet."""
        removed = 0
        for node in self.config.nodes:
            try:
                consumers = await self.redis.xinfo_consumers(keys.node(node.id), keys.NODE_GROUP)
            except ResponseError:
                continue  # no stream or no group yet
            for consumer in consumers:
                if consumer["pending"] == 0 and consumer["idle"] > CONSUMER_IDLE_MS:
                    await self.redis.xgroup_delconsumer(keys.node(node.id), keys.NODE_GROUP, consumer["name"])
                    removed += 1
        return removed

    async def now_ms(self) -> int:
        sec, usec = await self.redis.time()
        return int(sec) * 1000 + int(usec) // 1000

    async def open_round(self) -> Round:
        """Open a round (``lua/reap_round.lua``): server time, gap, and whether the server changed."""
        run_id = str((await self.redis.info("server")).get("run_id", ""))
        return await self.calls.reap_round(run_id)

    async def reap_leases(self, now: int) -> dict[str, int]:
        """Leases past expiry: the slot comes back; the job is retried or failed."""
        outcomes: dict[str, int] = {}
        expired = cast(list[bytes], await self.redis.zrangebyscore(keys.LEASES, "-inf", now, start=0, num=BATCH))
        if not expired:
            return outcomes
        records = cast(list[bytes | None], await self.redis.hmget(keys.JOBS, expired))
        for raw_job, raw in zip(expired, records, strict=True):
            job = raw_job.decode()
            if raw is None:
                await self.redis.zrem(keys.LEASES, job)
                continue
            rec = decode_record(raw)
            if rec.provider is None or rec.node is None:
                continue
            outcome = await self.calls.reap_lease(job, rec, rec.provider, rec.node, self._lost_event)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            if outcome != ReapOutcome.SKIP:
                log.warning("lease of job %s on %s expired: %s", job, rec.provider, outcome)
        return outcomes

    async def reap_replicas(self, now: int) -> int:
        """API processes that stopped saying they are alive: cancel what they waited on."""
        dead = cast(list[bytes], await self.redis.zrangebyscore(keys.REPLICAS, "-inf", now, start=0, num=20))
        for raw_rep in dead:
            replica = raw_rep.decode()
            members = cast(list[bytes], await self.redis.srandmember(keys.replica_jobs(replica), BATCH) or [])
            await self._cancel_all([m.decode() for m in members], replica)
            if await self.redis.scard(keys.replica_jobs(replica)) == 0:
                await self.redis.zrem(keys.REPLICAS, replica)
                log.warning("API replica %s stopped; its jobs are cancelled", replica)
        return len(dead)

    async def reap_orphans(self, now: int) -> int:
        """Waiting (or expired) jobs long past their deadline that no API collected."""
        stale = cast(
            list[bytes],
            await self.redis.zrangebyscore(keys.DEADLINES, "-inf", now - ORPHAN_GRACE_MS, start=0, num=BATCH),
        )
        await self._cancel_all([s.decode() for s in stale], None)
        return len(stale)

    async def _cancel_all(self, jobs: list[str], replica: str | None) -> None:
        if not jobs:
            return
        records = cast(list[bytes | None], await self.redis.hmget(keys.JOBS, jobs))
        for job, raw in zip(jobs, records, strict=True):
            if raw is None:
                if replica is not None:
                    await self.redis.srem(keys.replica_jobs(replica), job)
                else:
                    await self.redis.zrem(keys.DEADLINES, job)
                continue
            rec = decode_record(raw)
            await self.calls.cancel(job, keys.queue(rec.model, rec.lane), rec.replica, CancelReason.CLIENT)


# --- waiting jobs in a lane queue no plan of this config pumps ---------------------------------


async def rehome_queue(calls: ScriptCalls, queue: str, limit: int = BATCH) -> int:
    """The first ``limit`` jobs waiting in ``queue``, a lane queue ``calls``' config does not
    pump (a reload renamed or removed its lane), moved to the lane each belongs in now; those
    pinned to a provider a reload removed answered 503. Returns how many moved. A reaper round
    calls it for every such queue; a script call whose jobs came back to one (a requeue, an
    unpark) for that queue at once."""
    redis = calls.scripts.redis
    jobs = cast(list[bytes], await redis.zrange(queue, 0, limit - 1))
    if not jobs:
        return 0
    records = cast(list[bytes | None], await redis.hmget(keys.JOBS, jobs))
    homes: dict[Lane, list[str]] = {}
    homeless: dict[str, list[str]] = {}  # replica -> jobs
    for raw_job, raw in zip(jobs, records, strict=True):
        if raw is None:
            continue
        rec = decode_record(raw)
        if rec.state != "q":
            continue
        lane = calls.plans.home_of(rec.model, rec.lane, rec.endpoint, rec.pin)
        if lane is None:
            # Pinned to a provider a reload removed: its worker marked it so, or its
            # heartbeat ran out. (One that is up is in a newer config than this process's,
            # whose processes pump the job.)
            if rec.pin and await gone(redis, rec.pin):
                homeless.setdefault(rec.replica, []).append(raw_job.decode())
        elif lane.queue != queue:
            homes.setdefault(lane, []).append(raw_job.decode())
    moved = 0
    for lane, group in homes.items():
        n, _ = await calls.rehome(queue, lane, group)
        moved += n
    if moved:
        log.warning("%d jobs waiting in %s, a lane this config has not, moved to their lanes", moved, queue)
    for replica, group in homeless.items():
        n = await calls.abandon(queue, replica, group)
        log.warning("%d jobs waiting in %s are pinned to a provider a reload removed: answered", n, queue)
    return moved


async def gone(redis: Redis, provider: str) -> bool:
    """Was ``provider`` removed (its worker's mark), or is its worker silent?"""
    raw = cast(list[bytes | None], await redis.hmget(keys.provider(provider), wire.PROVIDER_HEALTH_FIELDS))
    health = wire.provider_health({k: v.decode() for k, v in zip(wire.PROVIDER_HEALTH_FIELDS, raw, strict=True)
                                   if v is not None})
    if health.removed:
        return True
    seconds, micros = await redis.time()
    return health.silent(seconds * 1000 + micros // 1000)
