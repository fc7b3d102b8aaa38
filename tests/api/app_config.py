"""The API tests' config: models m and org/model:tag on one provider no worker serves."""

from __future__ import annotations

from typing import Any

from dispatcher import config as cfg


def make_config(redis_url: str, **overrides: Any) -> cfg.Config:
    raw: dict[str, Any] = {
        "redis": {"url": redis_url},
        "api": {"max_body_bytes": 4096},
        # No worker runs here: requests wait for the provider (held) rather than being
        # refused for want of one.
        "queue": {"max_queue": 1, "queue_timeout_ms": 300, "hold_when_unavailable_ms": 60_000},
        "models": [
            {"id": "m", "display_name": "Model M", "providers": {"p": "served-m"}},
            {"id": "org/model:tag", "providers": {"p": "served-m"}, "max_queue": 0},
        ],
        "nodes": [{"id": "n", "providers": [
            {"id": "p", "type": "vllm", "base_url": "http://127.0.0.1:9", "models": ["served-m"]}]}],
    }
    raw.update(overrides)
    return cfg.parse(raw).config
