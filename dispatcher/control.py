"""Runtime control: drain a provider -- no new dispatch to it, from any API replica or any
freed slot, while the jobs it runs finish -- and resume it.

Kept apart from the read-only catalog (``dispatcher/catalog.py``) so that reading the fleet
never needs code that changes it. The mark is the field ``drain`` of ``{iop}:p:<provider>``
(``lua/drain.lua``): in Redis, so the whole fleet obeys it at once and it outlives API and
worker restarts; the dispatch step (``lua/lib/pump.lua``) reads it with the provider's
health, in the same HMGET.
"""

from __future__ import annotations

from typing import Literal

import msgspec
from redis.asyncio import Redis

from dispatcher import keys
from dispatcher.exceptions import UnknownProvider
from dispatcher.script_calls import ScriptCalls

# "draining": marked, jobs still run on it; "drained": marked, nothing runs (safe to stop).
DrainLabel = Literal["draining", "drained"]


def drain_state(mark: str | None, in_flight: int) -> DrainLabel | None:
    """What a provider hash's ``drain`` mark and ``in_flight`` say; None: open."""
    if not mark:
        return None
    return "draining" if in_flight > 0 else "drained"


class DrainState(msgspec.Struct):
    provider: str
    drain: DrainLabel | None
    in_flight: int


class Control:
    """Drain and resume, for one config (that of ``calls``)."""

    def __init__(self, calls: ScriptCalls, redis: Redis) -> None:
        self.calls = calls
        self.redis = redis

    def _check(self, provider_id: str) -> None:
        if provider_id not in self.calls.plans.by_provider:
            raise UnknownProvider(provider_id)

    async def drain(self, provider_id: str) -> DrainState:
        """Mark the provider drained (again: a no-op that keeps the first mark's time)."""
        return await self._run(provider_id, "drain")

    async def resume(self, provider_id: str) -> DrainState:
        """Clear the mark; jobs waiting for the provider's free slots get them at once."""
        return await self._run(provider_id, "resume")

    async def _run(self, provider_id: str, mode: Literal["drain", "resume"]) -> DrainState:
        self._check(provider_id)
        done = await self.calls.drain(provider_id, mode)
        return DrainState(provider_id, drain_state(done.mark, done.in_flight), max(done.in_flight, 0))

    async def state(self, provider_id: str) -> DrainState:
        self._check(provider_id)
        mark, in_flight = await self.redis.hmget(keys.provider(provider_id), ["drain", "in_flight"])
        running = max(int(in_flight or 0), 0)
        return DrainState(provider_id, drain_state(mark.decode() if isinstance(mark, bytes) else mark, running),
                          running)
