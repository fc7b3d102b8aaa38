"""One OpenAI request through iop: read and check it, submit its job, wait for the job's
first event (``api/waiting.py``), answer (``api/answers.py``).

The caller's body goes to the provider untouched but for ``model`` (the worker sets
the served name).
"""

from __future__ import annotations

import asyncio
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException
from redis.exceptions import RedisError

from api.answers import failure, json_answer, sse_answer
from api.gateway import Gateway
from api.metrics import RequestClock
from api.streams import no_slot
from api.waiting import ClientGone, HangUpWatch, JobWait
from dispatcher.events import Chunks, Done, Failed
from dispatcher.exceptions import (
    JobCancelled,
    ModelNotFound,
    QueueFull,
    RedisUnavailable,
    RequestError,
    RequestTimeout,
    WorkerLost,
)
from dispatcher.jsonbody import parse_request


async def relay(request: Request[Any, Any, Any], gw: Gateway, endpoint: str) -> Response[Any]:
    clock = RequestClock(gw.metrics)
    try:
        return await _relay(request, gw, endpoint, clock)
    except RequestError as exc:
        clock.done(exc.status)
        raise
    except HTTPException as exc:
        clock.done(exc.status_code)
        raise
    except BaseException:
        clock.done(500)
        raise


async def _relay(request: Request[Any, Any, Any], gw: Gateway, endpoint: str, clock: RequestClock) -> Response[Any]:
    gw.caller_keys.check(request.headers)
    try:
        async with asyncio.timeout(gw.config.api.body_timeout_s):
            body = await request.body()
    except TimeoutError:
        raise RequestTimeout("The request body did not arrive in time") from None
    model_id, stream = parse_request(body)
    model = gw.models.get(model_id)
    if model is None:
        raise ModelNotFound(model_id)
    clock.model = model_id
    if endpoint == "embeddings":
        stream = False
    release_slot = gw.streams.acquire() if stream else no_slot

    wait = JobWait(gw, gw.next_job_id(), model_id)
    hang_up = HangUpWatch(request, wait.waiter)
    handed_off = False
    try:
        try:
            submitted = await gw.jobs.submit(wait.job_id, model, body, endpoint, stream)
        except RedisError as exc:
            wait.settled = True
            raise RedisUnavailable(f"Redis is unavailable: {exc}") from None
        if submitted.status == "full":
            wait.settled = True
            raise QueueFull(
                f"The queue of '{model_id}' is full ({submitted.queued} waiting); retry later"
            )
        wait.waiting(submitted)
        first = await wait.next_event()
        hang_up.stop()
        if isinstance(first, Chunks):  # only a Start can come before Chunks
            raise WorkerLost("The worker's stream began without its start")
        if first.meta is not None:
            clock.provider = first.meta.provider
            clock.queued(first.meta.queue_ms)
        if isinstance(first, Done):
            clock.done(first.status)
            return json_answer(first, model_id)
        if isinstance(first, Failed):
            raise failure(first)
        # From here the stream owns the slot and the wait, and ends them when it ends.
        handed_off = True
        return sse_answer(wait, first, model_id, clock, release_slot)
    except ClientGone:
        raise JobCancelled("The client closed the connection") from None
    finally:
        hang_up.stop()
        if not handed_off:
            release_slot()
            wait.close()
