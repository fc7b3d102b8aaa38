"""Coarse model-lifecycle capability flags per provider type: what a type's runtime can do with
its models. The catalog shows them; iop's own loads and unloads (``lifecycle: managed``) go
through ``workers/adapters/model_runtime.py``, and pull and delete are never iop's.

| type       | list | load | unload | pull | delete |
|------------|------|------|--------|------|--------|
| ollama     | yes  | yes  | yes    | yes  | yes    |
| lemonade   | yes  | yes  | yes    | yes  | yes    |
| vllm       | yes  | *    | *      | no   | no     |
| sglang     | yes  | no   | no     | no   | no     |
| llamacpp   | yes  | *    | *      | no   | no     |
| openai_api | yes  | no   | no     | no   | no     |
| cli        | no   | no   | no     | no   | no     |

Why: Ollama (``/api/tags``, load by request, ``keep_alive: 0``, ``/api/pull``,
``/api/delete``) and Lemonade (``/api/v1/models``, ``/load``, ``/unload``, ``/pull``,
``/delete``) manage models at run time. llama.cpp's ``llama-server`` in router mode
(``--models-dir``, ``--models-max``) loads and unloads the GGUFs of its directory
(``/models/load``, ``/models/unload``), and pulls none (its ``POST /models`` downloads
only to the Hugging Face cache, not to the ``--models-dir`` it serves); started with one
``--model`` it serves that file alone. vLLM in sleep mode (``--enable-sleep-mode``,
``VLLM_SERVER_DEV_MODE=1``) unloads its one model to sleep and loads it again on
``/wake_up``; without it, it serves the model it was launched with, as SGLang does
(``update_weights`` swaps the weights of that model in place). *: the config cannot tell a
router or a sleep mode from the type, so those two say load and unload only for a provider
that says ``lifecycle: managed``. A hosted OpenAI-style API's catalog is read-only to its callers. A
cli provider is a command: it serves what its config says and reports nothing.
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
_LOADS = LifecycleFlags(list_models=True, load_model=True, unload_model=True)

FLAGS: dict[str, LifecycleFlags] = {
    "ollama": _ALL,
    "lemonade": _ALL,
    "vllm": _LIST_ONLY,
    "sglang": _LIST_ONLY,
    "llamacpp": _LIST_ONLY,
    "openai_api": _LIST_ONLY,
    "cli": LifecycleFlags(),
}


# The types that load and unload only in a mode the config declares (``lifecycle: managed``).
_IN_MODE = frozenset({"vllm", "llamacpp"})


def flags_for(provider_type: str, managed: bool = False) -> LifecycleFlags:
    """A type's flags; ``managed``: its provider says ``lifecycle: managed``."""
    flags = FLAGS.get(provider_type, LifecycleFlags())
    if managed and provider_type in _IN_MODE:
        return _LOADS
    return flags


# The types whose runtimes continue a trailing assistant message (chat) or a prompt (completions)
# where it stops, so that a stream cut on one provider goes on on another (api/continuation.py):
# vLLM, SGLang and llama.cpp's server with ``continue_final_message`` (iop sets it, with
# ``add_generation_prompt`` off; llama.cpp's server continues a trailing assistant message
# without them too, but then streams the text so far again first). Not a hosted OpenAI-style API (OpenAI's own answers a
# trailing assistant message with a new one), nor Ollama's and Lemonade's OpenAI endpoints, nor
# a command.
CONTINUES = frozenset({"vllm", "sglang", "llamacpp"})


class CapabilityFlags(msgspec.Struct, frozen=True):
    """What a provider's type can do with a request beyond answering it (the catalog's
    ``capability_flags``)."""

    continue_: bool = msgspec.field(default=False, name="continue")


def capability_flags(provider_type: str) -> CapabilityFlags:
    return CapabilityFlags(continue_=provider_type in CONTINUES)
