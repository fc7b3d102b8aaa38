"""Hypothesis against the config loader: whatever the file holds, the answer is a Config
or a ConfigError whose problems each carry a path -- never a crash; and the walk that finds
every problem at once finds what decoding would have stopped at."""

from __future__ import annotations

import re
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dispatcher import config as cfg
from dispatcher.config import legacy
from dispatcher.config.decode_errors import problem_from_validation
from dispatcher.config.field_rules import Findings
from dispatcher.exceptions import ConfigError
from tests.dispatcher.config.yaml_text import load_text

scalars = st.none() | st.booleans() | st.integers(-10, 10**12) | st.floats(allow_nan=False) | st.text(max_size=20)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12),
                                                                                          inner, max_size=4),
                      max_leaves=20)
KNOWN_KEYS = ["models", "nodes", "redis", "api", "queue", "dispatch", "demo", "openai", "id", "providers", "type",
              "category", "capacity", "base_url", "command", "models", "model_routes", "adapter", "target",
              "adapters", "max_queue", "queue_timeout_ms", "url", "timeout_s", "api_key_env"]
# Mostly the shape of a config, with anything in its values: reaches deeper than random dicts.
config_like = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KNOWN_KEYS), inner, max_size=5),
    max_leaves=30,
)


def outcome(load: Any) -> cfg.Config | ConfigError:
    """What loading gave: the config, or the ConfigError (anything else propagates and fails)."""
    try:
        return load()  # type: ignore[no-any-return]
    except ConfigError as exc:
        return exc


def check(raw: Any) -> None:
    result = outcome(lambda: cfg.parse(raw).config)
    if isinstance(result, ConfigError):
        assert result.problems
        for problem in result.problems:
            assert problem.path.startswith("$"), problem
            assert problem.message
    else:
        assert cfg.validate(result) == []


@given(values)
@settings(max_examples=300, suppress_health_check=list(HealthCheck), deadline=None)
def test_any_document(raw: Any) -> None:
    check(raw)


@given(st.dictionaries(st.sampled_from(KNOWN_KEYS), config_like, max_size=6))
@settings(max_examples=500, suppress_health_check=list(HealthCheck), deadline=None)
def test_config_shaped_documents(raw: Any) -> None:
    check(raw)


@given(st.text(max_size=300))
@settings(max_examples=300, suppress_health_check=list(HealthCheck), deadline=None)
def test_any_yaml_text(text: str) -> None:
    result = outcome(lambda: load_text(text).config)
    if isinstance(result, ConfigError):
        assert all(p.path.startswith("$") for p in result.problems)


def _range_words(message: str) -> bool:
    # msgspec words a bound as "Expected `int` >= 0"; the walk as "must be >= 0, got -1".
    return message.startswith(("Expected `int` ", "Expected `float` ")) and ", got" not in message


@given(st.dictionaries(st.sampled_from(KNOWN_KEYS), config_like, max_size=6))
@settings(max_examples=500, suppress_health_check=list(HealthCheck), deadline=None)
def test_the_walk_finds_what_decoding_would_and_leaves_what_decodes(raw: Any) -> None:
    """The walk of the struct types is at least as strict as msgspec: the problem decoding
    stops at is among those it finds, in the same words, and what it leaves decodes."""
    core = legacy.split(raw)[0]
    findings = Findings()  # (of the pool-shape part alone)
    checked = findings.check(core, cfg.Config)
    msgspec.convert(checked, type=cfg.Config)  # never raises
    try:
        msgspec.convert(core, type=cfg.Config)
    except msgspec.ValidationError as exc:
        first = problem_from_validation(exc, cfg.Config)
        found = {(p.path, p.message) for p in findings.problems}
        if "[...]" in first.path:  # msgspec does not name a mapping's key; the walk does
            assert any(re.fullmatch(re.escape(first.path).replace(r"\[\.\.\.\]", r"\..*"), path)
                       for path, _ in found), (first, found)
        elif first.message.endswith("(mapping key)") or _range_words(first.message):
            assert first.path in {path for path, _ in found}, (first, found)
        else:
            assert (first.path, first.message) in found, (first, found)
    else:
        assert findings.problems == []
