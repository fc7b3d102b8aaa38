"""Qualification reports in Redis (dispatcher/qualifications.py): kept newest first and aged
out past ``keep``, summarised per run, exported as Markdown, and their knees seeding
``capacity: auto`` -- against a real Redis."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from dispatcher import keys, qualifications
from dispatcher.qualifications import Latency, ProviderReport, Report

pytestmark = pytest.mark.anyio


def report(run: str, *providers: ProviderReport, cancelled: bool = False, model: str = "m") -> Report:
    return Report(model, f"2026-12-02T0{len(run) % 10}:00:00+00:00", run, "", "0.1.0", cancelled, {},
                  list(providers))


def prov(pid: str, knee: int | None, errors: int = 0, flags: list[str] | None = None) -> ProviderReport:
    return ProviderReport(pid, suggested_capacity=knee, errors=errors, flags=flags or [],
                          ttft_ms={"1": Latency(100.0, 120.0)}, throughput={"1": 10.0}, tokens_per_s=10.0)


async def test_reports_are_kept_newest_first_up_to_keep(redis: Redis) -> None:
    for i in range(4):
        await qualifications.store(redis, report(f"r{i}", prov("a", 2)), keep=3)
    assert (await qualifications.read(redis, "m")).run == "r3"  # type: ignore[union-attr]
    assert (await qualifications.read(redis, "m", 2)).run == "r1"  # type: ignore[union-attr]
    assert await qualifications.read(redis, "m", 3) is None
    assert [s.run for s in await qualifications.history(redis, "m")] == ["r3", "r2", "r1"]


async def test_the_runs_list_names_the_flagged_providers(redis: Redis) -> None:
    await qualifications.store(redis, report("r", prov("a", 2), prov("c", 2, flags=["diverges"])), keep=5)
    (summary,) = await qualifications.history(redis, "m")
    assert summary.providers == ["a", "c"]
    assert summary.flagged == ["c"]


async def test_a_finished_run_seeds_each_providers_knee(redis: Redis) -> None:
    seeds = await qualifications.seed_capacity(redis, report("r1", prov("a", 4), prov("b", 8)))
    assert set(seeds) == {"a", "b"}
    assert await qualifications.seeded_capacity(redis, "a") == 4
    assert await qualifications.seeded_capacity(redis, "b") == 8
    assert await qualifications.seeded_capacity(redis, "zz") is None
    raw = await redis.hget(keys.CAPACITY_SEEDS, "a")
    assert raw is not None
    assert qualifications._decode_seed(raw).run == "r1"


async def test_a_later_run_overwrites_the_seed_of_the_providers_it_measured(redis: Redis) -> None:
    await qualifications.seed_capacity(redis, report("r1", prov("a", 4), prov("b", 8)))
    await qualifications.seed_capacity(redis, report("r2", prov("a", 2), model="other"))
    assert await qualifications.seeded_capacity(redis, "a") == 2  # one limit per provider, whatever the model
    assert await qualifications.seeded_capacity(redis, "b") == 8


async def test_a_cancelled_run_or_a_failing_provider_seeds_nothing(redis: Redis) -> None:
    await qualifications.seed_capacity(redis, report("r1", prov("a", 4), prov("b", 4)))
    assert await qualifications.seed_capacity(redis, report("r2", prov("a", 1), cancelled=True)) == {}
    written = await qualifications.seed_capacity(redis, report("r3", prov("a", 1, errors=3), prov("b", None),
                                                               prov("c", 2)))
    assert set(written) == {"c"}
    assert await qualifications.seeded_capacity(redis, "a") == 4
    assert await qualifications.seeded_capacity(redis, "b") == 4


async def test_a_garbled_seed_reads_as_none(redis: Redis) -> None:
    await redis.hset(keys.CAPACITY_SEEDS, "a", b"not json")
    assert await qualifications.seeded_capacity(redis, "a") is None


def test_the_markdown_export_puts_providers_side_by_side_and_against_an_earlier_run() -> None:
    before = report("r1", prov("a", 2), prov("b", 4))
    now = report("r2", ProviderReport("a", type="vllm", suggested_capacity=4, ttft_ms={"1": Latency(90.0, 1500.0)},
                                      throughput={"1": 10.0, "2": 20.0}, tokens_per_s=20.0, agreement=1.0, rank=1),
                 prov("c", 2, flags=["diverges"]))
    md = qualifications.markdown(now, before)
    assert "| 1 | a | vllm | 4 | 90 ms / 1.50 s | 20.0 | 1.00 | - |" in md
    assert "| - | c |  | 2 | 100 ms / 120 ms | 10.0 | - | diverges |" in md
    assert "## Since run `r1`" in md
    assert "| a | 100 ms / 120 ms → 90 ms / 1.50 s | 10.0 → 20.0 | 2 → 4 |" in md
    assert "| c | new | new | new | new |" in md
