"""What every provider adapter offers the worker, and what it hands back.

An adapter runs one :class:`ProviderCall` and reports the answer to a :class:`Sink`:
``done()`` once for a JSON answer, or ``start()`` then ``chunks()`` as the provider
produces them for a streamed one; before either ends, ``usage()`` with the tokens the
provider reported, when it did (``workers/usage.py``). Failures are raised as
:class:`dispatcher.exceptions.ProviderError` subclasses: ``ProviderRejected`` for the
provider's own error status (passed through to the caller, its body in the endpoint's error
shape; ``retry_elsewhere`` for the statuses another provider may not share),
``ProviderTimeout`` when ``timeout_s`` runs out, ``ProviderUnreachable`` for everything else. Adapters never
rewrite model ids: the body already names the served target (the rewrite from
the caller's model id happens once, at dispatch).

Upstream headers a caller relies on pass through from an allow-list (:func:`passed_headers`);
hop-by-hop headers never do.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping
from typing import Protocol

import msgspec

from dispatcher.config import ProviderConfig
from dispatcher.endpoints import ENDPOINTS, Endpoint
from dispatcher.envelope import JSON
from dispatcher.events import Usage

# retry-after-ms and x-should-retry steer the OpenAI and Anthropic SDKs' own retries.
_PASSED = frozenset({"x-request-id", "request-id", "retry-after", "retry-after-ms", "x-should-retry"})
_PASSED_PREFIXES = ("openai-", "x-ratelimit-", "anthropic-")


def passed_headers(headers: Iterable[tuple[str, str]]) -> dict[str, str]:
    """The upstream answer's headers that go on to the caller."""
    out = {}
    for name, value in headers:
        low = name.lower()
        if low in _PASSED or low.startswith(_PASSED_PREFIXES):
            out[low] = value
    return out


class ProviderCall(msgspec.Struct, frozen=True):
    endpoint: str  # a name of dispatcher/endpoints.py
    body: bytes  # the caller's body, its model already set to ``target``
    target: str
    stream: bool
    method: str = "POST"
    path: str = ""  # under /v1 when not the endpoint's own (responses/{id}/cancel)
    content_type: str = JSON
    headers: Mapping[str, str] = {}
    # iop, not the caller, asked the stream for its usage: the usage-only chunk stays out
    # of the answer (workers/usage.py).
    usage_asked: bool = False

    @property
    def spec(self) -> Endpoint:
        return ENDPOINTS[self.endpoint]

    def upstream_path(self, provider_type: str) -> str:
        if self.path:
            return f"/v1/{self.path}"
        return self.spec.upstream_path(provider_type)


class ProbeResult(msgspec.Struct, frozen=True):
    healthy: bool
    reason: str = ""
    # Model names the provider itself reports; None when it cannot say.
    models: list[str] | None = None
    # Models loaded in memory right now, where the runtime says (Ollama's /api/ps).
    loaded: list[str] | None = None
    # Parallel slots the runtime reports (llama.cpp's /props total_slots, or /slots): shown
    # beside the capacity, and where a learned capacity starts (workers/capacity_control.py);
    # never a limit itself.
    slots: int | None = None


class Sink(Protocol):
    async def start(
        self, status: int, content_type: str = "text/event-stream", headers: Mapping[str, str] | None = None
    ) -> None:
        """A streamed answer begins (the provider accepted the request)."""

    async def chunks(self, payloads: list[bytes]) -> None:
        """Pieces of a streamed answer, in order: SSE payloads without ``[DONE]`` (typed
        ones as ``name\\ndata``), or raw bytes (dispatcher/endpoints.py)."""

    async def done(
        self, status: int, body: bytes, content_type: str, headers: Mapping[str, str] | None = None
    ) -> None:
        """The whole answer of a non-streamed request."""

    def ended(self, upstream_done: bool) -> None:
        """A stream ended properly; ``upstream_done``: the provider sent ``[DONE]``."""

    def usage(self, usage: Usage) -> None:
        """The answer's tokens as the provider reported them (before ``done``/``ended``)."""


class Adapter(abc.ABC):
    def __init__(self, provider: ProviderConfig) -> None:
        self.provider = provider

    @abc.abstractmethod
    async def call(self, call: ProviderCall, sink: Sink) -> None:
        """Run the call to the end, or raise a ProviderError."""

    @abc.abstractmethod
    async def probe(self, timeout_s: float) -> ProbeResult:
        """A cheap check that the provider can take work (asked while it runs nothing)."""

    async def probe_while_busy(self, timeout_s: float) -> ProbeResult | None:
        """A check that cannot disturb the requests the provider is running: its health
        alone (``models`` and the rest unset). None when the adapter knows no such check;
        the provider's traffic is then its only health signal while it is busy."""
        return None

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release what the adapter holds."""
