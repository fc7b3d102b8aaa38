"""What a qualification report says of a sweep (iop/qualify/run.py): a knee only where the curve
shows one, and a note naming the bound that cut a sweep short. Curves are written here."""

from __future__ import annotations

from typing import Any

from iop.qualify.run import Options as RunOptions
from iop.qualify.run import _report, sweep_note
from iop.qualify.workload import CallResult, Step, ladder

RUN: dict[str, Any] = {"run": "r1", "max_in_flight": 1, "share": 0.25, "max_seconds": 900, "iop_version": "t",
                       "providers": [{"provider": "p", "served_name": "s", "type": "vllm", "node": "n",
                                      "capacity": 4, "lifecycle": {}}]}


def curve(*tokens_per_s: float) -> list[Step]:
    return [Step(1 << i, [CallResult(True, ttft_s=0.1, tokens=round(t))], 1.0) for i, t in enumerate(tokens_per_s)]


def report_of(steps: list[Step], cut: list[str]) -> Any:
    notes = [sweep_note("p", ladder(1, 4, None), steps, RUN)] if cut else []
    return _report(RunOptions("http://x", "m"), RUN, "t0", {"p": steps}, {}, {}, [], False, notes, {"p": cut})


def test_the_ladder_stops_at_the_lowest_bound_and_names_it() -> None:
    # The demo at share 0.25: 7 slots, a quarter is 1.
    assert ladder(1, 4, None).levels == [1]
    assert ladder(1, 4, None).bounds == ["share"]
    # At share 1.0 the provider's capacity (6) ends it: a step of 8 would time iop's queue.
    assert ladder(7, 6, None).levels == [1, 2, 4]
    assert ladder(7, 6, None).bounds == ["capacity"]
    assert ladder(48, 16, 16).bounds == ["max_concurrency", "capacity"]


def test_a_sweep_the_share_cut_at_one_step_claims_no_knee_and_says_why() -> None:
    report = report_of(curve(10), ["share"])
    (p,) = report.providers
    assert p.suggested_capacity is None
    assert p.sweep_cut_by == ["share"]
    (note,) = report.notes
    assert note.startswith("p: no knee found, so no suggested_capacity: throughput still grew at concurrency 1")
    assert "qualify.share 0.25: 1 at once; raise it" in note


def test_a_sweep_that_still_grew_at_the_capacity_claims_no_knee() -> None:
    note = sweep_note("p", ladder(7, 4, None), curve(10, 20, 40), RUN)
    assert "grew at concurrency 4" in note
    assert "its capacity in iop (4: iop sends it no more at once" in note
    assert report_of(curve(10, 20, 40), ["capacity"]).providers[0].suggested_capacity is None


def test_a_knee_the_curve_shows_is_suggested() -> None:
    (p,) = report_of(curve(10, 20, 21), []).providers
    assert p.suggested_capacity == 2
    assert p.sweep_cut_by == []
