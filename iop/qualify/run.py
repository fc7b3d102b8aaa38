"""``iop qualify --url URL --model M [--provider P ...] [--json]``: start a run in the API, run
the benchmark and the agreement prompts through iop against each provider, store the report,
print it (a table, ``--json`` the stored document, ``--markdown`` its Markdown export)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from dispatcher.qualifications import LifecycleCheck, ProviderReport, Report, encode, markdown
from iop.qualify.agreement import Answer, compare
from iop.qualify.workload import (
    LONG_PROMPT,
    Client,
    Ladder,
    Step,
    Stopped,
    found_knee,
    knee,
    ladder,
    latency,
    step,
)

PROMPTS = Path(__file__).resolve().parent / "prompts.json"


@dataclass
class Options:
    url: str
    model: str
    key: str | None = None
    providers: list[str] = field(default_factory=list)
    prompts_file: str | None = None
    max_tokens: int = 64
    requests_per_step: int = 8
    max_concurrency: int | None = None
    answer_tokens: int = 48
    lifecycle_delete: bool = False


def prompts(extra: str | None) -> list[dict[str, Any]]:
    """The prompts that ship with iop, then an operator's (a JSON list of {id, messages})."""
    found: list[dict[str, Any]] = json.loads(PROMPTS.read_text())
    if extra:
        more = json.loads(Path(extra).read_text())
        if not isinstance(more, list) or not all(isinstance(p, dict) and "id" in p and "messages" in p for p in more):
            raise ValueError(f"{extra}: a JSON list of {{\"id\", \"messages\"}} objects is expected")
        found += more
    return found


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


async def _admin(session: aiohttp.ClientSession, o: Options, method: str, path: str, body: Any = None) -> Any:
    headers = {"Authorization": f"Bearer {o.key}"} if o.key else {}
    async with session.request(method, o.url.rstrip("/") + path, json=body, headers=headers) as resp:
        text = await resp.text()
        if resp.status >= 400:
            raise RuntimeError(f"{method} {path} answered {resp.status}: {_message(text)}")
        return json.loads(text) if text else None


def _message(text: str) -> str:
    """The ``message`` of an error answer (what says how to fix it), else its first 300 characters."""
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:300]
    return str(message)


async def _answers(client: Client, provider: str, fixed: list[dict[str, Any]], tokens: int) -> dict[str, Answer]:
    out = {}
    for p in fixed:
        r = await client.chat(provider, p["messages"], tokens, stream=False, deterministic=True, logprobs=True)
        if not r.ok:  # a runtime that refuses logprobs: the text alone
            r = await client.chat(provider, p["messages"], tokens, stream=False, deterministic=True)
        if r.ok:
            out[p["id"]] = Answer(r.text.strip(), r.logprobs)
    return out


async def qualify(o: Options, say: Any = None) -> Report:
    say = say or (lambda _m: None)
    fixed = prompts(o.prompts_file)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as admin:
        run = await _admin(admin, o, "POST", f"/admin/qualifications/{o.model}/runs",
                           {"providers": o.providers, "lifecycle_delete": o.lifecycle_delete})
        started = _now()
        client = Client(o.url, o.key, run["run"], o.model)
        curves: dict[str, list[Step]] = {}
        long: dict[str, Step] = {}
        answers: dict[str, dict[str, Answer]] = {}
        notes: list[str] = []
        cut: dict[str, list[str]] = {}  # provider -> the bounds that ended its sweep before a knee
        cancelled = False
        try:
            for p in run["providers"]:
                pid = p["provider"]
                curves[pid] = []
                bounded = ladder(run["max_in_flight"], p["capacity"], o.max_concurrency)
                for c in bounded.levels:
                    s = await step(client, pid, c, max(o.requests_per_step, 2 * c), o.max_tokens)
                    say(f"{pid}: concurrency {c}: {s.tokens_per_s:.1f} tokens/s")
                    curves[pid].append(s)
                    if len(curves[pid]) > 1 and knee(curves[pid]) != c:
                        break  # throughput stopped growing
                else:  # a bound ended the ladder while throughput still grew: no knee found
                    cut[pid] = bounded.bounds
                    notes.append(sweep_note(pid, bounded, curves[pid], run))
                    say(f"{pid}: {notes[-1]}")
                long[pid] = await step(client, pid, 1, 2, o.max_tokens, LONG_PROMPT)
            for p in run["providers"]:
                answers[p["provider"]] = await _answers(client, p["provider"], fixed, o.answer_tokens)
                say(f"{p['provider']}: {len(answers[p['provider']])} of {len(fixed)} agreement prompts answered")
        except (Stopped, asyncio.CancelledError, KeyboardInterrupt) as exc:
            cancelled = True
            notes.append(f"stopped early: {exc or 'interrupted'}")
            with contextlib.suppress(RuntimeError):  # refused already: cancelled or over its bounds
                await _admin(admin, o, "DELETE", f"/admin/qualifications/runs/{run['run']}")
        finally:
            await client.close()
        report = _report(o, run, started, curves, long, answers, fixed, cancelled, notes, cut)
        await _admin(admin, o, "POST", f"/admin/qualifications/{o.model}", msgspec.to_builtins(report))
    return report


def sweep_note(provider: str, bounded: Ladder, steps: list[Step], run: dict[str, Any]) -> str:
    """What ended ``provider``'s sweep before throughput stopped growing, and how to measure
    further: a line of the report's notes."""
    why = {
        "share": f"the run's share of the model's slots (qualify.share {run['share']:g}: {run['max_in_flight']} "
                 "at once; raise it to measure further)",
        "capacity": f"its capacity in iop ({bounded.top}: iop sends it no more at once, so a higher step would "
                    "time iop's own queue; qualify it with a higher capacity to find its knee)",
        "max_concurrency": f"--max-concurrency {bounded.top}",
    }
    said = " and ".join(why[b] for b in bounded.bounds)
    if not steps:
        return f"{provider}: not measured: the sweep allows no call at once, by {said}"
    return (f"{provider}: no knee found, so no suggested_capacity: throughput still grew at concurrency "
            f"{steps[-1].concurrency}, the sweep's last step under {said}")


def _report(o: Options, run: dict[str, Any], started: str, curves: dict[str, list[Step]], long: dict[str, Step],
            answers: dict[str, dict[str, Answer]], fixed: list[dict[str, Any]], cancelled: bool,
            notes: list[str], cut: dict[str, list[str]] | None = None) -> Report:
    agree = compare({p: a for p, a in answers.items()})
    out = []
    for p in run["providers"]:
        pid = p["provider"]
        steps = curves.get(pid, [])
        all_results = [r for s in steps for r in s.results]
        ttft = {str(s.concurrency): v for s in steps if (v := latency([r.ttft_s for r in s.results
                                                                      if r.ok and r.ttft_s is not None]))}
        itl = {str(s.concurrency): v for s in steps if (v := latency([g for r in s.results if r.ok for g in r.itl_s]))}
        throughput = {str(s.concurrency): round(s.tokens_per_s, 2) for s in steps}
        lstep = long.get(pid)
        flags = list(agree.flags.get(pid, [])) if pid in answers else ["not_compared"]
        errors = sum(1 for r in all_results if not r.ok)
        if errors:
            flags.append("errors")
        out.append(ProviderReport(
            provider=pid, served_name=p["served_name"], type=p["type"], node=p["node"],
            suggested_capacity=found_knee(steps) if steps else None, sweep_cut_by=(cut or {}).get(pid, []),
            ttft_ms=ttft, itl_ms=itl, throughput=throughput,
            tokens_per_s=round(max(throughput.values()), 2) if throughput else None,
            long_prompt_ttft_ms=latency([r.ttft_s for r in lstep.results if r.ok and r.ttft_s is not None])
            if lstep else None,
            agreement=agree.score.get(pid), logprob_divergence=agree.divergence.get(pid), flags=flags,
            lifecycle={a: msgspec.convert(c, LifecycleCheck) for a, c in p["lifecycle"].items()}, errors=errors))
    ranked = sorted((r for r in out if "1" in r.ttft_ms), key=lambda r: r.ttft_ms["1"].p50)
    ranks = {r.provider: i + 1 for i, r in enumerate(ranked)}
    out = [msgspec.structs.replace(r, rank=ranks.get(r.provider)) for r in out]
    config = {"max_tokens": o.max_tokens, "requests_per_step": o.requests_per_step,
              "max_concurrency": o.max_concurrency, "max_in_flight": run["max_in_flight"], "share": run["share"],
              "max_seconds": run["max_seconds"], "answer_tokens": o.answer_tokens,
              "prompts": [p["id"] for p in fixed], "prompts_file": o.prompts_file, "agreeing_group": agree.group,
              "lifecycle_delete": o.lifecycle_delete}
    return Report(o.model, started, run["run"], _now(), run["iop_version"], cancelled, config, out, notes)


def table(report: Report) -> str:
    rows = [["RANK", "PROVIDER", "TYPE", "CAPACITY", "TTFT p50/p90 @1", "TOK/S", "AGREE", "FLAGS"]]
    for p in sorted(report.providers, key=lambda p: (p.rank or 10**6, p.provider)):
        t = p.ttft_ms.get("1")
        rows.append([str(p.rank or "-"), p.provider, p.type, str(p.suggested_capacity or "-"),
                     f"{t.p50:.0f}/{t.p90:.0f} ms" if t else "-",
                     f"{p.tokens_per_s:.1f}" if p.tokens_per_s is not None else "-",
                     f"{p.agreement:.2f}" if p.agreement is not None else "-", ", ".join(p.flags) or "-"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def main(argv: Any) -> int:
    o = Options(url=argv.url, model=argv.model, key=os.environ.get(argv.key_env), providers=argv.provider or [],
                prompts_file=argv.prompts, max_tokens=argv.max_tokens, requests_per_step=argv.requests,
                max_concurrency=argv.max_concurrency, lifecycle_delete=argv.lifecycle_delete)
    quiet = argv.json or argv.markdown
    try:
        report = asyncio.run(qualify(o, None if quiet else lambda m: print(m, file=sys.stderr)))
    except (RuntimeError, ValueError, OSError, aiohttp.ClientError) as exc:
        print(f"iop qualify: {exc}", file=sys.stderr)
        return 1
    if argv.json:
        print(encode(report).decode())
    elif argv.markdown:
        print(markdown(report), end="")
    else:
        print(table(report))
        for note in report.notes:  # a sweep cut short, a run stopped early: the table alone hides it
            print(f"note: {note}")
    return 2 if any("diverges" in p.flags for p in report.providers) else 0
