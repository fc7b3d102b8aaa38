"""The benchmark part of a qualification (iop/qualify/workload.py): the knee of throughput
against concurrency (``suggested_capacity``), the concurrency ladder, and the percentiles of
what a client measured. Curves are written here, so each case says exactly what it holds."""

from __future__ import annotations

import pytest

from dispatcher.qualifications import Latency
from iop.qualify.workload import GROWTH, CallResult, Step, knee, latency, levels


def curve(*tokens_per_s: float, wall_s: float = 2.0) -> list[Step]:
    """Steps at concurrency 1, 2, 4, ... with these throughputs (one call of that many tokens
    a second over ``wall_s``)."""
    return [Step(1 << i, [CallResult(True, tokens=round(t * wall_s))], wall_s) for i, t in enumerate(tokens_per_s)]


def test_the_knee_is_the_last_step_that_still_grew() -> None:
    # A server of four slots: doubling until 4, flat after.
    assert knee(curve(10, 20, 40, 41, 40)) == 4


def test_growth_under_the_factor_is_not_growth() -> None:
    under = 20 * GROWTH - 1
    assert knee(curve(10, 20, under)) == 2
    assert knee(curve(10, 20, 20 * GROWTH)) == 4


def test_the_first_dip_ends_the_curve_even_if_a_later_step_grows_again() -> None:
    assert knee(curve(10, 20, 15, 80)) == 2


def test_a_server_that_never_grows_has_its_knee_at_one() -> None:
    assert knee(curve(30, 31, 29)) == 1


def test_a_curve_that_grows_to_its_end_has_its_knee_at_the_last_step() -> None:
    # The run's share of the model's slots stopped the ladder, not the server.
    assert knee(curve(10, 20, 40)) == 4


def test_no_steps_no_knee() -> None:
    assert knee([]) is None


def test_throughput_counts_the_answered_calls_only() -> None:
    s = Step(2, [CallResult(True, tokens=30), CallResult(False, tokens=99), CallResult(True, tokens=10)], 4.0)
    assert s.tokens_per_s == 10.0
    assert Step(1, [CallResult(True, tokens=5)], 0.0).tokens_per_s == 0.0


def test_failed_calls_that_cost_the_throughput_move_the_knee() -> None:
    ok = [CallResult(True, tokens=40)] * 4
    steps = [Step(1, ok[:1], 1.0), Step(2, ok[:2], 1.0), Step(4, ok[:2] + [CallResult(False)] * 2, 1.0)]
    assert knee(steps) == 2


@pytest.mark.parametrize(("cap", "limit", "expected"), [
    (16, None, [1, 2, 4, 8, 16]),
    (12, None, [1, 2, 4, 8]),
    (16, 4, [1, 2, 4]),
    (3, 8, [1, 2]),
    (1, None, [1]),
])
def test_the_ladder_doubles_up_to_the_share_and_the_callers_limit(cap: int, limit: int | None,
                                                                 expected: list[int]) -> None:
    assert levels(cap, limit) == expected


def test_latency_is_p50_and_p90_in_milliseconds() -> None:
    got = latency([i / 1000 for i in range(1, 101)])  # 1 ms .. 100 ms
    assert got == Latency(50.5, pytest.approx(90.1))
    assert latency([0.25]) == Latency(250.0, 250.0)
    assert latency([]) is None
