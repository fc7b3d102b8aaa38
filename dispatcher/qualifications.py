"""Qualification reports (``iop qualify``, issue 32): their shape, where they live in Redis, how
they age, and their Markdown export.

A report is one run of the standard workload against a model's providers: per provider its
benchmark (TTFT, inter-token latency and tokens/s at each concurrency, the knee as
``suggested_capacity``), its lifecycle (declared against verified) and its agreement with the
model's other providers. The CLI measures (``iop/qualify.py``, as a client: what callers see);
the API keeps. ``{iop}:qual:<model>`` is a list of reports, newest first, each JSON with the
run's config and iop's version; a new one pushes the oldest past ``qualify.keep_reports`` out.
A run in progress is ``{iop}:qual:run:<id>`` (its model, bounds and tokens asked so far),
which expires with the run's time bound.

A finished run also seeds ``capacity: auto``: ``{iop}:qual:cap`` holds, per provider, the
``suggested_capacity`` of the latest finished run that measured it without errors
(:func:`seed_capacity`); a worker starting an auto limit with none learned yet starts there
(:func:`seeded_capacity`) instead of at the engine's slots hint or two.
"""

from __future__ import annotations

from typing import Any

import msgspec
from redis.asyncio import Redis

from dispatcher import keys


class Latency(msgspec.Struct, frozen=True):
    p50: float
    p90: float


class LifecycleCheck(msgspec.Struct, frozen=True):
    """One lifecycle action of a provider: what its type declares (the catalog's coarse flag),
    and whether a safe call found the runtime answering it (None: not verified -- not asked,
    no safe call, or unreachable; ``how`` says which)."""

    declared: bool
    verified: bool | None
    how: str


class ProviderReport(msgspec.Struct, frozen=True):
    provider: str
    served_name: str = ""
    type: str = ""
    node: str = ""
    # The knee of throughput against concurrency: the concurrency past which it stopped growing
    # (None: not found -- throughput grew up to the sweep's last step, see sweep_cut_by).
    suggested_capacity: int | None = None
    # What ended the sweep while throughput still grew, so that no knee was found: ``share``
    # (the run's share of the model's slots), ``capacity`` (the provider's capacity in iop) and/or
    # ``max_concurrency`` (the caller's limit); the report's notes say how to measure further.
    # Empty: the sweep found its knee (or the run stopped before it ended).
    sweep_cut_by: list[str] = []
    # Concurrency (as a string: a JSON object's key) -> percentiles, ms.
    ttft_ms: dict[str, Latency] = {}
    itl_ms: dict[str, Latency] = {}
    # Concurrency -> completion tokens per second, all requests of that step together.
    throughput: dict[str, float] = {}
    # At the knee (the highest throughput measured).
    tokens_per_s: float | None = None
    # TTFT of the long prompt at concurrency 1.
    long_prompt_ttft_ms: Latency | None = None
    # 0-1: the mean similarity of its answers to the largest agreeing group's (None: no answer).
    agreement: float | None = None
    # Mean |logprob difference| over the tokens both it and the group's reference produced,
    # where both returned logprobs (None: not available).
    logprob_divergence: float | None = None
    flags: list[str] = []
    lifecycle: dict[str, LifecycleCheck] = {}
    errors: int = 0
    # 1 = the lowest TTFT p50 at concurrency 1 (as the client measured it).
    rank: int | None = None


class Report(msgspec.Struct, frozen=True):
    model: str
    started: str  # ISO 8601 UTC
    run: str = ""
    finished: str = ""
    iop_version: str = ""
    cancelled: bool = False
    # The workload and bounds the run used (prompts, concurrencies, max tokens, share ...).
    config: dict[str, Any] = {}
    providers: list[ProviderReport] = []
    notes: list[str] = []


class RunSummary(msgspec.Struct, frozen=True):
    index: int  # 0 = the latest
    run: str
    started: str
    providers: list[str]
    flagged: list[str]


class CapacitySeed(msgspec.Struct, frozen=True):
    """Where an auto limit starts: a qualification's knee, and the run that found it."""

    capacity: int
    model: str
    run: str
    started: str


decode_report = msgspec.json.Decoder(Report).decode
_decode_seed = msgspec.json.Decoder(CapacitySeed).decode
encode = msgspec.json.Encoder().encode


async def store(redis: Redis, report: Report, keep: int) -> None:
    key = keys.qualifications(report.model)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.lpush(key, encode(report))
        pipe.ltrim(key, 0, keep - 1)
        await pipe.execute()


async def read(redis: Redis, model: str, index: int = 0) -> Report | None:
    raw = await redis.lindex(keys.qualifications(model), index)
    return decode_report(raw) if raw is not None else None


async def history(redis: Redis, model: str) -> list[RunSummary]:
    out = []
    for i, raw in enumerate(await redis.lrange(keys.qualifications(model), 0, -1)):
        r = decode_report(raw)
        out.append(RunSummary(i, r.run, r.started, [p.provider for p in r.providers],
                              [p.provider for p in r.providers if p.flags]))
    return out


def seeds_of(report: Report) -> dict[str, CapacitySeed]:
    """The capacity seeds a report gives: its providers' knees, unless the run was cancelled
    (its ladder may have stopped before the knee) or the provider's calls failed (a knee of
    errors is not one of throughput)."""
    if report.cancelled:
        return {}
    return {p.provider: CapacitySeed(p.suggested_capacity, report.model, report.run, report.started)
            for p in report.providers if p.suggested_capacity is not None and not p.errors}


async def seed_capacity(redis: Redis, report: Report) -> dict[str, CapacitySeed]:
    """Write the report's seeds over those of earlier runs (of any model: a provider has one
    limit); what it wrote."""
    seeds = seeds_of(report)
    if seeds:
        await redis.hset(keys.CAPACITY_SEEDS, mapping={p: encode(s) for p, s in seeds.items()})
    return seeds


async def seeded_capacity(redis: Redis, provider_id: str) -> int | None:
    """Where ``provider_id``'s auto limit starts, from its latest qualification (None: none)."""
    raw = await redis.hget(keys.CAPACITY_SEEDS, provider_id)
    if raw is None:
        return None
    try:
        return _decode_seed(raw).capacity
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


NONE = "-"  # a figure not measured


def _ms(v: float | None) -> str:
    if v is None:
        return NONE
    return f"{v / 1000:.2f} s" if v >= 1000 else f"{v:.0f} ms"


def _lat(v: Latency | None) -> str:
    return NONE if v is None else f"{_ms(v.p50)} / {_ms(v.p90)}"


def markdown(report: Report, earlier: Report | None = None) -> str:
    """The report as Markdown: a table of the providers side by side, then each one's curve,
    lifecycle and flags; with ``earlier``, how each provider moved since that run."""
    lines = [f"# Qualification of `{report.model}`", "",
             f"Run `{report.run}` started {report.started}, finished {report.finished or NONE}"
             f"{' (cancelled)' if report.cancelled else ''}; iop {report.iop_version or '?'}.", ""]
    conc = sorted({int(c) for p in report.providers for c in p.ttft_ms}) or [1]
    lines += ["| rank | provider | type | suggested capacity | TTFT p50 / p90 at 1 | tokens/s at the knee "
              "| agreement | flags |", "|---|---|---|---|---|---|---|---|"]
    for p in sorted(report.providers, key=lambda p: (p.rank or 10**6, p.provider)):
        agree = NONE if p.agreement is None else f"{p.agreement:.2f}"
        tps = NONE if p.tokens_per_s is None else f"{p.tokens_per_s:.1f}"
        lines.append(f"| {p.rank or NONE} | {p.provider} | {p.type} | {p.suggested_capacity or NONE} "
                     f"| {_lat(p.ttft_ms.get('1'))} | {tps} | {agree} | {', '.join(p.flags) or NONE} |")
    lines += ["", "## Throughput and latency by concurrency", "",
              "| provider | " + " | ".join(f"c={c}" for c in conc) + " |",
              "|---|" + "---|" * len(conc)]
    for p in report.providers:
        cells = []
        for c in conc:
            t = p.throughput.get(str(c))
            cells.append(NONE if t is None else f"{t:.1f} tok/s, TTFT {_lat(p.ttft_ms.get(str(c)))}, "
                         f"ITL {_lat(p.itl_ms.get(str(c)))}")
        lines.append(f"| {p.provider} | " + " | ".join(cells) + " |")
    lines += ["", "## Lifecycle (declared / verified)", "",
              "| provider | " + " | ".join(("list", "load", "unload", "pull", "delete")) + " |",
              "|---|---|---|---|---|---|"]
    for p in report.providers:
        cells = []
        for action in ("list", "load", "unload", "pull", "delete"):
            check = p.lifecycle.get(action)
            if check is None:
                cells.append(NONE)
                continue
            verified = {True: "yes", False: "no", None: "?"}[check.verified]
            cells.append(f"{'yes' if check.declared else 'no'} / {verified}")
        lines.append(f"| {p.provider} | " + " | ".join(cells) + " |")
    if any(p.logprob_divergence is not None for p in report.providers):
        lines += ["", "Logprob divergence from the agreeing group's reference: " + ", ".join(
            f"{p.provider} {p.logprob_divergence:.3f}" for p in report.providers if p.logprob_divergence is not None)]
    if earlier is not None:
        lines += ["", f"## Since run `{earlier.run}` ({earlier.started})", "",
                  "| provider | TTFT p50 at 1 | tokens/s at the knee | suggested capacity | agreement |",
                  "|---|---|---|---|---|"]
        before = {p.provider: p for p in earlier.providers}
        for p in report.providers:
            b = before.get(p.provider)
            if b is None:
                lines.append(f"| {p.provider} | new | new | new | new |")
                continue
            lines.append(f"| {p.provider} | {_lat(b.ttft_ms.get('1'))} → {_lat(p.ttft_ms.get('1'))} "
                         f"| {b.tokens_per_s or 0:.1f} → {p.tokens_per_s or 0:.1f} "
                         f"| {b.suggested_capacity or NONE} → {p.suggested_capacity or NONE} "
                         f"| {b.agreement if b.agreement is not None else NONE} → "
                         f"{p.agreement if p.agreement is not None else NONE} |")
    if report.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in report.notes]
    return "\n".join(lines) + "\n"
