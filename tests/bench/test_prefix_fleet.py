"""bench/prefix_fleet.py's load generator and config check, as bench/capacity_fleet.py
uses them: a bounded drain that reports what is still unanswered, traces for a named model,
and which of iop's refusals of a config are a missing feature. Real HTTP against a
simulated server in this event loop; nothing here asserts a duration."""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec
import pytest

from bench.fleet_sim import SimConfig
from bench.prefix_fleet import (
    MODEL,
    UNANSWERED,
    Arrival,
    Target,
    Workload,
    config_problems,
    iop_config,
    make_trace,
    run_trace,
)
from tests.bench.conftest import Serve

pytestmark = pytest.mark.anyio

FAST = SimConfig(kv_blocks=30_000, block_tokens=4, max_batch=4, prefill_budget=64, step_ms=1.0,
                 prefill_ms_per_token=0.0, decode_ms_per_seq=0.0)


class One(Target):
    name = label = "one server"

    def __init__(self, url: str) -> None:
        self.url = url

    def route(self, arrival: Arrival) -> tuple[str, int | None]:
        return self.url, None


def arrival(at: float, max_tokens: int) -> Arrival:
    body = msgspec.json.encode({"model": "m", "stream": True, "stream_options": {"include_usage": True},
                                "max_tokens": max_tokens, "messages": [{"role": "user", "content": "a b c"}]})
    return Arrival(at, 0, body, 0, 6, 0)


async def test_what_the_drain_leaves_unanswered_is_cancelled_and_reported(serve: Serve) -> None:
    url = await serve(FAST)
    # 2 tokens take a few 1-ms steps; 100,000 take a hundred seconds.
    results = await run_trace(One(url), [arrival(0.0, 2), arrival(0.01, 100_000)], drain=2.0)
    answered, hung = results
    assert answered.status == 200
    assert answered.completion_tokens == 2
    assert hung.status == UNANSWERED
    assert hung.sent >= 0.01
    assert hung.ttft < float("inf")  # its first token came before the drain ran out; its end never did
    assert hung.done == float("inf")
    # The cancelled request left the server (its client went away).
    async with aiohttp.ClientSession() as http:
        for _ in range(200):
            async with http.get(f"{url}/sim/stats") as resp:
                stats = await resp.json()
            if not stats["running"]:
                break
            await asyncio.sleep(0.05)
    assert (stats["running"], stats["cancelled"]) == (0, 1)


async def test_without_a_drain_every_request_is_awaited(serve: Serve) -> None:
    url = await serve(FAST)
    results = await run_trace(One(url), [arrival(0.0, 3), arrival(0.0, 5)])
    assert [(r.status, r.completion_tokens) for r in results] == [(200, 3), (200, 5)]


def test_a_trace_asks_for_the_model_it_is_given() -> None:
    w = Workload(tenants=2)
    default = make_trace(w, "unique", 2.0, 5.0, "s", 16)
    named = make_trace(w, "unique", 2.0, 5.0, "s", 16, model="small")
    assert len(default) == len(named) == 10  # a Poisson process conditioned on its count
    assert {msgspec.json.decode(a.body)["model"] for a in default} == {MODEL}
    assert {msgspec.json.decode(a.body)["model"] for a in named} == {"small"}
    assert [a.at for a in default] == [a.at for a in named]


def test_config_problems_name_a_missing_feature_and_refuse_a_mistake() -> None:
    config = iop_config(["http://127.0.0.1:9"], 4, None)
    assert config_problems(config, ("capacity",)) == []
    config["nodes"][0]["providers"][0]["capacity"] = "not-a-number"
    problems = config_problems(config, ("capacity",))
    assert len(problems) == 1
    assert problems[0].startswith("$.nodes[0].providers[0].capacity")
    with pytest.raises(RuntimeError, match="refuses the benchmark's config"):
        config_problems(config, ("affinity",))  # refused, but not for the field asked about
