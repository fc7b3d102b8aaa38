"""The least a config that passes holds: one model, served by one provider of one node.

A config without a model is refused (``dispatcher.config.validation.NO_MODELS``); tests about
another section add these to what they check.
"""

from __future__ import annotations

import copy
from typing import Any

ONE_MODEL: dict[str, Any] = {
    "models": [{"id": "m", "providers": {"p": "served-m"}}],
    "nodes": [{"id": "n", "providers": [
        {"id": "p", "type": "vllm", "base_url": "http://127.0.0.1:9", "models": ["served-m"]}]}],
}

ONE_MODEL_YAML = """
models:
  - {id: m, providers: {p: served-m}}
nodes:
  - id: n
    providers: [{id: p, type: vllm, base_url: "http://127.0.0.1:9", models: [served-m]}]
"""


def with_one_model(sections: dict[str, Any]) -> dict[str, Any]:
    """``sections``, and the one model (a fresh copy) unless they hold models or nodes."""
    return {**copy.deepcopy(ONE_MODEL), **sections}
