"""The operator commands' HTTP calls to a running iop (``iop catalog``, ``iop provider``):
the stdlib's client, a key as a bearer token, JSON back, and failures said in one line."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from typing import Any


def call(url: str, method: str, path: str, key: str | None, timeout: float = 10.0) -> dict[str, Any]:
    request = urllib.request.Request(url.rstrip("/") + path, method=method, data=b"" if method == "POST" else None)
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        doc: dict[str, Any] = json.load(resp)
    return doc


def report(url: str, path: str, exc: OSError) -> int:
    """Say on stderr why a call failed; the exit status (1)."""
    if isinstance(exc, urllib.error.HTTPError):
        print(f"{url}{path} answered {exc.code}: {exc.read()[:300].decode(errors='replace')}", file=sys.stderr)
    else:
        print(f"cannot reach {url}: {exc}", file=sys.stderr)
    return 1
