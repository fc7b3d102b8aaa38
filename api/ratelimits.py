"""A tenant's rate limits and budget on the API side: what a request reserves, the headers
its answer carries, and the answer to a refusal. The counting is ``lua/lib/limits.lua``'s,
in Redis, inside the submit: every replica enforces one limit, at no extra round trip.

Headers, on every answer after the submit of a tenant with limits: OpenAI's names
(``x-ratelimit-limit-requests``, ``-remaining-requests``, ``-reset-requests`` and the
``-tokens`` set; resets as durations, ``1s``, ``6m0s``) and, for the day's budget,
``x-iop-budget-limit-tokens`` / ``x-iop-budget-remaining-tokens``; on ``/v1/messages``
Anthropic's (``anthropic-ratelimit-requests-limit``, ``-remaining``, ``-reset`` as an RFC 3339
time, the same for ``tokens``). A refusal carries ``Retry-After`` (seconds) and
``retry-after-ms``, which both official SDKs read before they retry.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from datetime import UTC, datetime

import msgspec

from dispatcher import wire
from dispatcher.endpoints import ErrorShape
from dispatcher.exceptions import BudgetExhausted, InvalidRequest, RateLimited, RequestError
from dispatcher.script_calls import SubmitStatus
from dispatcher.tenants import Tenant

DAY_MS = 86_400_000
# The wall clock the budget's day is read from (tests move it).
clock: Callable[[], float] = time.time


class _OutputCap(msgspec.Struct):
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    max_output_tokens: int | None = None


_caps = msgspec.json.Decoder(_OutputCap)


def estimate_tokens(body: bytes, json_body: bool, if_unset: int) -> int:
    """Prompt + output tokens a request may use: its JSON body's bytes / 4 (about four bytes
    a token in English text and JSON), plus the output it asks at most for (``max_tokens``,
    ``max_completion_tokens``, ``max_output_tokens``) or ``if_unset``."""
    if not json_body:
        return if_unset  # audio, images: their size says nothing of the tokens
    try:
        cap = _caps.decode(body)
        out = cap.max_tokens or cap.max_completion_tokens or cap.max_output_tokens or if_unset
    except msgspec.DecodeError:
        out = if_unset
    return len(body) // 4 + max(out, 0)


def limits_for(tenant: Tenant, body: bytes, json_body: bool, generates: bool = True) -> wire.Limits | None:
    """What a request of ``tenant`` checks and reserves; None for a tenant without limits.
    ``generates``: False for a call on a stored Response (it counts as a request only)."""
    lim = tenant.limits
    if lim is None:
        return None
    now_ms = int(clock() * 1000)
    counts_tokens = generates and bool(lim.tokens_per_minute or lim.tokens_per_day)
    return wire.Limits(
        tenant=tenant.name, requests_per_minute=lim.requests_per_minute or 0,
        tokens_per_minute=lim.tokens_per_minute or 0, tokens_per_day=lim.tokens_per_day or 0,
        tokens=estimate_tokens(body, json_body, lim.output_tokens_if_unset) if counts_tokens else 0,
        day=now_ms // DAY_MS, next_day_ms=DAY_MS - now_ms % DAY_MS)


class _State(msgspec.Struct):
    requests: tuple[int, int, int] | None = None  # limit, remaining, ms until full again
    tokens: tuple[int, int, int] | None = None
    budget: tuple[int, int] | None = None  # limit, remaining today
    limit: str | None = None  # refused: requests | tokens | budget
    retry_after_ms: int | None = None


_state = msgspec.json.Decoder(_State)


def _duration(ms: int) -> str:
    """OpenAI's reset format: 1s, 6m0s, 120ms."""
    if ms < 1000:
        return f"{ms}ms"
    s = ms / 1000
    if s < 60:
        return f"{s:.3g}s"
    m, rest = divmod(round(s), 60)
    return f"{m}m{rest}s"


def _at(ms: int) -> str:
    return datetime.fromtimestamp(clock() + ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def headers(raw: bytes, shape: ErrorShape) -> dict[str, str]:
    """The rate limit headers of a limited tenant's answer (``raw``: the submit's state), named
    as the clients of an endpoint with the error ``shape`` read them."""
    if not raw:
        return {}
    anthropic = shape == "anthropic"
    st = _state.decode(raw)
    out: dict[str, str] = {}
    for kind, window in (("requests", st.requests), ("tokens", st.tokens)):
        if window is None:
            continue
        limit, remaining, reset_ms = window
        if anthropic:
            out[f"anthropic-ratelimit-{kind}-limit"] = str(limit)
            out[f"anthropic-ratelimit-{kind}-remaining"] = str(remaining)
            out[f"anthropic-ratelimit-{kind}-reset"] = _at(reset_ms)
        else:
            out[f"x-ratelimit-limit-{kind}"] = str(limit)
            out[f"x-ratelimit-remaining-{kind}"] = str(remaining)
            out[f"x-ratelimit-reset-{kind}"] = _duration(reset_ms)
    if st.budget is not None:
        out["x-iop-budget-limit-tokens"], out["x-iop-budget-remaining-tokens"] = map(str, st.budget)
    return out


def refusal(status: SubmitStatus, raw: bytes, tenant: Tenant, shape: ErrorShape) -> RequestError:
    """The answer to a submit its tenant's limits refused."""
    st = _state.decode(raw)
    wait_ms = st.retry_after_ms or 0
    exc: RequestError
    if status == SubmitStatus.BUDGET_EXHAUSTED:
        exc = BudgetExhausted(f"Tenant '{tenant.name}' has used its {st.budget[0] if st.budget else ''} tokens "
                              "for today (the budget resets at 00:00 UTC)",
                              retry_after=max(math.ceil(wait_ms / 1000), 1))
    elif wait_ms < 0:
        limit = st.tokens[0] if st.tokens else 0
        return InvalidRequest(f"This request may use more tokens than tenant '{tenant.name}' may use in a minute "
                              f"({limit}): lower max_tokens or the prompt", param="max_tokens")
    else:
        per = "requests" if st.limit == "requests" else "tokens"
        exc = RateLimited(f"Rate limit of tenant '{tenant.name}' reached: {per} per minute; retry in "
                          f"{wait_ms / 1000:.1f} s", retry_after=max(math.ceil(wait_ms / 1000), 1))
    exc.headers.update(headers(raw, shape))
    exc.headers["retry-after-ms"] = str(max(wait_ms, 1))
    return exc
