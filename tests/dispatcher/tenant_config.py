"""A config with two tenants' keys and three priority bands, shared by the tenant tests of
tests/dispatcher (what a tenant may do) and tests/api (which tenant a request is)."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from dispatcher import config as cfg


def config(monkeypatch: pytest.MonkeyPatch, **api: Any) -> cfg.Config:
    """Models qwen3.6:35b and llama3.1:8b under the api section ``api``; the keys T_WEB and
    T_LEGACY name are set."""
    monkeypatch.setenv("T_WEB", "web-secret")
    monkeypatch.setenv("T_LEGACY", "old-1, old-2")
    return cfg.parse({"api": api, "models": [{"id": "qwen3.6:35b", "providers": {"p": "s"}},
                                                     {"id": "llama3.1:8b", "providers": {"p": "s"}}],
                              "nodes": [{"id": "n", "providers": [
                                  {"id": "p", "type": "vllm", "base_url": "http://h:1", "models": ["s"]}]}]}).config


KEYS = [
    {"name": "web", "key_env": "T_WEB", "priority": "interactive", "models": ["qwen3.6:*"]},
    {"name": "eval", "key_sha256": hashlib.sha256(b"eval-secret").hexdigest(), "priority": "batch"},
]
BANDS = ["interactive", "standard", "batch"]
