"""What a config implies for one node's worker, and the adapters that outlive a reload.

:class:`NodeRuntime` is built once from (config, node): the node's part of the config and
the script calls its plans make. A reload (``SIGHUP``) builds a new one and the worker
swaps its one reference to it.

:class:`ProviderAdapters` are the node's provider adapters. They are not rebuilt by a
reload: an unchanged provider keeps its adapter (its connections, its CLI processes), a
changed or removed one is *retired* -- jobs already dispatched to it finish on it, then it
is closed -- and every adapter is closed at exit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import anyio

from dispatcher.config import Config, NodeConfig, ProviderConfig
from dispatcher.plans import Plans
from dispatcher.script_calls import ScriptCalls
from dispatcher.scripts import Scripts
from workers.adapters.base import Adapter
from workers.adapters.factory import make_adapter
from workers.adapters.openai_http import HttpSession, new_session, session_size
from workers.leases import RunKey, Runs


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


@dataclass
class Retired:
    """An adapter a reload took out of ``current``, kept for the runs that may still use it."""

    provider_id: str
    adapter: Adapter
    since: float  # monotonic seconds when it was retired
    runs: set[RunKey]  # the runs of its provider that may be calling it
    # Its provider left the config: a job of it read later (dispatched before the reload's
    # mark landed) runs on it too (``for_job``). False for one a change replaced.
    removed: bool


class ProviderAdapters:
    """The adapters of the node's providers (``current``) and those a reload replaced or
    whose provider it removed (``retired``): jobs already dispatched to them still run on
    them. A retired adapter is closed and dropped (:meth:`close_idle`) once none of the runs
    that may use it is left and it was retired at least ``keep_s`` ago (time for a job
    dispatched to a removed provider before the reload to be read from the node stream).
    ``runs``: the worker's runs (None: none is ever known to run)."""

    def __init__(self, runs: Runs | None = None, keep_s: float = 0.0) -> None:
        self.current: dict[str, Adapter] = {}
        self.retired: list[Retired] = []
        self._runs = runs
        self._keep_s = keep_s
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
        the one a reload retired when it removed the provider."""
        found = self.current.get(provider_id)
        if found is not None:
            return found
        return next((r.adapter for r in reversed(self.retired) if r.removed and r.provider_id == provider_id), None)

    def retire(self, provider_id: str) -> None:
        """A reload removed the provider: its adapter only finishes what it runs."""
        adapter = self.current.pop(provider_id, None)
        if adapter is not None:
            self.retired.append(Retired(provider_id, adapter, time.monotonic(), self._running(provider_id), True))

    def add(self, provider: ProviderConfig, node: NodeConfig) -> None:
        """A provider a reload added to ``node`` (perhaps again: jobs of it read from now on
        run on the new adapter, not on the one retired when it was removed)."""
        for r in self.retired:
            if r.removed and r.provider_id == provider.id:
                r.removed = False
                r.runs |= self._running(provider.id)
        self.current[provider.id] = make_adapter(provider, self._session_for(node))

    def replace(self, provider: ProviderConfig, node: NodeConfig) -> None:
        """A provider a reload changed: a new adapter; running calls keep the old one."""
        old = self.current[provider.id]
        self.retired.append(Retired(provider.id, old, time.monotonic(), self._running(provider.id), False))
        self.current[provider.id] = make_adapter(provider, self._session_for(node))

    async def close_idle(self) -> int:
        """Close and drop the retired adapters no run may use any more; how many."""
        now = time.monotonic()
        idle = []
        for r in self.retired:
            if r.removed:
                r.runs |= self._running(r.provider_id)  # read since it was retired (for_job)
            r.runs = {key for key in r.runs if self._runs is not None and self._runs.get(key) is not None}
            if not r.runs and now - r.since >= self._keep_s:
                idle.append(r)
        for r in idle:
            self.retired.remove(r)
            await r.adapter.aclose()
        return len(idle)

    async def run(self, period_s: float) -> None:
        """:meth:`close_idle` every ``period_s``, for good."""
        while True:
            await anyio.sleep(period_s)
            await self.close_idle()

    def _running(self, provider_id: str) -> set[RunKey]:
        if self._runs is None:
            return set()
        return {r.key for r in self._runs if r.job.provider == provider_id}

    async def aclose(self) -> None:
        for adapter in [*self.current.values(), *(r.adapter for r in self.retired)]:
            await adapter.aclose()
        for session in self._sessions:
            await session.close()

    def _session_for(self, node: NodeConfig) -> HttpSession:
        """An HTTP session whose pool fits the node's capacity (a reload may have raised it)."""
        needed = sum(p.fixed_capacity for p in node.providers)
        if not self._sessions or session_size(self._sessions[-1]) < needed:
            self._sessions.append(new_session(needed))
        return self._sessions[-1]
