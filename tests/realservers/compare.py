"""One request sent to a real server directly and through iop, and what must match.

What may differ: ids and timestamps (fresh per answer), ``model`` (through iop it is the
alias the caller used), and the ``x-iop-*`` / hop headers. Everything else must be the
same: status, body fields, the SSE framing (event names in order, ``data: [DONE]`` exactly
when the upstream sends one, the usage chunk), and the provider headers iop relays.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx

# Fields that are fresh in every answer; and the times in llama-server's ``timings`` (its
# counts, ``cache_n``, ``prompt_n``, ``predicted_n``, must match).
VOLATILE = frozenset({"id", "created", "created_at", "item_id", "system_fingerprint",
                      "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
                      "predicted_ms", "predicted_per_token_ms", "predicted_per_second"})
# Where an answer names its model: the top level, and inside Responses / Messages events.
MODEL_HOLDERS = ("response", "message")
# Provider headers iop passes on (workers/adapters/base.py).
RELAYED_NAMES = frozenset({"x-request-id", "request-id", "retry-after"})
RELAYED_PREFIXES = ("openai-", "x-ratelimit-", "anthropic-")


@dataclass
class Event:
    name: str | None
    data: str

    def json(self) -> Any:
        return json.loads(self.data)


@dataclass
class Answer:
    status: int
    headers: httpx.Headers
    text: str
    events: list[Event] = field(default_factory=list)
    streamed: bool = False

    def json(self) -> Any:
        return json.loads(self.text)

    @property
    def names(self) -> list[str | None]:
        return [e.name for e in self.events]

    @property
    def done(self) -> bool:
        return any(e.data == "[DONE]" for e in self.events)

    def payloads(self) -> list[Any]:
        return [e.json() for e in self.events if e.data != "[DONE]"]

    def describe(self) -> str:
        return f"HTTP {self.status}, content-type {self.headers.get('content-type')!r}:\n{self.text[:3000]}"


def parse_sse(text: str) -> list[Event]:
    """Events of an SSE body (any of CRLF, LF, CR line ends; comments dropped)."""
    events: list[Event] = []
    name: str | None = None
    data: list[str] = []
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    for line in [*lines, ""]:
        if line == "":
            if data:
                events.append(Event(name, "\n".join(data)))
            name, data = None, []
        elif line.startswith(":"):
            continue
        else:
            key, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if key == "event":
                name = value
            elif key == "data":
                data.append(value)
    return events


def send(base: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None,
         timeout: float = 60) -> Answer:
    """POST ``body`` to ``base + path``; a stream is read to its end and parsed."""
    with httpx.Client(timeout=timeout) as client, client.stream("POST", base + path, json=body,
                                                                headers=headers or {}) as resp:
        text = resp.read().decode()
        streamed = resp.headers.get("content-type", "").startswith("text/event-stream")
        return Answer(resp.status_code, resp.headers, text, parse_sse(text) if streamed else [], streamed)


def models_in(obj: Any) -> list[Any]:
    """Every ``model`` an answer (or one event's payload) names."""
    if not isinstance(obj, dict):
        return []
    found = [obj["model"]] if "model" in obj else []
    for holder in MODEL_HOLDERS:
        inner = obj.get(holder)
        if isinstance(inner, dict) and "model" in inner:
            found.append(inner["model"])
    return found


def scrub(obj: Any) -> Any:
    """``obj`` without what may differ: volatile fields blanked, models removed."""
    if isinstance(obj, dict):
        return {k: ("<volatile>" if k in VOLATILE else scrub(v)) for k, v in obj.items() if k != "model"}
    if isinstance(obj, list):
        return [scrub(v) for v in obj]
    return obj


def relayed(headers: httpx.Headers) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()
            if k.lower() in RELAYED_NAMES or k.lower().startswith(RELAYED_PREFIXES)}


def assert_same(direct: Answer, via: Answer, alias: str) -> None:
    """``via`` (through iop, asked for ``alias``) answers what ``direct`` did."""
    assert via.status == direct.status, f"status: direct {direct.status}, through iop {via.describe()}"
    assert via.streamed == direct.streamed, (
        f"streamed: direct {direct.streamed}, through iop {via.streamed}\ndirect {direct.describe()}\n"
        f"through iop {via.describe()}")
    if direct.streamed:
        assert via.names == direct.names, f"event names: direct {direct.names}, through iop {via.names}"
        assert via.done == direct.done, f"data: [DONE]: direct {direct.done}, through iop {via.done}"
        d_payloads, v_payloads = direct.payloads(), via.payloads()
    else:
        d_payloads, v_payloads = [direct.json()], [via.json()]
    assert len(v_payloads) == len(d_payloads), f"{len(d_payloads)} events directly, {len(v_payloads)} through iop"
    for d, v in zip(d_payloads, v_payloads, strict=True):
        if direct.status < 300:
            assert len(models_in(v)) == len(models_in(d)), f"model fields: direct {d}, through iop {v}"
            assert all(m == alias for m in models_in(v)), f"model through iop is not {alias!r}: {v}"
        assert scrub(v) == scrub(d), f"direct {d}\nthrough iop {v}"
    assert_headers_relayed(direct, via)


def assert_headers_relayed(direct: Answer, via: Answer) -> None:
    """The provider headers iop passes on came back, with their values (counters aside)."""
    sent, got = relayed(direct.headers), relayed(via.headers)
    missing = sorted(set(sent) - set(got))
    assert not missing, f"provider headers not relayed through iop: {missing} (direct sent {sent}, iop {got})"
    for name, value in sent.items():
        if not any(part in name for part in ("remaining", "reset", "processing-ms", "request-id")):
            assert got[name] == value, f"{name}: direct {value!r}, through iop {got[name]!r}"
    assert via.headers.get("x-iop-provider"), f"no x-iop-provider header: {dict(via.headers)}"


def usage_chunks(answer: Answer) -> list[Any]:
    return [p for p in answer.payloads() if isinstance(p, dict) and p.get("usage")]
