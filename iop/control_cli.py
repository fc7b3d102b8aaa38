"""Runtime control of a running iop: overrides layered over its config, kept in Redis and
applied by every API replica and worker at once (``api/control.py``), with the stdlib's HTTP
client like ``iop provider drain``.

    iop provider disable ID [--for D]            POST   /admin/providers/{id}/disable
    iop provider enable ID                       POST   /admin/providers/{id}/enable
    iop provider capacity ID N [--for D]         PUT    /admin/providers/{id}/capacity  {"capacity": N}
    iop provider capacity ID --min A --max B     PUT    /admin/providers/{id}/capacity  {"min": A, "max": B}
    iop provider capacity ID --clear             DELETE /admin/providers/{id}/capacity
    iop provider load|unload ID MODEL            POST   /admin/providers/{id}/models/{MODEL}/load|unload
    iop model fallbacks ID A,B [--for D]         PUT    /admin/models/{id}/fallbacks    {"fallbacks": [A, B]}
    iop model prefer ID P1,P2 [--for D]          PUT    /admin/models/{id}/preference   {"providers": [P1, P2]}
    iop model fallbacks|prefer ID --clear        DELETE the same
    iop overrides                                GET    /admin/overrides
    iop audit [--since D|MS] [--limit N]         GET    /admin/audit?since=MS&limit=N

``--for D`` sends ``"for_s"``: the override lapses by itself after D (``90s``, ``15m``,
``1h``, ``2d``, or a bare number of seconds). Each prints one line (an override, a cleared
one, a load under way; ``overrides`` and ``audit`` a line per item), ``--json`` the answer
as it came. Exit status 0 done, 1 refused or unreachable (the server's error said on stderr),
2 bad arguments (nothing sent)."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from iop.http_client import call, report

UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"(\d+)([smhd]?)")
DURATION_FORMS = "90s, 15m, 1h, 2d, or a number of seconds"
# `--since` takes a duration (that long ago) or a time in ms since the epoch, as the audit's
# `at` says it (to page back from an entry). A bare number below this is read as seconds:
# 10^11 ms is 1973, 10^11 s three thousand years, so the two readings never meet.
EPOCH_MS_FROM = 10**11
MAX_AUDIT_LIMIT = 1000  # the API's own bound (GET /admin/audit)


class UsageError(ValueError):
    """Arguments argparse lets through that do not make one request (``capacity`` with both
    a number and ``--clear``): said like argparse's own errors, exit status 2."""


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    body: dict[str, Any] | None = None


# --------------------------------------------------------------------------- arguments


def parse_duration(text: str) -> int:
    """``90s``, ``15m``, ``1h``, ``2d`` or bare seconds, as seconds (argparse ``type=``)."""
    match = _DURATION.fullmatch(text.strip().lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration: give {DURATION_FORMS}")
    seconds = int(match.group(1)) * UNIT_S[match.group(2)]
    if seconds < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a duration must be at least 1 second")
    return seconds


def since_ms(text: str, now_ms: int | None = None) -> int:
    """``--since``: a duration back from now, or a time in ms since the epoch (argparse ``type=``)."""
    stripped = text.strip()
    if stripped.isdigit() and int(stripped) >= EPOCH_MS_FROM:
        return int(stripped)
    try:
        seconds = parse_duration(stripped)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a duration ({DURATION_FORMS}) nor a time in ms since the epoch") from None
    now = int(time.time() * 1000) if now_ms is None else now_ms
    return now - seconds * 1000


def whole_number(text: str, low: int, high: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"{text}: must be at least {low}" if high is None
                                         else f"{text}: must be from {low} to {high}")
    return value


def capacity(text: str) -> int:
    """A capacity or a bound of one (argparse ``type=``): at least 1; the API names the upper
    bound (the provider's ``max_capacity``)."""
    return whole_number(text, 1)


def audit_limit(text: str) -> int:
    return whole_number(text, 1, MAX_AUDIT_LIMIT)


def id_list(text: str) -> list[str]:
    """``a,b`` as ``["a", "b"]``; spaces around a comma are dropped, so are empty items (``''``
    is the empty list: a model without fallbacks)."""
    return [item.strip() for item in text.split(",") if item.strip()]


def _quoted(text: str) -> str:
    # Ids hold ':' (qwen3.6:35b) and served names '/' (Qwen/Qwen3-8B): one path segment each.
    return urllib.parse.quote(text, safe="")


def _with_expiry(body: dict[str, Any], for_s: int | None) -> dict[str, Any]:
    return body if for_s is None else {**body, "for_s": for_s}


def build_request(args: argparse.Namespace) -> Request:
    """The one HTTP call the parsed command makes (``args.control`` names the command).
    Raises :class:`UsageError` for arguments that make none."""
    control: str = args.control
    for_s: int | None = getattr(args, "for_s", None)
    if getattr(args, "clear", False) and for_s is not None:
        raise UsageError("--for sets when an override lapses: it does not go with --clear")
    target = _quoted(getattr(args, "id", ""))  # `overrides` and `audit` name none
    provider = f"/admin/providers/{target}"
    if control == "disable":
        return Request("POST", f"{provider}/disable", None if for_s is None else {"for_s": for_s})
    if control == "enable":
        return Request("POST", f"{provider}/enable")
    if control == "capacity":
        return _capacity(args, f"{provider}/capacity", for_s)
    if control in ("load", "unload"):
        return Request("POST", f"{provider}/models/{_quoted(args.model)}/{control}")
    if control == "fallbacks":
        return _model_list(args, f"/admin/models/{target}/fallbacks", "fallbacks", for_s)
    if control == "prefer":
        return _model_list(args, f"/admin/models/{target}/preference", "providers", for_s)
    if control == "overrides":
        return Request("GET", "/admin/overrides")
    if control == "audit":
        query = {name: value for name, value in (("since", args.since), ("limit", args.limit)) if value is not None}
        return Request("GET", "/admin/audit" + (f"?{urllib.parse.urlencode(query)}" if query else ""))
    raise ValueError(f"no control command {control!r}")  # a parser wired to a command not here


def _model_list(args: argparse.Namespace, path: str, key: str, for_s: int | None) -> Request:
    """``iop model fallbacks|prefer ID LIST`` (PUT ``{key: [...]}``) or ``--clear`` (DELETE)."""
    if args.clear:
        if args.ids is not None:
            raise UsageError(f"give either the {key} or --clear, not both")
        return Request("DELETE", path)
    if args.ids is None:
        raise UsageError(f"give the {key} (comma-separated) or --clear")
    ids = id_list(args.ids)
    if key == "providers" and not ids:
        raise UsageError("give at least one provider to prefer (--clear goes back to the config's order)")
    return Request("PUT", path, _with_expiry({key: ids}, for_s))


def _capacity(args: argparse.Namespace, path: str, for_s: int | None) -> Request:
    """A fixed capacity, the bounds of ``capacity: auto``, or ``--clear`` (both): exactly one."""
    bounds = (args.min, args.max)
    given = [name for name, there in (("N", args.capacity is not None),
                                      ("--min/--max", bounds != (None, None)), ("--clear", args.clear)) if there]
    if len(given) != 1:
        raise UsageError("give one of N (a fixed capacity), --min A --max B (the bounds of capacity: auto) "
                         "or --clear" + (f", not {' and '.join(given)}" if given else ""))
    if args.clear:
        return Request("DELETE", path)
    if args.capacity is not None:
        return Request("PUT", path, _with_expiry({"capacity": args.capacity}, for_s))
    if None in bounds:
        raise UsageError("--min and --max go together")
    if args.min > args.max:
        raise UsageError(f"--min {args.min} is above --max {args.max}")
    return Request("PUT", path, _with_expiry({"min": args.min, "max": args.max}, for_s))


# --------------------------------------------------------------------------- what is printed


def clock(ms: int, now_ms: int) -> str:
    """``14:03:10 UTC`` on the day of ``now_ms``, else with its date."""
    at = datetime.fromtimestamp(ms / 1000, tz=UTC)
    today = datetime.fromtimestamp(now_ms / 1000, tz=UTC).date()
    return at.strftime("%H:%M:%S UTC" if at.date() == today else "%Y-%m-%d %H:%M:%S UTC")


def stamp(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")


def expiry(until: int | None, now_ms: int) -> str:
    return "no expiry" if until is None else f"until {clock(until, now_ms)}"


def shown(value: Any) -> str:
    """A value as the commands take it: ``a,b`` for a list (``none`` empty), ``1-8`` for
    bounds, ``-`` for nothing, compact JSON for anything else."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(map(str, value)) if value else "none"
    if isinstance(value, dict) and set(value) == {"min", "max"}:
        return f"{value['min']}-{value['max']}"
    if isinstance(value, str | int | float):
        return str(value)
    return json.dumps(value, separators=(",", ":"))


def setting(field: str, value: Any) -> str:
    """``capacity 2``, ``disabled``, ``capacity bounds 1-8``, ``fallbacks a,b``."""
    if field == "enabled":
        return "enabled" if value else "disabled"
    return f"{field.replace('_', ' ')} {shown(value)}"


def describe_override(doc: dict[str, Any], now_ms: int) -> str:
    """``gpu1: capacity 2 (config 6) until 14:03:10 UTC, by ops``."""
    field = doc["field"]
    config = "enabled" if field == "enabled" and doc.get("config") else shown(doc.get("config"))
    until = doc.get("until")
    lapses = ", no expiry" if until is None else f" until {clock(until, now_ms)}"
    return f"{doc['id']}: {setting(field, doc.get('value'))} (config {config}){lapses}, by {doc.get('by')}"


def describe_cleared(doc: dict[str, Any]) -> str:
    field, name = doc["field"], doc["id"]
    if field == "enabled":
        return f"{name}: enabled (its disable override cleared)" if doc["cleared"] else \
            f"{name}: no disable override; nothing changed"
    label = field.replace("_", " ")
    return f"{name}: {label} override cleared; the config's applies" if doc["cleared"] else \
        f"{name}: no {label} override; nothing changed"


def describe_lifecycle(doc: dict[str, Any]) -> str:
    """``gpu-b: loading llama3.1:8b``: under way, ``iop catalog`` shows when it is done; or
    already so, and nothing was ordered."""
    provider, model, state = doc["provider"], doc["model"], doc["state"]
    if state in ("loaded", "unloaded"):
        return f"{provider}: {model} is {'loaded already' if state == 'loaded' else 'not loaded'}; nothing to do"
    return f"{provider}: {state} {model}"


def _columns(rows: Sequence[Sequence[str]]) -> list[str]:
    # Every column but the last padded to its widest cell, so the lines read as a table.
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join([*(cell.ljust(w) for cell, w in zip(row, widths, strict=False)), row[-1]]).rstrip()
            for row in rows]


def describe_overrides(doc: dict[str, Any], now_ms: int) -> list[str]:
    """One line per override: target, id, field, value, config, by whom, until when."""
    overrides = doc.get("overrides") or []
    if not overrides:
        return ["no overrides in force"]
    # By target, id, field, as the API lists them: a target's overrides on adjacent lines
    # whatever order an older or newer API sends.
    overrides = sorted(overrides, key=lambda o: (str(o["target"]), str(o["id"]), str(o["field"])))
    return _columns([[o["target"], o["id"], o["field"], shown(o.get("value")), f"config {shown(o.get('config'))}",
                      f"by {o.get('by')}", expiry(o.get("until"), now_ms)] for o in overrides])


def describe_audit(doc: dict[str, Any]) -> list[str]:
    """One line per entry, newest first as the API sends them: when, who, what, on what,
    before -> after, from where."""
    entries = doc.get("entries") or []
    if not entries:
        return ["no audit entries"]
    return _columns([[stamp(e["at"]), str(e.get("by")), str(e.get("action")), str(e.get("target")),
                      f"{shown(e.get('before'))} -> {shown(e.get('after'))}", f"via {e.get('via')}"]
                     for e in entries])


def describe(doc: dict[str, Any], now_ms: int) -> list[str]:
    """The lines of any answer of these endpoints, told apart by their fields."""
    if "overrides" in doc:
        return describe_overrides(doc, now_ms)
    if "entries" in doc:
        return describe_audit(doc)
    if "cleared" in doc:
        return [describe_cleared(doc)]
    if "state" in doc and "provider" in doc:
        return [describe_lifecycle(doc)]
    return [describe_override(doc, now_ms)]


# --------------------------------------------------------------------------- the command


def main(args: argparse.Namespace, key: str | None, *,
         usage_error: Callable[[str], Any] | None = None) -> int:
    """Build the request (bad arguments: ``usage_error``, argparse's, which exits 2), send it,
    print the answer. Exit status 0 done, 1 refused or unreachable."""
    try:
        request = build_request(args)
    except UsageError as exc:
        if usage_error is not None:
            usage_error(str(exc))
        print(f"iop: error: {exc}", file=sys.stderr)
        return 2
    try:
        doc = call(args.url, request.method, request.path, key, body=request.body)
    except OSError as exc:  # urllib's errors among them
        return report(args.url, request.path, exc)
    if args.json:
        print(json.dumps(doc))
    else:
        for line in describe(doc, int(time.time() * 1000)):
            print(line)
    return 0
