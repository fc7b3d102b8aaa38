"""Runtime control over HTTP, behind the admin keys (``dispatcher/control.py`` does the work;
docs/OPERATIONS.md "Runtime control" shows it in use):

    POST   /admin/providers/{id}/drain | /resume       {"provider", "drain", "in_flight"}
    GET    /admin/providers/{id}                       the same, read only
    POST   /admin/providers/{id}/disable | /enable     an override: no new dispatch there
    PUT    /admin/providers/{id}/capacity              {"capacity": N} | {"min": A, "max": B}
    DELETE /admin/providers/{id}/capacity
    PUT    /admin/models/{id}/fallbacks                {"fallbacks": [...]}
    PUT    /admin/models/{id}/preference               {"providers": [...]}
    DELETE /admin/models/{id}/fallbacks | /preference
    POST   /admin/providers/{id}/models/{served}/load | /unload     202
    GET    /admin/overrides                            every override in force
    GET    /admin/audit?since=<ms>&limit=<n>           control actions, newest first

An override's write takes an optional ``"for_s"`` (it lapses by itself then) and answers the
override as ``GET /admin/overrides`` lists it; a clear answers ``{"cleared": bool}``.

Apart from the read-only surfaces (``api/operator.py``), and guarded more strictly than they
are, because these act on the whole fleet (``KeyGuard.check_control``): the admin keys
decide, from anywhere. Without admin keys a caller key never suffices (403: a caller must
not take providers out of the pool), and an API with no key at all answers only clients on
loopback (403 to others), so an open API reached over the network cannot change the fleet.
Who acted -- an admin key's name -- and through what (``X-IOP-Via: cli`` or ``ui``, else
``http``) go into the audit log with each action.

The reads of one provider's drain state, of the overrides and of the audit log take the
read-only surfaces' rule instead (admin keys, else caller keys, else open): they show what
``/catalog`` already shows to the same callers.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, TypeVar

import msgspec
from litestar import Request, Response, Router, delete, get, post, put
from litestar.di import NamedDependency
from litestar.exceptions import NotFoundException
from litestar.params import FromPath, FromQuery
from redis.exceptions import RedisError

from api.gateway import Gateway
from dispatcher.control import (
    Actor,
    CapacityBody,
    Control,
    FallbacksBody,
    ForBody,
    PreferenceBody,
)
from dispatcher.exceptions import InvalidOverride, RedisUnavailable

Body = TypeVar("Body", bound=msgspec.Struct)
VIAS = frozenset({"cli", "ui"})
MAX_AUDIT = 1000


def _control(gw: Gateway) -> Control:
    # Built per call from the current runtime: a reload or an override may swap its calls.
    return Control(gw.runtime.calls, gw.redis, gw.file_config)


def _actor(gw: Gateway, request: Request[Any, Any, Any]) -> Actor:
    via = request.headers.get("x-iop-via", "").strip().lower()
    return Actor(by=gw.runtime.admin.name_of(request.headers), via=via if via in VIAS else "http")


async def _body(request: Request[Any, Any, Any], kind: type[Body], empty_ok: bool = False) -> Body:
    raw = await request.body()
    if not raw.strip() and empty_ok:
        raw = b"{}"
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.DecodeError as exc:
        raise InvalidOverride(f"the body is not what this endpoint takes: {exc}") from None


async def _answer(action: Awaitable[Any], status: int = 200) -> Response[bytes]:
    try:
        result = await action
    except RedisError as exc:
        raise RedisUnavailable(f"Redis is unavailable, nothing was changed: {exc}") from None
    return Response(msgspec.json.encode(result), status_code=status, media_type="application/json")


@post("/admin/providers/{provider_id:str}/drain", status_code=200,
      summary="Stop new dispatch to a provider, fleet-wide; its running jobs finish")
async def drain(gw: NamedDependency[Gateway], request: Request[Any, Any, Any],
                provider_id: FromPath[str]) -> Response[bytes]:
    return await _answer(_control(gw).drain(provider_id, _actor(gw, request)))


@post("/admin/providers/{provider_id:str}/resume", status_code=200,
      summary="Let a drained provider take jobs again; waiting ones get its free slots at once")
async def resume(gw: NamedDependency[Gateway], request: Request[Any, Any, Any],
                 provider_id: FromPath[str]) -> Response[bytes]:
    return await _answer(_control(gw).resume(provider_id, _actor(gw, request)))


@get("/admin/providers/{provider_id:str}", summary="A provider's drain state and running jobs")
async def provider_state(gw: NamedDependency[Gateway], provider_id: FromPath[str]) -> Response[bytes]:
    return await _answer(_control(gw).state(provider_id))


@post("/admin/providers/{provider_id:str}/disable", status_code=200,
      summary="Override: no new dispatch to a provider anywhere (running requests finish); optional for_s")
async def disable(gw: NamedDependency[Gateway], request: Request[Any, Any, Any],
                  provider_id: FromPath[str]) -> Response[bytes]:
    body = await _body(request, ForBody, empty_ok=True)
    return await _answer(_control(gw).disable(provider_id, _actor(gw, request), body.for_s))


@post("/admin/providers/{provider_id:str}/enable", status_code=200, summary="Clear a provider's disable override")
async def enable(gw: NamedDependency[Gateway], request: Request[Any, Any, Any],
                 provider_id: FromPath[str]) -> Response[bytes]:
    return await _answer(_control(gw).enable(provider_id, _actor(gw, request)))


@put("/admin/providers/{provider_id:str}/capacity", status_code=200,
     summary='Override a provider\'s capacity ({"capacity": N}) or its learned bounds ({"min", "max"})')
async def set_capacity(gw: NamedDependency[Gateway], request: Request[Any, Any, Any],
                       provider_id: FromPath[str]) -> Response[bytes]:
    body = await _body(request, CapacityBody)
    return await _answer(_control(gw).set_capacity(provider_id, body, _actor(gw, request)))


@delete("/admin/providers/{provider_id:str}/capacity", status_code=200,
        summary="Clear a provider's capacity overrides")
async def clear_capacity(gw: NamedDependency[Gateway], request: Request[Any, Any, Any],
                         provider_id: FromPath[str]) -> Response[bytes]:
    return await _answer(_control(gw).clear_capacity(provider_id, _actor(gw, request)))


async def _model_override(gw: Gateway, request: Request[Any, Any, Any], rest: str) -> Response[bytes]:
    # A model id may hold a '/' (an organisation's prefix): the path's last segment names the
    # field, everything before it the model.
    model_id, _, name = rest.strip("/").rpartition("/")
    control, actor, put = _control(gw), _actor(gw, request), request.method == "PUT"
    if name == "fallbacks":
        if put:
            return await _answer(control.set_fallbacks(model_id, await _body(request, FallbacksBody), actor))
        return await _answer(control.clear_fallbacks(model_id, actor))
    if name == "preference":
        if put:
            return await _answer(control.set_preference(model_id, await _body(request, PreferenceBody), actor))
        return await _answer(control.clear_preference(model_id, actor))
    raise NotFoundException(f"no such override of a model: {name!r} (fallbacks, preference)")


@put("/admin/models/{rest:path}", status_code=200,
     summary='Override a model\'s fallbacks (.../fallbacks, {"fallbacks": [...]}) or the order of preference '
             'among its providers (.../preference, {"providers": [...]})')
async def set_model_override(gw: NamedDependency[Gateway], request: Request[Any, Any, Any],
                             rest: FromPath[str]) -> Response[bytes]:
    return await _model_override(gw, request, rest)


@delete("/admin/models/{rest:path}", status_code=200,
        summary="Clear a model's fallbacks (.../fallbacks) or preference (.../preference) override")
async def clear_model_override(gw: NamedDependency[Gateway], request: Request[Any, Any, Any],
                               rest: FromPath[str]) -> Response[bytes]:
    return await _model_override(gw, request, rest)


@post("/admin/providers/{provider_id:str}/models/{rest:path}", status_code=202,
      summary="Load (.../models/{served}/load) or unload (.../unload) a model on a provider whose models iop "
              "manages: its worker asks the runtime")
async def model_order(gw: NamedDependency[Gateway], request: Request[Any, Any, Any], provider_id: FromPath[str],
                      rest: FromPath[str]) -> Response[bytes]:
    # A served name may hold '/' (Qwen/Qwen3.6-35B-A3B, hf.co/org/model:tag): the last segment
    # is the action.
    served, _, op = rest.strip("/").rpartition("/")
    if op not in ("load", "unload") or not served:
        raise NotFoundException(f"no such action on a provider's model: {op!r} (load, unload)")
    return await _answer(_control(gw).model_order(provider_id, served, "load" if op == "load" else "unload",
                                                  _actor(gw, request)), 202)


@get("/admin/overrides", summary="Every override in force: who set it, when, and when it lapses")
async def list_overrides(gw: NamedDependency[Gateway]) -> Response[bytes]:
    async def listing() -> dict[str, Any]:
        return {"overrides": await _control(gw).overrides()}
    return await _answer(listing())


@get("/admin/audit", summary="Control actions, newest first")
async def audit(gw: NamedDependency[Gateway], since: FromQuery[int | None] = None,
                limit: FromQuery[int] = 100) -> Response[bytes]:
    if not 1 <= limit <= MAX_AUDIT:
        raise InvalidOverride(f"limit must be between 1 and {MAX_AUDIT}, got {limit}", param="limit")
    if since is not None and not 0 <= since < 2**63:
        raise InvalidOverride(f"since is a time in UTC ms, from 0, got {since}", param="since")

    async def listing() -> dict[str, Any]:
        return {"entries": await _control(gw).audit(since, limit)}
    return await _answer(listing())


def control_routers(read_guards: list[Any], write_guards: list[Any]) -> list[Router]:
    return [Router(path="/", route_handlers=[drain, resume, disable, enable, set_capacity, clear_capacity,
                                             set_model_override, clear_model_override, model_order],
                   guards=write_guards),
            Router(path="/", route_handlers=[provider_state, list_overrides, audit], guards=read_guards)]
