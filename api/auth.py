"""Keys: ``Authorization: Bearer <key>`` (or ``x-api-key: <key>``, as Anthropic's clients
send it).

Caller keys -- the named ``api.keys`` (each one a tenant) and those of
``api.api_keys_env`` (tenant ``default``) -- guard ``/v1/*``: :class:`CallerKeys` finds a
request's tenant (``dispatcher/tenants.py`` holds what a tenant may do). Admin keys
(``api.admin_keys_env``) guard the operator surfaces ``/catalog`` and ``/metrics`` (the
``/ui`` page itself holds no data and asks for a key when ``/catalog`` wants one). Without
admin keys the operator surfaces take the caller keys; with neither, everything is open.
``/healthz`` and ``/readyz`` are always open.

Admin keys may be named, ``name:key``: the audit of control actions names who acted by it
(``KeyGuard.name_of``). Runtime control (drain, overrides: ``api/control.py``) is stricter, because it acts on the
whole fleet: the admin keys decide, from anywhere; without them a caller key never
suffices, and an API without any key answers only clients on this machine's loopback --
Redis's protected mode. The peer is the socket's, never ``X-Forwarded-For``: a header is
the client's word, and behind a load balancer the peer is the balancer, so control through
it needs admin keys.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from dispatcher.config import DEFAULT_TENANT, ApiConfig, Config
from dispatcher.exceptions import AdminKeyRequired, Unauthorized
from dispatcher.tenants import Tenant, Tenants

log = logging.getLogger("iop.auth")

MISSING_KEY = "Incorrect or missing API key (Authorization: Bearer <key>, or x-api-key)"


class CallerKeys:
    """The tenant a request's caller key names (and, behind a load balancer that sets it,
    the trusted tenant header)."""

    def __init__(self, config: Config, tenants: Tenants) -> None:
        api = config.api
        self.tenants = tenants
        self.header = api.tenant_header.lower() if api.tenant_header else None
        self.open = not api.api_keys_env and not api.keys
        # sha256(key) -> tenant name. Presented keys are hashed first, so looking the digest
        # up says nothing useful about any key through its timing.
        self._digests: dict[bytes, str] = {}
        for key in api.keys:
            if key.key_sha256:
                self._digests[bytes.fromhex(key.key_sha256)] = key.name
            elif key.key_env:
                value = os.environ.get(key.key_env, "").strip()
                if value:
                    self._digests[_digest(value.encode())] = key.name
                else:
                    log.warning("tenant %s has no key: environment variable %s is unset or empty", key.name,
                                key.key_env)
        if api.api_keys_env:
            for value in os.environ.get(api.api_keys_env, "").split(","):
                if value.strip():
                    self._digests.setdefault(_digest(value.strip().encode()), DEFAULT_TENANT)

    def tenant_of(self, headers: Mapping[str, str]) -> Tenant:
        """The tenant of a request; Unauthorized without a known key."""
        tenant = self.tenants.default if self.open else self._by_key(headers)
        if self.header is not None and (named := headers.get(self.header)):
            # Only behind a load balancer that sets it: the header names the tenant.
            found = self.tenants.by_name.get(named)
            if found is None:
                raise Unauthorized(f"Unknown tenant {named!r} in {self.header}")
            tenant = found
        return tenant

    def _by_key(self, headers: Mapping[str, str]) -> Tenant:
        presented = presented_key(headers)
        name = self._digests.get(_digest(presented)) if presented else None
        if name is None:
            raise Unauthorized(MISSING_KEY)
        return self.tenants.by_name[name]


def presented_key(headers: Mapping[str, str]) -> bytes:
    """The key of ``Authorization: Bearer <key>``, else of ``x-api-key`` (Anthropic's clients); b"" if none."""
    scheme, _sep, token = headers.get("authorization", "").partition(" ")
    presented = token.strip() if scheme.lower() == "bearer" else ""
    return (presented or headers.get("x-api-key", "").strip()).encode()


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def load_keys(env_name: str | None) -> list[bytes] | None:
    """The accepted keys; None when the API is open. A named but empty variable opens nothing."""
    if not env_name:
        return None
    return [k.strip().encode() for k in os.environ.get(env_name, "").split(",") if k.strip()]


_KEY_NAME = re.compile(r"^([A-Za-z0-9_.-]{1,64}):(.+)$")


def named_keys(entries: list[bytes]) -> tuple[list[bytes], dict[bytes, str]]:
    """Admin keys as ``api.admin_keys_env`` lists them -- ``name:key``, or a bare key -- and
    the name the audit log gives each (a bare key's: ``key-`` and the first 8 hex digits of
    its sha256, which names it without giving it away)."""
    keys: list[bytes] = []
    names: dict[bytes, str] = {}
    for entry in entries:
        m = _KEY_NAME.match(entry.decode(errors="replace"))
        key = m.group(2).encode() if m else entry
        keys.append(key)
        names[key] = m.group(1) if m else f"key-{hashlib.sha256(key).hexdigest()[:8]}"
    return keys, names


class KeyGuard:
    """The operator surfaces' guard: the admin keys, or else any caller key."""

    def __init__(self, keys: list[bytes] | None, callers: CallerKeys | None = None) -> None:
        self.keys: list[bytes] | None = None
        self.names: dict[bytes, str] = {}
        if keys is not None:
            self.keys, self.names = named_keys(keys)
        self.callers = callers

    def name_of(self, headers: Mapping[str, str]) -> str:
        """Who a control call is, for the audit log: its admin key's name (never the key),
        or ``loopback`` on an API without admin keys (only loopback clients get that far)."""
        if self.keys is None:
            return "loopback"
        return self.names.get(presented_key(headers), "unknown")

    # Async on purpose: Litestar runs a sync guard in a worker thread, which cost a fifth
    # of the API's CPU per request.
    async def __call__(self, connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        self.check(connection.headers)

    def check(self, headers: Mapping[str, str]) -> None:
        if self.keys is None:
            if self.callers is not None:
                self.callers.tenant_of(headers)
            return
        presented = presented_key(headers)
        # Compare against every key, whatever matches, so timing says nothing about which.
        ok = False
        for key in self.keys:
            ok |= hmac.compare_digest(presented, key)
        if not ok or not presented:
            raise Unauthorized(MISSING_KEY)

    def check_control(self, headers: Mapping[str, str], peer: str | None) -> None:
        """Runtime control (``api/control.py``): as :meth:`check`, but never on a caller key --
        a caller must not take providers out of the pool -- and, on an API without any key,
        only for a ``peer`` (the client's IP address, as the socket has it) on loopback."""
        self.check(headers)
        if self.keys is not None:
            return
        if self.callers is not None and not self.callers.open:
            raise AdminKeyRequired(
                "Runtime control (drain, resume, overrides, loads) needs an admin key, and a caller key never is one: "
                "set api.admin_keys_env to an environment variable holding comma-separated admin keys"
            )
        if not is_loopback(peer):
            raise AdminKeyRequired(
                f"Runtime control (drain, resume, overrides, loads) from {peer or 'an unknown address'} needs an "
                "admin key: without admin keys only clients on this machine's loopback (127.0.0.1, ::1) may, "
                "and a load balancer in front counts as a remote client. Set api.admin_keys_env to an environment "
                "variable holding comma-separated admin keys, and send one as Authorization: Bearer <key>"
            )


def admin_guard(admin_keys_env: str | None, callers: CallerKeys) -> KeyGuard:
    return KeyGuard(load_keys(admin_keys_env)) if admin_keys_env else KeyGuard(None, callers)


def is_loopback(host: str | None) -> bool:
    """Whether a peer address is on this machine's loopback: 127.0.0.0/8 or ::1, also as an
    IPv4-mapped IPv6 address (``::ffff:127.0.0.1``: how a dual-stack socket shows an IPv4
    client). No address -- a unix socket, or a peer the server could not name -- and
    anything that is not an IP address is not: the rule fails closed."""
    if not host:
        return False
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def listens_on_loopback(host: str) -> bool:
    """Whether a server bound to ``host`` is reachable from this machine only. A name other
    than ``localhost`` may resolve anywhere, so it counts as the network."""
    return host == "localhost" or is_loopback(host)


def exposure_notes(api: ApiConfig, host: str) -> list[tuple[int, str]]:
    """What an API bound to ``host`` with these keys leaves open, as (log level, message):
    logged once when it starts (``iop/serve.py``)."""
    notes: list[tuple[int, str]] = []
    open_api = not api.api_keys_env and not api.keys
    if open_api and not api.admin_keys_env and not listens_on_loopback(host):
        notes.append((logging.WARNING, (
            f"the API listens on {host}, beyond loopback, with no keys: anyone who reaches it can call every "
            "model and read /catalog and /metrics. Set api.api_keys_env (or api.keys) for callers and "
            "api.admin_keys_env for operators, or listen on 127.0.0.1"
        )))
    if api.admin_keys_env:
        return notes
    if open_api:
        notes.append((logging.INFO, (
            "no admin keys (api.admin_keys_env): draining and resuming providers answer loopback clients only "
            "(127.0.0.0/8, ::1), so not through a load balancer; set api.admin_keys_env to control them from "
            "elsewhere"
        )))
    else:
        notes.append((logging.INFO, (
            "no admin keys (api.admin_keys_env): draining and resuming providers are refused to everyone, since "
            "a caller key never suffices; set api.admin_keys_env to use them"
        )))
    return notes
