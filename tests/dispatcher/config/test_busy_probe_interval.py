"""``dispatch.busy_probe_interval_ms``: how seldom a busy provider is probed (workers/provider_state.py)."""

from __future__ import annotations

from typing import Any

import pytest

from dispatcher import config as cfg
from dispatcher.config.schema import BUSY_PROBE_FACTOR
from dispatcher.exceptions import ConfigError
from tests.dispatcher.config.one_model import with_one_model


def problems(dispatch: dict[str, Any]) -> list[tuple[str, str]]:
    try:
        cfg.parse(with_one_model({"dispatch": dispatch}))
    except ConfigError as exc:
        return [(p.path, p.message) for p in exc.problems]
    return []


def test_unset_it_is_a_multiple_of_the_probe_interval() -> None:
    assert cfg.parse(with_one_model({})).config.dispatch.busy_probe_period_ms == BUSY_PROBE_FACTOR * 5_000 == 60_000
    dispatch = cfg.parse(with_one_model({"dispatch": {"probe_interval_ms": 700}})).config.dispatch
    assert dispatch.busy_probe_interval_ms is None
    assert dispatch.busy_probe_period_ms == BUSY_PROBE_FACTOR * 700
    # A long probe interval stays valid without the setting.
    assert problems({"probe_interval_ms": 120_000}) == []


def test_set_it_is_taken_as_it_is() -> None:
    dispatch = cfg.parse(with_one_model({"dispatch": {"busy_probe_interval_ms": 9_000}})).config.dispatch
    assert dispatch.busy_probe_period_ms == 9_000
    assert problems({"probe_interval_ms": 300, "busy_probe_interval_ms": 300}) == []


@pytest.mark.parametrize(("dispatch", "expected"), [
    ({"busy_probe_interval_ms": 0}, "must not be shorter than probe_interval_ms (5000), got 0"),
    ({"busy_probe_interval_ms": -1}, "got -1"),
    ({"busy_probe_interval_ms": 1_000}, "must not be shorter than probe_interval_ms (5000), got 1000"),
    ({"probe_interval_ms": 2_000, "busy_probe_interval_ms": 1_999}, "(2000), got 1999"),
])
def test_shorter_than_the_probe_interval_is_refused(dispatch: dict[str, Any], expected: str) -> None:
    found = problems(dispatch)
    assert [path for path, _ in found] == ["$.dispatch.busy_probe_interval_ms"], found
    assert expected in found[0][1]


def test_not_a_number_is_refused_at_its_path() -> None:
    found = problems({"busy_probe_interval_ms": "often"})
    assert [path for path, _ in found] == ["$.dispatch.busy_probe_interval_ms"], found
