"""Keys: ``Authorization: Bearer <key>`` (or ``x-api-key: <key>``, as Anthropic's clients
send it).

Caller keys -- the named ``api.keys`` (each one a tenant) and those of
``api.api_keys_env`` (tenant ``default``) -- guard ``/v1/*``: ``dispatcher/tenants.py``
finds a request's tenant. Admin keys (``api.admin_keys_env``) guard the operator
surfaces ``/catalog`` and ``/metrics`` (the ``/ui`` page itself holds no data and asks
for a key when ``/catalog`` wants one). Without admin keys the operator surfaces take
the caller keys; with neither, everything is open. ``/healthz`` and ``/readyz`` are
always open.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from dispatcher.exceptions import AdminKeyRequired, Unauthorized
from dispatcher.tenants import Tenants, presented_key


def load_keys(env_name: str | None) -> list[bytes] | None:
    """The accepted keys; None when the API is open. A named but empty variable opens nothing."""
    if not env_name:
        return None
    return [k.strip().encode() for k in os.environ.get(env_name, "").split(",") if k.strip()]


class KeyGuard:
    """The operator surfaces' guard: the admin keys, or else any caller key."""

    def __init__(self, keys: list[bytes] | None, tenants: Tenants | None = None) -> None:
        self.keys = keys
        self.tenants = tenants

    # Async on purpose: Litestar runs a sync guard in a worker thread, which cost a fifth
    # of the API's CPU per request.
    async def __call__(self, connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        self.check(connection.headers)

    def check(self, headers: Mapping[str, str]) -> None:
        if self.keys is None:
            if self.tenants is not None:
                self.tenants.of(headers)
            return
        presented = presented_key(headers)
        # Compare against every key, whatever matches, so timing says nothing about which.
        ok = False
        for key in self.keys:
            ok |= hmac.compare_digest(presented, key)
        if not ok or not presented:
            raise Unauthorized("Incorrect or missing API key (Authorization: Bearer <key>, or x-api-key)")

    def check_control(self, headers: Mapping[str, str]) -> None:
        """Runtime control (``api/control.py``): as :meth:`check`, but never on a caller key --
        a caller must not take providers out of the pool. An API without any key stays open."""
        self.check(headers)
        if self.keys is None and self.tenants is not None and not self.tenants.open:
            raise AdminKeyRequired("Draining and resuming providers needs an admin key: set api.admin_keys_env")


def admin_guard(admin_keys_env: str | None, tenants: Tenants) -> KeyGuard:
    return KeyGuard(load_keys(admin_keys_env)) if admin_keys_env else KeyGuard(None, tenants)
