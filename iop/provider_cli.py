"""``iop provider drain|resume ID``: runtime control of a running iop over its admin
endpoints (``api/control.py``), with the stdlib's HTTP client like ``iop catalog``. The
provider's other commands (``disable``, ``enable``, ``capacity``, ``load``, ``unload``) are
overrides and orders, in ``iop/control_cli.py``.

``drain --wait`` polls ``GET /admin/providers/{id}`` until nothing runs on the provider any
more (``drained``): then it can be stopped or updated without cutting a request."""

from __future__ import annotations

import json
import sys
import time
import urllib.parse
from typing import Any

from iop.http_client import call, report

POLL_S = 0.5


def describe(doc: dict[str, Any]) -> str:
    """``gpu1: draining (2 running)``, ``gpu1: drained``, ``gpu1: open (1 running)``."""
    state = doc.get("drain") or "open"
    running = doc.get("in_flight", 0)
    return f"{doc['provider']}: {state}" + (f" ({running} running)" if running else "")


def main(action: str, provider_id: str, url: str, key: str | None, *, wait: bool = False,
         wait_timeout: float | None = None, as_json: bool = False) -> int:
    """``action``: ``drain`` | ``resume``. Exit status 0 done; 1 refused, unreachable, or
    resumed by someone else during ``--wait``; 3 ``--wait`` gave up (``wait_timeout``
    seconds) before the provider was drained."""
    base = f"/admin/providers/{urllib.parse.quote(provider_id, safe='')}"
    try:
        doc = call(url, "POST", f"{base}/{action}", key)
        print(json.dumps(doc) if as_json else describe(doc))
        if action != "drain" or not wait:
            return 0
        deadline = None if wait_timeout is None else time.monotonic() + wait_timeout
        shown = doc
        while doc.get("drain") != "drained":
            if deadline is not None and time.monotonic() >= deadline:
                print(f"{provider_id}: still {doc.get('drain') or 'open'} after {wait_timeout:g}s", file=sys.stderr)
                return 3
            time.sleep(POLL_S)
            doc = call(url, "GET", base, key)
            if doc != shown:
                print(json.dumps(doc) if as_json else describe(doc))
                shown = doc
            if doc.get("drain") is None:
                print(f"{provider_id}: resumed by someone else while waiting", file=sys.stderr)
                return 1
        return 0
    except OSError as exc:  # urllib's errors among them
        return report(url, base, exc)
