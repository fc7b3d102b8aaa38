"""The operator commands' HTTP calls to a running iop (``iop catalog``, ``iop provider``,
``iop model``, ``iop overrides``, ``iop audit``): the stdlib's client, a key as a bearer
token, a JSON body for a write that has one, JSON back, and failures said in one line."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from typing import Any

# Every call says it comes from the CLI: the audit log records where a control action came
# from (``via``: cli, http, reload, expiry), and the API cannot tell curl from iop otherwise.
VIA_HEADER = "X-IOP-Via"
VIA = "cli"
# How much of an answer that is not iop's JSON error body a failure quotes (an HTML page of
# a proxy in front, a traceback): enough to say what it is, not a screenful.
QUOTED_BYTES = 300


def call(url: str, method: str, path: str, key: str | None, timeout: float = 10.0,
         body: dict[str, Any] | None = None) -> dict[str, Any]:
    """``method path`` on the API at ``url``; its JSON answer. ``body`` goes as JSON; a POST
    without one sends an empty body (Content-Length 0, which some proxies require)."""
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    request = urllib.request.Request(url.rstrip("/") + path, method=method, data=data)
    if body is not None:
        request.add_header("Content-Type", "application/json")
    request.add_header(VIA_HEADER, VIA)
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        doc: dict[str, Any] = json.load(resp)
    return doc


def error_text(raw: bytes) -> str:
    """What an error answer says: iop's ``{"error": {"message", "code"}}`` as ``message
    (code)``, anything else as its first bytes."""
    try:
        error = json.loads(raw)["error"]
        message, code = error["message"], error.get("code")
    except (ValueError, KeyError, TypeError):
        return raw[:QUOTED_BYTES].decode(errors="replace")
    return f"{message} ({code})" if code else str(message)


def report(url: str, path: str, exc: OSError) -> int:
    """Say on stderr why a call failed; the exit status (1)."""
    if isinstance(exc, urllib.error.HTTPError):
        print(f"{url.rstrip('/')}{path} answered {exc.code}: {error_text(exc.read())}", file=sys.stderr)
    else:
        print(f"cannot reach {url}: {exc}", file=sys.stderr)
    return 1
