"""One request through iop: read and check it (``api/intake.py``), submit its job, wait
for the job's first event (``api/waiting.py``), answer (``api/answers.py``).

The caller's body goes to the provider untouched but for ``model`` (the worker sets
the served name).
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException
from redis.exceptions import RedisError

from api import ratelimits
from api.answers import failure, json_answer, sse_answer
from api.gateway import Gateway
from api.intake import Intake, fallbacks, take, take_stored
from api.metrics import RequestClock
from api.stream_slots import no_slot
from api.waiting import ClientGone, HangUpWatch, JobWait
from dispatcher import tracing
from dispatcher.endpoints import ENDPOINTS
from dispatcher.events import Chunks, Done, Failed
from dispatcher.exceptions import (
    DeadlineUnmeetable,
    JobCancelled,
    NoProviderAvailable,
    QueueFull,
    RedisUnavailable,
    RequestError,
    ResponseProviderDown,
    TenantQueueFull,
    WorkerLost,
)
from dispatcher.script_calls import SubmitStatus, Submitted


async def relay(
    request: Request[Any, Any, Any], gw: Gateway, endpoint: str, response_id: str | None = None, rest: str = ""
) -> Response[Any]:
    """``response_id``: a call on a stored Response (``rest``: what follows the id in the path)."""
    clock = RequestClock(gw.metrics)
    if tracing.tracer is not None:
        route = f"/v1/{endpoint}" if response_id is None else f"/v1/responses/{{response_id}}{rest}"
        clock.trace = tracing.RequestTrace(request.method, route, request.headers)
    try:
        return await _relay(request, gw, endpoint, clock, response_id, rest)
    except RequestError as exc:
        clock.done(exc.status)
        raise
    except HTTPException as exc:
        clock.done(exc.status_code)
        raise
    except asyncio.CancelledError:
        # The caller went away (or the server is stopping): not a failure of iop's.
        clock.done(CLIENT_CLOSED)
        raise
    except BaseException:
        clock.done(500)
        raise


# What a request whose handler was cancelled is counted as (nginx's "client closed request").
CLIENT_CLOSED = 499
# The statuses a model's fallbacks are tried on: it cannot take the request at once.
FALL_BACK_ON = frozenset({SubmitStatus.NO_PROVIDER, SubmitStatus.FULL, SubmitStatus.TENANT_FULL,
                          SubmitStatus.DEADLINE_UNMEETABLE})
# Says which model served the answer (a fallback's id when one did).
MODEL_HEADER = "x-iop-model"


async def _submit(gw: Gateway, wait: JobWait, intake: Intake) -> Submitted:
    return await gw.jobs.submit(wait.job_id, intake.lane, intake.stored, intake.endpoint, intake.stream,
                                intake.pinned, intake.tenant, intake.blocks, intake.limits, intake.deadline_ms)


async def _relay(
    request: Request[Any, Any, Any], gw: Gateway, endpoint: str, clock: RequestClock, response_id: str | None,
    rest: str,
) -> Response[Any]:
    tenant = gw.tenants.of(request.headers)
    clock.tenant = tenant.name
    trace = clock.trace
    traceparent = "" if trace is None else trace.traceparent
    if response_id is None:
        intake = await take(request, gw, endpoint, tenant, traceparent)
    else:
        intake = await take_stored(request, gw, response_id, rest, tenant, traceparent)
    model_id, stream = intake.model.id, intake.stream
    clock.model = model_id
    if intake.fell_back_from is not None:
        gw.metrics.fell_back(intake.fell_back_from, model_id)
    spec = ENDPOINTS[intake.endpoint]
    release_slot = gw.streams.acquire() if stream else no_slot

    job_id = tenant.job_id(gw.next_job_id()) if gw.tenants.flow_control else gw.next_job_id()
    wait = JobWait(gw, job_id, model_id, intake.lane.queue)
    hang_up = HangUpWatch(request, wait.waiter)
    handed_off = False
    limit_headers: dict[str, str] = {}
    if trace is not None:
        trace.submitted(job_id)
    try:
        try:
            submitted = await _submit(gw, wait, intake)
            if submitted.status in FALL_BACK_ON and intake.model.fallbacks:
                for other in fallbacks(request, gw, intake):
                    tried = await _submit(gw, wait, other)
                    if tried.status in (SubmitStatus.DISPATCHED, SubmitStatus.QUEUED):
                        gw.metrics.fell_back(intake.model.id, other.model.id)
                        submitted, intake, model_id = tried, other, other.model.id
                        wait.model_id, wait.queue_key, clock.model = model_id, intake.lane.queue, model_id
                        break
                    if tried.status not in FALL_BACK_ON:
                        submitted = tried  # its tenant's limits: no other model changes that
                        break
        except RedisError as exc:
            # Not settled: the last try may have gone through with its reply lost, so the
            # wait's close cancels the job (held through the outage too).
            raise RedisUnavailable(f"Redis is unavailable: {exc}") from None
        if submitted.limits:
            limit_headers = ratelimits.headers(submitted.limits, spec.errors == "anthropic")
            if submitted.status in (SubmitStatus.RATE_LIMITED, SubmitStatus.BUDGET_EXHAUSTED):
                wait.settled = True
                raise ratelimits.refusal(submitted.status, submitted.limits, tenant, spec.errors == "anthropic")
        if submitted.status == SubmitStatus.FULL:
            wait.settled = True
            raise QueueFull(
                f"The queue of '{model_id}' is full ({submitted.queued} waiting); retry later"
            )
        if submitted.status == SubmitStatus.TENANT_FULL:
            wait.settled = True
            raise TenantQueueFull(f"Tenant '{tenant.name}' already has {tenant.max_queued} requests waiting; "
                                  "retry later")
        if submitted.status == SubmitStatus.UNAVAILABLE:
            wait.settled = True
            raise ResponseProviderDown(
                f"The provider holding this response is unavailable ({submitted.why}); retry later"
            )
        if submitted.status == SubmitStatus.NO_PROVIDER:
            wait.settled = True
            raise NoProviderAvailable(f"No provider of '{model_id}' is available ({submitted.why}); retry later")
        if submitted.status == SubmitStatus.DEADLINE_UNMEETABLE:
            wait.settled = True
            wait_ms = int(submitted.why or 0)
            raise DeadlineUnmeetable(
                f"'{model_id}' cannot start this request within its deadline: its queue is about "
                f"{wait_ms / 1000:.1f} s longer than that; retry later", retry_after=max(math.ceil(wait_ms / 1000), 1))
        wait.waiting(submitted)
        first = await wait.next_event()
        hang_up.stop()
        if isinstance(first, Chunks):  # only a Start can come before Chunks
            raise WorkerLost("The worker's stream began without its start")
        if first.meta is not None:
            clock.provider = first.meta.provider
            clock.queued(first.meta.queue_ms)
        if trace is not None:
            trace.first(first)
        if isinstance(first, Done):
            clock.done(first.status, first.usage)
            answer: Response[Any] = json_answer(first, model_id)
        elif isinstance(first, Failed):
            raise failure(first)
        else:
            # From here the stream owns the slot and the wait, and ends them when it ends.
            handed_off = True
            answer = sse_answer(wait, first, model_id, clock, release_slot, spec)
        if limit_headers:
            answer.headers.update(limit_headers)
        answer.headers[MODEL_HEADER] = model_id
        return answer
    except ClientGone:
        raise JobCancelled("The client closed the connection") from None
    except RequestError as exc:
        if limit_headers:
            for name, value in limit_headers.items():
                exc.headers.setdefault(name, value)
        raise
    finally:
        hang_up.stop()
        if not handed_off:
            release_slot()
            wait.close()
