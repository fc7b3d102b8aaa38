"""Coarse model-lifecycle capability flags per provider type (flags only: iop reports what a
runtime could do, it never loads or unloads models itself).

| type       | list | load | unload | pull | delete |
|------------|------|------|--------|------|--------|
| ollama     | yes  | yes  | yes    | yes  | yes    |
| lemonade   | yes  | yes  | yes    | yes  | yes    |
| vllm       | yes  | no   | no     | no   | no     |
| sglang     | yes  | no   | no     | no   | no     |
| llamacpp   | yes  | no   | no     | no   | no     |
| openai_api | yes  | no   | no     | no   | no     |
| cli        | no   | no   | no     | no   | no     |

Why: Ollama (``/api/tags``, load by request, ``keep_alive: 0``, ``/api/pull``,
``/api/delete``) and Lemonade (``/api/v1/models``, ``/load``, ``/unload``, ``/pull``,
``/delete``) manage models at run time. vLLM and SGLang serve the one model they were
launched with: ``/v1/models`` lists it, while LoRA adapters, sleep mode or SGLang's
``update_weights`` do not change which model is served; llama.cpp's ``llama-server``
likewise serves the model file it was started with. A hosted OpenAI-style API's
catalog is read-only to its callers. A cli provider is a command: it serves what its
config says and reports nothing.
"""

from __future__ import annotations

import msgspec


class LifecycleFlags(msgspec.Struct, frozen=True):
    list_models: bool = False
    load_model: bool = False
    unload_model: bool = False
    pull_model: bool = False
    delete_model: bool = False


_ALL = LifecycleFlags(True, True, True, True, True)
_LIST_ONLY = LifecycleFlags(list_models=True)

FLAGS: dict[str, LifecycleFlags] = {
    "ollama": _ALL,
    "lemonade": _ALL,
    "vllm": _LIST_ONLY,
    "sglang": _LIST_ONLY,
    "llamacpp": _LIST_ONLY,
    "openai_api": _LIST_ONLY,
    "cli": LifecycleFlags(),
}


def flags_for(provider_type: str) -> LifecycleFlags:
    return FLAGS.get(provider_type, LifecycleFlags())
