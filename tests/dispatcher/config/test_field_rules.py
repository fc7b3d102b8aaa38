"""A setting's range and reload policy live on its field (schema.py); the checks are derived.

Every value out of range is reported at once, each at its path, next to the decoding and
cross-field problems of the rest of the file; defaults are always in range.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Annotated, Any

import msgspec
import pytest

from dispatcher import config as cfg
from dispatcher.config import field_rules
from dispatcher.config.field_rules import POSITIVE, RESTART, Findings, declared_ranges, restart_paths
from dispatcher.config.validation import NO_MODELS
from dispatcher.exceptions import ConfigError, ConfigProblem

ROOT = Path(__file__).resolve().parents[3]


def base() -> dict[str, Any]:
    return {
        "models": [{"id": "m1", "providers": {"p1": "served-m1"}}],
        "nodes": [{"id": "n1", "providers": [
            {"id": "p1", "type": "vllm", "base_url": "http://127.0.0.1:9", "models": ["served-m1"]},
        ]}],
    }


def problems_of(raw: Any) -> list[ConfigProblem]:
    with pytest.raises(ConfigError) as info:
        cfg.parse(raw)
    return info.value.problems


@pytest.fixture(autouse=True)
def _no_redis_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("IOP_REDIS_URL", raising=False)


# --------------------------------------------------------------------------- defaults


def test_the_default_config_lacks_only_a_model() -> None:
    assert cfg.validate(cfg.Config()) == [ConfigProblem("$.models", NO_MODELS)]


@pytest.mark.parametrize("path", ["iop/demo.yaml", "deploy/iop.yaml"])
def test_the_shipped_configs_validate(path: str) -> None:
    loaded = cfg.load(ROOT / path)  # `iop up` runs iop/demo.yaml; compose deploy/iop.yaml
    assert cfg.validate(loaded.config) == []


@pytest.mark.parametrize("declared", declared_ranges(cfg.Config), ids=lambda d: f"{d.struct.__name__}.{d.name}")
def test_every_default_is_in_its_range(declared: field_rules.Declared) -> None:
    if declared.default is not None:  # None: unset, which every range allows
        assert declared.range.problem(declared.default) is None


# --------------------------------------------------------------------------- messages


@pytest.mark.parametrize(("where", "value", "message"), [
    ("queue.max_queue", -1, "must be >= 0, got -1"),
    ("queue.queue_timeout_ms", 0, "must be > 0, got 0"),
    ("queue.hold_when_unavailable_ms", -2, "must be >= 0, got -2"),
    ("queue.refuse_predicted_over_ms", 0, "must be >= 1, got 0"),
    ("api.max_body_bytes", 0, "must be > 0, got 0"),
    ("api.header_timeout_s", -0.5, "must be > 0, got -0.5"),
    ("api.max_streams", 0, "must be > 0, got 0"),
    ("dispatch.lease_ms", 0, "must be > 0, got 0"),
    ("dispatch.reap_interval_ms", -1, "must be > 0, got -1"),
    ("dispatch.drain_grace_s", -1, "must be >= 0, got -1"),
    ("responses.max_ids", 0, "must be > 0, got 0"),
    ("tracing.sample_ratio", 2, "must be between 0 and 1, got 2"),
    ("tracing.sample_ratio", -0.1, "must be between 0 and 1, got -0.1"),
    ("redis.failover_hold_ms", -1, "must be >= 0, got -1 (0: no holding)"),
])
def test_a_value_out_of_range_is_the_only_problem(where: str, value: float, message: str) -> None:
    raw = base()
    section, name = where.split(".")
    raw[section] = {name: value}
    assert problems_of(raw) == [ConfigProblem(f"$.{where}", message)]


def test_fields_in_lists_are_checked_at_their_paths() -> None:
    raw = base()
    raw["models"][0].update(max_queue=-1, queue_timeout_ms=0)
    raw["nodes"][0]["providers"][0].update(capacity=-3, timeout_s=0)
    raw["api"] = {"keys": [{"name": "t", "key_sha256": "0" * 64, "weight": 0, "max_in_flight": 0,
                            "limits": {"tokens_per_day": 0}}]}
    assert problems_of(raw) == [
        ConfigProblem("$.models[0].max_queue", "must be >= 0, got -1"),
        ConfigProblem("$.models[0].queue_timeout_ms", "must be > 0, got 0"),
        ConfigProblem("$.nodes[0].providers[0].capacity",
                      "must be >= 0, got -3 (0 keeps the provider out of rotation)"),
        ConfigProblem("$.nodes[0].providers[0].timeout_s", "must be > 0, got 0"),
        ConfigProblem("$.api.keys[0].weight", "must be > 0, got 0"),
        ConfigProblem("$.api.keys[0].max_in_flight", "must be >= 1, got 0"),
        ConfigProblem("$.api.keys[0].limits.tokens_per_day", "must be >= 1, got 0"),
    ]


def test_nan_is_out_of_every_range() -> None:
    raw = base()
    raw["tracing"] = {"sample_ratio": math.nan}
    assert problems_of(raw) == [ConfigProblem("$.tracing.sample_ratio", "must be between 0 and 1, got nan")]


# --------------------------------------------------------------------------- every problem at once


def test_ranges_decoding_and_cross_field_problems_are_reported_together() -> None:
    raw = base()
    raw["queue"] = {"max_queue": -1, "queue_timeout_ms": 0}
    raw["dispatch"] = {"lease_ms": 0, "heartbeat_interval_ms": 20_000}  # interval >= the default ttl
    raw["models"][0]["providers"]["ghost"] = "x"
    raw["tracing"] = {"sample_ratio": 5}
    assert sorted((p.path, p.message) for p in problems_of(raw)) == sorted([
        ("$.queue.max_queue", "must be >= 0, got -1"),
        ("$.queue.queue_timeout_ms", "must be > 0, got 0"),
        ("$.dispatch.lease_ms", "must be > 0, got 0"),
        ("$.tracing.sample_ratio", "must be between 0 and 1, got 5"),
        ("$.dispatch.heartbeat_interval_ms", "must be shorter than heartbeat_ttl_ms (20000 >= 10000)"),
        ("$.models[0].providers.ghost", "no node defines provider 'ghost'"),
    ])


def test_ranges_are_reported_with_a_decoding_error() -> None:
    raw = base()
    raw["queue"] = {"max_queue": -1, "max_qeue": 3}
    raw["dispatch"] = {"max_attempts": 0}
    paths = {p.path: p.message for p in problems_of(raw)}
    assert paths == {
        "$.queue.max_queue": "must be >= 0, got -1",
        "$.dispatch.max_attempts": "must be > 0, got 0",
        "$.queue.max_qeue": "unknown field `max_qeue`",
    }


def test_a_value_of_the_wrong_type_is_left_to_decoding() -> None:
    for value, words in ((True, "`bool`"), ("2", "`str`"), (1.5, "`float`")):
        raw = base()
        raw["queue"] = {"max_queue": value}
        [problem] = problems_of(raw)
        assert problem.path == "$.queue.max_queue"
        assert words in problem.message


def test_unset_fields_keep_none() -> None:
    raw = base()
    raw["models"][0].update(max_queue=None, queue_timeout_ms=None)
    raw["dispatch"] = {"reap_interval_ms": None}
    config = cfg.parse(raw).config
    assert (config.models[0].max_queue, config.models[0].queue_timeout_ms) == (None, None)
    assert config.dispatch.reap_interval_ms is None


def test_out_of_range_drops_only_the_offending_values_and_copies() -> None:
    raw = base()
    raw["queue"] = {"max_queue": -1, "queue_timeout_ms": 5}
    raw["nodes"][0]["providers"][0]["capacity"] = -1
    before = copy.deepcopy(raw)
    findings = Findings()
    cleaned, problems = findings.check(raw, cfg.Config), findings.problems
    assert raw == before  # not modified
    assert cleaned["queue"] == {"queue_timeout_ms": 5}
    assert "capacity" not in cleaned["nodes"][0]["providers"][0]
    assert cleaned["models"] is raw["models"]  # untouched parts are shared, not copied
    assert [p.path for p in problems] == ["$.nodes[0].providers[0].capacity", "$.queue.max_queue"]
    # What is left decodes, with the defaults standing in.
    config = msgspec.convert(cleaned, type=cfg.Config)
    assert (config.queue.max_queue, config.nodes[0].providers[0].capacity) == (100, 1)


def test_validate_checks_ranges_of_a_config_built_in_code() -> None:
    config = msgspec.structs.replace(cfg.parse(base()).config, queue=cfg.QueueConfig(max_queue=-1),
                                     dispatch=cfg.DispatchConfig(drain_grace_s=-1.0),
                                     tracing=cfg.TracingConfig(sample_ratio=1.5))
    assert cfg.validate(config) == [
        ConfigProblem("$.queue.max_queue", "must be >= 0, got -1"),
        ConfigProblem("$.dispatch.drain_grace_s", "must be >= 0, got -1.0"),
        ConfigProblem("$.tracing.sample_ratio", "must be between 0 and 1, got 1.5"),
    ]


def test_legacy_adapters_are_checked_at_their_legacy_paths() -> None:
    raw = {
        "openai": {"model_routes": [{"model": "m", "adapter": "a", "target": "t"}]},
        "nodes": [{"id": "n1", "adapters": {"a": {"type": "ollama", "base_url": "http://x", "capacity": -1,
                                                  "timeout_s": 0}}}],
        "queue": {"max_queue": -1},
    }
    assert sorted((p.path, p.message) for p in problems_of(raw)) == [
        ("$.nodes[0].adapters.a.capacity", "must be >= 0, got -1 (0 keeps the provider out of rotation)"),
        ("$.nodes[0].adapters.a.timeout_s", "must be > 0, got 0.0"),  # decoded (as a float) before the check
        ("$.queue.max_queue", "must be >= 0, got -1"),
    ]


# --------------------------------------------------------------------------- the rules themselves


def test_a_range_on_a_required_field_is_refused() -> None:
    class Bad(msgspec.Struct):
        port: Annotated[int, POSITIVE]

    with pytest.raises(TypeError, match="needs a default"):
        Findings().check({"port": 0}, Bad)


def test_the_restart_only_settings() -> None:
    assert set(restart_paths(cfg.Config)) == {
        ("redis",), ("dispatch",), ("tracing",),
        ("api", "max_body_bytes"), ("api", "max_header_bytes"), ("api", "header_timeout_s"),
        ("api", "keep_alive_s"),
    }


class _Inner(msgspec.Struct, frozen=True):
    fixed: Annotated[int, RESTART] = 1
    free: int = 2


class _Outer(msgspec.Struct):
    inner: _Inner = _Inner()
    section: Annotated[_Inner, RESTART] = _Inner()
    optional: _Inner | None = None  # no running value to keep a field of


def test_a_restart_mark_is_found_on_a_field_or_a_section() -> None:
    assert restart_paths(_Outer) == (("inner", "fixed"), ("section",))


def test_an_unknown_reload_policy_is_refused() -> None:
    class Typo(msgspec.Struct):
        x: Annotated[int, msgspec.Meta(extra={"reload": "restrat"})] = 1

    with pytest.raises(ValueError, match="unknown reload policy 'restrat'"):
        restart_paths(Typo)


class _Named(msgspec.Struct):
    name: Annotated[str, msgspec.Meta(min_length=1)] = "x"


def test_a_constraint_the_walk_cannot_check_is_refused() -> None:
    # msgspec would report only the first: such a rule belongs in validation.py.
    with pytest.raises(TypeError, match="min_length"):
        declared_ranges(_Named)
