"""Lanes: a request goes only to providers that serve its endpoint, or to the one provider
that holds its state; a provider that fails a job before any output hands it to another.
Plans from config, and the scripts against real Redis servers."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import Redis

from dispatcher import config as cfg
from dispatcher import events, keys
from dispatcher.exceptions import ConfigError
from dispatcher.plans import Lane, Plans
from tests.dispatcher.harness import LaneHarness, lane_config

pytestmark = pytest.mark.anyio


# --- plans -------------------------------------------------------------------------------------------


def test_providers_serving_everything_share_one_lane() -> None:
    plans = Plans(lane_config({"a": None, "b": None}))
    main = plans.main_lane("m")
    assert main == Lane("m", "", ("a", "b"))
    assert main.queue == keys.queue("m")
    for endpoint in ("chat/completions", "responses", "rerank"):
        assert plans.lane_for("m", endpoint) == main
    assert plans.pinned_lane("m", "a") == Lane("m", "a", ("a",))


def test_an_endpoint_only_some_serve_has_its_own_lane() -> None:
    plans = Plans(lane_config({"a": ["chat/completions"], "b": ["chat/completions", "rerank"],
                               "c": ["chat/completions", "rerank"]}))
    assert plans.lane_for("m", "chat/completions") == plans.main_lane("m")
    rerank = plans.lane_for("m", "rerank")
    assert rerank == Lane("m", "b,c", ("b", "c"))
    assert rerank is not None
    assert rerank.queue == "{iop}:q:m|b,c"
    assert plans.lane_for("m", "audio/speech") is None
    # A freed slot of b may go to any lane b is in, so b's plan pumps them all.
    queues = {queue for queue, _ in plans.by_provider["b"].lanes}
    assert queues == {keys.queue("m", lane) for lane in ("", "b", "b,c")}


def test_unknown_endpoint_names_are_config_errors() -> None:
    with pytest.raises(ConfigError) as info:
        lane_config({"a": ["chat/completions", "chat/completion"]})
    assert "$.nodes[0].providers[0].endpoints[1]" in str(info.value)


# --- scripts -----------------------------------------------------------------------------------------


@pytest.fixture
def lanes(any_redis: Redis) -> Any:
    return lambda config: LaneHarness(any_redis, config)


async def test_a_request_goes_only_to_providers_of_its_endpoint(lanes: Any) -> None:
    h = lanes(lane_config({"a": ["chat/completions"], "b": ["chat/completions", "rerank"]}, capacity=2))
    await h.up("a")
    await h.up("b")
    rerank = h.calls.plans.lane_for("m", "rerank")
    # a is the less loaded, but does not serve rerank.
    await h.set_in_flight("b", 1)
    job, status = await h.submit_to(rerank, endpoint="rerank")
    assert status == "dispatched"
    assert (await h.assignment(job)).provider == "b"
    assert (await h.assignment(job)).lane == "b"
    # b full: the rerank job waits in its lane even though a is free.
    waiting, status = await h.submit_to(rerank, endpoint="rerank")
    assert status == "queued"
    assert await h.redis.zrange(rerank.queue, 0, -1) == [waiting.encode()]
    # A slot of b frees: it goes to the waiting rerank job.
    assert await h.done(job) == "released"
    assert (await h.assignment(waiting)).provider == "b"


async def test_a_freed_slot_goes_to_the_oldest_job_across_its_lanes(lanes: Any) -> None:
    h = lanes(lane_config({"a": ["chat/completions"], "b": ["chat/completions", "rerank"]}))
    await h.up("a")
    await h.up("b")
    main, rerank = h.calls.plans.main_lane("m"), h.calls.plans.lane_for("m", "rerank")
    first, _ = await h.submit_to(main)  # on a
    second, _ = await h.submit_to(main)  # on b
    older, s1 = await h.submit_to(rerank, endpoint="rerank")
    newer, s2 = await h.submit_to(main)
    assert (s1, s2) == ("queued", "queued")
    # b frees: the rerank job is older than the chat one, and b serves both.
    assert await h.done(second) == "released"
    assert (await h.assignment(older)).provider == "b"
    # a frees: the chat job, which a serves.
    assert await h.done(first) == "released"
    assert (await h.assignment(newer)).provider == "a"


async def test_pinned_job_goes_to_its_provider_only(lanes: Any) -> None:
    h = lanes(lane_config({"a": None, "b": None}))
    await h.up("a")
    await h.up("b")
    await h.set_in_flight("b", 1)  # b is full: a free slot on a must not take b's pinned job
    pinned = h.calls.plans.pinned_lane("m", "b")
    job, status = await h.submit_to(pinned, pinned=True, endpoint="responses")
    assert status == "queued"
    await h.set_in_flight("b", 0)
    await h.up("b")  # its heartbeat pumps b's lanes
    assert (await h.assignment(job)).provider == "b"


async def test_pinned_job_to_a_provider_that_is_down_is_refused_at_once(lanes: Any) -> None:
    h = lanes(lane_config({"a": None, "b": None}))
    await h.up("a")
    await h.up("b", "unavailable")
    job, status = await h.submit_to(h.calls.plans.pinned_lane("m", "b"), pinned=True, endpoint="responses")
    assert status == "unavailable"
    assert await h.record(job) is None
    # Without the pin, the same lane of one provider down is no provider at all.
    _, status = await h.submit_to(h.calls.plans.pinned_lane("m", "b"), pinned=False, endpoint="responses")
    assert status == "no_provider"


async def test_a_failed_job_goes_to_another_provider_never_the_same(lanes: Any) -> None:
    h = lanes(lane_config({"a": None, "b": None, "c": None}))
    for pid in "abc":
        await h.up(pid)
    job, _ = await h.submit_to(h.calls.plans.main_lane("m"))
    tried = [(await h.assignment(job)).provider]
    assert await h.fail(job) == "requeued"
    tried.append((await h.assignment(job)).provider)
    assert await h.fail(job) == "requeued"
    tried.append((await h.assignment(job)).provider)
    assert sorted(tried) == ["a", "b", "c"]
    record = await h.record(job)
    assert record.attempt == 3
    for pid in "abc":
        assert await h.in_flight(pid) == (1 if pid == tried[-1] else 0)


async def test_a_retry_waits_for_a_busy_other_provider_not_the_free_failed_one(lanes: Any) -> None:
    h = lanes(lane_config({"a": None, "b": None}))
    await h.up("a")
    await h.up("b")
    main = h.calls.plans.main_lane("m")
    job, _ = await h.submit_to(main)
    other, _ = await h.submit_to(main)
    failing = (await h.assignment(job)).provider
    busy = (await h.assignment(other)).provider
    assert await h.fail(job) == "requeued"
    # Its provider is free now, but the job excludes it: it waits.
    assert await h.record(job) is not None
    assert (await h.record(job)).state == "q"
    # A new job takes the freed provider at once: the retried head, which only the busy one
    # may run, keeps its place but holds nobody behind it (issue 19, defect 3).
    newer, status = await h.submit_to(main)
    assert status == "dispatched"
    assert (await h.assignment(newer)).provider == failing
    assert (await h.record(job)).state == "q"
    assert await h.done(other) == "released"
    assert (await h.assignment(job)).provider == busy


async def test_a_retried_job_whose_other_providers_went_down_may_go_back(lanes: Any) -> None:
    h = lanes(lane_config({"a": None, "b": None}))
    await h.up("a")
    await h.up("b")
    main = h.calls.plans.main_lane("m")
    job, _ = await h.submit_to(main)
    other, _ = await h.submit_to(main)
    failing = (await h.assignment(job)).provider
    busy = (await h.assignment(other)).provider
    assert await h.fail(job) == "requeued"
    # The only provider it may still try goes down: rather than wait for nobody, it goes
    # back to the one that failed it (its exclusions are dropped).
    await h.up(busy, "unavailable")
    await h.up(failing)
    assert (await h.record(job)).state == "d"
    assert (await h.assignment(job)).provider == failing


async def test_no_retry_without_another_healthy_provider(lanes: Any) -> None:
    h = lanes(lane_config({"a": None, "b": None}))
    await h.up("a")
    await h.up("b", "unavailable")
    job, _ = await h.submit_to(h.calls.plans.main_lane("m"))
    assert await h.fail(job) == "failed"
    assert await h.record(job) is None
    entries = await h.redis.xrange(keys.reply("rep1"))
    assert events.decode(entries[-1][1][b"event"]).status == 502  # type: ignore[union-attr]


async def test_retries_stop_at_max_attempts(lanes: Any) -> None:
    h = lanes(lane_config({"a": None, "b": None, "c": None}, max_attempts=2))
    for pid in "abc":
        await h.up(pid)
    job, _ = await h.submit_to(h.calls.plans.main_lane("m"))
    assert await h.fail(job) == "requeued"
    assert await h.fail(job) == "failed"


async def test_remembered_responses_are_bounded_and_expire(any_redis: Redis) -> None:
    config = cfg.parse({"nodes": [{"id": "n1", "providers": [{"id": "a", "type": "vllm",
                                                             "base_url": "http://127.0.0.1:1", "models": ["m@a"]}]}],
                        "models": [{"id": "m", "providers": {"a": "m@a"}}],
                        "responses": {"max_ids": 3, "id_ttl_s": 60}}).config
    h = LaneHarness(any_redis, config)
    await h.scripts.load()
    for i in range(5):
        await h.calls.remember_response(f"resp_{i}", "a", "m")
    assert await any_redis.hlen(keys.RESPONSES) == 3
    assert await h.api.stored_response("resp_0") is None  # the oldest went first
    stored = await h.api.stored_response("resp_4")
    assert stored is not None
    assert (stored.provider, stored.model) == ("a", "m")
    ttl = await any_redis.zscore(keys.RESPONSES_BY_EXPIRY, "resp_4")
    now_ms = (await any_redis.time())[0] * 1000
    assert 55_000 < ttl - now_ms <= 61_000
    # An expired id is unknown, and the next remember forgets it.
    await any_redis.zadd(keys.RESPONSES_BY_EXPIRY, {"resp_4": 1})
    await any_redis.hset(keys.RESPONSES, "resp_4", "a\tm\t1")
    assert await h.api.stored_response("resp_4") is None
    await h.calls.remember_response("resp_5", "a", "m")
    assert not await any_redis.hexists(keys.RESPONSES, "resp_4")
