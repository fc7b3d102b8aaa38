"""What a tenant may do: its band, its models (which one a request is: tests/api/test_auth.py)."""

from __future__ import annotations

from typing import Any

import pytest

from dispatcher import config as cfg
from dispatcher.exceptions import ConfigError, InvalidRequest
from dispatcher.tenants import Tenants
from tests.dispatcher.tenant_config import BANDS, KEYS, config


def tenants(monkeypatch: pytest.MonkeyPatch, **api: Any) -> Tenants:
    return Tenants(config(monkeypatch, **api))


def test_allow_lists_are_globs(monkeypatch: pytest.MonkeyPatch) -> None:
    t = tenants(monkeypatch, keys=KEYS, priorities=BANDS)
    web = t.by_name["web"]
    assert web.allows("qwen3.6:35b")
    assert not web.allows("llama3.1:8b")
    assert t.by_name["eval"].allows("llama3.1:8b")


def test_an_open_api_has_no_flow_control(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not tenants(monkeypatch).flow_control


def test_the_priority_header_only_lowers(monkeypatch: pytest.MonkeyPatch) -> None:
    t = tenants(monkeypatch, keys=KEYS, priorities=BANDS)
    web, ev = t.by_name["web"], t.by_name["eval"]
    assert t.band_for(web, {"x-iop-priority": "batch"}) == 2
    assert t.band_for(ev, {"x-iop-priority": "interactive"}) == 2
    with pytest.raises(InvalidRequest):
        t.band_for(web, {"x-iop-priority": "urgent"})


def test_every_tenant_problem_is_reported_with_its_path() -> None:
    with pytest.raises(ConfigError) as info:
        cfg.parse({"api": {
            "priorities": ["hi", "hi"],
            "keys": [
                {"name": "a b", "key_env": "X"},
                {"name": "c", "key_env": "X", "key_sha256": "0" * 64, "priority": "nope", "weight": 0,
                 "max_queued": 0, "models": ["nothing*"]},
                {"name": "c", "key_sha256": "xyz"},
            ],
        }})
    text = str(info.value)
    for path in ("$.api.priorities[1]", "$.api.default_priority", "$.api.keys[0].name", "$.api.keys[1]:",
                 "$.api.keys[1].priority", "$.api.keys[1].weight", "$.api.keys[1].max_queued",
                 "$.api.keys[1].models[0]", "$.api.keys[2].name", "$.api.keys[2].key_sha256"):
        assert path in text, (path, text)
