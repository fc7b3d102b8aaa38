"""Do a model's providers answer alike? Each fixed prompt (temperature 0, a seed) goes to every
provider; answers are compared pairwise by text similarity (difflib's ratio over words), and by
logprob divergence where both runtimes returned logprobs for the same tokens. The largest group
of providers that agree with each other is the reference; a provider whose mean similarity to
that group is under the threshold is flagged: another model served under the id, another
quantization, a broken chat template.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

THRESHOLD = 0.8


@dataclass
class Answer:
    text: str
    # (token, logprob) of each generated token, where the runtime said them.
    logprobs: list[tuple[str, float]] | None = None


@dataclass
class Agreement:
    score: dict[str, float | None] = field(default_factory=dict)
    divergence: dict[str, float | None] = field(default_factory=dict)
    group: list[str] = field(default_factory=list)
    flags: dict[str, list[str]] = field(default_factory=dict)


def similarity(a: str, b: str) -> float:
    wa, wb = a.split(), b.split()
    if not wa and not wb:
        return 1.0
    return difflib.SequenceMatcher(None, wa, wb, autojunk=False).ratio()


def divergence(a: list[tuple[str, float]] | None, b: list[tuple[str, float]] | None) -> float | None:
    """Mean |logprob difference| over the common prefix of the same tokens (None: no logprobs)."""
    if not a or not b:
        return None
    diffs = []
    for (ta, la), (tb, lb) in zip(a, b, strict=False):
        if ta != tb:
            break
        diffs.append(abs(la - lb))
    return round(sum(diffs) / len(diffs), 4) if diffs else None


def compare(answers: dict[str, dict[str, Answer]], threshold: float = THRESHOLD) -> Agreement:
    """``answers``: provider -> prompt id -> its answer. Two providers are compared over the
    prompts both answered; a provider that answered none is flagged ``no_answers`` and left out
    of the grouping (one broken provider must not make the others look divergent)."""
    out = Agreement()
    answering = sorted(p for p, a in answers.items() if a)
    for p in sorted(set(answers) - set(answering)):
        out.score[p] = None
        out.divergence[p] = None
        out.flags[p] = ["no_answers"]
    if not answering:
        return out

    def common(p: str, q: str) -> list[str]:
        return sorted(set(answers[p]) & set(answers[q]))

    def mean_sim(p: str, q: str) -> float:
        shared = common(p, q)
        if not shared:
            return 0.0  # nothing to compare them on: no evidence that they agree
        return sum(similarity(answers[p][i].text, answers[q][i].text) for i in shared) / len(shared)

    sims = {(p, q): mean_sim(p, q) for p in answering for q in answering if p < q}

    def sim(p: str, q: str) -> float:
        return 1.0 if p == q else sims[(min(p, q), max(p, q))]

    # The largest group whose members all agree pairwise (few providers: every subset is fine
    # up to 12; greedy past that). Ties go to the subset of the alphabetically first members.
    best: list[str] = [answering[0]]
    if len(answering) <= 12:
        for mask in range(1, 1 << len(answering)):
            group = [p for i, p in enumerate(answering) if mask >> i & 1]
            if len(group) > len(best) and all(sim(p, q) >= threshold for p in group for q in group):
                best = group
    else:
        for p in answering:
            group = [q for q in answering if sim(p, q) >= threshold]
            if len(group) > len(best):
                best = group
    out.group = best
    # No group is a majority: which side is right cannot be told.
    tie = len(answering) > 1 and len(best) * 2 <= len(answering)
    ref = best[0]
    for p in answering:
        others = [q for q in best if q != p]
        out.score[p] = round(sum(sim(p, q) for q in others) / len(others), 4) if others else (
            1.0 if len(answering) == 1 else round(max(sim(p, q) for q in answering if q != p), 4))
        divs = [d for i in common(p, ref)
                if (d := divergence(answers[p][i].logprobs, answers[ref][i].logprobs)) is not None]
        out.divergence[p] = round(sum(divs) / len(divs), 4) if divs and p != ref else (0.0 if divs else None)
        flags = []
        if p not in best or (out.score[p] or 0) < threshold:
            flags.append("diverges")
        if tie:
            flags.append("no_majority")
        out.flags[p] = flags
    return out
