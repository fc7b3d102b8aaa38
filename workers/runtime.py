"""What a config implies for one node's worker, and the adapters that outlive a reload.

:class:`NodeRuntime` is built once from (config, node): the node's part of the config and
the script calls its plans make. A reload (``SIGHUP``) builds a new one and the worker
swaps its one reference to it.

:class:`ProviderAdapters` are the node's provider adapters. They are not rebuilt by a
reload: an unchanged provider keeps its adapter (its connections, its CLI processes), a
changed or removed one is *retired* -- jobs already dispatched to it finish on it -- and
every adapter is closed at exit.
"""

from __future__ import annotations

from dataclasses import dataclass

from dispatcher.config import Config, NodeConfig, ProviderConfig
from dispatcher.plans import Plans
from dispatcher.script_calls import ScriptCalls
from dispatcher.scripts import Scripts
from workers.adapters.base import Adapter
from workers.adapters.factory import make_adapter
from workers.adapters.openai_http import HttpSession, new_session, session_size


@dataclass(frozen=True)
class NodeRuntime:
    """One config as one node's worker runs it."""

    config: Config
    node: NodeConfig
    calls: ScriptCalls

    @classmethod
    def build(cls, config: Config, node_id: str, scripts: Scripts) -> NodeRuntime | None:
        """None: the config has no node ``node_id``."""
        node = config.node(node_id)
        if node is None:
            return None
        return cls(config, node, ScriptCalls(scripts, config, Plans(config)))

    @property
    def providers(self) -> dict[str, ProviderConfig]:
        return {p.id: p for p in self.node.providers}

    def provider(self, provider_id: str) -> ProviderConfig | None:
        return next((p for p in self.node.providers if p.id == provider_id), None)


class ProviderAdapters:
    """The adapters of the node's providers (``current``) and those a reload replaced or
    whose provider it removed (``retired``): jobs already dispatched to them still run on
    them."""

    def __init__(self) -> None:
        self.current: dict[str, Adapter] = {}
        self.retired: dict[str, Adapter] = {}
        self._sessions: list[HttpSession] = []

    def open(self, node: NodeConfig) -> None:
        """An adapter for each of ``node``'s providers (in the running event loop)."""
        session = self._session_for(node)
        self.current = {p.id: make_adapter(p, session) for p in node.providers}

    def __contains__(self, provider_id: object) -> bool:
        return provider_id in self.current

    def __getitem__(self, provider_id: str) -> Adapter:
        return self.current[provider_id]

    def for_job(self, provider_id: str) -> Adapter | None:
        """The adapter a job dispatched to ``provider_id`` runs on: its current one, else
        the one a reload retired."""
        return self.current.get(provider_id) or self.retired.get(provider_id)

    def retire(self, provider_id: str) -> None:
        """A reload removed the provider: its adapter only finishes what it runs."""
        adapter = self.current.pop(provider_id, None)
        if adapter is not None:
            self.retired[provider_id] = adapter

    def add(self, provider: ProviderConfig, node: NodeConfig) -> None:
        """A provider a reload added to ``node``."""
        self.current[provider.id] = make_adapter(provider, self._session_for(node))

    def replace(self, provider: ProviderConfig, node: NodeConfig) -> None:
        """A provider a reload changed: a new adapter; running calls keep the old one."""
        self.retired[f"{provider.id}@{len(self.retired)}"] = self.current[provider.id]
        self.current[provider.id] = make_adapter(provider, self._session_for(node))

    async def aclose(self) -> None:
        for adapter in [*self.current.values(), *self.retired.values()]:
            await adapter.aclose()
        for session in self._sessions:
            await session.close()

    def _session_for(self, node: NodeConfig) -> HttpSession:
        """An HTTP session whose pool fits the node's capacity (a reload may have raised it)."""
        needed = sum(p.fixed_capacity for p in node.providers)
        if not self._sessions or session_size(self._sessions[-1]) < needed:
            self._sessions.append(new_session(needed))
        return self._sessions[-1]
