"""Maintenance that keeps Redis honest when processes die: expired leases, dead API
replicas, and waiting jobs nobody will ever collect.

It runs inside every API and worker process; a short lock lets one of them do a round
per interval. Each round reads candidates with plain commands, then hands every one to
a script that checks it again before acting, so a round that races with normal
traffic -- or with another round -- changes nothing it should not.

A round never judges liveness across a gap in the fleet's view of Redis: ``reap_round``
opens it, and when the last round is too long ago (Redis was down or restored) or ran on
another server (a restart or a failover), it first gives every lease and replica a fresh
period, and the round then reconciles in_flight with the leases the server holds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import cast

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from dispatcher import events, keys
from dispatcher.config import Config
from dispatcher.events import Failed, decode_record
from dispatcher.exceptions import WorkerLost
from dispatcher.jobs import REPLY_KEEP_MS, JobClient
from dispatcher.plans import Plan, Plans
from dispatcher.scripts import Scripts

log = logging.getLogger("iop.reaper")

BATCH = 200
# A live API cancels its own expired jobs at their deadline; this is the backstop for
# one that could not (Redis was away at that moment).
ORPHAN_GRACE_MS = 30_000
# Rounds between the slower checks: in_flight against leases, and departed consumers.
RECONCILE_EVERY = 30
# A consumer (worker process) idle this long with nothing pending is gone: a live worker
# reads at least every third of a lease, and one removed by mistake is recreated by its
# next read, so the threshold only needs to be safely above a read.
CONSUMER_IDLE_MS = 60_000


@dataclass
class ReapStats:
    leases: dict[str, int]
    gap_ms: int = 0  # > 0: time since the last round; -1: no round was ever recorded
    new_server: bool = False
    replicas: int = 0
    orphans: int = 0
    corrected: list[tuple[str, int, int]] | None = None


class Reaper:
    def __init__(self, redis: Redis, scripts: Scripts, config: Config, plans: Plans, owner: str) -> None:
        self.redis = redis
        self.scripts = scripts
        self.config = config
        self.plans = plans
        self.owner = owner
        self.jobs = JobClient(redis, scripts, config, plans, owner)
        self.rounds = 0
        self.provider_ids = [p.id for _, p in config.providers()]
        self._lost_event = events.encode(
            Failed.from_error(WorkerLost("the worker running this request was lost"))
        )

    async def run_once(self) -> ReapStats | None:
        """One round, if no other process holds the round lock; None when skipped."""
        interval = self.config.dispatch.reap_interval_ms
        if not await self.redis.set(keys.REAPER_LOCK, self.owner, nx=True, px=interval):
            return None
        now, gap_ms, new_server = await self.open_round()
        if gap_ms or new_server:
            log.warning("%s: every lease and replica gets a fresh period before anyone is judged",
                        "Redis is a new server (restart or failover)" if new_server
                        else f"no reaper round for {gap_ms} ms" if gap_ms > 0 else "first reaper round")
        stats = ReapStats(leases=await self.reap_leases(now), gap_ms=gap_ms, new_server=new_server)
        stats.replicas = await self.reap_replicas(now)
        stats.orphans = await self.reap_orphans(now)
        if self.rounds % RECONCILE_EVERY == 0 or gap_ms or new_server:
            stats.corrected = await self.reconcile()
            await self.forget_departed_consumers()
        self.rounds += 1
        return stats

    async def reconcile(self) -> list[tuple[str, int, int]]:
        """Set in_flight to the live leases of every configured provider; the corrections."""
        flat = await self.scripts.reconcile(
            [*keys.JOB_KEYS, *(keys.provider(p) for p in self.provider_ids)], self.provider_ids
        )
        fixes = [(flat[i].decode(), int(flat[i + 1]), int(flat[i + 2])) for i in range(0, len(flat), 3)]
        for provider, old, new in fixes:
            log.warning("in_flight of %s was %d, live leases say %d: corrected", provider, old, new)
        return fixes

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

    async def open_round(self) -> tuple[int, int, bool]:
        """Server time, gap since the last round (ms; -1: none recorded), server changed."""
        run_id = str((await self.redis.info("server")).get("run_id", ""))
        d = self.config.dispatch
        now, gap, changed = await self.scripts.reap_round(
            [keys.LEASES, keys.REPLICAS, keys.REAPER_SEEN],
            [d.observation_gap_ms, d.lease_ms, d.replica_ttl_ms, run_id],
        )
        return int(now), int(gap), bool(changed)

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
            plan: Plan = self.plans.by_provider.get(rec.provider, self.plans.empty)
            ks, head = plan.args(
                (*keys.PUMP_KEYS, keys.node(rec.node), keys.reply(rec.replica), keys.replica_jobs(rec.replica),
                 keys.provider(rec.provider), keys.queue(rec.model), keys.REAPER_SEEN),
                self.config.dispatch.lease_ms,
            )
            outcome, _ = await self.scripts.reap_lease(
                ks, [*head, job, keys.NODE_GROUP, self.config.dispatch.max_attempts, self._lost_event, REPLY_KEEP_MS,
                     self.config.dispatch.observation_gap_ms, events.REQUEUED]
            )
            name = cast(bytes, outcome).decode()
            outcomes[name] = outcomes.get(name, 0) + 1
            if name != "skip":
                log.warning("lease of job %s on %s expired: %s", job, rec.provider, name)
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
            await self.jobs.cancel(job, rec.model, "client", rec.replica)
