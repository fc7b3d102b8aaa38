"""``iop catalog``: the provider catalog of a running iop as a terminal table.

One row per provider, grouped by node; under it, its probe's reason (when it has one) and
the endpoints it serves, short names on one line (``chat`` for ``chat/completions``,
``speech`` for ``audio/speech``...) wrapped to fit :data:`WIDTH` columns. The load column
shows ``in_flight/capacity`` and, when the runtime reports a different number of parallel
slots (llama.cpp), that hint: ``1/4 (slots 8)``. The health column also says when an
operator drained the provider (``iop provider drain``): ``available (draining)``, then
``available (drained)`` once nothing runs on it, and when one disabled it (``iop provider
disable``): ``available (disabled)``; a model group's candidate lines say the same.

An operator's override (``iop provider capacity``, ``iop model fallbacks``...: the catalog's
``override`` fields) has a line of its own under the provider or model group it acts on,
with the effective value, the config's, who set it and until when, if it lapses:
``capacity 2 (override by ops, config 6, until 14:03 UTC, 59m left)``.

With flow control, a table of the tenants (band, weight, jobs waiting and running, limits)
follows the providers when there is more than the ``default`` tenant, and each model group
lists the tenants with jobs waiting or running in it. A tenant with rate limits or a budget
(``api.keys[].limits``) has a line under its row: what it used of each window, ``used/limit``
(``-`` for a window it has no limit in), and the requests refused so far, by reason:
``rate limits: requests/min 12/60, tokens/min -, tokens/day 51200/1000000; refused 3 requests,
0 tokens, 1 budget``.

The CACHE column is the share of a provider's prompt tokens it served from its prefix cache
(``-`` while it reported none). A model group with cache-aware dispatch has a line under it:
its mode, load bound, the prompt blocks its prefix index holds of its maximum, and its
decisions since Redis started, with the share of hits:
``affinity prefix: bound 1.25, index 120/10000 blocks, hit 30, miss 8, spill 2 (75% hits)``."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from iop.http_client import call, report

GREEN, RED, YELLOW, DIM, BOLD, RESET = "\033[32m", "\033[31m", "\033[33m", "\033[2m", "\033[1m", "\033[0m"
HEALTH_COLOUR = {"available": GREEN, "unavailable": RED, "unknown": YELLOW}
BAR_WIDTH = 10
WIDTH = 120
# Short names of the endpoints whose name has a prefix (the others are short already).
SHORT_ENDPOINTS = {
    "chat/completions": "chat",
    "messages/count_tokens": "count_tokens",
    "audio/transcriptions": "transcriptions",
    "audio/translations": "translations",
    "audio/speech": "speech",
    "images/generations": "images",
}


def fetch(url: str, key: str | None, timeout: float = 10.0) -> dict[str, Any]:
    return call(url, "GET", "/catalog", key, timeout)


def bar(in_flight: int, capacity: int) -> str:
    filled = BAR_WIDTH if capacity <= 0 else min(BAR_WIDTH, round(BAR_WIDTH * in_flight / capacity))
    return "█" * filled + "░" * (BAR_WIDTH - filled)


def capacity_text(p: dict[str, Any]) -> str:
    """``in_flight/capacity``, with the runtime's own slot count when it says one that differs,
    ``auto`` for a learned capacity, and the load other clients put on it."""
    slots = p.get("slots")
    hint = f" (slots {slots})" if slots is not None and slots != p["capacity"] else ""
    auto = " auto" if p.get("capacity_mode") == "auto" else ""
    external = f" +{p['external_load']} others" if p.get("external_load") else ""
    return f"{p['in_flight']}/{p['capacity']}{auto}{hint}{external}"


def load_lines(p: dict[str, Any]) -> list[str]:
    """Under a provider: why its learned capacity last moved, its engine's own load, a rate limit."""
    lines = []
    if p.get("capacity_mode") == "auto" and p.get("capacity_reason"):
        bounds = p.get("capacity_bounds") or []
        lines.append(f"capacity learned ({'-'.join(map(str, bounds))}): {p['capacity_reason']}")
    engine = p.get("engine")
    if engine:
        kv = f", KV {engine['kv_usage'] * 100:.0f}%" if engine.get("kv_usage") is not None else ""
        running = "-" if engine.get("running") is None else engine["running"]
        waiting = "-" if engine.get("waiting") is None else engine["waiting"]
        lines.append(f"engine: {running} running, {waiting} waiting{kv} ({engine['age_ms'] / 1000:.1f}s old)")
    if p.get("rate_limited"):
        lines.append(f"rate limited: {p['rate_limited']['reason']}")
    return lines


def lifecycle_lines(p: dict[str, Any]) -> list[str]:
    """A managed provider's models (docs/PROVIDERS.md "Models that load and unload"): how many
    it holds of how many it may, the load under way, then each model's state in its runtime,
    its loads and its failed loads, a line each."""
    if p.get("lifecycle") != "managed":
        return []
    states = p.get("models_state") or {}
    held = [m for m, s in states.items() if s["state"] in ("loaded", "loading")]
    head = f"models held: {len(held)} of {p.get('max_loaded') or '?'}"
    if p.get("loading"):
        head += f"; loading {p['loading']}"
    lines = [head]
    for m, s in states.items():
        parts = [s["state"]]
        if s.get("load_s") is not None:
            parts.append(f"loads take {s['load_s']:.1f} s")
        loads = s.get("loads") or {}
        if loads:
            parts.append("loaded " + ", ".join(f"{n}x by {why}" for why, n in sorted(loads.items())))
        if s.get("failure"):
            parts.append(f"last load failed: {s['failure']}")
        lines.append(f"{m}: " + "; ".join(parts))
    return lines


def ms_text(ms: float) -> str:
    return f"{ms / 1000:.2f}s" if ms >= 1000 else f"{ms:.0f}ms"


def live_text(window: str, v: dict[str, Any]) -> str:
    """One window of a provider's live figures: ``5m: 120 req, 2 err (5xx 2), ttft p50 80ms p90
    210ms, e2e p50 1.20s p90 2.31s, 41 tok/s, up 99.8%``; a figure it has nothing for is left out."""
    parts = [f"{window}: {v['requests']} req"]
    errors = v.get("errors") or {}
    if errors:
        parts.append(f"{sum(errors.values())} err (" + ", ".join(f"{k} {n}" for k, n in errors.items()) + ")")
    for label, field in (("ttft", "ttft_ms"), ("e2e", "e2e_ms")):
        pct = v.get(field)
        if pct:
            parts.append(f"{label} p50 {ms_text(pct['p50'])} p90 {ms_text(pct['p90'])}")
    if v.get("tokens_per_s") is not None:
        parts.append(f"{v['tokens_per_s']:.0f} tok/s")
    if v.get("uptime") is not None:
        parts.append(f"up {v['uptime'] * 100:.1f}%")
    return ", ".join(parts)


def live_lines(p: dict[str, Any]) -> list[str]:
    """A provider's live figures (absent from an older iop's catalog): each window that has
    seen a request or a heartbeat."""
    windows = p.get("live") or {}
    shown = [live_text(w, v) for w, v in windows.items() if v.get("requests") or v.get("uptime") is not None]
    return ["live " + "; ".join(shown)] if shown else []


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f}"


def telemetry_text(node: dict[str, Any]) -> str:
    """A node's host and devices, as its freshest worker reported them; '-' where nothing did."""
    t = node.get("telemetry")
    if not t:
        return "telemetry: no worker reports"
    cpu, mem = t.get("cpu"), t.get("memory")
    cpu_text = "-" if not cpu or cpu.get("utilization") is None else f"{cpu['utilization']:.0%}"
    parts = [f"cpu {cpu_text}" + (f" of {cpu['cores']} cores" if cpu else ""),
             f"memory {_gib(mem['used_bytes'])}/{_gib(mem['total_bytes'])} GiB" if mem else "memory -"]
    gpus = t.get("gpus")
    if gpus is None:
        parts.append(f"gpus - ({t.get('gpus_reason') or 'not read'})")
    elif not gpus:
        parts.append("gpus none")
    else:
        parts += [f"gpu{g['index']} {'-' if g.get('utilization') is None else format(g['utilization'], '.0%')} "
                  f"{_gib(g.get('memory_used_bytes'))}/{_gib(g.get('memory_total_bytes'))} GiB" for g in gpus]
    for m in t.get("models") or []:
        held = [f"{_gib(m['vram_bytes'])} GiB VRAM"] if m.get("vram_bytes") is not None else []
        held += [f"KV {m['kv_usage']:.0%}"] if m.get("kv_usage") is not None else []
        parts.append(f"{m['provider']} {m['model']}: {', '.join(held) or '-'}")
    return "telemetry: " + ", ".join(parts)


def _utc(ms: int, now_ms: int) -> str:
    """``14:03 UTC``, with the date when it is not the server's today (an override set for 2d)."""
    at = datetime.fromtimestamp(ms / 1000, UTC)
    same_day = at.date() == datetime.fromtimestamp(now_ms / 1000, UTC).date()
    return at.strftime("%H:%M UTC" if same_day else "%Y-%m-%d %H:%M UTC")


def _left(ms: int) -> str:
    """A time left, coarse: ``40s``, ``59m``, ``3h05m``, ``2d3h``."""
    s = max(0, ms // 1000)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600}h"


def _value_text(field: str, value: Any) -> str:
    """An override's value (or its config's) as the line shows it."""
    if isinstance(value, list):  # fallbacks, preference
        return ", ".join(map(str, value)) or "none"
    if isinstance(value, dict):  # capacity_bounds: {"min", "max"}
        return f"{value.get('min')}-{value.get('max')}"
    if field == "enabled":
        return "enabled" if value else "disabled"
    return str(value)


# How each overridable field is named on its line, in the order the lines come.
OVERRIDE_LABELS = {"enabled": "", "capacity": "capacity", "capacity_bounds": "capacity bounds",
                   "fallbacks": "fallbacks", "preference": "preference"}


def override_lines(overrides: dict[str, Any] | None, now_ms: int) -> list[str]:
    """A provider's or model group's overrides (its catalog ``override`` field; absent from an
    older iop's catalog), a line each: the value in force, marked, with the config's value,
    who set it and until when -- ``disabled (override by ops, until 14:03 UTC, 59m left)``,
    ``capacity 2 (override by ops, config 6)`` for one that lasts until cleared."""
    if not overrides:
        return []
    order = list(OVERRIDE_LABELS)
    lines = []
    for field in sorted(overrides, key=lambda f: (order.index(f) if f in order else len(order), f)):
        o = overrides[field] or {}
        label = OVERRIDE_LABELS.get(field, field.replace("_", " "))
        value = _value_text(field, o.get("value"))
        notes = ["override" + (f" by {o['by']}" if o.get("by") else "")]
        # "disabled" says it all: its config value is always "enabled".
        if field != "enabled" and "config" in o:
            notes.append(f"config {_value_text(field, o['config'])}")
        until = o.get("until")
        if until is not None:
            notes.append(f"until {_utc(until, now_ms)}, {_left(until - now_ms)} left")
        lines.append(f"{label} {value}".strip() + f" ({', '.join(notes)})")
    return lines


def _indented(paint: Callable[[str, str], str], lines: list[str], code: str) -> list[str]:
    """Detail lines under a row, wrapped, the indentation left unpainted."""
    out = []
    for line in wrapped(lines, "    "):
        body = line.lstrip(" ")
        out.append(line[:len(line) - len(body)] + paint(body, code))
    return out


def wrapped(lines: list[str], indent: str) -> list[str]:
    """Lines wrapped to :data:`WIDTH` at ``indent``, a long one's rest indented under it."""
    return [part for line in lines for part in textwrap.wrap(
        line, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ",
        break_long_words=False, break_on_hyphens=False)]


def health_text(health: str, p: dict[str, Any] | None) -> str:
    """A health with what an operator did beside it: ``available (disabled, draining)``. The
    health stays the probe's word; ``enabled`` is absent from an older iop's catalog."""
    marks = [] if p is None else (["disabled"] if p.get("enabled") is False else []) + (
        [p["drain"]] if p.get("drain") else [])
    return health + (f" ({', '.join(marks)})" if marks else "")


def endpoints_lines(endpoints: list[str], indent: str) -> list[str]:
    text = ", ".join(SHORT_ENDPOINTS.get(e, e) for e in endpoints) or "none"
    return textwrap.wrap(f"endpoints: {text}", WIDTH, initial_indent=indent, subsequent_indent=indent + "  ",
                         break_long_words=False, break_on_hyphens=False)


def render(doc: dict[str, Any], colour: bool) -> str:
    def paint(text: str, code: str) -> str:
        return f"{code}{text}{RESET}" if colour else text

    providers = {p["id"]: p for p in doc["providers"]}
    now_ms = int(doc.get("server_time_ms") or 0)
    headers = ["PROVIDER", "TYPE", "CATEGORY", "HEALTH", "LOAD", "QUEUED", "TOK/S", "CACHE", "MODELS"]
    rows: list[tuple[str, list[str], list[str | None]]] = []
    for node in doc["nodes"]:
        for pid in node["providers"]:
            p = providers[pid]
            ratio = "-" if p["load_ratio"] is None else f"{p['load_ratio']:.2f}"
            models = ", ".join(m + (" (not offered)" if m in p["missing_models"] else "") for m in p["models"])
            # An operator's disable and drain show beside the probe's health: ``available (draining)``.
            health = health_text(p["health"], p)
            # The share of its prompt tokens it served from its prefix cache, where it says.
            hit = p.get("cache_hit_rate")
            cache = "-" if hit is None else f"{hit:.0%}"
            cells = [p["id"], p["type"], p["category"], health,
                     f"{bar(p['in_flight'], p['capacity'])} {capacity_text(p)} {ratio}",
                     str(p["queued"]), f"{p.get('tokens_per_s', 0):.0f}", cache, models]
            codes: list[str | None] = [None, None, None, HEALTH_COLOUR.get(p["health"]), None, None, None, None, None]
            rows.append((node["id"], cells, codes))
    widths = [max([len(h)] + [len(r[1][i]) for r in rows]) for i, h in enumerate(headers)]

    lines: list[str] = []
    current = None
    for node_id, cells, codes in rows:
        if node_id != current:
            current = node_id
            lines.append(paint(f"node {node_id}", BOLD))
            node_doc: dict[str, Any] = next((n for n in doc["nodes"] if n["id"] == node_id), {})
            if "telemetry" in node_doc:  # an older iop's catalog has none
                lines.append("  " + paint(telemetry_text(node_doc), DIM))
            lines.append("  " + "  ".join(paint(h.ljust(w), DIM) for h, w in zip(headers, widths, strict=True)))
        padded = [c.ljust(w) for c, w in zip(cells, widths, strict=True)]
        lines.append("  " + "  ".join(paint(c, code) if code else c
                                      for c, code in zip(padded, codes, strict=True)).rstrip())
        p = providers[cells[0]]
        if p["reason"]:
            lines.append("    " + paint(p["reason"], DIM))
        # Not dimmed: an operator's hand is on this provider, and the line says until when.
        lines.extend(_indented(paint, override_lines(p.get("override"), now_ms), YELLOW))
        if p.get("evidence"):  # absent from an older iop's catalog, None with nothing held against it
            lines.append("    " + paint(evidence_text(p["evidence"]), DIM))
        lines.extend("    " + paint(line, DIM) for line in load_lines(p))
        lines.extend("    " + paint(line, DIM) for line in lifecycle_lines(p))
        lines.extend("    " + paint(line, DIM) for line in live_lines(p))
        if "endpoints" in p:  # an older iop's catalog has none
            lines.extend("    " + paint(line[4:], DIM) for line in endpoints_lines(p["endpoints"], "    "))
    tenants = doc.get("tenants") or []  # an older iop's catalog has none
    if any(t["name"] != "default" or t.get("limits") for t in tenants):
        lines.append("")
        lines.extend(tenant_lines(tenants, paint))
    lines.append("")
    lines.append(paint("model groups", BOLD))
    for m in doc["models"]:
        wait = "-" if m["oldest_wait_ms"] is None else f"{m['oldest_wait_ms'] / 1000:.1f}s"
        lines.append(f"  {m['id']} ({m['display_name']}): queued {m['queued']}, oldest wait {wait}, "
                     f"free slots {m['available_slots']}")
        lines.extend(_indented(paint, override_lines(m.get("override"), now_ms), YELLOW))
        if m.get("affinity"):  # None when its affinity is off; absent from an older iop's catalog
            lines.append("    " + affinity_text(m["affinity"]))
        for c in m["candidates"]:
            # A disabled or drained candidate gets no new job here: say so beside its health.
            marks = health_text("", providers.get(c["provider"]))
            lines.append(f"    {c['provider']} -> {c['served_name']}  "
                         f"{paint(c['health'], HEALTH_COLOUR.get(c['health'], ''))}{marks}  "
                         f"{c['in_flight']}/{c['capacity']}")
        for u in m.get("tenants") or []:
            lines.append(f"    tenant {u['tenant']}: queued {u['queued']}, in flight {u['in_flight']}")
    return "\n".join(lines)


def affinity_text(a: dict[str, Any]) -> str:
    """A model group's cache-aware dispatch on one line, its decisions' hit share at the end."""
    decisions = {k: int(a.get("decisions", {}).get(k, 0)) for k in ("hit", "miss", "spill")}
    total = sum(decisions.values())
    share = f"{decisions['hit'] / total:.0%}" if total else "-"
    counts = ", ".join(f"{k} {n}" for k, n in decisions.items())
    home = (f", home queue {a['home_queue']:g}x: {a.get('home_queued', 0)} past cap"
            if a.get("home_queue") else "")
    return (f"affinity {a['mode']}: bound {a['load_bound']:g}, index {a['index_blocks']}/{a['index_max_blocks']} "
            f"blocks, {counts} ({share} hits){home}")


def limits_text(t: dict[str, Any]) -> str:
    """A tenant's limits: ``queued <= 100, in flight <= 4``, or ``-``."""
    parts = [f"{what} <= {t[field]}" for what, field in (("queued", "max_queued"), ("in flight", "max_in_flight"))
             if t.get(field) is not None]
    return ", ".join(parts) or "-"


def evidence_text(evidence: dict[str, Any]) -> str:
    """What iop holds against a provider's 5xx answers, in one line."""
    ejections = ", ".join(f"{n} {kind.replace('_', ' ')}" for kind, n in evidence["ejections"].items() if n)
    return (f"5xx held against it: {evidence['streak_5xx']} in a row; excused (the request's fault): "
            f"{evidence['excused_5xx']}; ejections: {ejections or 'none'}")


def tenant_lines(tenants: list[dict[str, Any]], paint: Callable[[str, str], str]) -> list[str]:
    """The tenants table: one row per configured tenant, in config order."""
    headers = ["TENANT", "BAND", "WEIGHT", "QUEUED", "IN FLIGHT", "LIMITS"]
    rows = [[t["name"], t["band"], f"{t['weight']:g}", str(t["queued"]), str(t["in_flight"]), limits_text(t)]
            for t in tenants]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    lines = [paint("tenants", BOLD),
             "  " + "  ".join(paint(h.ljust(w), DIM) for h, w in zip(headers, widths, strict=True))]
    for t, r in zip(tenants, rows, strict=True):
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if t.get("limits"):  # None without rate limits or budget; absent from an older iop's catalog
            lines.extend(rate_limit_lines(t["limits"]))
    return lines


# A tenant's windows: (label, limit field, used field).
RATE_WINDOWS = (("requests/min", "requests_per_minute", "requests_used"),
                ("tokens/min", "tokens_per_minute", "tokens_used"),
                ("tokens/day", "tokens_per_day", "tokens_used_today"))
REFUSALS = ("requests", "tokens", "budget")


def rate_limit_lines(lim: dict[str, Any]) -> list[str]:
    """A tenant's rate limits and budget under its row: ``used/limit`` per window (``-``: no
    limit in it), then its refusals by reason; wrapped between items to fit :data:`WIDTH`."""
    items = [f"{label} {'-' if lim.get(limit) is None else f'{lim.get(used, 0)}/{lim[limit]}'}"
             for label, limit, used in RATE_WINDOWS]
    refused = lim.get("refused") or {}
    items = [item + "," for item in items[:-1]] + [items[-1] + ";",
             "refused " + ", ".join(f"{int(refused.get(kind, 0))} {kind}" for kind in REFUSALS)]
    lines = ["    rate limits:"]
    for item in items:
        if len(lines[-1]) + 1 + len(item) > WIDTH:
            lines.append("      " + item)
        else:
            lines[-1] += " " + item
    return lines


def main(url: str, as_json: bool, key_env: str, colour: bool | None) -> int:
    try:
        doc = fetch(url, os.environ.get(key_env))
    except OSError as exc:  # urllib's errors among them
        return report(url, "/catalog", exc)
    if as_json:
        print(json.dumps(doc, indent=2))
        return 0
    if colour is None:
        colour = sys.stdout.isatty() and "NO_COLOR" not in os.environ
    print(render(doc, colour))
    return 0
