"""The adapter for a provider's type."""

from __future__ import annotations

from dispatcher.config import HTTP_TYPES, ProviderConfig
from workers.adapters.base import Adapter
from workers.adapters.cli import CliAdapter
from workers.adapters.openai_http import HttpSession, OpenAIHttpAdapter


def make_adapter(provider: ProviderConfig, session: HttpSession) -> Adapter:
    if provider.type in HTTP_TYPES:
        return OpenAIHttpAdapter(provider, session)
    if provider.type == "cli":
        return CliAdapter(provider)
    raise ValueError(f"no adapter for provider type {provider.type!r}")
