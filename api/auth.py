"""Keys: ``Authorization: Bearer <key>`` checked in constant time.

Two sets: caller keys (``api.api_keys_env``) guard ``/v1/*``; admin keys
(``api.admin_keys_env``) guard the operator surfaces ``/catalog`` and ``/metrics``
(the ``/ui`` page itself holds no data and asks for a key when ``/catalog`` wants
one). Without admin keys the operator surfaces take the caller keys; with neither,
everything is open. ``/healthz`` and ``/readyz`` are always open.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from dispatcher.exceptions import Unauthorized


def admin_keys(api_keys_env: str | None, admin_keys_env: str | None) -> list[bytes] | None:
    return load_keys(admin_keys_env) if admin_keys_env else load_keys(api_keys_env)


def load_keys(env_name: str | None) -> list[bytes] | None:
    """The accepted keys; None when the API is open. A named but empty variable opens nothing."""
    if not env_name:
        return None
    return [k.strip().encode() for k in os.environ.get(env_name, "").split(",") if k.strip()]


class KeyGuard:
    def __init__(self, keys: list[bytes] | None) -> None:
        self.keys = keys

    # Async on purpose: Litestar runs a sync guard in a worker thread, which cost a fifth
    # of the API's CPU per request. The request path calls check() itself instead: a
    # guard also costs a copy of the route handler per call.
    async def __call__(self, connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        self.check(connection.headers)

    def check(self, headers: Mapping[str, str]) -> None:
        if self.keys is None:
            return
        header = headers.get("authorization", "")
        scheme, _sep, token = header.partition(" ")
        presented = token.strip().encode() if scheme.lower() == "bearer" else b""
        # Compare against every key, whatever matches, so timing says nothing about which.
        ok = False
        for key in self.keys:
            ok |= hmac.compare_digest(presented, key)
        if not ok or not presented:
            raise Unauthorized("Incorrect or missing API key (Authorization: Bearer <key>)")
