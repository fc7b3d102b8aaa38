"""Device telemetry (issue 32): what a node's worker says of its host and devices, published
every heartbeat interval into ``{iop}:tel:<node>`` (field: the worker's id; the key expires three
intervals after the last report, so a dead worker's report goes with it), read by the catalog
as ``nodes[].telemetry``.

* ``cpu`` (utilization since the last reading, 0-1, and cores) and ``memory`` (used and total
  bytes) of the host, from ``/proc`` (None where it cannot be read: another OS);
* ``gpus``: per device its utilization and memory, through NVML (the optional ``nvidia-ml-py``
  extra) -- an empty list where NVML finds none, None (with ``gpus_reason``) where it cannot be
  asked at all;
* ``models``: what each runtime says of the models it holds -- Ollama's ``/api/ps``
  ``size_vram``; vLLM's KV cache use comes from the engine reading its worker already keeps
  (``workers/engine_metrics.py``), which the catalog adds.

Absent is absent: a figure nothing reported is None, never 0.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import anyio
import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from dispatcher import keys
from dispatcher.config import NodeConfig
from dispatcher.telemetry import Cpu, Gpu, HeldModel, Memory, Telemetry

log = logging.getLogger("iop.worker")


class Nvml(Protocol):
    """What of pynvml (``nvidia-ml-py``) is used: a stand-in replaces it in tests."""

    def nvmlInit(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetName(self, handle: Any) -> Any: ...
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...


class _NoGpu:
    """NVML as a machine with no NVIDIA device would answer it: no device."""

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 0

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        raise IndexError(index)

    nvmlDeviceGetName = nvmlDeviceGetUtilizationRates = nvmlDeviceGetMemoryInfo = nvmlDeviceGetHandleByIndex


NO_GPU = _NoGpu()


def load_nvml(dev: str = "/dev") -> tuple[Nvml | None, str]:
    """NVML, or: no GPU (no /dev/nvidia* device, so ``gpus: []``), or None and why (a device NVML
    cannot read: the figure is absent)."""
    try:
        import pynvml  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        if not any(Path(dev).glob("nvidia[0-9]*")):
            return NO_GPU, ""
        return None, "NVML not installed (.venv/bin/pip install -e '.[gpu]' for nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded ...: no NVIDIA GPU here
        return None, f"NVML unavailable: {exc}"
    return pynvml, ""


def gpus(nvml: Nvml | None) -> list[Gpu] | None:
    if nvml is None:
        return None
    out = []
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        name = nvml.nvmlDeviceGetName(h)
        util = mem = None
        try:
            util = nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100
        except Exception:  # a device that does not say (MIG, some vGPUs)
            util = None
        try:
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
        except Exception:
            mem = None
        out.append(Gpu(i, name.decode() if isinstance(name, bytes) else str(name), util,
                       int(mem.used) if mem is not None else None, int(mem.total) if mem is not None else None))
    return out


class HostReader:
    """CPU utilization between two readings of /proc/stat; memory from /proc/meminfo."""

    def __init__(self, proc: str = "/proc") -> None:
        self.proc = proc
        self._last: tuple[int, int] | None = None

    def cpu(self) -> Cpu | None:
        try:
            with open(f"{self.proc}/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle, total = fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields)
        util = None
        if self._last is not None and total > self._last[1]:
            util = round(1 - (idle - self._last[0]) / (total - self._last[1]), 4)
        self._last = (idle, total)
        return Cpu(util, os.cpu_count() or 1)

    def memory(self) -> Memory | None:
        try:
            with open(f"{self.proc}/meminfo") as f:
                info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.count(":") == 1}
        except (OSError, ValueError, IndexError):
            return None
        if "MemTotal" not in info or "MemAvailable" not in info:
            return None
        return Memory(info["MemTotal"] - info["MemAvailable"], info["MemTotal"])


async def ollama_models(session: aiohttp.ClientSession, provider: str, base_url: str) -> list[HeldModel]:
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        async with session.get(f"{root}/api/ps") as resp:
            doc = await resp.json(content_type=None) if resp.status == 200 else {}
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return []
    return [HeldModel(provider, str(m.get("name") or m.get("model")),
                      int(m["size_vram"]) if isinstance(m.get("size_vram"), int) else None)
            for m in (doc.get("models") or []) if isinstance(m, dict)]


class TelemetryLoop:
    """Publishes this worker's reading of its node every ``interval_s``."""

    def __init__(self, redis: Redis, node: Callable[[], NodeConfig], worker_id: str, interval_s: float,
                 nvml: tuple[Nvml | None, str] | None = None) -> None:
        self.redis = redis
        self.node = node
        self.worker_id = worker_id
        self.interval_s = interval_s
        self.host = HostReader()
        self.nvml, self.nvml_reason = nvml if nvml is not None else load_nvml()

    async def read(self, session: aiohttp.ClientSession) -> Telemetry:
        import time

        models: list[HeldModel] = []
        for prov in self.node().providers:
            if prov.type == "ollama" and prov.base_url:
                models += await ollama_models(session, prov.id, prov.base_url)
        found = gpus(self.nvml)
        return Telemetry(int(time.time() * 1000), self.host.cpu(), self.host.memory(), found,
                         self.nvml_reason if found is None else "", models)

    async def publish(self, session: aiohttp.ClientSession) -> None:
        reading = await self.read(session)
        key = keys.telemetry(self.node().id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, self.worker_id, msgspec.json.encode(reading))
            pipe.pexpire(key, int(self.interval_s * 3000))
            await pipe.execute()

    async def run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while True:
                try:
                    await self.publish(session)
                except RedisError as exc:
                    log.debug("telemetry not published: %s", exc)
                await anyio.sleep(self.interval_s)
