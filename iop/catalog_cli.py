"""``iop catalog``: the provider catalog of a running iop as a terminal table."""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any

GREEN, RED, YELLOW, DIM, BOLD, RESET = "\033[32m", "\033[31m", "\033[33m", "\033[2m", "\033[1m", "\033[0m"
HEALTH_COLOUR = {"available": GREEN, "unavailable": RED, "unknown": YELLOW}
BAR_WIDTH = 10


def fetch(url: str, key: str | None, timeout: float = 10.0) -> dict[str, Any]:
    request = urllib.request.Request(url.rstrip("/") + "/catalog")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        doc: dict[str, Any] = json.load(resp)
    return doc


def bar(in_flight: int, capacity: int) -> str:
    filled = BAR_WIDTH if capacity <= 0 else min(BAR_WIDTH, round(BAR_WIDTH * in_flight / capacity))
    return "█" * filled + "░" * (BAR_WIDTH - filled)


def render(doc: dict[str, Any], colour: bool) -> str:
    def paint(text: str, code: str) -> str:
        return f"{code}{text}{RESET}" if colour else text

    providers = {p["id"]: p for p in doc["providers"]}
    headers = ["PROVIDER", "TYPE", "CATEGORY", "HEALTH", "LOAD", "QUEUED", "MODELS"]
    rows: list[tuple[str, list[str], list[str | None]]] = []
    for node in doc["nodes"]:
        for pid in node["providers"]:
            p = providers[pid]
            ratio = "-" if p["load_ratio"] is None else f"{p['load_ratio']:.2f}"
            models = ", ".join(m + (" (not offered)" if m in p["missing_models"] else "") for m in p["models"])
            cells = [p["id"], p["type"], p["category"], p["health"],
                     f"{bar(p['in_flight'], p['capacity'])} {p['in_flight']}/{p['capacity']} {ratio}",
                     str(p["queued"]), models]
            codes: list[str | None] = [None, None, None, HEALTH_COLOUR.get(p["health"]), None, None, None]
            rows.append((node["id"], cells, codes))
    widths = [max([len(h)] + [len(r[1][i]) for r in rows]) for i, h in enumerate(headers)]

    lines: list[str] = []
    current = None
    for node_id, cells, codes in rows:
        if node_id != current:
            current = node_id
            lines.append(paint(f"node {node_id}", BOLD))
            lines.append("  " + "  ".join(paint(h.ljust(w), DIM) for h, w in zip(headers, widths, strict=True)))
        padded = [c.ljust(w) for c, w in zip(cells, widths, strict=True)]
        lines.append("  " + "  ".join(paint(c, code) if code else c
                                      for c, code in zip(padded, codes, strict=True)).rstrip())
        reason = providers[cells[0]]["reason"]
        if reason:
            lines.append("    " + paint(reason, DIM))
    lines.append("")
    lines.append(paint("model groups", BOLD))
    for m in doc["models"]:
        wait = "-" if m["oldest_wait_ms"] is None else f"{m['oldest_wait_ms'] / 1000:.1f}s"
        lines.append(f"  {m['id']} ({m['display_name']}): queued {m['queued']}, oldest wait {wait}, "
                     f"free slots {m['available_slots']}")
        for c in m["candidates"]:
            lines.append(f"    {c['provider']} -> {c['served_name']}  "
                         f"{paint(c['health'], HEALTH_COLOUR.get(c['health'], ''))}  "
                         f"{c['in_flight']}/{c['capacity']}")
    return "\n".join(lines)


def main(url: str, as_json: bool, key_env: str, colour: bool | None) -> int:
    try:
        doc = fetch(url, os.environ.get(key_env))
    except urllib.error.HTTPError as exc:
        print(f"{url}/catalog answered {exc.code}: {exc.read()[:300].decode(errors='replace')}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"cannot reach {url}: {exc}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(doc, indent=2))
        return 0
    if colour is None:
        colour = sys.stdout.isatty() and "NO_COLOR" not in os.environ
    print(render(doc, colour))
    return 0
