"""Running one job: call its provider, stream its output through a :class:`RedisSink`,
then finish it -- the final event written with the release of its slot.

Through a Redis outage shorter than ``OUTAGE_LEASES`` leases, running provider calls go
on: streamed output is held by the sink and final answers by :meth:`JobRunner.finish`
until Redis takes them.
"""

from __future__ import annotations

import logging
import time

import anyio
from redis.exceptions import RedisError

from dispatcher import events, tracing
from dispatcher.backoff import Backoff
from dispatcher.endpoints import ENDPOINTS, RESPONSES
from dispatcher.envelope import JSON, RequestEnvelope, unwrap
from dispatcher.events import Assignment, Failed
from dispatcher.exceptions import ProviderError, ProviderRejected, ProviderTimeout, ProviderUnreachable, WorkerLost
from dispatcher.jsonbody import with_model, with_model_asking_usage
from dispatcher.live import LiveSample, error_kind
from dispatcher.multipart import with_field
from dispatcher.script_calls import FinishMode, FinishOutcome
from dispatcher.tenants import is_qualification
from dispatcher.worker_side import WorkerSide
from workers.adapters.base import ProviderCall, Sink
from workers.capacity import CallSample
from workers.capacity_control import CapacityControl
from workers.leases import SHUTDOWN, Running, Runs
from workers.provider_state import ProviderState
from workers.runtime import ProviderAdapters
from workers.sink import JobAborted, RedisSink
from workers.stored_responses import stored_response_sink
from workers.usage import ASKABLE, final_usage

log = logging.getLogger("iop.worker")

# How long a worker keeps a job's output and slot through a Redis outage before leaving
# the job to its lease: docs/OPERATIONS.md "Redis outages" promises two lease periods.
OUTAGE_LEASES = 2


class JobRunner:
    """Runs the jobs dispatched to ``node_id`` on ``adapters``, registered in ``runs`` (whose
    leases are renewed meanwhile); tells ``providers`` what each call says of its provider.
    ``lease_ms``: how long output and answers are held through a Redis outage."""

    def __init__(self, side: WorkerSide, node_id: str, adapters: ProviderAdapters, runs: Runs,
                 providers: ProviderState, lease_ms: int, capacity: CapacityControl | None = None) -> None:
        self._side = side
        self._capacity = capacity
        self._node_id = node_id
        self._adapters = adapters
        self._runs = runs
        self._providers = providers
        self._hold_s = OUTAGE_LEASES * lease_ms / 1000

    async def run(self, job: Assignment) -> None:
        """Run ``job`` to its end, whatever happens; its slot is always given back."""
        running = self._runs.start(job)
        sink = RedisSink(self._side, job, self._node_id, self._hold_s)
        if self._capacity is not None and job.stream:
            # Its first token's lateness is its engine's queue, where the engine reports none.
            capacity = self._capacity
            capacity.call_started(job.provider, running.key)
            sink.on_first_output = lambda: capacity.first_output(job.provider, running.key)
        final: events.Event | None = None
        try:
            if running.abort_reason is None:
                final = await self.call(job, running, sink)
            if running.abort_reason == SHUTDOWN and final is None:
                # Given up at shutdown: dispatched again elsewhere unless output had started.
                final = Failed.from_error(WorkerLost("the worker shut down before the answer was complete"),
                                          sink.meta)
            elif running.abort_reason is not None:
                final = None
        except Exception:
            # One job's failure must not take down the task group, and every other job with it.
            log.exception("job %s: unexpected failure", job.job, extra=job.log_context())
            final = Failed.from_error(ProviderUnreachable("internal error in the worker"), sink.meta)
        finally:
            with anyio.CancelScope(shield=True):
                mode: FinishMode = "done"
                if running.abort_reason == SHUTDOWN:
                    mode = "requeue"
                elif running.retry:
                    mode = "retry"
                try:
                    await self.finish(running, sink, final, mode=mode, verdict=running.verdict, live=running.live)
                finally:
                    self._runs.end(running)
                    if self._capacity is not None and job.stream:
                        self._capacity.call_ended(job.provider, running.key)
                    if running.provider_failed:
                        # Released: if it runs nothing else now, the whole probe may be asked.
                        self._providers.probe_now(job.provider)

    async def call(self, job: Assignment, running: Running, sink: RedisSink) -> events.Event | None:
        """The provider's call; its final event, or None when the run was aborted."""
        adapter = self._adapters.for_job(job.provider)
        if adapter is None or job.endpoint not in ENDPOINTS:
            return Failed.from_error(
                ProviderUnreachable(f"node {self._node_id} cannot run {job.endpoint} on provider {job.provider}"),
                sink.meta,
            )
        started = time.monotonic()
        with running.scope:
            try:
                # No local limiter: the slot accounting in Redis already bounds every worker
                # of the node together, which a per-process one could not.
                request = unwrap(job.body)
                out: Sink = sink
                if job.endpoint == RESPONSES:
                    out = stored_response_sink(sink, request, lambda rid: self._side.remember_response(rid, job),
                                               self._side.forget_response)
                with tracing.provider_span(job, self._node_id, request.traceparent, sink):
                    await adapter.call(provider_call(job, request, adapter.provider.asks_stream_usage), out)
                self._providers.answered(job.provider)
                running.verdict = ANSWERED
                final = sink.final_event()
                running.live = live_sample(job, started, sink, final)
                if self._capacity is not None:
                    # A call sent to wait in its home's queue (past the limit) waited there by
                    # design: its latency would read as the limit being too high.
                    sample = None if job.queued else timed(started, sink, final)
                    self._capacity.called(job.provider, sample, sink_status(sink, final),
                                          sink.headers if not isinstance(final, events.Done) else final.headers)
                return final
            except JobAborted as exc:
                running.abort_reason = running.abort_reason or exc.reason
            except ProviderError as exc:
                running.live = failed_sample(job, started, exc)
                if self._capacity is not None and isinstance(exc, ProviderRejected):
                    self._capacity.called(job.provider, None, exc.status, exc.headers)
                if fails_the_provider(exc):
                    self._providers.call_failed(job.provider, exc)
                    running.provider_failed = True
                running.verdict = verdict_of(exc)
                # Before any output, another provider of the lane may serve it (lua/finish.lua).
                running.retry = exc.retry_elsewhere and not sink.started
                return Failed.from_error(exc, sink.meta)
            except RedisError as exc:
                # The sink held the output as long as it could (see workers/sink.py).
                log.warning("job %s: %s", job.job, exc, extra=job.log_context())
                sink.discard()
                return Failed.from_error(WorkerLost("the worker lost Redis while streaming"), sink.meta)
        return None

    async def hand_back(self, job: Assignment) -> None:
        """Give back a job this worker was handed but will not run: to its queue again."""
        lost = Failed.from_error(WorkerLost("the worker shut down before the job started"))
        await self.finish(Running(job), None, lost, mode="requeue")

    async def finish(
        self, running: Running, sink: RedisSink | None, final: events.Event | None, mode: FinishMode = "done",
        verdict: str = "", live: LiveSample | None = None,
    ) -> None:
        """Write what the sink holds, then the final event with the release; through a Redis
        outage of up to ``OUTAGE_LEASES`` leases (the job stays in ``runs`` meanwhile, so
        its lease is renewed whenever Redis answers). ``verdict``: what the call said of its
        provider (:func:`verdict_of`); ``live``: the call in the live figures."""
        job = running.job
        data = events.encode(final) if final is not None else None
        backoff = Backoff(0.05, 0.5)
        failing_since: float | None = None
        while True:
            try:
                if sink is not None and data is not None and mode == "done":
                    await sink.flush()
                usage = final_usage(final)
                outcome = await self._side.finish(job, data, mode=mode, tokens=usage.completion,
                                                  prompt=usage.prompt, cached=usage.cached, verdict=verdict,
                                                  live=live)
                if outcome not in (FinishOutcome.RELEASED, FinishOutcome.STALE):
                    why = "given up at shutdown" if mode == "requeue" else f"provider {job.provider} failed it"
                    log.info("job %s %s: %s", job.job, why, outcome, extra=job.log_context())
                return
            except JobAborted as exc:
                # The client left (or the job was taken over) before its output was written.
                log.info("job %s: %s before its output was written", job.job, exc.reason, extra=job.log_context())
                data = None
            except RedisError as exc:
                now = time.monotonic()
                failing_since = failing_since or now
                if now - failing_since > self._hold_s:
                    # The lease runs out and the reaper settles the job instead.
                    log.error("job %s: could not release (%s); leaving it to the lease", job.job, exc,
                              extra=job.log_context())
                    return
                await backoff.sleep()


# A call's verdict on its provider, for the evidence lua/finish.lua keeps: it answered.
ANSWERED = "ok"


def fails_the_provider(exc: ProviderError) -> bool:
    """Does a call's error take its provider out of rotation at once: it refused or reset
    the connection, timed out, cut a stream, answered garbage? Its own answers, 5xx
    included, never do: a 5xx may be the request's fault, and only the evidence of several
    requests (lua/lib/blame.lua) ejects a provider for them."""
    return isinstance(exc, ProviderUnreachable | ProviderTimeout)


def verdict_of(exc: ProviderError) -> str:
    """What a failed call says of its provider for that evidence: a 5xx by its status; an
    answer under 500 (a 4xx is the caller's business) that it answered; else nothing (an
    unreachable provider is out already, a cancelled call says nothing)."""
    if isinstance(exc, ProviderRejected):
        return str(exc.status) if exc.status >= 500 else ANSWERED
    return ""


def timed(started: float, sink: RedisSink, final: events.Event) -> CallSample | None:
    """A 2xx answer as the capacity controller reads it (workers/capacity.py)."""
    if sink_status(sink, final) >= 300:
        return None
    ended = time.monotonic()
    ttft = sink.first_output_at - started if sink.first_output_at is not None and not isinstance(final, events.Done) \
        else None
    return CallSample(e2e_s=ended - started, ttft_s=ttft, tokens=final_usage(final).completion)


def live_sample(job: Assignment, started: float, sink: RedisSink, final: events.Event) -> LiveSample | None:
    """An answered call as the live figures count it (dispatcher/live.py): a caller's only, so
    that a qualification's load (dispatcher/tenants.py QUALIFY_TENANT) never reads as traffic."""
    if is_qualification(job.job):
        return None
    ended = time.monotonic()
    ttft = None
    if sink.first_output_at is not None and not isinstance(final, events.Done):
        ttft = (sink.first_output_at - started) * 1000
    return LiveSample((ended - started) * 1000, ttft, error_kind(sink_status(sink, final)))


def failed_sample(job: Assignment, started: float, exc: ProviderError) -> LiveSample | None:
    if is_qualification(job.job):
        return None
    kind = error_kind(exc.status if isinstance(exc, ProviderRejected) else 0,
                      timeout=isinstance(exc, ProviderTimeout), unreachable=isinstance(exc, ProviderUnreachable))
    return LiveSample((time.monotonic() - started) * 1000, None, kind or "other")


def sink_status(sink: RedisSink, final: events.Event) -> int:
    return final.status if isinstance(final, events.Done) else sink.status


def provider_call(job: Assignment, request: RequestEnvelope, ask_usage: bool = False) -> ProviderCall:
    """The call a job makes, its model set to the provider's served name; ``ask_usage``: a
    streamed chat/completions asks for its usage too (the provider's ``stream_usage``)."""
    body = request.body
    usage_asked = False
    if body and request.content_type == JSON:
        if ask_usage and job.stream and job.endpoint in ASKABLE and not request.path:
            body, usage_asked = with_model_asking_usage(body, job.target)
        else:
            body = with_model(body, job.target)
    elif body and request.content_type.startswith("multipart/form-data"):
        body = with_field(body, request.content_type, "model", job.target)
    return ProviderCall(
        job.endpoint, body, job.target, job.stream, request.method, request.path, request.content_type,
        request.headers, usage_asked,
    )
