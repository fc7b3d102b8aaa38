"""Operators' overrides of the config, kept in Redis beside it (docs/DESIGN.md "Runtime
control"): what they are, the config they make, and how every process keeps up with them.

An override replaces one config value fleet-wide until it is cleared or lapses:

==================  ==========  =============================================================
field               target      what holds it
==================  ==========  =============================================================
``enabled``         provider    ``off`` in its hash: dispatch reads it (lib/takes_work.lua)
``capacity``        provider    ``cap_o`` in its hash: the capacity in force
                                (lib/capacity_in_force.lua), whatever its worker proposes
``capacity_bounds`` provider    ``cap_lo``/``cap_hi`` in its hash, and the effective config:
                                its worker learns ``capacity: auto`` within them
``fallbacks``       model       the effective config (the API's intake reads it)
``preference``      model       the effective config (the plans' candidate ranks)
==================  ==========  =============================================================

``lua/override.lua`` is the only writer: the record in ``keys.OVERRIDES``, the fields of the
provider hash, the version and the audit entry change in one call, so nothing is half done
and the hash fields hold in every process at the instant of the call. What the config
derives in each process -- its plans, its fallbacks, its workers' bounds -- follows within
``WATCH_S``: every API and worker process polls the version (:class:`OverrideWatch`, one GET
per tick) and, when it moved, rebuilds what it runs from :func:`effective` of its config.
A process that starts reads them before it serves; a reload applies them to the new file.

Each override may lapse (``until``): the server's clock decides (``lua/override.lua``
``lapse``), and every process's watch asks it when one of its records is due, so an
override lapses within a tick of its time whoever runs, with an audit entry ``via
expiry``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import anyio
import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from dispatcher import keys, wire
from dispatcher.config import Config, ProviderConfig

log = logging.getLogger("iop.overrides")

Field = Literal["enabled", "capacity", "capacity_bounds", "fallbacks", "preference"]
PROVIDER_FIELDS: tuple[Field, ...] = ("enabled", "capacity", "capacity_bounds")
MODEL_FIELDS: tuple[Field, ...] = ("fallbacks", "preference")
# How often a process looks at the version: the bound is a second, and a GET of one
# small string per process per tick costs nothing Redis notices.
WATCH_S = 0.2

_decode_override = msgspec.json.Decoder(wire.Override).decode


def target_of(name: Field) -> Literal["provider", "model"]:
    return "provider" if name in PROVIDER_FIELDS else "model"


def field_key(name: Field, target_id: str) -> str:
    """The overrides hash's field: ``<field>|<id>`` (no id holds a ``|``: config validation)."""
    return f"{name}|{target_id}"


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The overrides in force, as one read found them."""

    version: int = -1
    records: dict[tuple[Field, str], wire.Override] = field(default_factory=dict)

    def get(self, name: Field, target_id: str) -> wire.Override | None:
        return self.records.get((name, target_id))

    def of(self, target_id: str, fields: Iterable[Field]) -> dict[str, wire.Override]:
        """``target_id``'s overrides among ``fields``, by field name."""
        return {name: rec for name in fields if (rec := self.records.get((name, target_id))) is not None}

    def next_lapse_ms(self) -> int | None:
        """The earliest ``until`` among the records (server ms), None if none lapses."""
        times = [rec.until for rec in self.records.values() if rec.until]
        return min(times) if times else None

    def due(self, now_ms: int) -> list[tuple[Field, str]]:
        return [k for k, rec in self.records.items() if rec.until and rec.until <= now_ms]


async def read(redis: Redis) -> Snapshot:
    """Every override in force."""
    async with redis.pipeline(transaction=True) as pipe:
        pipe.get(keys.OVERRIDES_VERSION)
        pipe.hgetall(keys.OVERRIDES)
        version, raw = await pipe.execute()
    return Snapshot(int(version or 0), parse(raw))


def parse(raw: dict[Any, Any]) -> dict[tuple[Field, str], wire.Override]:
    """The overrides hash's fields as records (one that does not decode is skipped, and said)."""
    records: dict[tuple[Field, str], wire.Override] = {}
    for fkey, blob in raw.items():
        text = fkey.decode() if isinstance(fkey, bytes) else fkey
        name, _, target_id = text.partition("|")
        if name not in (*PROVIDER_FIELDS, *MODEL_FIELDS):
            continue
        try:
            records[(cast(Field, name), target_id)] = _decode_override(blob)
        except msgspec.DecodeError as exc:
            log.warning("override %s not read: %s", text, exc)
    return records


def config_value(config: Config, name: Field, target_id: str) -> Any:
    """What the config says of ``name`` for ``target_id`` (None: no such target)."""
    if target_of(name) == "provider":
        prov = config.provider(target_id)
        if prov is None:
            return None
        if name == "enabled":
            return True
        if name == "capacity":
            return prov.capacity
        lo, hi = prov.capacity_bounds
        return {"min": lo, "max": hi}
    model = config.model(target_id)
    if model is None:
        return None
    return list(model.fallbacks) if name == "fallbacks" else list(model.preference)


def stale_reason(config: Config, name: Field, target_id: str, value: Any) -> str | None:
    """Why an override no longer fits ``config`` (what it names is gone, or it would break a
    rule of the new file); None when it still does."""
    if target_of(name) == "provider":
        prov = config.provider(target_id)
        if prov is None:
            return f"provider {target_id!r} is no longer in the config"
        if name == "capacity_bounds" and not prov.auto:
            return f"provider {target_id!r} no longer learns its capacity (capacity: auto)"
        return None
    model = config.model(target_id)
    if model is None:
        return f"model {target_id!r} is no longer in the config"
    if name == "preference":
        gone = [pid for pid in value if pid not in model.providers]
        return f"provider(s) {', '.join(gone)} no longer serve model {target_id!r}" if gone else None
    gone = [mid for mid in value if config.model(mid) is None]
    return f"fallback model(s) {', '.join(gone)} are no longer in the config" if gone else None


def effective(config: Config, snapshot: Snapshot) -> Config:
    """``config`` with the overrides it derives something from applied (fallbacks,
    preference, the bounds of a learned capacity); an override that no longer fits it is
    left out (:func:`stale_reason`; a reload drops it: :func:`drop_stale`). ``enabled`` and
    a fixed ``capacity`` act in the provider hash alone (lib/takes_work.lua,
    lib/capacity_in_force.lua)."""
    if not snapshot.records:
        return config
    models = []
    for model in config.models:
        changes: dict[str, Any] = {}
        for name in MODEL_FIELDS:
            rec = snapshot.get(name, model.id)
            if rec is not None and stale_reason(config, name, model.id, rec.value) is None:
                changes[name] = list(rec.value)
        models.append(msgspec.structs.replace(model, **changes) if changes else model)
    nodes = []
    for node in config.nodes:
        provs: list[ProviderConfig] = []
        for prov in node.providers:
            rec = snapshot.get("capacity_bounds", prov.id)
            if rec is not None and prov.auto and isinstance(rec.value, dict):
                prov = msgspec.structs.replace(prov, min_capacity=int(rec.value["min"]),
                                               max_capacity=int(rec.value["max"]))
            provs.append(prov)
        nodes.append(msgspec.structs.replace(node, providers=provs))
    return msgspec.structs.replace(config, models=models, nodes=nodes)


def view(name: Field, target_id: str, rec: wire.Override) -> dict[str, Any]:
    """One override as ``GET /admin/overrides`` and the override writes answer it."""
    return {"target": target_of(name), "id": target_id, "field": name, "value": rec.value, "config": rec.config,
            "by": rec.by, "at": rec.at, "until": rec.until, "via": rec.via}


class OverrideWatch:
    """Keeps one process's config in step with the overrides: polls the version every
    ``WATCH_S``, and when it moved reads them and calls ``apply`` with the new snapshot (the
    process rebuilds what it derives from the config); asks ``lapse`` for the records whose
    time has come. ``apply`` is called once at :meth:`start`, before the process serves."""

    def __init__(self, redis: Redis, apply: Callable[[Snapshot], Awaitable[None]],
                 lapse: Callable[[Field, str], Awaitable[None]]) -> None:
        self._redis = redis
        self._apply = apply
        self._lapse = lapse
        self.snapshot = Snapshot()
        # Server ms minus this process's clock (ms), from the last version read: lapse times
        # are the server's.
        self._skew_ms = 0

    async def start(self) -> None:
        """Read and apply what is in force now (a Redis that does not answer: the config
        alone until it does; the loop keeps asking)."""
        try:
            await self.refresh()
        except RedisError as exc:
            log.warning("overrides not read at start (the config alone applies until Redis answers): %s", exc)

    async def refresh(self, force: bool = False) -> bool:
        """Read the version; on a change (or ``force``) the overrides, then apply them.
        Whether they were applied."""
        version = await self._redis.get(keys.OVERRIDES_VERSION)
        if not force and int(version or 0) == self.snapshot.version:
            return False
        snap = await read(self._redis)
        self.snapshot = snap
        server_s, micros = await self._redis.time()
        self._skew_ms = int(server_s) * 1000 + int(micros) // 1000 - int(time.time() * 1000)
        await self._apply(snap)
        return True

    async def run(self) -> None:
        while True:
            await anyio.sleep(WATCH_S)
            try:
                await self.refresh()
                now = int(time.time() * 1000) + self._skew_ms
                for name, target_id in self.snapshot.due(now):
                    await self._lapse(name, target_id)
            except RedisError as exc:
                log.debug("overrides not watched this tick: %s", exc)
