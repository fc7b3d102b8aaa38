"""Runtime control: what an operator may change in a running fleet, checked against the
config's own rules, done by one script call each so that nothing is half applied, and
audited in the same call (docs/OPERATIONS.md "Runtime control").

* drain a provider -- no new dispatch to it, from any API replica or any freed slot, while
  the jobs it runs finish -- and resume it (``lua/drain.lua``: the field ``drain`` of
  ``{iop}:p:<provider>``, read by the dispatch step with the provider's health);
* override a config value fleet-wide, for a while or until cleared: disable a provider, fix
  its capacity or bound a learned one, change a model's fallbacks or its preference among
  its providers (``lua/override.lua``; dispatcher/overrides.py says who applies what);
* load or unload a model on a provider whose models iop manages (``lua/model_order.lua``);
* read the overrides in force and the audit of every action.

Kept apart from the read-only catalog (``dispatcher/catalog.py``) so that reading the fleet
never needs code that changes it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
from redis.asyncio import Redis

from dispatcher import keys, overrides, wire
from dispatcher.config import AUTO_MAX_CAPACITY, Config, ModelConfig, ProviderConfig
from dispatcher.config.validation import validate
from dispatcher.exceptions import ControlConflict, InvalidOverride, ModelNotFound, RequestError, UnknownProvider
from dispatcher.overrides import Field
from dispatcher.script_calls import ScriptCalls

log = logging.getLogger("iop.control")

# "draining": marked, jobs still run on it; "drained": marked, nothing runs (safe to stop).
DrainLabel = Literal["draining", "drained"]
# The longest an override may be given (a year): a typo of units should not outlive the fleet.
MAX_FOR_S = 366 * 86400


def drain_state(mark: str | None, in_flight: int) -> DrainLabel | None:
    """What a provider hash's ``drain`` mark and ``in_flight`` say; None: open."""
    if not mark:
        return None
    return "draining" if in_flight > 0 else "drained"


class DrainState(msgspec.Struct):
    provider: str
    drain: DrainLabel | None
    in_flight: int


@dataclass(frozen=True, slots=True)
class Actor:
    """Who acts (an admin key's name, never the key) and through what (``http``, ``cli``,
    ``ui``, ``reload``, ``expiry``)."""

    by: str = "iop"
    via: str = "http"


class UnknownServedModel(RequestError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class CapacityBody(msgspec.Struct, forbid_unknown_fields=True):
    """``PUT /admin/providers/{id}/capacity``: a fixed capacity, or the bounds of a learned one."""

    capacity: int | None = None
    min: int | None = None
    max: int | None = None
    for_s: float | None = None


class FallbacksBody(msgspec.Struct, forbid_unknown_fields=True):
    fallbacks: list[str]
    for_s: float | None = None


class PreferenceBody(msgspec.Struct, forbid_unknown_fields=True):
    providers: list[str]
    for_s: float | None = None


class ForBody(msgspec.Struct, forbid_unknown_fields=True):
    for_s: float | None = None


def for_ms(for_s: float | None) -> int:
    """An override's time in ms (0: no expiry); 422 for one that is not a positive time."""
    if for_s is None:
        return 0
    if not 0 < for_s <= MAX_FOR_S:
        raise InvalidOverride(f"for_s must be over 0 and at most {MAX_FOR_S} (a year), got {for_s:g}",
                              param="for_s")
    return max(round(for_s * 1000), 1)


def _json(value: Any) -> bytes:
    return msgspec.json.encode(value)


class Control:
    """The operator's actions on the fleet, checked against ``config`` -- the file's: what an
    override replaces, and what it may name -- with the calls of the config in force
    (``calls``: the file's with the overrides applied)."""

    def __init__(self, calls: ScriptCalls, redis: Redis, config: Config | None = None) -> None:
        self.calls = calls
        self.redis = redis
        self.config = config if config is not None else calls.config

    # --- checks ----------------------------------------------------------------------------

    def _provider(self, provider_id: str) -> ProviderConfig:
        prov = self.config.provider(provider_id)
        if prov is None or provider_id not in self.calls.plans.by_provider:
            raise UnknownProvider(provider_id)
        return prov

    def _model(self, model_id: str) -> ModelConfig:
        model = self.config.model(model_id)
        if model is None:
            raise ModelNotFound(model_id)
        return model

    # --- drain -----------------------------------------------------------------------------

    async def drain(self, provider_id: str, actor: Actor = Actor()) -> DrainState:
        """Mark the provider drained (again: a no-op that keeps the first mark's time)."""
        return await self._drain(provider_id, "drain", actor)

    async def resume(self, provider_id: str, actor: Actor = Actor()) -> DrainState:
        """Clear the mark; jobs waiting for the provider's free slots get them at once."""
        return await self._drain(provider_id, "resume", actor)

    async def _drain(self, provider_id: str, mode: Literal["drain", "resume"], actor: Actor) -> DrainState:
        self._provider(provider_id)
        done = await self.calls.drain(provider_id, mode, actor.by, actor.via)
        return DrainState(provider_id, drain_state(done.mark, done.in_flight), max(done.in_flight, 0))

    async def state(self, provider_id: str) -> DrainState:
        self._provider(provider_id)
        mark, in_flight = await self.redis.hmget(keys.provider(provider_id), ["drain", "in_flight"])
        running = max(int(in_flight or 0), 0)
        return DrainState(provider_id, drain_state(mark.decode() if isinstance(mark, bytes) else mark, running),
                          running)

    # --- overrides -------------------------------------------------------------------------

    async def disable(self, provider_id: str, actor: Actor, for_s: float | None = None) -> dict[str, Any]:
        """No new dispatch to the provider anywhere; its running jobs finish."""
        self._provider(provider_id)
        return await self._set("enabled", provider_id, False, actor, for_ms(for_s), "disable")

    async def enable(self, provider_id: str, actor: Actor) -> dict[str, Any]:
        self._provider(provider_id)
        return await self._clear("enabled", provider_id, actor, "enable")

    async def set_capacity(self, provider_id: str, body: CapacityBody, actor: Actor) -> dict[str, Any]:
        """A fixed capacity (``capacity``), or the bounds a learned one stays within
        (``min``/``max``, for ``capacity: auto``), each between 1 and the provider's
        ``max_capacity`` (for a fixed capacity, which has none: the default ceiling of a
        learned one, or its configured capacity if that is more)."""
        prov = self._provider(provider_id)
        if prov.auto:
            ceiling = prov.capacity_bounds[1]
            bound = f"provider {provider_id!r}'s max_capacity {ceiling}" + (
                "" if prov.max_capacity is not None else " (the default: set max_capacity in its config to allow more)")
        else:
            # A fixed capacity has no max_capacity: an override may raise it to the default
            # ceiling of a learned one, or keep it at its configured value if that is more.
            ceiling = max(prov.fixed_capacity, AUTO_MAX_CAPACITY)
            bound = (f"{ceiling}, the most an override may give provider {provider_id!r} (its configured capacity "
                     f"or {AUTO_MAX_CAPACITY}, whichever is more)")
        window = for_ms(body.for_s)
        if body.capacity is not None:
            if body.min is not None or body.max is not None:
                raise InvalidOverride("give either capacity, or min and max, not both", param="capacity")
            if body.capacity < 1:
                raise InvalidOverride(
                    f"capacity must be at least 1, got {body.capacity} (to take the provider out of rotation, "
                    "disable it)", param="capacity")
            if body.capacity > ceiling:
                raise InvalidOverride(f"capacity {body.capacity} is above {bound}", param="capacity")
            return await self._set("capacity", provider_id, body.capacity, actor, window, "capacity")
        if body.min is None or body.max is None:
            raise InvalidOverride('give {"capacity": N}, or {"min": A, "max": B} for a learned capacity',
                                  param="capacity")
        if not prov.auto:
            raise InvalidOverride(
                f"min and max bound a learned capacity, and provider {provider_id!r} has a fixed one "
                f"({prov.capacity}): give {{\"capacity\": N}}", param="min")
        if body.min < 1:
            raise InvalidOverride(f"min must be at least 1, got {body.min}", param="min")
        if body.max > ceiling:
            raise InvalidOverride(f"max {body.max} is above {bound}", param="max")
        if body.min > body.max:
            raise InvalidOverride(f"min {body.min} is above max {body.max}", param="min")
        return await self._set("capacity_bounds", provider_id, {"min": body.min, "max": body.max}, actor, window,
                               "capacity")

    async def clear_capacity(self, provider_id: str, actor: Actor) -> dict[str, Any]:
        self._provider(provider_id)
        fixed = await self._clear("capacity", provider_id, actor, "capacity.clear")
        bounds = await self._clear("capacity_bounds", provider_id, actor, "capacity.clear")
        return {**fixed, "cleared": fixed["cleared"] or bounds["cleared"]}

    async def set_fallbacks(self, model_id: str, body: FallbacksBody, actor: Actor) -> dict[str, Any]:
        """The model's fallbacks, checked as the config's are: known models, not itself, none
        twice, no loop -- with every other override in force counted."""
        self._model(model_id)
        problems = self._problems_with(model_id, fallbacks=list(body.fallbacks))
        if problems:
            raise InvalidOverride("; ".join(problems), param="fallbacks")
        return await self._set("fallbacks", model_id, list(body.fallbacks), actor, for_ms(body.for_s),
                               "fallbacks")

    async def clear_fallbacks(self, model_id: str, actor: Actor) -> dict[str, Any]:
        self._model(model_id)
        return await self._clear("fallbacks", model_id, actor, "fallbacks.clear")

    async def set_preference(self, model_id: str, body: PreferenceBody, actor: Actor) -> dict[str, Any]:
        """The providers of the model filled first, in order (lua/lib/pick.lua)."""
        self._model(model_id)
        if not body.providers:
            raise InvalidOverride("name at least one provider (to prefer none, clear the override)",
                                  param="providers")
        problems = self._problems_with(model_id, preference=list(body.providers))
        if problems:
            raise InvalidOverride("; ".join(problems), param="providers")
        return await self._set("preference", model_id, list(body.providers), actor, for_ms(body.for_s),
                               "preference")

    async def clear_preference(self, model_id: str, actor: Actor) -> dict[str, Any]:
        self._model(model_id)
        return await self._clear("preference", model_id, actor, "preference.clear")

    def _problems_with(self, model_id: str, **change: list[str]) -> list[str]:
        """What the config's rules say of the config in force with ``model_id`` changed so."""
        running = self.calls.config
        models = [msgspec.structs.replace(m, **change) if m.id == model_id else m for m in running.models]
        index = next(i for i, m in enumerate(models) if m.id == model_id)
        prefix = f"$.models[{index}]."
        out = []
        for problem in validate(msgspec.structs.replace(running, models=models)):
            if problem.path.startswith(prefix + next(iter(change))):
                out.append(problem.message)
        return out

    async def _set(self, name: Field, target_id: str, value: Any, actor: Actor, window_ms: int,
                   action: str) -> dict[str, Any]:
        config = overrides.config_value(self.config, name, target_id)
        _, record = await self.calls.override(
            "set", name, target_id, value=_json(value), config=_json(config), by=actor.by, via=actor.via,
            for_ms=window_ms, action=action)
        rec = msgspec.json.decode(record, type=wire.Override)
        log.info("override: %s of %s: %s (config %s)%s, by %s via %s", action, target_id, json.dumps(value),
                 json.dumps(config), f" for {window_ms / 1000:g}s" if window_ms else "", actor.by, actor.via)
        return overrides.view(name, target_id, rec)

    async def _clear(self, name: Field, target_id: str, actor: Actor, action: str) -> dict[str, Any]:
        config = overrides.config_value(self.config, name, target_id)
        changed, _ = await self.calls.override("clear", name, target_id, config=_json(config), by=actor.by,
                                               via=actor.via, action=action)
        if changed:
            log.info("override: %s of %s, by %s via %s", action, target_id, actor.by, actor.via)
        return {"target": overrides.target_of(name), "id": target_id, "field": name, "cleared": changed}

    async def lapse(self, name: Field, target_id: str) -> bool:
        """Clear an override whose time has come by the server's clock (any process may ask;
        one does it). Audited as its own action, via ``expiry``."""
        action = {"enabled": "enable", "capacity": "capacity.clear", "capacity_bounds": "capacity.clear",
                  "fallbacks": "fallbacks.clear", "preference": "preference.clear"}[name]
        config = overrides.config_value(self.config, name, target_id)
        if name in overrides.PROVIDER_FIELDS and target_id not in self.calls.plans.by_provider:
            return False  # a provider this process's config has not: one that has it lapses it
        changed, _ = await self.calls.override("lapse", name, target_id, config=_json(config), by="iop",
                                               via="expiry", action=action)
        if changed:
            log.info("override: %s of %s lapsed (its time ran out)", name, target_id)
        return changed

    async def drop_stale(self, snapshot: overrides.Snapshot) -> list[str]:
        """Clear the overrides that no longer fit this config (a reload removed what they
        name): each said in the log and audited via ``reload``. What was dropped, in words."""
        dropped = []
        for (name, target_id), rec in sorted(snapshot.records.items()):
            why = overrides.stale_reason(self.config, name, target_id, rec.value)
            if why is None:
                continue
            # A provider the reload removed has no plan here: its hash is cleared, nothing pumped.
            changed, _ = await self.calls.override(
                "clear", name, target_id, config=_json(overrides.config_value(self.config, name, target_id)),
                by="iop", via="reload", action=f"{name}.drop")
            if changed:
                words = f"override {name} of {target_id} dropped: {why}"
                log.warning("reload: %s", words)
                dropped.append(words)
        return dropped

    async def overrides(self) -> list[dict[str, Any]]:
        snap = await overrides.read(self.redis)
        found = sorted(snap.records.items(), key=lambda kv: (overrides.target_of(kv[0][0]), kv[0][1], kv[0][0]))
        return [overrides.view(name, target_id, rec) for (name, target_id), rec in found]

    # --- models that load and unload -------------------------------------------------------

    async def model_order(self, provider_id: str, served: str, op: Literal["load", "unload"],
                          actor: Actor) -> dict[str, Any]:
        """Ask the provider's runtime to load or unload ``served`` now (its worker does it)."""
        prov = self._provider(provider_id)
        if served not in prov.models:
            raise UnknownServedModel(f"provider {provider_id!r} has no model {served!r} (its models: "
                                     f"{', '.join(prov.models) or 'none'})", param="model")
        if not prov.manages_models:
            raise ControlConflict(
                f"iop does not load or unload the models of provider {provider_id!r} (lifecycle: "
                f"{prov.lifecycle}): set lifecycle: managed on a provider whose runtime can")
        outcome, what = await self.calls.scripts.model_order(
            [keys.provider(provider_id), keys.AUDIT, keys.AUDIT_COUNTS],
            [op, served, actor.by, actor.via, keys.AUDIT_KEEP, f"provider/{provider_id}",
             round(prov.load_timeout_s * 1000)])
        state = outcome.decode() if isinstance(outcome, bytes) else str(outcome)
        if state == "busy":
            detail = what.decode() if isinstance(what, bytes) else str(what)
            raise ControlConflict(f"provider {provider_id!r} is {detail} now: one order at a time; try again "
                                  "when it is done")
        return {"provider": provider_id, "model": served, "state": state}

    # --- audit -----------------------------------------------------------------------------

    async def audit(self, since_ms: int | None = None, limit: int = 100) -> list[wire.AuditEntry]:
        """The newest ``limit`` entries at or after server ms ``since_ms``, newest first."""
        low = f"{since_ms}-0" if since_ms is not None else "-"
        raw: list[tuple[bytes, dict[bytes, bytes]]] = await self.redis.xrevrange(  # type: ignore[assignment]
            keys.AUDIT, "+", low, count=limit)
        return [audit_entry(entry_id, fields) for entry_id, fields in raw]


def audit_entry(entry_id: bytes | str, fields: dict[Any, Any]) -> wire.AuditEntry:
    """A stream entry of ``keys.AUDIT`` (lib/audit.lua) as its Struct."""
    f = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
         for k, v in fields.items()}

    def value(raw: str | None) -> Any:
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            return raw

    return wire.AuditEntry(
        id=entry_id.decode() if isinstance(entry_id, bytes) else entry_id, at=int(f.get("at") or 0),
        by=f.get("by", ""), action=f.get("action", ""), target=f.get("target", ""), before=value(f.get("before")),
        after=value(f.get("after")), via=f.get("via", ""))


async def audit_once(calls: ScriptCalls, action: str, target: str, before: Any, after: Any, by: str, via: str,
                     once_digest: str | None = None) -> bool:
    """Append one entry for an action no script takes (a reload, a qualification run); with
    ``once_digest``, only if no process audited this digest already."""
    ks = [keys.AUDIT, keys.AUDIT_COUNTS, *([keys.AUDIT_ONCE] if once_digest else [])]
    done = await calls.scripts.audit(
        ks, [keys.AUDIT_KEEP, by, action, target, _json(before), _json(after), via, once_digest or ""])
    return bool(done)
