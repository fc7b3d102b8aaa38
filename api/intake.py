"""What a request is, before it becomes a job: its model, whether it streams, the lane of
providers it may go to, and what is stored for its worker.

* JSON bodies name their ``model`` (and ``stream``); multipart uploads (audio) carry
  them as form fields. Bodies go on untouched but for the model (set by the worker).
* The lane is that of the model's providers that serve the endpoint
  (``dispatcher/plans.py``); none serving it is ``400 unsupported_endpoint``, at once.
* Fallbacks (``models[].fallbacks``), decided here only: the first of them that serves the
  endpoint takes a request its model cannot serve there; the rest, in order, are tried
  when its model cannot take it now (:data:`FALL_BACK_ON`, ``api/relay.py``).
* A call on a stored Response -- ``previous_response_id``, or ``/v1/responses/{id}...``
  -- goes only to the provider that made it (``lua/remember_response.lua``): its lane
  of one. A provider that left the pool is ``409``; one that is down, ``503``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from typing import Any

import msgspec
from litestar import Request
from litestar.exceptions.http_exceptions import RequestEntityTooLarge

from api.ratelimits import limits_for
from api.request_headers import headers_of
from api.runtime import Runtime
from dispatcher import wire
from dispatcher.affinity import blocks_of, session_block, session_of
from dispatcher.api_side import StoredResponse
from dispatcher.config import ModelConfig
from dispatcher.endpoints import ENDPOINTS, RESPONSES
from dispatcher.envelope import FORWARDED_HEADERS, JSON, RequestEnvelope, wrap
from dispatcher.exceptions import (
    BodyTooLarge,
    InvalidRequest,
    ModelNotAllowed,
    ModelNotFound,
    RequestTimeout,
    ResponseNotFound,
    ResponseProviderGone,
    UnsupportedEndpoint,
)
from dispatcher.jsonbody import read_request
from dispatcher.multipart import fields
from dispatcher.plans import Lane
from dispatcher.script_calls import SubmitStatus
from dispatcher.tenants import Tenant


class Intake(msgspec.Struct, frozen=True):
    """A Struct, not a frozen dataclass: every request makes one (or more), and a frozen
    dataclass sets each field through ``object.__setattr__``."""

    model: ModelConfig
    endpoint: str
    stream: bool
    lane: Lane
    pinned: bool  # the lane is one provider's, because the request's state lives there
    stored: bytes  # what the worker gets (dispatcher/envelope.py)
    tenant: Tenant
    # Cache-aware dispatch (the model's affinity): its prompt's block hashes, or its
    # conversation's (dispatcher/affinity.py); empty when off.
    blocks: tuple[str, ...] = ()
    # Its tenant's rate limits and budget, with its token estimate (api/ratelimits.py).
    limits: wire.Limits | None = None
    # x-iop-deadline-ms: the longest the caller waits for it to start (0: not said).
    deadline_ms: int = 0
    body: bytes = b""  # as it came (a fallback's affinity blocks are computed from it)
    fell_back_from: str | None = None  # the model it was asked for, when a fallback takes it (counted once)


DEADLINE_HEADER = "x-iop-deadline-ms"


def _deadline(headers: Mapping[str, str]) -> int:
    raw = headers.get(DEADLINE_HEADER)
    if raw is None:
        return 0
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise InvalidRequest(f"{DEADLINE_HEADER} must be a positive number of milliseconds, got {raw!r}",
                             param=DEADLINE_HEADER)
    return value


# The submit statuses a model's fallbacks are tried on: it cannot take the request at once.
FALL_BACK_ON = frozenset({SubmitStatus.NO_PROVIDER, SubmitStatus.FULL, SubmitStatus.TENANT_FULL,
                          SubmitStatus.DEADLINE_UNMEETABLE})


def _serving(rt: Runtime, tenant: Tenant, model: ModelConfig, endpoint: str) -> Iterator[tuple[ModelConfig, Lane]]:
    """``model``'s fallbacks, in order, that ``tenant`` may call and that serve ``endpoint``, each
    with its lane there: the one rule of which fallback may take a request."""
    for fb_id in model.fallbacks:
        fb = rt.models.get(fb_id)
        if fb is None or not tenant.allows(fb_id):
            continue
        lane = rt.plans.lane_for(fb_id, endpoint)
        if lane is not None:
            yield fb, lane


def fallbacks(request: Request[Any, Any, Any], rt: Runtime, intake: Intake) -> Iterator[Intake]:
    """The request as each of its model's fallbacks would take it, in order (a request on a
    stored Response has none)."""
    if intake.pinned:
        return
    asked = intake.fell_back_from or intake.model.id
    for model, found in _serving(rt, intake.tenant, intake.model, intake.endpoint):
        blocks = (affinity_blocks(model, intake.endpoint, intake.body, headers_of(request)) if intake.blocks else ())
        yield msgspec.structs.replace(intake, model=model, lane=_in_band(request, rt, intake.tenant, found),
                                      blocks=blocks, fell_back_from=asked)


def _allowed(rt: Runtime, tenant: Tenant, model_id: str) -> ModelConfig:
    model = rt.models.get(model_id)
    if model is None:
        raise ModelNotFound(model_id)
    if not tenant.allows(model_id):
        raise ModelNotAllowed(f"Your key may not call '{model_id}'")
    return model


def _in_band(request: Request[Any, Any, Any], rt: Runtime, tenant: Tenant, lane: Lane) -> Lane:
    if len(rt.plans.bands) == 1:
        return lane
    band = rt.tenants.band_for(tenant, headers_of(request))
    return lane if band == lane.band else rt.plans.banded(lane, band)


async def read_body(request: Request[Any, Any, Any], rt: Runtime) -> bytes:
    try:
        async with asyncio.timeout(rt.config.api.body_timeout_s):
            return await request.body()
    except TimeoutError:
        raise RequestTimeout("The request body did not arrive in time") from None
    except RequestEntityTooLarge:
        raise too_large(headers_of(request), rt.config.api.max_body_bytes) from None


def too_large(headers: Mapping[str, str], limit: int) -> BodyTooLarge:
    """The answer to a body over ``limit`` (``api.max_body_bytes``, which Litestar enforces):
    its size when the request announced it, and the limit, so the caller knows what fits."""
    announced = headers.get("content-length", "")
    size = f"is {announced} bytes" if announced.isdigit() and int(announced) > limit else f"is over {limit} bytes"
    return BodyTooLarge(f"The request body {size}; this server takes at most {limit} bytes (api.max_body_bytes)")


async def take(
    request: Request[Any, Any, Any], rt: Runtime, endpoint: str, tenant: Tenant, traceparent: str = ""
) -> Intake:
    """A POST whose body names its model. ``traceparent``: of the request's span, for the
    worker's (dispatcher/tracing.py)."""
    body = await read_body(request, rt)
    spec = ENDPOINTS[endpoint]
    request_headers = headers_of(request)
    content_type = request_headers.get("content-type", JSON)
    previous = None
    if spec.body == "multipart":
        if not content_type.startswith("multipart/form-data"):
            raise InvalidRequest(f"/v1/{endpoint} takes multipart/form-data, not {content_type}")
        form = fields(body, content_type, ("model", "stream"))
        model_id, stream = form.get("model", "").strip(), form.get("stream", "").strip().lower() == "true"
        if not model_id:
            raise InvalidRequest("You must provide a model parameter", param="model")
    else:
        content_type = JSON
        model_id, stream, previous = read_request(body)
    model = _allowed(rt, tenant, model_id)
    stream = spec.always_streams or (stream and spec.can_stream)
    headers = forwarded(request) if spec.forwards else {}
    stored = wrap(RequestEnvelope(body, content_type=content_type, headers=headers, traceparent=traceparent))
    if previous is not None and endpoint == RESPONSES:
        maker = await _maker(rt, previous, "previous_response_id")
        lane = _in_band(request, rt, tenant, _pinned_lane(rt, model, maker, previous))
        return Intake(model, endpoint, stream, lane, True, stored, tenant,
                      limits=limits_for(tenant, body, True), deadline_ms=_deadline(request_headers))
    asked = None
    found = rt.plans.lane_for(model.id, endpoint)
    if found is None:
        # A fallback that serves it takes it, else it is refused.
        taker = next(_serving(rt, tenant, model, endpoint), None)
        if taker is None:
            raise UnsupportedEndpoint(f"No provider of '{model.id}' serves /v1/{endpoint}")
        asked, (model, found) = model.id, taker
    return Intake(model, endpoint, stream, _in_band(request, rt, tenant, found), False, stored, tenant,
                  affinity_blocks(model, endpoint, body, request_headers) if spec.body != "multipart" else (),
                  limits_for(tenant, body, content_type == JSON), _deadline(request_headers), body, asked)


async def take_stored(
    request: Request[Any, Any, Any], rt: Runtime, response_id: str, rest: str, tenant: Tenant, traceparent: str = ""
) -> Intake:
    """A call on a stored Response (``GET/DELETE /v1/responses/{id}``, ``.../cancel``,
    ``.../input_items``): to the provider that made it, for the model it was made with."""
    body = await read_body(request, rt)
    stored = await rt.jobs.stored_response(response_id)
    if stored is None:
        raise ResponseNotFound(f"No response with id '{response_id}' is known to iop (never stored, or forgotten)")
    if stored.model not in rt.models:
        raise ResponseProviderGone(f"Response '{response_id}' was made for model '{stored.model}', "
                                   "which this gateway no longer serves")
    model = _allowed(rt, tenant, stored.model)
    path = f"{RESPONSES}/{response_id}{rest}"
    if request.url.query:
        path += f"?{request.url.query}"
    envelope = RequestEnvelope(body, request.method, path, JSON, forwarded(request), traceparent)
    lane = _in_band(request, rt, tenant, _pinned_lane(rt, model, stored, response_id))
    return Intake(model, RESPONSES, False, lane, True, wrap(envelope), tenant,
                  limits=limits_for(tenant, body, False, generates=False))


def affinity_blocks(model: ModelConfig, endpoint: str, body: bytes, headers: Mapping[str, str]) -> tuple[str, ...]:
    """What cache-aware dispatch keys a request by (``models[].affinity``): the chained hashes
    of its prompt's blocks (``prefix``), or one hash of its conversation key (``session``;
    none without one); nothing when off."""
    mode = model.affinity.mode
    if mode == "prefix":
        return tuple(blocks_of(endpoint, body))
    if mode == "session":
        try:
            decoded = msgspec.json.decode(body)
        except msgspec.DecodeError:
            return ()
        key = session_of(endpoint, decoded if isinstance(decoded, dict) else {}, headers)
        return () if key is None else (session_block(key),)
    return ()


def forwarded(request: Request[Any, Any, Any]) -> dict[str, str]:
    headers = headers_of(request)
    return {name: headers[name] for name in FORWARDED_HEADERS if name in headers}


async def _maker(rt: Runtime, response_id: str, param: str) -> StoredResponse:
    stored = await rt.jobs.stored_response(response_id)
    if stored is None:
        raise ResponseNotFound(f"Previous response with id '{response_id}' not found.", param=param)
    return stored


def _pinned_lane(rt: Runtime, model: ModelConfig, stored: StoredResponse, response_id: str) -> Lane:
    """The lane of the provider that made the response, for ``model`` (the request's: a
    follow-up may name another model than the response was made for)."""
    lane = rt.plans.pinned_lane(model.id, stored.provider)
    if lane is not None:
        return lane
    made = f"Response '{response_id}' lives on provider '{stored.provider}'"
    if all(prov.id != stored.provider for _, prov in rt.config.providers()):
        raise ResponseProviderGone(f"{made}, which is no longer in this gateway's config; start a new conversation")
    if stored.model == model.id:
        raise ResponseProviderGone(f"{made}, which no longer serves '{model.id}' here; start a new conversation")
    # It made the response for another model; whether it ever served this one, iop cannot say.
    again = (f"continue it with model '{stored.model}', or start a new conversation"
             if rt.plans.pinned_lane(stored.model, stored.provider) is not None else "start a new conversation")
    raise ResponseProviderGone(f"{made}, which made it for model '{stored.model}' and does not serve "
                               f"'{model.id}' here: {again}")
