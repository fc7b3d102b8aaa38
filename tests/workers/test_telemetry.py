"""Device telemetry (issue 32): the host's CPU and memory from /proc (a made-up /proc here), the
GPUs' shape through a stand-in for NVML, absent figures as absent, and a report published into
Redis and read back by the catalog."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from redis.asyncio import Redis

from dispatcher import keys
from dispatcher.catalog import read_catalog
from tests.dispatcher.harness import make_config
from workers.telemetry import NO_GPU, HostReader, TelemetryLoop, gpus, load_nvml

pytestmark = pytest.mark.anyio


class FakeNvml:
    """What pynvml answers on a machine with two GPUs, the second of which keeps its utilization."""

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        return index

    def nvmlDeviceGetName(self, handle: Any) -> Any:
        return b"NVIDIA A100-SXM4-80GB" if handle == 0 else "NVIDIA L4"

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        if handle == 1:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return SimpleNamespace(gpu=37, memory=12)

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        return SimpleNamespace(used=10 * 2**30, total=80 * 2**30, free=70 * 2**30)


def test_gpus_through_nvml_have_their_shape_and_absent_figures_stay_absent() -> None:
    found = gpus(FakeNvml())
    assert found is not None
    assert [(g.index, g.name, g.utilization) for g in found] == [(0, "NVIDIA A100-SXM4-80GB", 0.37),
                                                                 (1, "NVIDIA L4", None)]
    assert (found[0].memory_used_bytes, found[0].memory_total_bytes) == (10 * 2**30, 80 * 2**30)


def test_without_nvml_there_is_no_gpu_list_at_all() -> None:
    assert gpus(None) is None


def test_without_nvml_and_without_an_nvidia_device_there_are_none(tmp_path: Path) -> None:
    assert load_nvml(str(tmp_path))[0] == NO_GPU
    (tmp_path / "nvidia0").write_text("")
    nvml, reason = load_nvml(str(tmp_path))
    if nvml is None:  # nvidia-ml-py not installed here: a device it cannot read is unknown, not none
        assert "NVML" in reason


def test_cpu_utilization_is_between_two_readings_and_memory_from_meminfo(tmp_path: Path) -> None:
    (tmp_path / "stat").write_text("cpu  100 0 100 700 100 0 0 0 0 0\n")
    (tmp_path / "meminfo").write_text("MemTotal:       1000 kB\nMemFree:         100 kB\nMemAvailable:    400 kB\n")
    host = HostReader(str(tmp_path))
    first = host.cpu()
    assert first is not None
    assert first.utilization is None  # one reading says nothing yet
    (tmp_path / "stat").write_text("cpu  150 0 150 750 150 0 0 0 0 0\n")  # 100 busy of 200
    second = host.cpu()
    assert second is not None
    assert second.utilization == 0.5
    mem = host.memory()
    assert mem is not None
    assert (mem.used_bytes, mem.total_bytes) == (600 * 1024, 1000 * 1024)


def test_an_unreadable_host_is_absent_not_zero(tmp_path: Path) -> None:
    host = HostReader(str(tmp_path / "nothing"))
    assert host.cpu() is None
    assert host.memory() is None


async def test_a_published_report_is_the_catalogs_node_telemetry(any_redis: Redis) -> None:
    config = make_config({"a": 1}, {"m": ["a"]})
    loop = TelemetryLoop(any_redis, lambda: config.nodes[0], "w1", 1.0, nvml=(FakeNvml(), ""))
    async with aiohttp.ClientSession() as session:
        await loop.publish(session)
    assert 0 < await any_redis.pttl(keys.telemetry("n1")) <= 3000
    cat = await read_catalog(any_redis, config)
    node = cat.nodes[0]
    assert node.workers == ["w1"]
    assert node.telemetry is not None
    assert node.telemetry.gpus is not None
    assert len(node.telemetry.gpus) == 2
    assert node.telemetry.memory is not None


async def test_a_machine_without_a_gpu_reports_an_empty_list(any_redis: Redis) -> None:
    class NoGpu(FakeNvml):
        def nvmlDeviceGetCount(self) -> int:
            return 0

    config = make_config({"a": 1}, {"m": ["a"]})
    loop = TelemetryLoop(any_redis, lambda: config.nodes[0], "w1", 1.0, nvml=(NoGpu(), ""))
    async with aiohttp.ClientSession() as session:
        t = await loop.read(session)
    assert t.gpus == []
    assert t.cpu is not None
    assert t.memory is not None


async def test_a_node_no_worker_reports_has_no_telemetry(any_redis: Redis) -> None:
    cat = await read_catalog(any_redis, make_config({"a": 1}, {"m": ["a"]}))
    assert cat.nodes[0].telemetry is None
    assert cat.nodes[0].workers == []
