"""Requests none of whose providers can take work are answered at once (``lib/pump.lua``
refuse_unavailable: heartbeats, drains, ``lua/refuse.lua`` in reaper rounds), unless their
model holds them (``hold_when_unavailable_ms``)."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import Redis

from dispatcher import events, keys
from dispatcher.control import Control
from dispatcher.events import Failed
from dispatcher.exceptions import NoProviderAvailable, ResponseProviderDown
from tests.dispatcher.harness import Harness, LaneHarness, lane_config, make_config

pytestmark = pytest.mark.anyio


async def answers(h: Harness) -> dict[str, Failed]:
    """The Failed events in replica rep1's reply stream, by job."""
    out: dict[str, Failed] = {}
    for _, fields in await h.redis.xrange(keys.reply("rep1")):
        event = events.decode(fields[b"event"])
        if isinstance(event, Failed):
            out[fields[b"job"].decode()] = event
    return out


@pytest.fixture
def harness(any_redis: Redis) -> Any:
    return lambda config: Harness(any_redis, config)


async def test_waiting_jobs_are_answered_when_their_last_provider_goes_down(harness: Any) -> None:
    h = harness(make_config({"a": 1}, {"m": ["a"]}))
    await h.up("a")
    running, s1 = await h.submit("m")
    waiting, s2 = await h.submit("m")
    assert (s1, s2) == ("dispatched", "queued")
    await h.node.heartbeat("a", "unavailable", [("reason", "GET /health answered 404")])
    refused = (await answers(h))[waiting]
    assert (refused.status, refused.code) == (503, "no_provider_available")
    # In the words a submit's refusal has (api/relay.py): the script writes them itself.
    assert refused.message == NoProviderAvailable.because("m", "a: GET /health answered 404").message
    assert await h.record(waiting) is None
    assert await h.queued("m") == []
    assert await h.redis.sismember(keys.replica_jobs("rep1"), waiting) == 0
    # The running one is the worker's to finish.
    assert (await h.record(running)).state == "d"


async def test_a_lane_with_another_provider_up_keeps_its_jobs(harness: Any) -> None:
    h = harness(make_config({"a": 1, "b": 1}, {"m": ["a", "b"]}))
    await h.up("a")
    await h.up("b")
    await h.submit("m")
    await h.submit("m")
    waiting, status = await h.submit("m")
    assert status == "queued"
    await h.node.heartbeat("a", "unavailable", [("reason", "down")])
    assert await answers(h) == {}
    assert await h.queued("m") == [waiting]
    assert await h.calls.refuse(await h.now_ms()) == 0


async def test_a_reaper_sweep_answers_jobs_whose_worker_died(harness: Any) -> None:
    h = harness(make_config({"a": 1}, {"m": ["a"]}))
    await h.up("a")
    await h.submit("m")
    waiting, _ = await h.submit("m")
    assert await h.calls.refuse(await h.now_ms()) == 0
    # Its worker died: no heartbeat says so, the last one only expires.
    await h.redis.hset(keys.provider("a"), "hb_exp", 1)
    assert await h.calls.refuse(await h.now_ms()) == 1
    refused = (await answers(h))[waiting]
    assert refused.code == "no_provider_available"
    assert "a: stale heartbeat: last one" in refused.message


async def test_a_reaper_round_judges_silence_only_near_when_it_opened(harness: Any) -> None:
    """A round's call retried across a failover runs on the new server seconds after the
    round opened on the old one, where no heartbeat could land meanwhile (or was lost with
    the writes the replica never got): its silence is not death. A sentinel failover under
    load once had 6 waiting requests refused so (tests/e2e/test_failover.py)."""
    h = harness(make_config({"a": 1}, {"m": ["a"]}))
    await h.up("a")
    await h.submit("m")
    waiting, _ = await h.submit("m")
    await h.redis.hset(keys.provider("a"), "hb_exp", 1)  # silent, its heartbeat expired
    gap_ms = h.config.dispatch.observation_gap_ms
    assert await h.calls.refuse(await h.now_ms() - gap_ms - 1_000) == 0
    assert await answers(h) == {}
    assert await h.queued("m") == [waiting]
    # The same silence, judged by a round that opened just now, is death.
    assert await h.calls.refuse(await h.now_ms()) == 1
    assert (await answers(h))[waiting].code == "no_provider_available"


async def left_with_one_waiting(harness: Any) -> tuple[Harness, str]:
    """Provider a of one slot busy, a job waiting, and its worker leaving (SIGTERM:
    workers/worker.py marks its providers unavailable and `leaving`)."""
    h = harness(make_config({"a": 1}, {"m": ["a"]}))
    await h.up("a")
    await h.submit("m")
    waiting, _ = await h.submit("m")
    await h.node.heartbeat("a", "unavailable", [("reason", "worker draining"), ("leaving", 1)])
    return h, waiting


async def test_a_leaving_worker_refuses_nobody_while_another_may_take_its_provider_over(harness: Any) -> None:
    # A rolling restart: the old worker drains, the new one heartbeats its providers at its
    # next beat.
    h, waiting = await left_with_one_waiting(harness)
    arrived, status = await h.submit("m")
    assert status == "queued"  # not refused: another worker of the node may be about to take it
    assert await h.calls.refuse(await h.now_ms()) == 0  # nor by a reaper round, within the leaving beat's TTL
    assert await answers(h) == {}
    # The other worker's heartbeat takes the provider over and clears the mark.
    await h.node.heartbeat("a", "available", [("capacity", 2), ("node", "n1"), ("leaving", "")])
    assert (await h.assignment(waiting)).provider == "a"
    assert await h.queued("m") == [arrived]  # a's second slot is taken; it waits its turn


async def test_a_leaving_worker_nobody_takes_over_refuses_after_its_heartbeat_ttl(harness: Any) -> None:
    h, waiting = await left_with_one_waiting(harness)
    assert await h.calls.refuse(await h.now_ms()) == 0
    await h.redis.hset(keys.provider("a"), "hb_exp", 1)  # its TTL passed with no other worker's beat
    assert await h.calls.refuse(await h.now_ms()) == 1
    refused = (await answers(h))[waiting]
    assert refused.code == "no_provider_available"
    assert "a: its worker left" in refused.message
    assert "no other worker of its node took it over" in refused.message


async def test_a_held_job_is_answered_only_after_the_hold(harness: Any) -> None:
    # A hold far longer than the test, so that "not refused yet" cannot race a loaded
    # machine; its end is then moved into the past rather than waited for.
    hold_ms = 60_000
    h = harness(make_config({"a": 1}, {"m": ["a"]}, hold_when_unavailable_ms=hold_ms))
    early, status = await h.submit("m")
    assert status == "queued"  # no provider, but the model holds
    await h.up("a")  # it comes back in time: the held job goes
    assert (await h.assignment(early)).provider == "a"
    later, status = await h.submit("m")
    assert status == "queued"  # a is busy
    assert (await h.record(later)).hold_until_ms is None  # a provider was up: no hold yet
    before = await h.now_ms()
    await h.node.heartbeat("a", "unavailable", [("reason", "restarting")])
    after = await h.now_ms()
    # Its hold starts now: not refused yet.
    assert before + hold_ms <= (await h.record(later)).hold_until_ms <= after + hold_ms
    assert await answers(h) == {}
    assert await h.calls.refuse(await h.now_ms()) == 0
    assert await answers(h) == {}
    await h.backdate(later, "hold_until_ms", hold_ms)  # the hold has run out
    assert await h.calls.refuse(await h.now_ms()) == 1
    assert (await answers(h))[later].code == "no_provider_available"


async def test_draining_the_last_provider_answers_its_waiting_jobs(any_redis: Redis) -> None:
    h = LaneHarness(any_redis, lane_config({"a": None, "b": None}))
    control = Control(h.calls, any_redis)
    await h.up("a")
    await h.up("b")
    main, pinned = h.calls.plans.main_lane("m"), h.calls.plans.pinned_lane("m", "b")
    await h.submit_to(main)
    await h.submit_to(main)
    waiting, _ = await h.submit_to(main)
    held, _ = await h.submit_to(pinned, pinned=True, endpoint="responses")
    await control.drain("a")
    assert await answers(h) == {}  # b still serves the lane
    await control.drain("b")
    got = await answers(h)
    assert (got[waiting].code, got[held].code) == ("no_provider_available", "response_provider_unavailable")
    assert got[waiting].message == NoProviderAvailable.because(
        "m", "a: drained by an operator; b: drained by an operator").message
    assert got[held].message == ResponseProviderDown.because("b: drained by an operator").message
