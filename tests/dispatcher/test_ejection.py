"""Ejection on evidence: the scripts' side (``lua/lib/evidence.lua``, ``blame.lua``,
``eject.lua``, ``answered.lua``, and the tiers of ``lib/pump.lua``) against real Redis
servers (every available version), through ``ScriptCalls`` as a worker calls them.

A provider leaves rotation for its 5xx answers only on evidence about the provider: a
streak of 5xx on different requests that other providers answered (or that no other
could try), or an outlying 5xx rate; never for a request that another provider also
answers 5xx. An ejection is time-boxed, ends in a trial of one request at a time, and never
leaves a lane without a provider. The server's clock cannot be moved, so time passing is
played by moving ``ej_until`` back."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from redis.asyncio import Redis

from dispatcher import config as cfg
from dispatcher import keys
from dispatcher.catalog import read_catalog
from dispatcher.events import Assignment
from dispatcher.script_calls import CancelReason
from tests.dispatcher.harness import Harness, make_config

pytestmark = pytest.mark.anyio

FAILED = b"failed"


def with_ejection(config: cfg.Config, **rules: Any) -> cfg.Config:
    return msgspec.structs.replace(config, ejection=msgspec.structs.replace(config.ejection, **rules))


def harness(redis: Redis, providers: dict[str, int], **rules: Any) -> Harness:
    return Harness(redis, with_ejection(make_config(providers, {"m": list(providers)}), **rules))


async def fields(h: Harness, pid: str) -> dict[str, str]:
    raw = await h.redis.hgetall(keys.provider(pid))
    return {k.decode(): v.decode() for k, v in raw.items()}


async def dispatched_to(h: Harness, job: str) -> str:
    return (await h.assignment(job)).provider


async def latest(h: Harness, job: str) -> Assignment:
    """The job's newest dispatch (a retried job has one entry per attempt)."""
    return [a for a in await h.assignments() if a.job == job][-1]


async def fail_then_answer(h: Harness, status: str = "500") -> tuple[str, str]:
    """A job answered ``status`` by the provider it first went to, then answered by the one it
    is retried on; (first, second) provider."""
    job, state = await h.submit("m")
    assert state == "dispatched"
    first = await latest(h, job)
    assert await h.node.finish(first, FAILED, mode="retry", verdict=status) == "requeued"
    second = await latest(h, job)
    assert second.provider != first.provider
    assert await h.node.finish(second, b"ok", verdict="ok") == "released"
    return first.provider, second.provider


async def fail_everywhere(h: Harness) -> list[str]:
    """A job every provider it is tried on answers 500 (a bad request); the providers tried."""
    job, state = await h.submit("m")
    assert state == "dispatched"
    tried = []
    while True:
        a = await latest(h, job)
        tried.append(a.provider)
        outcome = await h.node.finish(a, FAILED, mode="retry", verdict="500")
        if outcome != "requeued":
            assert outcome == "failed"
            return tried


async def server_ms(h: Harness) -> int:
    """Redis's clock in ms, as the scripts read it (lib/jobs.lua now_ms): a script run between
    two readings saw a time between them."""
    sec, usec = await h.redis.time()
    return int(sec) * 1000 + int(usec) // 1000


async def age_ejection(h: Harness, pid: str) -> None:
    """The provider's ejection time has run out."""
    sec, _ = await h.redis.time()
    await h.redis.hset(keys.provider(pid), "ej_until", (int(sec) - 1) * 1000)


async def provider_view(h: Harness, pid: str) -> Any:
    catalog = await read_catalog(h.redis, h.config)
    return next(p for p in catalog.providers if p.id == pid)


async def test_a_provider_other_providers_stand_in_for_is_ejected_after_its_streak(any_redis: Redis) -> None:
    # a is the lower id: the tie-break sends each new job there first.
    h = harness(any_redis, {"a": 4, "b": 4})
    await h.up("a")
    await h.up("b")
    for n in range(1, 5):
        assert await fail_then_answer(h) == ("a", "b")
        assert (await fields(h, "a"))["c5xx"] == str(n)
        assert (await provider_view(h, "a")).health == "available"
    assert await fail_then_answer(h) == ("a", "b")
    view = await provider_view(h, "a")
    assert view.health == "unavailable"
    assert view.reason.startswith("ejected: 5 consecutive 500s on different requests; on trial again at ")
    assert view.reason.endswith(" UTC")
    assert view.ejection is not None
    assert view.ejection.state == "ejected"
    assert view.evidence is not None
    assert view.evidence.ejections["consecutive_5xx"] == 1
    # Out of rotation: every new job goes to b, though a is idle and the tie-break favours it.
    for _ in range(3):
        job, _ = await h.submit("m")
        assert await dispatched_to(h, job) == "b"


async def test_a_request_every_provider_answers_5xx_is_held_against_none_of_them(any_redis: Redis) -> None:
    h = harness(any_redis, {"a": 4, "b": 4})
    await h.up("a")
    await h.up("b")
    for _ in range(40):
        assert sorted(await fail_everywhere(h)) == ["a", "b"]
    for pid in ("a", "b"):
        view = await provider_view(h, pid)
        assert view.health == "available", view.reason
        assert view.ejection is None
        assert (await fields(h, pid)).get("c5xx", "0") == "0"
    # Each was excused once per request it answered last (the other 5xx came first).
    excused = [(await provider_view(h, pid)).evidence for pid in ("a", "b")]
    assert sum(e.excused_5xx for e in excused if e is not None) == 40


async def test_an_answered_request_ends_a_streak(any_redis: Redis) -> None:
    h = harness(any_redis, {"a": 4, "b": 4})
    await h.up("a")
    await h.up("b")
    for _ in range(4):
        await fail_then_answer(h)
    job, _ = await h.submit("m")
    a = await latest(h, job)
    assert a.provider == "a"
    await h.node.finish(a, b"ok", verdict="ok")
    assert (await fields(h, "a"))["c5xx"] == "0"
    for _ in range(4):
        await fail_then_answer(h)
    assert (await provider_view(h, "a")).ejection is None


async def test_the_last_provider_of_a_model_is_never_ejected_for_5xx(any_redis: Redis) -> None:
    h = harness(any_redis, {"a": 2})
    await h.up("a")
    for _ in range(12):
        assert await fail_everywhere(h) == ["a"]
    view = await provider_view(h, "a")
    assert view.health == "available"
    assert view.ejection is None
    assert view.evidence is not None
    assert view.evidence.streak_5xx == 12
    _job, state = await h.submit("m")
    assert state == "dispatched"


async def test_a_provider_whose_stand_in_is_down_stays_in(any_redis: Redis) -> None:
    h = harness(any_redis, {"a": 2, "b": 2})
    await h.up("a")
    await h.up("b", "unavailable")
    for _ in range(8):
        assert await fail_everywhere(h) == ["a"]  # no other provider could try it
    assert (await provider_view(h, "a")).ejection is None


async def test_an_ejection_ends_in_a_trial_of_one_request_and_an_answer_brings_it_back(any_redis: Redis) -> None:
    h = harness(any_redis, {"a": 4, "b": 4}, consecutive_5xx=1)
    await h.up("a")
    await h.up("b")
    await fail_then_answer(h)
    assert (await provider_view(h, "a")).ejection is not None
    await age_ejection(h, "a")
    view = await provider_view(h, "a")
    assert view.health == "available"
    assert view.ejection is not None
    assert view.ejection.state == "on_trial"
    assert view.reason.startswith("on trial after an ejection (1 consecutive 500s on different requests)")
    # On trial: one request at a time, though it has 4 slots and is idle.
    trial, _ = await h.submit("m")
    assert await dispatched_to(h, trial) == "a"
    others = [(await h.submit("m"))[0] for _ in range(3)]
    assert [await dispatched_to(h, j) for j in others] == ["b", "b", "b"]
    await h.node.finish(await latest(h, trial), b"ok", verdict="ok")
    view = await provider_view(h, "a")
    assert view.ejection is None
    assert view.reason == ""
    more = [(await h.submit("m"))[0] for _ in range(3)]
    assert [await dispatched_to(h, j) for j in more] == ["a", "a", "a"]


async def test_a_5xx_on_trial_ejects_again_for_twice_as_long(any_redis: Redis) -> None:
    h = harness(any_redis, {"a": 4, "b": 4}, consecutive_5xx=1, base_s=30, max_s=100)
    await h.up("a")
    await h.up("b")
    before = await server_ms(h)
    await fail_then_answer(h)
    after = await server_ms(h)
    assert before + 30_000 <= int((await fields(h, "a"))["ej_until"]) <= after + 30_000
    for expected in (60_000, 100_000, 100_000):  # doubled, then capped at max_s
        await age_ejection(h, "a")
        before = await server_ms(h)
        await fail_then_answer(h)
        after = await server_ms(h)
        f = await fields(h, "a")
        assert f["ej_kind"] == "trial"
        assert before + expected <= int(f["ej_until"]) <= after + expected


async def test_at_most_max_ejected_percent_of_a_lane_is_ejected(any_redis: Redis) -> None:
    # Three providers, two of them broken: only one of them is ejected (50% of 3 is 1).
    h = harness(any_redis, {"a": 1, "b": 1, "c": 8}, consecutive_5xx=1)
    for pid in ("a", "b", "c"):
        await h.up(pid)
    job, _ = await h.submit("m")
    first = await latest(h, job)
    assert first.provider == "a"
    await h.node.finish(first, FAILED, mode="retry", verdict="500")
    second = await latest(h, job)
    assert second.provider in ("b", "c")
    await h.node.finish(second, b"ok", verdict="ok")
    assert (await provider_view(h, "a")).ejection is not None
    # b fails one that c answers: b would be the second of three ejected.
    job, _ = await h.submit("m")
    first = await latest(h, job)
    assert first.provider == "b"
    await h.node.finish(first, FAILED, mode="retry", verdict="502")
    second = await latest(h, job)
    assert second.provider == "c"
    await h.node.finish(second, b"ok", verdict="ok")
    view = await provider_view(h, "b")
    assert view.ejection is None
    assert view.health == "available"
    assert view.evidence is not None
    assert view.evidence.streak_5xx == 1


async def test_a_lane_whose_other_providers_cannot_take_work_uses_its_ejected_one(any_redis: Redis) -> None:
    h = harness(any_redis, {"a": 2, "b": 2}, consecutive_5xx=1)
    await h.up("a")
    await h.up("b")
    await fail_then_answer(h)
    assert (await provider_view(h, "a")).ejection is not None
    await h.up("b", "unavailable")
    job, state = await h.submit("m")
    assert state == "dispatched"  # not 503 no_provider_available: a 5xx alone never leaves none
    assert await dispatched_to(h, job) == "a"


async def test_an_outlying_5xx_rate_ejects_though_no_streak_is_long_enough(any_redis: Redis) -> None:
    h = harness(any_redis, {"a": 4, "b": 4}, consecutive_5xx=5, failure_rate=0.5, min_requests=20)
    await h.up("a")
    await h.up("b")
    # a answers every other request it gets; b answers everything.
    for i in range(40):
        if (await provider_view(h, "a")).ejection is not None:
            break
        if i % 2:
            job, _ = await h.submit("m")
            a = await latest(h, job)
            assert a.provider == "a"
            await h.node.finish(a, b"ok", verdict="ok")
        else:
            assert await fail_then_answer(h) == ("a", "b")
    view = await provider_view(h, "a")
    assert view.ejection is not None
    assert view.evidence is not None
    assert view.evidence.ejections["failure_rate"] == 1
    assert "requests answered 5xx" in view.ejection.reason


async def test_4xx_and_answers_below_the_rate_never_eject(any_redis: Redis) -> None:
    h = harness(any_redis, {"a": 4, "b": 4}, consecutive_5xx=2, failure_rate=0.5, min_requests=4)
    await h.up("a")
    await h.up("b")
    for _ in range(30):
        job, _ = await h.submit("m")
        a = await latest(h, job)
        # A 4xx is the provider's answer (the worker's verdict is 'ok'): it counts for it.
        await h.node.finish(a, b"400", verdict="ok")
    await fail_then_answer(h)
    assert (await provider_view(h, "a")).ejection is None


async def test_a_job_that_ends_without_an_answer_blames_nobody(any_redis: Redis) -> None:
    h = harness(any_redis, {"a": 1, "b": 1}, consecutive_5xx=1)
    await h.up("a")
    await h.up("b")
    busy, _ = await h.submit("m")
    assert await dispatched_to(h, busy) == "a"
    job, _ = await h.submit("m")
    on_b = await latest(h, job)
    assert on_b.provider == "b"
    await h.node.finish(on_b, FAILED, mode="retry", verdict="500")  # requeued: waits for a
    record = await h.record(job)
    assert record is not None
    assert list(record.failed_5xx) == ["b|500"]
    await h.api.cancel(job, keys.queue("m"), CancelReason.CLIENT)  # its client leaves while it waits
    assert (await fields(h, "b")).get("c5xx", "0") == "0"
    assert (await provider_view(h, "b")).ejection is None
