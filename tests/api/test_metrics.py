"""The request metrics an API process keeps (``api/metrics.py``)."""

from __future__ import annotations

from api.metrics import RequestClock, RequestMetrics
from dispatcher.events import Usage


def rendered(metrics: RequestMetrics) -> str:
    return metrics.render(None).decode()


def test_cached_prompt_tokens_are_counted_beside_the_prompt_tokens() -> None:
    metrics = RequestMetrics()
    for usage in (Usage(1000, 10, 900), Usage(500, 5, 0), Usage(200, 2, 100)):
        clock = RequestClock(metrics)
        clock.model, clock.provider, clock.tenant = "m", "p", "default"
        clock.done(200, usage)
    text = rendered(metrics)
    assert 'iop_tokens_total{kind="prompt",model="m",provider="p",tenant="default"} 1700.0' in text
    # A provider's cache hit rate is the one over the other: 1000 / 1700 here.
    assert 'iop_cached_tokens_total{model="m",provider="p"} 1000.0' in text


def test_no_cached_series_for_a_provider_that_reports_none() -> None:
    metrics = RequestMetrics()
    clock = RequestClock(metrics)
    clock.model, clock.provider, clock.tenant = "m", "q", "default"
    clock.done(200, Usage(100, 1))
    assert 'iop_cached_tokens_total{model="m",provider="q"}' not in rendered(metrics)
