"""The runs of one worker and their leases.

A run is a (job, fence) pair: after a lease expired the same job may be dispatched to
this very worker again, and the old run must then stop without touching the new one.

* :class:`Runs`    the worker's running jobs by (job, fence), the cancels that came before
                   their job did, and whether nothing runs (what a shutdown waits for)
* :class:`Leases`  extend the leases of the running jobs a third of a lease after the last
                   success (sooner after a failure), each call bounded well under that;
                   abort the runs the renewal says were cancelled or taken over
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import anyio
from redis.exceptions import RedisError

from dispatcher.events import Assignment
from dispatcher.live import LiveSample
from dispatcher.worker_side import WorkerSide

log = logging.getLogger("iop.worker")

RunKey = tuple[str, int]  # (job id, fence)

# Abort reasons: the client left, the job was dispatched again (a newer fence), the worker
# shuts down (the job goes back to its queue unless output had started).
CANCELLED = "cancelled"
STALE = "stale"
SHUTDOWN = "shutdown"


@dataclass
class Running:
    job: Assignment
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    abort_reason: str | None = None
    # Its provider failed it before any output: another provider of its lane may take it.
    retry: bool = False
    # The call failed in a way that says something of the provider (``fails_the_provider``).
    provider_failed: bool = False
    # What the call says of its provider for the evidence finish keeps (``verdict_of``):
    # "ok" it answered (whatever the status under 500), "<status>" a 5xx, "" nothing.
    verdict: str = ""
    # The call in its provider x model's live figures (None: not counted: aborted, handed
    # back, or a qualification's).
    live: LiveSample | None = None

    @property
    def key(self) -> RunKey:
        return (self.job.job, self.job.fence)

    def abort(self, reason: str) -> None:
        if self.abort_reason is None:
            self.abort_reason = reason
        self.scope.cancel()


class Runs:
    """The jobs this worker runs, by (job, fence).

    A cancel that arrives before its job was read from the stream is kept ``keep_s``
    (a lease: by then the job has run elsewhere or been settled) and applies when the
    job starts here.
    """

    def __init__(self, keep_s: float) -> None:
        self._runs: dict[RunKey, Running] = {}
        self._keep_s = keep_s
        # Cancels that arrived before their job was read from the stream: job -> until.
        self.early_cancels: dict[str, float] = {}
        self._idle: anyio.Event | None = None  # set whenever no job runs

    def __len__(self) -> int:
        return len(self._runs)

    def __iter__(self) -> Iterator[Running]:
        return iter(list(self._runs.values()))

    def get(self, key: RunKey) -> Running | None:
        return self._runs.get(key)

    def start(self, job: Assignment) -> Running:
        """A new run of ``job``; an older run of the same job here is aborted (stale); an
        early cancel of the job aborts this one before it calls anything."""
        running = Running(job)
        for other in self._runs.values():
            if other.job.job == job.job:
                # Its lease ran out while this worker could not renew it, and the job came
                # back here: the old run is fenced off and must stop calling the provider.
                other.abort(STALE)
        self._runs[running.key] = running
        if self._idle is None or self._idle.is_set():
            self._idle = anyio.Event()
        if self.early_cancels.pop(job.job, None) is not None:
            running.abort_reason = CANCELLED
        return running

    def end(self, running: Running) -> None:
        self._runs.pop(running.key, None)
        if not self._runs and self._idle is not None:
            self._idle.set()

    def cancel(self, job_id: str) -> None:
        """The job's client left: abort its runs here, or remember the cancel for a while
        if the job has not reached this worker yet."""
        runs = [r for r in self._runs.values() if r.job.job == job_id]
        for running in runs:
            running.abort(CANCELLED)
        if runs:
            return
        now = time.monotonic()
        self.early_cancels[job_id] = now + self._keep_s
        for jid, expiry in list(self.early_cancels.items()):
            if expiry < now:
                del self.early_cancels[jid]

    def on_provider(self, provider_id: str) -> bool:
        return any(r.job.provider == provider_id for r in self._runs.values())

    def entry_ids(self) -> set[str]:
        """The node stream entries of the running jobs."""
        return {r.job.entry_id for r in self._runs.values()}

    async def idle(self) -> None:
        """Until no job runs."""
        if self._runs and self._idle is not None:
            await self._idle.wait()

    def abort_all(self, reason: str) -> None:
        for running in list(self._runs.values()):
            running.abort(reason)


class Leases:
    """Keeps the leases of ``runs``; ``after_renewal`` runs after each successful renewal
    (the worker looks for entries delivered to it that it does not run)."""

    def __init__(self, runs: Runs, side: WorkerSide, lease_ms: int,
                 after_renewal: Callable[[], Awaitable[None]]) -> None:
        self._runs = runs
        self._side = side
        self._lease_s = lease_ms / 1000
        self._after_renewal = after_renewal
        self._soon: anyio.Event | None = None  # set to renew (and learn of cancels) now

    def renew_now(self) -> None:
        """Renew at once rather than at the next period (from the running event loop)."""
        if self._soon is None:
            self._soon = anyio.Event()
        self._soon.set()

    async def run(self) -> None:
        """Renew from the last success, not after each attempt: a failed or slow call must
        not push the next one to the lease's expiry, where the reaper races it."""
        period = self._lease_s / 3
        timeout = min(period / 3, 2.0)  # a hung call fails with time for two more tries
        retry = min(period / 6, 0.25)
        next_at = time.monotonic() + period
        if self._soon is None:
            self._soon = anyio.Event()
        while True:
            with anyio.move_on_after(max(next_at - time.monotonic(), 0.0)):
                await self._soon.wait()
            self._soon = anyio.Event()
            started = time.monotonic()
            runs = list(self._runs)
            try:
                aborts = await self._side.renew([r.key for r in runs], reply_within=timeout)
            except RedisError as exc:
                log.warning("lease renewal failed: %s", exc)
                next_at = started + retry
                continue
            next_at = started + period
            await self._after_renewal()
            for abort in aborts:
                running = self._runs.get((abort.job, abort.fence))
                if running is not None:
                    log.info("job %s: aborting (%s)", abort.job, abort.reason, extra=running.job.log_context())
                    running.abort(abort.reason)
