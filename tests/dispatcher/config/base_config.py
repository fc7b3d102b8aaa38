"""The config tests' valid base config, and the problems a mutated copy of it raises."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from dispatcher import config as cfg
from dispatcher.exceptions import ConfigError, ConfigProblem


def base() -> dict[str, Any]:
    """A small valid config: one model served by one vllm provider on one node.

    Every test takes a fresh copy and mutates it to introduce exactly the problem it checks.
    """
    return copy.deepcopy(
        {
            "redis": {"url": "redis://localhost:6379/0"},
            "api": {"api_keys_env": "IOP_API_KEYS", "max_body_bytes": 1024},
            "queue": {"max_queue": 10, "queue_timeout_ms": 5000},
            "models": [
                {"id": "m1", "display_name": "Model one", "providers": {"p1": "served-m1"}},
            ],
            "nodes": [
                {
                    "id": "n1",
                    "providers": [
                        {
                            "id": "p1",
                            "type": "vllm",
                            "base_url": "http://gpu1:8000",
                            "models": ["served-m1"],
                            "capacity": 2,
                        }
                    ],
                }
            ],
        }
    )


def provider(cfg_dict: dict[str, Any], node: int = 0, index: int = 0) -> dict[str, Any]:
    """Provider ``index`` of node ``node`` in a raw config (to mutate in place)."""
    prov: dict[str, Any] = cfg_dict["nodes"][node]["providers"][index]
    return prov


def problems_of(raw: Any) -> list[ConfigProblem]:
    """The problems ``parse(raw)`` raises; fails the test if it does not raise."""
    with pytest.raises(ConfigError) as info:
        cfg.parse(raw)
    assert info.value.problems, "ConfigError raised without problems"
    return info.value.problems


def only_problem(raw: Any) -> ConfigProblem:
    """The one problem ``parse(raw)`` raises; fails the test on none or more than one."""
    problems = problems_of(raw)
    assert len(problems) == 1, problems
    return problems[0]
