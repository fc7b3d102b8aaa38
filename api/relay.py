"""One request through iop: its tenant (``api/auth.py``), read and check it
(``api/intake.py``), submit its job, wait for the job's first event (``api/waiting.py``),
answer (``api/answers.py``); :class:`api.exchange.Exchange` holds what it holds meanwhile
and ends it once.

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
from api.continuation import Continuer
from api.exchange import Exchange
from api.gateway import Gateway
from api.intake import FALL_BACK_ON, Intake, fallbacks, take, take_stored
from api.metrics import RequestClock
from api.qualify import PROVIDER_HEADER, admit, qualification_of
from api.request_headers import headers_of
from api.runtime import Runtime
from api.waiting import ClientGone, JobWait
from dispatcher import tracing
from dispatcher.endpoints import ENDPOINTS, ErrorShape
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
from dispatcher.tenants import Tenant


async def relay(
    request: Request[Any, Any, Any], gw: Gateway, endpoint: str, response_id: str | None = None, rest: str = ""
) -> Response[Any]:
    """``response_id``: a call on a stored Response (``rest``: what follows the id in the path)."""
    clock = RequestClock(gw.metrics)
    if tracing.tracer is not None:
        route = f"/v1/{endpoint}" if response_id is None else f"/v1/responses/{{response_id}}{rest}"
        clock.trace = tracing.RequestTrace(request.method, route, headers_of(request))
    exchange = Exchange(clock)
    try:
        answer = await _relay(request, gw, gw.runtime, exchange, endpoint, response_id, rest)
    except RequestError as exc:
        exchange.answered(exc.status)
        raise
    except HTTPException as exc:
        exchange.answered(exc.status_code or 500)
        raise
    except asyncio.CancelledError:
        # The caller went away (or the server is stopping): not a failure of iop's.
        exchange.answered(CLIENT_CLOSED)
        raise
    except BaseException:
        exchange.answered(500)
        raise
    exchange.answered(answer.status_code or 200)
    return answer


# What a request whose handler was cancelled is counted as (nginx's "client closed request").
CLIENT_CLOSED = 499
# Says which model served the answer (a fallback's id when one did).
MODEL_HEADER = "x-iop-model"


async def _submit(rt: Runtime, wait: JobWait, intake: Intake) -> Submitted:
    return await rt.jobs.submit(wait.job_id, intake.lane, intake.stored, intake.endpoint, intake.stream,
                                intake.pinned, intake.tenant, intake.blocks, intake.limits, intake.deadline_ms)


async def _submit_to_a_taker(
    request: Request[Any, Any, Any], rt: Runtime, wait: JobWait, intake: Intake
) -> tuple[Submitted, Intake]:
    """Submit the job to its model, or to the first of its fallbacks that takes it
    (``api/intake.py`` decides which, and on what)."""
    submitted = await _submit(rt, wait, intake)
    if submitted.status not in FALL_BACK_ON or not intake.model.fallbacks:
        return submitted, intake
    for other in fallbacks(request, rt, intake):
        tried = await _submit(rt, wait, other)
        if tried.status in (SubmitStatus.DISPATCHED, SubmitStatus.QUEUED):
            wait.submitted_to(other.model.id, other.lane.queue)
            return tried, other
        if tried.status not in FALL_BACK_ON:
            return tried, intake  # its tenant's limits: no other model changes that
    return submitted, intake


async def _relay(
    request: Request[Any, Any, Any], gw: Gateway, rt: Runtime, exchange: Exchange, endpoint: str,
    response_id: str | None, rest: str,
) -> Response[Any]:
    clock = exchange.clock
    # A qualification run's request (iop qualify) comes with the admin key, not a caller's.
    run_id = qualification_of(request, rt)
    tenant = rt.callers.tenant_of(headers_of(request)) if run_id is None else rt.tenants.default
    clock.tenant = tenant.name
    trace = clock.trace
    traceparent = "" if trace is None else trace.traceparent
    if response_id is None:
        intake = await take(request, rt, endpoint, tenant, traceparent)
    else:
        intake = await take_stored(request, rt, response_id, rest, tenant, traceparent)
    if run_id is not None:
        intake = await admit(gw, rt, run_id, intake, headers_of(request).get(PROVIDER_HEADER, ""))
        tenant = intake.tenant
        clock.tenant = tenant.name
    model_id = intake.model.id
    clock.model = model_id
    spec = ENDPOINTS[intake.endpoint]
    if intake.stream:
        exchange.take_stream_slot(gw.streams)

    job_id = tenant.job_id(gw.next_job_id()) if rt.tenants.flow_control else gw.next_job_id()
    wait = exchange.wait_for(request, JobWait(
        job_id, model_id, intake.lane.queue, replies=gw.replies, jobs=rt.jobs, rules=rt.wait_rules,
        spawn=gw.spawn))
    limit_headers: dict[str, str] = {}
    if trace is not None:
        trace.submitted(job_id)
    try:
        try:
            submitted, intake = await _submit_to_a_taker(request, rt, wait, intake)
        except RedisError as exc:
            # Not settled: the last try may have gone through with its reply lost, so the
            # wait's close cancels the job (held through the outage too).
            raise RedisUnavailable(f"Redis is unavailable: {exc}") from None
        if intake.fell_back_from is not None:
            model_id = clock.model = intake.model.id
            gw.metrics.fell_back(intake.fell_back_from, model_id)
        if submitted.limits:
            limit_headers = ratelimits.headers(submitted.limits, spec.errors)
        refused = _refusal(submitted, model_id, tenant, spec.errors)
        if refused is not None:
            wait.refused()
            raise refused
        wait.waiting(submitted)
        first = await wait.next_event()
        exchange.first_event_came()
        if isinstance(first, Chunks):  # only a Start can come before Chunks
            raise WorkerLost("The worker's stream began without its start")
        if first.meta is not None:
            clock.provider = first.meta.provider
            clock.queued(first.meta.queue_ms)
        if trace is not None:
            trace.first(first)
        if isinstance(first, Failed):
            # Raised, so that one handler (api/error_handlers.py) answers every error of the endpoint.
            raise failure(first)
        if isinstance(first, Done):
            exchange.answer_carries(first.usage)
            answer: Response[Any] = json_answer(first, model_id)
        else:
            answer = sse_answer(exchange, first, model_id, spec, Continuer(gw, rt, intake))
        if limit_headers:
            answer.headers.update(limit_headers)
        answer.headers[MODEL_HEADER] = model_id
        return answer
    except ClientGone:
        raise JobCancelled("The client closed the connection") from None
    except RequestError as exc:
        for name, value in limit_headers.items():
            exc.headers.setdefault(name, value)
        raise


def _refusal(submitted: Submitted, model_id: str, tenant: Tenant, shape: ErrorShape) -> RequestError | None:
    """The error a submit that did not take the job answers; None when it took it."""
    status = submitted.status
    if status in (SubmitStatus.RATE_LIMITED, SubmitStatus.BUDGET_EXHAUSTED) and submitted.limits:
        return ratelimits.refusal(status, submitted.limits, tenant, shape)
    if status == SubmitStatus.FULL:
        return QueueFull(f"The queue of '{model_id}' is full ({submitted.queued} waiting); retry later")
    if status == SubmitStatus.TENANT_FULL:
        return TenantQueueFull(f"Tenant '{tenant.name}' already has {tenant.max_queued} requests waiting; "
                               "retry later")
    if status == SubmitStatus.UNAVAILABLE:
        return ResponseProviderDown.because(submitted.why)
    if status == SubmitStatus.NO_PROVIDER:
        return NoProviderAvailable.because(model_id, submitted.why)
    if status == SubmitStatus.DEADLINE_UNMEETABLE:
        wait_ms = int(submitted.why or 0)
        return DeadlineUnmeetable(
            f"'{model_id}' cannot start this request within its deadline: its queue is about "
            f"{wait_ms / 1000:.1f} s longer than that; retry later", retry_after=max(math.ceil(wait_ms / 1000), 1))
    return None
