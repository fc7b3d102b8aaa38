"""Tenants' rate limits and budgets in the scripts (``lua/lib/limits.lua``, through
``lua/submit.lua`` and ``lua/finish.lua``), against a real Redis: a sliding minute that
admits a minute's worth and then one request per interval, tokens reserved at submit and
settled to the reported usage, a day's budget that stops a tenant and resumes the next day,
a reservation given back when the submit is refused for another reason."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from redis.asyncio import Redis

from api import ratelimits
from dispatcher import config as cfg
from dispatcher import keys, wire
from dispatcher.catalog import read_catalog
from dispatcher.script_calls import SubmitStatus, Submitted
from dispatcher.tenants import Tenants
from tests.dispatcher.harness import Harness

pytestmark = pytest.mark.anyio

DAY = 20_000  # a UTC day number (2024-10-04): the API passes its own


def limited_config(capacity: int = 64, max_queue: int = 100, **limits: Any) -> cfg.Config:
    return cfg.parse({
        "queue": {"max_queue": max_queue},
        "api": {"keys": [{"name": "team-a", "key_sha256": "a" * 64, "limits": limits}]},
        "nodes": [{"id": "n1", "providers": [
            {"id": "p", "type": "vllm", "base_url": "http://127.0.0.1:1", "capacity": capacity, "models": ["m@p"]}]}],
        "models": [{"id": "m", "providers": {"p": "m@p"}}],
    }).config


class LimitHarness(Harness):
    async def start(self) -> LimitHarness:
        await self.up("p")
        self.tenant = Tenants(self.config).by_name["team-a"]
        return self

    async def send(self, tokens: int = 0, day: int = DAY) -> tuple[str, Submitted]:
        assert self.tenant.limits is not None
        lim = self.tenant.limits
        limits = wire.Limits("team-a", lim.requests_per_minute or 0, lim.tokens_per_minute or 0,
                             lim.tokens_per_day or 0, tokens, day, 3_600_000)
        job = uuid.uuid4().hex
        lane = self.calls.plans.main_lane("m")
        return job, await self.api.submit(job, lane, b'{"model":"m"}', "chat/completions", False,
                                          tenant=self.tenant, limits=limits)

    async def finish(self, job: str, prompt: int, completion: int) -> None:
        await self.node.finish(await self.assignment(job), b"", mode="done", tokens=completion, prompt=prompt)

    async def state(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in (await self.redis.hgetall(keys.LIMITS)).items()}


async def harness(redis: Redis, config: cfg.Config) -> LimitHarness:
    return await LimitHarness(redis, config).start()


def window(submitted: Submitted, kind: str) -> list[int]:
    return list(json.loads(submitted.limits)[kind])


async def test_a_minute_of_requests_then_one_per_interval(any_redis: Redis) -> None:
    h = await harness(any_redis, limited_config(requests_per_minute=6))
    remaining = []
    for _ in range(6):
        _, sub = await h.send()
        assert sub.status == SubmitStatus.DISPATCHED
        remaining.append(window(sub, "requests")[1])
    assert remaining == [5, 4, 3, 2, 1, 0]
    _, refused = await h.send()
    assert refused.status == SubmitStatus.RATE_LIMITED
    state = json.loads(refused.limits)
    assert state["limit"] == "requests"
    # One request every 10 s: the next is admitted when the first of the six has "left".
    assert 9_000 < state["retry_after_ms"] <= 10_000
    assert 50_000 < state["requests"][2] <= 60_000  # back to the full limit in a minute
    # Refused requests do not count against the window, and are counted.
    _, again = await h.send()
    assert again.status == SubmitStatus.RATE_LIMITED
    assert (await h.state())["x:team-a:requests"] == "2"
    answer = ratelimits.refusal(again.status, again.limits, h.tenant, "openai")
    assert answer.status == 429
    assert answer.code == "rate_limited"
    assert answer.retry_after == 10
    assert answer.headers["x-ratelimit-remaining-requests"] == "0"
    assert answer.headers["x-ratelimit-limit-requests"] == "6"


async def test_the_window_slides(any_redis: Redis) -> None:
    h = await harness(any_redis, limited_config(requests_per_minute=6))
    for _ in range(6):
        await h.send()
    # Move the window's clock back 10 s, as if the six had come 10 s ago: one more fits.
    tat, _, under = (await h.state())["r:team-a"].partition("|")
    assert under == "6"
    await any_redis.hset(keys.LIMITS, "r:team-a", f"{float(tat) - 10_000}|6")
    _, sub = await h.send()
    assert sub.status == SubmitStatus.DISPATCHED
    assert window(sub, "requests")[1] == 0
    assert (await h.send())[1].status == SubmitStatus.RATE_LIMITED


async def test_tokens_are_reserved_then_settled_to_the_usage(any_redis: Redis) -> None:
    h = await harness(any_redis, limited_config(tokens_per_minute=1000))
    job, sub = await h.send(tokens=600)
    assert window(sub, "tokens")[1] == 400
    # 600 reserved: 500 more do not fit in the minute...
    _, refused = await h.send(tokens=500)
    assert refused.status == SubmitStatus.RATE_LIMITED
    assert json.loads(refused.limits)["limit"] == "tokens"
    # ...until the job reports it used 150 in all: 450 are given back.
    await h.finish(job, prompt=100, completion=50)
    _, sub = await h.send(tokens=500)
    assert sub.status == SubmitStatus.DISPATCHED
    assert window(sub, "tokens")[1] in (349, 350)  # a few ms of refill may round it


async def test_a_job_without_usage_keeps_its_estimate(any_redis: Redis) -> None:
    h = await harness(any_redis, limited_config(tokens_per_minute=1000))
    job, _ = await h.send(tokens=600)
    before = (await h.state())["t:team-a"]
    await h.finish(job, prompt=0, completion=0)
    assert (await h.state())["t:team-a"] == before


async def test_a_request_larger_than_a_minute_is_refused_for_good(any_redis: Redis) -> None:
    h = await harness(any_redis, limited_config(tokens_per_minute=1000))
    _, refused = await h.send(tokens=1001)
    assert refused.status == SubmitStatus.RATE_LIMITED
    answer = ratelimits.refusal(refused.status, refused.limits, h.tenant, "openai")
    assert answer.status == 400  # no retry would ever fit it
    assert "1000" in answer.message


async def test_a_budget_stops_the_tenant_until_the_next_day(any_redis: Redis) -> None:
    h = await harness(any_redis, limited_config(tokens_per_day=1000))
    job, sub = await h.send(tokens=700)
    assert json.loads(sub.limits)["budget"] == [1000, 300]
    await h.finish(job, prompt=500, completion=300)  # it used 800
    _, refused = await h.send(tokens=300)
    assert refused.status == SubmitStatus.BUDGET_EXHAUSTED
    answer = ratelimits.refusal(refused.status, refused.limits, h.tenant, "anthropic")
    assert answer.code == "budget_exhausted"
    assert answer.retry_after == 3600  # the harness says midnight is an hour away
    assert answer.headers["x-iop-budget-remaining-tokens"] == "200"
    assert (await h.send(tokens=200))[1].status == SubmitStatus.DISPATCHED
    # The next day (on the API's clock) it starts afresh; a replica whose clock is still on
    # the day before does not take it back.
    _, sub = await h.send(tokens=900, day=DAY + 1)
    assert sub.status == SubmitStatus.DISPATCHED
    assert json.loads(sub.limits)["budget"] == [1000, 100]
    assert (await h.send(tokens=200, day=DAY))[1].status == SubmitStatus.BUDGET_EXHAUSTED
    catalog = await read_catalog(any_redis, h.config)
    view = next(t for t in catalog.tenants if t.name == "team-a").limits
    assert view is not None
    assert view.refused == {"requests": 0, "tokens": 0, "budget": 2}


async def test_a_submit_refused_for_another_reason_gives_its_reservation_back(any_redis: Redis) -> None:
    h = await harness(any_redis, limited_config(capacity=1, max_queue=0, requests_per_minute=2,
                                                tokens_per_minute=1000))
    first, sub = await h.send(tokens=100)
    assert sub.status == SubmitStatus.DISPATCHED
    before = await h.state()
    _, full = await h.send(tokens=100)  # the provider is busy and nothing may wait
    assert full.status == SubmitStatus.FULL
    assert await h.state() == before
    await h.finish(first, prompt=0, completion=0)
    assert (await h.send(tokens=100))[1].status == SubmitStatus.DISPATCHED


async def test_the_catalog_shows_what_each_limited_tenant_used(any_redis: Redis) -> None:
    h = await harness(any_redis, limited_config(requests_per_minute=10, tokens_per_minute=1000,
                                                tokens_per_day=5000))
    job, _ = await h.send(tokens=300, day=(await h.redis.time())[0] // 86_400)
    await h.finish(job, prompt=150, completion=50)
    catalog = await read_catalog(any_redis, h.config)
    view = next(t for t in catalog.tenants if t.name == "team-a").limits
    assert view is not None
    assert (view.requests_per_minute, view.requests_used) == (10, 1)
    assert (view.tokens_per_minute, view.tokens_used) == (1000, 200)
    assert (view.tokens_per_day, view.tokens_used_today) == (5000, 200)


async def test_a_limit_changed_by_a_reload_counts_what_the_window_holds(any_redis: Redis) -> None:
    h = await harness(any_redis, limited_config(requests_per_minute=6))
    for _ in range(6):
        await h.send()
    assert (await h.send())[1].status == SubmitStatus.RATE_LIMITED
    # Raised to 60 a minute: the six in the window are six of sixty, not a minute's worth.
    raised = await harness(any_redis, limited_config(requests_per_minute=60))
    _, sub = await raised.send()
    assert sub.status == SubmitStatus.DISPATCHED
    assert window(sub, "requests")[1] == 53
    # Lowered to 3: the window holds more than a minute's worth, so it waits.
    lowered = await harness(any_redis, limited_config(requests_per_minute=3))
    _, refused = await lowered.send()
    assert refused.status == SubmitStatus.RATE_LIMITED
    assert json.loads(refused.limits)["retry_after_ms"] > 60_000
