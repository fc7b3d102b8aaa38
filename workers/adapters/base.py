"""What every provider adapter offers the worker, and what it hands back.

An adapter runs one :class:`ProviderCall` and reports the answer to a :class:`Sink`:
``done()`` once for a JSON answer, or ``start()`` then ``chunks()`` as the provider
produces them for a streamed one. Failures are raised as
:class:`dispatcher.exceptions.ProviderError` subclasses: ``ProviderRejected`` for the
provider's own 4xx (passed through to the caller), ``ProviderTimeout`` when
``timeout_s`` runs out, ``ProviderUnreachable`` for everything else. Adapters never
rewrite model ids: the body already names the served target (the rewrite from
the caller's model id happens once, at dispatch).
"""

from __future__ import annotations

import abc
from typing import Protocol

import msgspec

from dispatcher.config import ProviderConfig

ENDPOINTS = ("chat/completions", "completions", "embeddings")


class ProviderCall(msgspec.Struct, frozen=True):
    endpoint: str  # one of ENDPOINTS
    body: bytes  # the caller's JSON body, its "model" already set to ``target``
    target: str
    stream: bool


class ProbeResult(msgspec.Struct, frozen=True):
    healthy: bool
    reason: str = ""
    # Model names the provider itself reports; None when it cannot say.
    models: list[str] | None = None
    # Models loaded in memory right now, where the runtime says (Ollama's /api/ps).
    loaded: list[str] | None = None


class Sink(Protocol):
    async def start(self, status: int) -> None:
        """A streamed answer begins (the provider accepted the request)."""

    async def chunks(self, payloads: list[bytes]) -> None:
        """SSE ``data:`` payloads of a streamed answer, in order, without ``[DONE]``."""

    async def done(self, status: int, body: bytes, content_type: str) -> None:
        """The whole answer of a non-streamed request."""


class Adapter(abc.ABC):
    def __init__(self, provider: ProviderConfig) -> None:
        self.provider = provider

    @abc.abstractmethod
    async def call(self, call: ProviderCall, sink: Sink) -> None:
        """Run the call to the end, or raise a ProviderError."""

    @abc.abstractmethod
    async def probe(self, timeout_s: float) -> ProbeResult:
        """A cheap check that the provider can take work."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release what the adapter holds."""
