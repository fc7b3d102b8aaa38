"""The benchmark part of a qualification: streamed chat requests through iop, pinned to one
provider (``x-iop-provider``), at concurrency 1, 2, 4, ... until throughput stops growing (or
the run's share of the model's slots, the provider's capacity in iop, or the run's bounds,
stop it: then no knee is claimed). Each request is timed as a
client sees it: TTFT to the first content chunk, inter-token latency between content chunks,
completion tokens from the stream's usage (or its content chunks, where it reports none).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from dispatcher.qualifications import Latency

# Growth under this factor from one concurrency to its double means the knee was passed.
GROWTH = 1.15
SHORT_PROMPT = "Write a short story about a lighthouse keeper."
# About 2,000 words: what makes prefill show in TTFT.
LONG_PROMPT = ("Summarise the following notes in two sentences. " +
               " ".join(f"Note {i}: the keeper checked lamp {i % 7} and logged the weather." for i in range(180)))


class Stopped(Exception):
    """The run was refused (cancelled, past its time or tokens) or interrupted."""


@dataclass
class CallResult:
    ok: bool
    ttft_s: float | None = None
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    tokens: int = 0
    text: str = ""
    logprobs: list[tuple[str, float]] | None = None
    error: str = ""


@dataclass
class Step:
    concurrency: int
    results: list[CallResult]
    wall_s: float

    @property
    def tokens_per_s(self) -> float:
        return sum(r.tokens for r in self.results if r.ok) / self.wall_s if self.wall_s > 0 else 0.0


def latency(values: list[float]) -> Latency | None:
    if not values:
        return None
    ms = sorted(v * 1000 for v in values)
    if len(ms) == 1:
        return Latency(round(ms[0], 1), round(ms[0], 1))
    q = statistics.quantiles(ms, n=10, method="inclusive")
    return Latency(round(statistics.median(ms), 1), round(q[8], 1))


class Client:
    """Calls through iop as one run: the admin key, the run's header, one provider's pin."""

    def __init__(self, url: str, key: str | None, run: str, model: str, timeout_s: float = 120.0) -> None:
        self.url = url.rstrip("/")
        self.run = run
        self.model = model
        self.headers = {"x-iop-qualify": run, **({"Authorization": f"Bearer {key}"} if key else {})}
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))

    async def close(self) -> None:
        await self.session.close()

    async def chat(self, provider: str, messages: list[dict[str, Any]], max_tokens: int, *, stream: bool = True,
                   deterministic: bool = False, logprobs: bool = False) -> CallResult:
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                                "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if deterministic:
            body.update(temperature=0, seed=1234, top_p=1)
        if logprobs:
            body["logprobs"] = True
        started = time.monotonic()
        headers = {**self.headers, "x-iop-provider": provider}
        try:
            async with self.session.post(f"{self.url}/v1/chat/completions", json=body, headers=headers) as resp:
                if resp.status == 409:
                    raise Stopped((await resp.text())[:300])
                if resp.status >= 400:
                    return CallResult(False, e2e_s=time.monotonic() - started,
                                      error=f"{resp.status}: {(await resp.text())[:200]}")
                if not stream:
                    doc = await resp.json()
                    return _json_result(doc, time.monotonic() - started)
                return await _read_stream(resp, started)
        except (aiohttp.ClientError, TimeoutError) as exc:
            return CallResult(False, e2e_s=time.monotonic() - started, error=f"{type(exc).__name__}: {exc}")


def _json_result(doc: dict[str, Any], e2e: float) -> CallResult:
    choice = (doc.get("choices") or [{}])[0]
    text = (choice.get("message") or {}).get("content") or ""
    usage = doc.get("usage") or {}
    lp = choice.get("logprobs") or {}
    pairs = [(str(t.get("token")), float(t["logprob"])) for t in lp.get("content") or []
             if isinstance(t, dict) and isinstance(t.get("logprob"), int | float)] or None
    return CallResult(True, None, e2e, [], int(usage.get("completion_tokens") or len(text.split())), text, pairs)


async def _read_stream(resp: aiohttp.ClientResponse, started: float) -> CallResult:
    first = last = None
    gaps: list[float] = []
    chunks = 0
    usage_tokens = None
    text: list[str] = []
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        try:
            doc = json.loads(data)
        except ValueError:
            continue
        if doc.get("usage"):
            usage_tokens = doc["usage"].get("completion_tokens")
        for choice in doc.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                now = time.monotonic()
                if first is None:
                    first = now
                elif last is not None:
                    gaps.append(now - last)
                last = now
                chunks += 1
                text.append(piece)
    ended = time.monotonic()
    return CallResult(True, None if first is None else first - started, ended - started, gaps,
                      int(usage_tokens) if usage_tokens else chunks, "".join(text))


async def step(client: Client, provider: str, concurrency: int, requests: int, max_tokens: int,
               prompt: str = SHORT_PROMPT) -> Step:
    """``requests`` calls, ``concurrency`` at a time. A refusal (:class:`Stopped`) ends the step:
    no call starts after it, those under way finish (iop admitted them), and it is raised as
    itself -- not inside the ExceptionGroup a task group would make of it."""
    queue = list(range(requests))
    results: list[CallResult] = []
    refused: list[Stopped] = []

    async def worker() -> None:
        while queue and not refused:
            queue.pop()
            try:
                results.append(await client.chat(provider, [{"role": "user", "content": prompt}], max_tokens))
            except Stopped as exc:
                refused.append(exc)

    started = time.monotonic()
    async with asyncio.TaskGroup() as tg:
        for _ in range(concurrency):
            tg.create_task(worker())
    if refused:
        raise refused[0]
    return Step(concurrency, results, time.monotonic() - started)


def knee(steps: list[Step]) -> int | None:
    """The concurrency past which throughput stopped growing: the last step that still grew
    by GROWTH over the one before (the first, if none did)."""
    if not steps:
        return None
    best = steps[0]
    for prev, cur in itertools.pairwise(steps):
        if cur.tokens_per_s >= prev.tokens_per_s * GROWTH:
            best = cur
        else:
            break
    return best.concurrency


def found_knee(steps: list[Step]) -> int | None:
    """The knee where the curve shows one: a step after it grew less than GROWTH. None when
    throughput grew up to the last step measured (or one step alone was): the knee is there or
    beyond, and a sweep cut short by a bound must not present that step as the knee."""
    found = knee(steps)
    return found if found is not None and found != steps[-1].concurrency else None


@dataclass(frozen=True)
class Ladder:
    """A provider's concurrency sweep: its steps, and the bounds that end it (``share``: the
    run's share of the model's slots; ``capacity``: the provider's capacity in iop, past which
    calls would wait in iop's own queue, not on the provider; ``max_concurrency``: the caller's
    ``--max-concurrency``), each as high as ``top``."""

    levels: list[int]
    top: int
    bounds: list[str]


def ladder(share_slots: int, capacity: int, limit: int | None) -> Ladder:
    # Capped at the provider's capacity: a step above it would time iop's queue as well as the
    # provider, and its extra throughput (the capacity's, not the step's) would pass for growth.
    tops = {"max_concurrency": limit, "capacity": capacity, "share": share_slots}
    top = min(v for v in tops.values() if v is not None)
    return Ladder(levels(top, None), top, [name for name, v in tops.items() if v == top])


def levels(cap: int, limit: int | None) -> list[int]:
    top = min(cap, limit) if limit else cap
    out, c = [], 1
    while c <= top:
        out.append(c)
        c *= 2
    return out
