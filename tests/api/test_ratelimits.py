"""api/ratelimits.py: what a limited tenant's request reserves, the headers its answer
carries, and the answer to a refusal. The counting itself is Lua's
(tests/dispatcher/test_limits.py); the state it hands back is given here as the JSON
``lua/lib/limits.lua`` writes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from api import ratelimits
from dispatcher import config as cfg
from dispatcher.exceptions import BudgetExhausted, InvalidRequest, RateLimited
from dispatcher.script_calls import SubmitStatus
from dispatcher.tenants import Tenant, Tenants

# 2024-10-04 01:00:00.250 UTC: day 20_000 of the epoch, 23 h less 250 ms before its end.
NOW_S = 20_000 * 86_400 + 3_600.25


@pytest.fixture(autouse=True)
def fixed_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ratelimits, "clock", lambda: NOW_S)


def tenant(**limits: Any) -> Tenant:
    key: dict[str, Any] = {"name": "team-a", "key_sha256": "a" * 64}
    if limits:
        key["limits"] = limits
    config = cfg.parse({
        "api": {"keys": [key]},
        "nodes": [{"id": "n1", "providers": [
            {"id": "p", "type": "vllm", "base_url": "http://127.0.0.1:1", "models": ["m@p"]}]}],
        "models": [{"id": "m", "providers": {"p": "m@p"}}],
    }).config
    return Tenants(config).by_name["team-a"]


def state(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


# --- what a request reserves ----------------------------------------------------------------------


@pytest.mark.parametrize("cap", ["max_tokens", "max_completion_tokens", "max_output_tokens"])
def test_a_json_request_is_its_bytes_over_four_and_the_output_it_asks_for(cap: str) -> None:
    body = json.dumps({"model": "m", cap: 300, "messages": [{"role": "user", "content": "x" * 400}]}).encode()
    assert ratelimits.estimate_tokens(body, True, 1024) == len(body) // 4 + 300


def test_without_an_output_cap_the_tenants_default_counts() -> None:
    body = b'{"model":"m","messages":[]}'
    assert ratelimits.estimate_tokens(body, True, 1024) == len(body) // 4 + 1024
    # A body that is not JSON after all: the same default, never a failure here.
    assert ratelimits.estimate_tokens(b"{not json", True, 7) == len(b"{not json") // 4 + 7


def test_a_body_that_is_not_json_counts_only_the_default() -> None:
    # Audio or an image: its size says nothing of its tokens.
    assert ratelimits.estimate_tokens(b"\x00" * 40_000, False, 50) == 50


def test_a_tenant_without_limits_reserves_nothing() -> None:
    assert ratelimits.limits_for(tenant(), b"{}", True) is None


def test_the_limits_carry_the_estimate_and_the_budgets_day_on_the_apis_clock() -> None:
    body = b'{"model":"m","max_tokens":100}'
    got = ratelimits.limits_for(tenant(requests_per_minute=10, tokens_per_minute=5_000, tokens_per_day=90_000),
                                body, True)
    assert got is not None
    assert (got.tenant, got.requests_per_minute, got.tokens_per_minute, got.tokens_per_day) == (
        "team-a", 10, 5_000, 90_000)
    assert got.tokens == len(body) // 4 + 100
    assert got.day == 20_000
    assert got.next_day_ms == 23 * 3_600_000 - 250


def test_tokens_are_reserved_only_where_tokens_are_limited_and_generated() -> None:
    body = b'{"model":"m","max_tokens":100}'
    requests_only = ratelimits.limits_for(tenant(requests_per_minute=10), body, True)
    assert requests_only is not None
    assert requests_only.tokens == 0
    # A call on a stored Response counts as a request only.
    stored = ratelimits.limits_for(tenant(tokens_per_minute=5_000), body, True, generates=False)
    assert stored is not None
    assert stored.tokens == 0


# --- the headers of an answer ------------------------------------------------------------------------


def test_no_state_no_headers() -> None:
    assert ratelimits.headers(b"", shape="openai") == {}


@pytest.mark.parametrize(("reset_ms", "shown"), [(120, "120ms"), (1_500, "1.5s"), (360_000, "6m0s"), (61_400, "1m1s")])
def test_openai_headers_give_resets_as_durations(reset_ms: int, shown: str) -> None:
    got = ratelimits.headers(state(requests=[10, 7, reset_ms], tokens=[5_000, 4_000, 1_000]), shape="openai")
    assert got == {
        "x-ratelimit-limit-requests": "10", "x-ratelimit-remaining-requests": "7", "x-ratelimit-reset-requests": shown,
        "x-ratelimit-limit-tokens": "5000", "x-ratelimit-remaining-tokens": "4000", "x-ratelimit-reset-tokens": "1s",
    }


def test_anthropic_headers_give_resets_as_times_and_the_budget_has_its_own() -> None:
    got = ratelimits.headers(state(requests=[10, 0, 30_000], budget=[90_000, 12]), shape="anthropic")
    assert got == {
        "anthropic-ratelimit-requests-limit": "10", "anthropic-ratelimit-requests-remaining": "0",
        "anthropic-ratelimit-requests-reset": "2024-10-04T01:00:30Z",
        "x-iop-budget-limit-tokens": "90000", "x-iop-budget-remaining-tokens": "12",
    }


# --- the answer to a refusal -------------------------------------------------------------------------


def test_a_rate_limit_refusal_says_which_limit_and_when_to_retry() -> None:
    raw = state(requests=[10, 0, 2_300], limit="requests", retry_after_ms=2_300)
    exc = ratelimits.refusal(SubmitStatus.RATE_LIMITED, raw, tenant(requests_per_minute=10), shape="openai")
    assert isinstance(exc, RateLimited)
    assert exc.status == 429
    assert "requests per minute" in exc.message
    assert "'team-a'" in exc.message
    assert exc.retry_after == 3  # whole seconds, rounded up: never early
    assert exc.headers["retry-after-ms"] == "2300"
    assert exc.headers["x-ratelimit-remaining-requests"] == "0"


def test_a_refusal_due_at_once_still_asks_for_a_wait() -> None:
    raw = state(tokens=[5_000, 0, 0], limit="tokens", retry_after_ms=0)
    exc = ratelimits.refusal(SubmitStatus.RATE_LIMITED, raw, tenant(tokens_per_minute=5_000), shape="openai")
    assert "tokens per minute" in exc.message
    assert (exc.retry_after, exc.headers["retry-after-ms"]) == (1, "1")


def test_a_spent_budget_names_its_size_and_waits_for_the_next_day() -> None:
    raw = state(budget=[90_000, 0], limit="budget", retry_after_ms=3_600_000)
    exc = ratelimits.refusal(SubmitStatus.BUDGET_EXHAUSTED, raw, tenant(tokens_per_day=90_000), shape="anthropic")
    assert isinstance(exc, BudgetExhausted)
    assert "90000 tokens" in exc.message
    assert exc.retry_after == 3_600
    assert exc.headers["x-iop-budget-remaining-tokens"] == "0"


def test_a_request_larger_than_a_minutes_tokens_is_the_callers_error() -> None:
    # No wait would let it through (lua/lib/limits.lua answers a negative wait).
    raw = state(tokens=[5_000, 5_000, 0], limit="tokens", retry_after_ms=-1)
    exc = ratelimits.refusal(SubmitStatus.RATE_LIMITED, raw, tenant(tokens_per_minute=5_000), shape="openai")
    assert isinstance(exc, InvalidRequest)
    assert exc.status == 400
    assert exc.param == "max_tokens"
    assert "(5000)" in exc.message
    assert exc.retry_after is None
