"""Device telemetry as the workers publish it (``workers/telemetry.py``, ``{iop}:tel:<node>``) and
the catalog reads it (``nodes[]``): a node's live workers and the freshest report among them, with
each vLLM-style provider's KV cache use from its engine reading (``workers/engine_metrics.py``).
A figure nothing reported is None, never 0."""

from __future__ import annotations

from typing import cast

import msgspec
from redis.asyncio import Redis

from dispatcher import keys


class Cpu(msgspec.Struct, frozen=True):
    utilization: float | None
    cores: int


class Memory(msgspec.Struct, frozen=True):
    used_bytes: int
    total_bytes: int


class Gpu(msgspec.Struct, frozen=True):
    index: int
    name: str
    utilization: float | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None


class HeldModel(msgspec.Struct, frozen=True):
    provider: str
    model: str
    vram_bytes: int | None = None
    kv_usage: float | None = None


class Telemetry(msgspec.Struct, frozen=True):
    at_ms: int  # when the worker read it (its clock)
    cpu: Cpu | None
    memory: Memory | None
    gpus: list[Gpu] | None
    gpus_reason: str = ""
    models: list[HeldModel] = []


class WorkerTelemetry(msgspec.Struct, frozen=True):
    worker: str
    telemetry: Telemetry


def _decode(raw: bytes) -> Telemetry | None:
    try:
        return msgspec.json.decode(raw, type=Telemetry)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


async def read_nodes(redis: Redis, node_ids: list[str]) -> dict[str, list[WorkerTelemetry]]:
    """Each node's live workers' reports, freshest first (a worker gone stops reporting, and its
    node's key expires three intervals after the last report)."""
    if not node_ids:
        return {}
    async with redis.pipeline(transaction=False) as pipe:
        for node in node_ids:
            pipe.hgetall(keys.telemetry(node))
        replies = await pipe.execute()
    out: dict[str, list[WorkerTelemetry]] = {}
    for node, raw in zip(node_ids, replies, strict=True):
        found = [WorkerTelemetry(w.decode(), t) for w, v in cast(dict[bytes, bytes], raw).items()
                 if (t := _decode(v)) is not None]
        out[node] = sorted(found, key=lambda w: -w.telemetry.at_ms)
    return out
