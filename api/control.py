"""Runtime control over HTTP, behind the admin keys: drain a provider (no new dispatch to it
anywhere in the fleet, its running jobs finish) and resume it (``dispatcher/control.py``).

    POST /admin/providers/{provider_id}/drain
    POST /admin/providers/{provider_id}/resume
    GET  /admin/providers/{provider_id}

each answering ``{"provider": id, "drain": "draining" | "drained" | null, "in_flight": n}``.

Apart from the read-only surfaces (``api/operator.py``), and guarded more strictly than they
are, because a drain acts on the whole fleet (``KeyGuard.check_control``): the admin keys
decide, from anywhere. Without admin keys a caller key never suffices (403: a caller must
not take providers out of the pool), and an API with no key at all answers only clients on
loopback (403 to others), so an open API reached over the network cannot drain the fleet.

The read, ``GET /admin/providers/{id}``, takes the read-only surfaces' rule instead (admin
keys, else caller keys, else open): it shows what ``/catalog`` already shows to the same
callers (``providers[].drain``, ``in_flight``), so a stricter rule would hide nothing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from litestar import Response, Router, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath
from redis.exceptions import RedisError

from api.gateway import Gateway
from dispatcher.control import Control, DrainState
from dispatcher.exceptions import RedisUnavailable


def _control(gw: NamedDependency[Gateway]) -> Control:
    # Built per call from the current runtime: a config reload may swap its calls.
    return Control(gw.runtime.calls, gw.redis)


async def _answer(action: Callable[[str], Awaitable[DrainState]], provider_id: str) -> Response[bytes]:
    try:
        result = await action(provider_id)
    except RedisError as exc:
        raise RedisUnavailable(f"Redis is unavailable: {exc}") from None
    return Response(msgspec.json.encode(result), media_type="application/json")


@post("/admin/providers/{provider_id:str}/drain", status_code=200,
      summary="Stop new dispatch to a provider, fleet-wide; its running jobs finish")
async def drain(gw: NamedDependency[Gateway], provider_id: FromPath[str]) -> Response[bytes]:
    return await _answer(_control(gw).drain, provider_id)


@post("/admin/providers/{provider_id:str}/resume", status_code=200,
      summary="Let a drained provider take jobs again; waiting ones get its free slots at once")
async def resume(gw: NamedDependency[Gateway], provider_id: FromPath[str]) -> Response[bytes]:
    return await _answer(_control(gw).resume, provider_id)


@get("/admin/providers/{provider_id:str}", summary="A provider's drain state and running jobs")
async def provider_state(gw: NamedDependency[Gateway], provider_id: FromPath[str]) -> Response[bytes]:
    return await _answer(_control(gw).state, provider_id)


def control_routers(read_guards: list[Any], write_guards: list[Any]) -> list[Router]:
    return [Router(path="/", route_handlers=[drain, resume], guards=write_guards),
            Router(path="/", route_handlers=[provider_state], guards=read_guards)]
