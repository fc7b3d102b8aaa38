"""Streams that outlive their provider: an answer cut after output began goes on as a
*continuation* on another provider of its model, and the caller sees one whole answer
(docs/API.md "Continued answers", docs/DESIGN.md "Streams that outlive their provider").

The API replica relaying a stream is the one place that holds all of it: the chunks it
relayed are kept as they are (a reference each, nothing parsed while nothing fails), and only
a cut reads them. :class:`Transcript` reads a cut stream's chunks -- its id, its text so far,
whether it may be continued faithfully -- and makes the continuation's request: the same
request with the text so far as a trailing assistant message (chat: with
``continue_final_message``, which vLLM, SGLang and llama.cpp's server honour) or appended to the prompt
(completions), ``max_tokens`` less what was used. :class:`Splice` rewrites the
continuation's chunks into the caller's stream: the first stream's id and ``created``, no
second role chunk, the usage of the whole answer, and an ``iop`` member on the chunk that
ends it naming the providers that wrote it.

Not continued (the stream ends with its error, as before): anything but chat/completions
and completions streams; a cut inside a tool call, or while the model was still reasoning;
a structured output (``response_format``), ``n`` > 1, ``logprobs`` or ``echo`` on
completions; a model with ``continue_streams: false`` or no continuation left of its
``max_continuations``; no provider of the model whose type can continue
(``dispatcher/capability_flags.py`` ``CONTINUES``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from redis.exceptions import RedisError

from api.waiting import JobWait
from dispatcher.capability_flags import CONTINUES
from dispatcher.endpoints import CHAT, COMPLETIONS
from dispatcher.envelope import unwrap, wrap
from dispatcher.events import Usage
from dispatcher.script_calls import SubmitStatus

if TYPE_CHECKING:
    from api.gateway import Gateway
    from api.intake import Intake
    from api.runtime import Runtime

log = logging.getLogger("iop.api")

# The failures a continuation answers: the stream was cut (the provider's connection reset
# or refused, its stream stopped without its end), or its worker was lost (killed, or
# drained with a deadline). Anything else is the provider's or the request's own answer.
CONTINUABLE_CODES = frozenset({"provider_error", "worker_lost"})
ENDPOINTS = frozenset({CHAT, COMPLETIONS})
# The most of a stream kept for a continuation; a longer one is not continued (a chunk is
# a token's few hundred bytes: about 20,000 tokens).
MAX_KEPT_BYTES = 8 * 1024 * 1024

_decode = msgspec.json.Decoder(dict[str, Any]).decode
_encode = msgspec.json.Encoder().encode


def _choice(chunk: dict[str, Any]) -> dict[str, Any] | None:
    choices = chunk.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0]
    return None


@dataclass
class Transcript:
    """What a cut stream carried, read from its chunks (JSON payloads, as relayed)."""

    endpoint: str
    id: str | None = None
    created: Any = None
    text: list[str] = field(default_factory=list)
    tokens: int = 0  # chunks that carried text: a token each, on the engines iop fronts
    reasoning: bool = False  # reasoning deltas came ...
    tool_call: bool = False
    several: bool = False  # more than one choice
    ended: bool = False  # a finish_reason came: the answer was whole

    @classmethod
    def read(cls, endpoint: str, chunks: list[bytes]) -> Transcript:
        t = cls(endpoint)
        for raw in chunks:
            try:
                chunk = _decode(raw)
            except msgspec.DecodeError:
                continue
            t.feed(chunk)
        return t

    def feed(self, chunk: dict[str, Any]) -> None:
        if self.id is None and isinstance(chunk.get("id"), str):
            self.id, self.created = chunk["id"], chunk.get("created")
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            if choice.get("index", 0) != 0:
                self.several = True
                continue
            if choice.get("finish_reason"):
                self.ended = True
            if self.endpoint == CHAT:
                delta = choice.get("delta") or {}
                if delta.get("tool_calls") or delta.get("function_call"):
                    self.tool_call = True
                if delta.get("reasoning_content") or delta.get("reasoning"):
                    self.reasoning = True
                piece = delta.get("content")
            else:
                piece = choice.get("text")
            if isinstance(piece, str) and piece:
                self.text.append(piece)
                self.tokens += 1

    @property
    def so_far(self) -> str:
        return "".join(self.text)

    def why_not(self) -> str | None:
        """Why this stream may not be continued faithfully; None when it may."""
        if self.ended:
            return "the answer had ended"
        if self.several:
            return "several choices"
        if self.tool_call:
            return "cut inside a tool call"
        if self.reasoning and not self.text:
            return "cut while the model was reasoning"
        return None


def request_problem(endpoint: str, body: dict[str, Any]) -> str | None:
    """Why a request's answer could not be continued, whatever the cut; None when it could."""
    if endpoint not in ENDPOINTS:
        return "not a chat or completions stream"
    n = body.get("n")
    if isinstance(n, int) and n > 1:
        return "n > 1"
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"):
        return "a structured output"
    if body.get("guided_json") is not None or body.get("guided_regex") is not None \
            or body.get("guided_grammar") is not None:
        return "a structured output"
    if endpoint == COMPLETIONS:
        if body.get("echo") or body.get("logprobs") or not isinstance(body.get("prompt"), str):
            return "echo, logprobs or a prompt that is not one string"
        best_of = body.get("best_of")
        if isinstance(best_of, int) and best_of > 1:
            return "best_of > 1"
    elif not isinstance(body.get("messages"), list):
        return "no messages"
    return None


def continuation_body(body: dict[str, Any], endpoint: str, t: Transcript) -> bytes | None:
    """The request that continues ``t``; None when the answer used every token it may."""
    out = dict(body)
    for name in ("max_tokens", "max_completion_tokens"):
        limit = out.get(name)
        if isinstance(limit, int) and not isinstance(limit, bool):
            if limit - t.tokens <= 0:
                return None
            out[name] = limit - t.tokens
    if endpoint == CHAT:
        messages = list(out["messages"])
        if t.text:
            messages.append({"role": "assistant", "content": t.so_far})
            out["continue_final_message"] = True
            out["add_generation_prompt"] = False
        out["messages"] = messages
    elif t.text:
        out["prompt"] = out["prompt"] + t.so_far
    return _encode(out)


@dataclass
class Splice:
    """Rewrites a continuation's chunks into the caller's stream (see the module's text)."""

    endpoint: str
    id: str | None
    created: Any
    before: int  # tokens relayed before the cut (every earlier segment's)
    providers: list[str]

    def chunks(self, chunks: list[bytes]) -> list[bytes]:
        out: list[bytes] = []
        for raw in chunks:
            try:
                chunk = _decode(raw)
            except msgspec.DecodeError:
                out.append(raw)
                continue
            rewritten = self.chunk(chunk)
            if rewritten is not None:
                out.append(_encode(rewritten))
        return out

    def chunk(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        if self.id is not None and "id" in chunk:
            chunk["id"] = self.id
        if self.created is not None and "created" in chunk:
            chunk["created"] = self.created
        choice = _choice(chunk)
        if choice is not None and self.endpoint == CHAT:
            delta = choice.get("delta")
            # The role chunk: the caller had it from the first segment.
            if isinstance(delta, dict) and "role" in delta and not delta.get("content") \
                    and not choice.get("finish_reason") and set(delta) <= {"role", "content", "refusal"}:
                return None
            if isinstance(delta, dict):
                delta.pop("role", None)
        if choice is not None and choice.get("finish_reason"):
            chunk["iop"] = {"continued": len(self.providers) - 1, "providers": list(self.providers)}
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            chunk["usage"] = self.usage(usage)
        return chunk

    def end_usage(self, usage: Usage) -> Usage:
        """The whole answer's usage, as the metrics and the tenant's budget count it."""
        return Usage(max(usage.prompt - self.before, 0), usage.completion + self.before, usage.cached)

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The whole answer's: the original prompt once (the continuation's prompt held the text
        so far), every generated token."""
        out = dict(usage)
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int) and isinstance(completion, int):
            out["prompt_tokens"] = max(prompt - self.before, 0)
            out["completion_tokens"] = completion + self.before
            out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
        return out


class Continuer:
    """Resubmits one request's cut stream as continuations, one at a time (the relaying
    stream asks, after the previous one ended): built by the relay with what the submit
    needs, read only at a cut, so a stream that is never cut pays nothing but a reference."""

    def __init__(self, gw: Gateway, rt: Runtime, intake: Intake) -> None:
        self.gw, self.rt, self.intake = gw, rt, intake
        self.done = 0  # continuations so far

    def possible(self) -> bool:
        """Whether a cut of this request's stream could be continued at all (kept chunks)."""
        m = self.intake.model
        return self.intake.endpoint in ENDPOINTS and m.continue_streams and m.max_continuations > 0

    def why_off(self, kept_bytes: int) -> str:
        """Why a cut of a stream that kept nothing is not continued."""
        m = self.intake.model
        if self.intake.endpoint not in ENDPOINTS:
            return "not a chat or completions stream"
        if not m.continue_streams:
            return "continue_streams is off"
        if m.max_continuations <= 0:
            return "max_continuations is 0"
        return f"the stream was longer than the {MAX_KEPT_BYTES} bytes kept ({kept_bytes})"

    async def resume(self, kept: list[bytes], reason: str, providers: list[str]) -> Continued | str:
        """The continuation of a stream cut for ``reason`` that had relayed ``kept`` (every
        segment's chunks), its providers so far ``providers``: submitted, with its first
        event; or why not, in words (the stream then ends with its error)."""
        intake, model = self.intake, self.intake.model
        if self.done >= model.max_continuations:
            return f"no continuation left (max_continuations {model.max_continuations})"
        try:
            body = _decode(intake.body)
        except msgspec.DecodeError:
            return "the request body is not a JSON object"
        problem = request_problem(intake.endpoint, body)
        if problem is not None:
            return problem
        t = Transcript.read(intake.endpoint, kept)
        why = t.why_not()
        if why is not None:
            return why
        types = {p.id: p.type for _, p in self.rt.config.providers()}
        members = [pid for pid in intake.lane.providers if pid in types]
        excluded = [pid for pid in members if types[pid] not in CONTINUES]
        if len(excluded) == len(members):
            return "no provider of the model can continue an answer"
        new_body = continuation_body(body, intake.endpoint, t)
        if new_body is None:
            return "the answer had used its max_tokens"
        stored = wrap(msgspec.structs.replace(unwrap(intake.stored), body=new_body))
        gw, rt = self.gw, self.rt
        job_id = intake.tenant.job_id(gw.next_job_id()) if rt.tenants.flow_control else gw.next_job_id()
        wait = JobWait(job_id, model.id, intake.lane.queue, replies=gw.replies, jobs=rt.jobs, rules=rt.wait_rules,
                       spawn=gw.spawn)
        try:
            submitted = await rt.jobs.submit(job_id, intake.lane, stored, intake.endpoint, True, intake.pinned,
                                             intake.tenant, intake.blocks, None, 0, excluded, True)
        except RedisError as exc:
            wait.close()
            return f"Redis is unavailable: {exc}"
        if submitted.status not in (SubmitStatus.DISPATCHED, SubmitStatus.QUEUED):
            wait.refused()
            wait.close()
            return f"its submit answered {submitted.status.value}"
        wait.waiting(submitted)
        self.done += 1
        log.info("continuation: the stream of %s on %s was cut (%s) after %d token(s): continued as job %s (%d of %d)",
                 model.id, providers[-1] if providers else "?", reason, t.tokens, job_id, self.done,
                 model.max_continuations)
        return Continued(wait, Splice(intake.endpoint, t.id, t.created, t.tokens, list(providers)))


@dataclass
class Continued:
    wait: JobWait
    splice: Splice
