"""One loop per provider of a node: the shape the worker's per-provider parts share
(``ProviderState``, ``CapacityControl``, ``ModelLifecycle``).

``run`` starts a loop for each provider of the node in force and waits until ``stop``; a
reload starts one for a provider it added or changed (``start``, afresh) and ends the loop of
one it removed (``forget``). A part says which providers it runs a loop for (``wants``), what
a loop does (``_loop``, inside the cancel scope it is given) and what it forgets of a
provider besides its loop (``_forgotten``).
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import anyio
from anyio.abc import TaskGroup

from dispatcher.config import ProviderConfig
from workers.runtime import NodeRuntime


class ProviderLoops(abc.ABC):
    def __init__(self, runtime: Callable[[], NodeRuntime]) -> None:
        self._runtime = runtime
        self._stopped = False
        self._scope: anyio.CancelScope | None = None
        self._tg: TaskGroup | None = None
        self._scopes: dict[str, anyio.CancelScope] = {}

    async def run(self) -> None:
        """A loop for each provider of the node, until :meth:`stop`; a reload may start more."""
        self._scope = anyio.CancelScope()
        if self._stopped:
            self._scope.cancel()
        with self._scope:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                for provider in self._runtime().node.providers:
                    self.start(provider.id)
                await anyio.sleep_forever()

    def stop(self) -> None:
        """Every loop ends (the worker shuts down)."""
        self._stopped = True
        if self._scope is not None:
            self._scope.cancel()

    def start(self, provider_id: str) -> None:
        """The provider's loop, afresh (one a reload added or changed); none for a provider
        this part does not want."""
        if self._tg is None:
            return
        self.forget(provider_id)
        provider = self._runtime().provider(provider_id)
        if provider is None or not self.wants(provider):
            return
        self._scopes[provider_id] = scope = anyio.CancelScope()
        self._tg.start_soon(self._loop, provider_id, scope)

    def forget(self, provider_id: str) -> None:
        """Its loop ends and nothing of it is kept (a reload removed it, or starts it afresh)."""
        scope = self._scopes.pop(provider_id, None)
        if scope is not None:
            scope.cancel()
        self._forgotten(provider_id)

    def wants(self, provider: ProviderConfig) -> bool:
        """Whether this part runs a loop for ``provider``."""
        return True

    def _forgotten(self, provider_id: str) -> None:
        """What it kept of the provider besides its loop, dropped (nothing, unless a part keeps
        something)."""
        return None

    @abc.abstractmethod
    async def _loop(self, provider_id: str, scope: anyio.CancelScope) -> None: ...
