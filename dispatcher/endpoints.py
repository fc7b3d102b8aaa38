"""The model-bearing endpoints iop relays, what each looks like on the wire, and which
runtime serves which.

An endpoint's *name* is its path under ``/v1`` (``chat/completions``, ``responses``,
``audio/speech``...): the same name is a capability in a provider's ``endpoints:`` list
and the key dispatch uses to choose among a model's providers
(:mod:`dispatcher.plans`). The calls on a stored response (``GET /v1/responses/{id}``
and friends) belong to the ``responses`` capability.

How a streamed answer travels (``stream``):

* ``sse``       -- OpenAI ``data:`` events ending in ``[DONE]`` (chat, completions). A
                   chunk is one event's data.
* ``typed_sse`` -- events with ``event:`` lines (Responses, Messages, audio transcripts).
                   A chunk is ``name + "\\n" + data`` (name may be empty); the stream has
                   ended properly once an event named in ``terminal`` went by.
* ``bytes``     -- a binary body relayed as it arrives (``audio/speech``). A chunk is raw
                   bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

StreamKind = Literal["sse", "typed_sse", "bytes"]
BodyKind = Literal["json", "multipart"]
ErrorShape = Literal["openai", "anthropic"]


@dataclass(frozen=True, slots=True)
class Endpoint:
    name: str
    body: BodyKind = "json"
    stream: StreamKind = "sse"
    # typed_sse: event names that end a stream properly (anything else ending it is a break).
    terminal: frozenset[bytes] = frozenset()
    # The answer is streamed whatever the request says (audio/speech).
    always_streams: bool = False
    # The request may ask for a stream at all.
    can_stream: bool = True
    errors: ErrorShape = "openai"
    # Where the runtime serves it: "v1" (under /v1) or "root" (at the server's root),
    # by provider type; types not named use "v1".
    root_for: frozenset[str] = frozenset()
    # Caller headers the provider needs (dispatcher/envelope.py FORWARDED_HEADERS) go on.
    forwards: bool = False

    def upstream_path(self, provider_type: str) -> str:
        return f"/{self.name}" if provider_type in self.root_for else f"/v1/{self.name}"


_RESPONSE_END = frozenset({b"response.completed", b"response.failed", b"response.incomplete", b"error"})

ENDPOINTS: dict[str, Endpoint] = {
    e.name: e
    for e in (
        Endpoint("chat/completions"),
        Endpoint("completions"),
        Endpoint("embeddings", can_stream=False),
        Endpoint("responses", stream="typed_sse", terminal=_RESPONSE_END, forwards=True),
        Endpoint("messages", stream="typed_sse", terminal=frozenset({b"message_stop", b"error"}),
                 errors="anthropic", forwards=True),
        Endpoint("messages/count_tokens", can_stream=False, errors="anthropic", forwards=True),
        Endpoint("rerank", can_stream=False),
        Endpoint("score", can_stream=False),
        Endpoint("tokenize", can_stream=False, root_for=frozenset({"vllm", "llamacpp"})),
        Endpoint("detokenize", can_stream=False, root_for=frozenset({"vllm", "llamacpp"})),
        Endpoint("audio/transcriptions", body="multipart", stream="typed_sse",
                 terminal=frozenset({b"transcript.text.done", b"error"})),
        # OpenAI's translations do not stream.
        Endpoint("audio/translations", body="multipart", can_stream=False),
        Endpoint("audio/speech", stream="bytes", always_streams=True),
        Endpoint("images/generations", can_stream=False),
    )
}

# What each runtime serves when its provider entry has no ``endpoints:`` list.
_CORE = ("chat/completions", "completions", "embeddings")
DEFAULT_ENDPOINTS: dict[str, tuple[str, ...]] = {
    # count_tokens: vllm/entrypoints/anthropic/api_router.py (vLLM PR #35588, February 2026); an
    # older vLLM answers FastAPI's 404, which reaches the caller wrapped in Anthropic's shape.
    "vllm": (*_CORE, "responses", "messages", "messages/count_tokens", "rerank", "score", "tokenize", "detokenize",
             "audio/transcriptions", "audio/translations"),
    "sglang": (*_CORE, "responses", "rerank", "score", "tokenize", "detokenize"),
    "lemonade": (*_CORE, "responses", "rerank", "audio/transcriptions"),
    "ollama": (*_CORE, "responses", "messages"),
    "llamacpp": (*_CORE, "messages", "messages/count_tokens", "rerank", "tokenize", "detokenize"),
    # A hosted OpenAI-style API: what the OpenAI API itself serves. Proxies that speak more
    # (LiteLLM: messages, rerank) list their endpoints.
    "openai_api": (*_CORE, "responses", "audio/transcriptions", "audio/translations", "audio/speech",
                   "images/generations"),
    "cli": ("chat/completions", "completions"),
}

# Endpoints whose stored state lives on the provider that made it.
RESPONSES = "responses"
# The endpoints whose cut streams iop continues on another provider (api/continuation.py).
CHAT = "chat/completions"
COMPLETIONS = "completions"
