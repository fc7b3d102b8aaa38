"""The tokens of an answer, read from the provider's own ``usage``.

Each endpoint reports them its own way; what is read here:

* chat/completions, completions -- ``usage.prompt_tokens`` / ``completion_tokens`` of the
  JSON answer, or of a stream's chunks (the final usage-only chunk that
  ``stream_options.include_usage`` asks for, or usage in every chunk: vLLM's
  ``continuous_usage_stats``, cumulative, so the last one wins). A llama-server chat
  stream that did not ask has no usage, but its last chunk has ``timings``: the prompt is
  what it read plus what its cache held (``prompt_n`` + ``cache_n``), the completion
  ``predicted_n``.
* embeddings -- ``usage.prompt_tokens``.
* responses -- the JSON answer's ``usage.input_tokens`` / ``output_tokens``; in a stream,
  the ``response`` of ``response.completed`` (or ``.incomplete`` / ``.failed``).
* messages (Anthropic) -- ``usage.input_tokens`` (plus the cache reads and writes Anthropic
  counts apart) / ``output_tokens``; in a stream, ``message_start``'s ``message.usage``
  then ``message_delta``'s cumulative ``usage``: per count, the last one reported wins.
* rerank, score -- only ``usage.total_tokens``: all of it is prompt.
* audio transcriptions and translations, images -- ``usage`` with input/output tokens
  (a duration-based usage counts nothing).

Anything else counts nothing. Only answers to the endpoint's own POST count (not a
retrieve of a stored Response), and only 2xx JSON answers are decoded at all; a stream's
chunk is decoded only when its bytes hold ``"usage"``.

Of the prompt tokens, how many the runtime served from its prefix cache (``_cached``; they
travel in ``Usage.cached`` to the provider's totals in Redis and ``iop_cached_tokens_total``,
the measure of what cache-aware dispatch buys):

* OpenAI, vLLM (``--enable-prompt-tokens-details``), SGLang (``--enable-cache-report``),
  llama.cpp's OpenAI endpoints -- ``usage.prompt_tokens_details.cached_tokens``; the
  Responses API's ``usage.input_tokens_details.cached_tokens``.
* Anthropic (and llama.cpp's Messages) -- ``usage.cache_read_input_tokens``; DeepSeek's
  ``usage.prompt_cache_hit_tokens``.
* In a stream, the same ``usage`` wherever the usage above is read (a Responses event's
  ``response``, ``message_start``'s ``message``).
* llama.cpp -- ``timings.cache_n`` (its answers and final chunks carry ``timings``). Not
  the top-level ``tokens_cached`` of its ``/completion`` answers: that is every token
  the slot holds once the answer is done (``slot.n_past``: prompt plus generated
  tokens, cache hit or not), no measure of what the cache saved.
"""

from __future__ import annotations

import msgspec

from dispatcher.endpoints import Endpoint
from dispatcher.events import Done, End, Event, Usage
from workers.adapters.base import ProviderCall

# The endpoints whose answers may say how many tokens they took.
COUNTED = frozenset({
    "chat/completions", "completions", "embeddings", "responses", "messages", "rerank", "score",
    "audio/transcriptions", "audio/translations", "images/generations",
})
# Where iop may ask a stream for its usage (``stream_options.include_usage``).
ASKABLE = frozenset({"chat/completions", "completions"})

_USAGE = b'"usage"'
_TIMINGS = b'"timings"'


class _Counts(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    total_tokens: int | None = None
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None
    prompt_cache_hit_tokens: int | None = None
    # Raw (empty when absent): their shapes vary, and one that is odd must not lose the rest.
    prompt_tokens_details: msgspec.Raw = msgspec.Raw()
    input_tokens_details: msgspec.Raw = msgspec.Raw()


class _Answer(msgspec.Struct):
    usage: _Counts | None = None
    timings: msgspec.Raw = msgspec.Raw()  # llama.cpp's: cache_n


class _Chunk(msgspec.Struct):
    usage: _Counts | None = None
    # Raw: a chunk's other fields are none of iop's business, whatever their shape.
    choices: list[msgspec.Raw] | None = None
    # Raw (empty when absent): msgspec takes no Raw in a union.
    response: msgspec.Raw = msgspec.Raw()  # Responses lifecycle events
    message: msgspec.Raw = msgspec.Raw()  # Anthropic message_start
    timings: msgspec.Raw = msgspec.Raw()  # llama.cpp's: cache_n


class _Timings(msgspec.Struct):
    """The counts of llama-server's ``timings`` (its times are none of iop's business)."""

    cache_n: int | None = None
    prompt_n: int | None = None
    predicted_n: int | None = None


_answer = msgspec.json.Decoder(_Answer)
_timings = msgspec.json.Decoder(_Timings)
_chunk = msgspec.json.Decoder(_Chunk)
_object = msgspec.json.Decoder(dict[str, msgspec.Raw])
_NULL = b"null"


def final_usage(final: Event | None) -> Usage:
    """The tokens of a finished job as its final event says them (zeros when it says none):
    what ``lua/finish.lua`` adds to its provider's throughput and cache totals."""
    if isinstance(final, Done | End) and final.usage is not None:
        return final.usage
    return _NONE


_NONE = Usage(0, 0)


def completion_tokens(final: Event | None) -> int:
    """The tokens a finished job generated (its provider's throughput, ``lua/finish.lua``)."""
    return final_usage(final).completion


def counted(call: ProviderCall) -> bool:
    """Does this call's answer count (the endpoint's own POST, of an endpoint with usage)?"""
    return call.endpoint in COUNTED and call.method == "POST" and not call.path


def _pair(c: _Counts | None) -> tuple[int | None, int | None]:
    """(prompt, completion) as this ``usage`` says them; None where it says nothing."""
    if c is None:
        return None, None
    prompt = c.prompt_tokens
    if prompt is None and c.input_tokens is not None:
        prompt = c.input_tokens + (c.cache_creation_input_tokens or 0) + (c.cache_read_input_tokens or 0)
    completion = c.completion_tokens if c.completion_tokens is not None else c.output_tokens
    if prompt is None and completion is None and c.total_tokens is not None:
        prompt = c.total_tokens  # rerank, score: no generation, all of it read
    return prompt, completion


def _timed_pair(raw: msgspec.Raw) -> tuple[int | None, int | None]:
    """(prompt, completion) as llama-server's ``timings`` say them; None where they say nothing."""
    try:
        t = _timings.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return None, None
    if any(n is not None and n < 0 for n in (t.cache_n, t.prompt_n, t.predicted_n)):
        return None, None
    prompt = t.prompt_n + (t.cache_n or 0) if t.prompt_n is not None else None
    return prompt, t.predicted_n


def _usage(prompt: int | None, completion: int | None, cached: int | None = None) -> Usage | None:
    if prompt is None and completion is None:
        return None
    return Usage(max(prompt or 0, 0), max(completion or 0, 0), cached or 0)


_loose = msgspec.json.Decoder()


def _cached_in(raw: msgspec.Raw, key: str) -> int | None:
    """The count ``key`` of a JSON object left raw (None if it is no object, or says none)."""
    try:
        held = _loose.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return None
    return _count(held.get(key)) if isinstance(held, dict) else None


def _cached(c: _Counts | None, timings: msgspec.Raw) -> int | None:
    """The prompt tokens served from the cache, as this ``usage`` (and llama.cpp's
    ``timings``) say them: the sources of the module's docstring, in its order."""
    if c is not None:
        for details in (c.prompt_tokens_details, c.input_tokens_details):
            if details and (n := _cached_in(details, "cached_tokens")) is not None:
                return n
        for n in (c.cache_read_input_tokens, c.prompt_cache_hit_tokens):
            if n is not None and n >= 0:
                return n
    return _cached_in(timings, "cache_n") if timings else None


def json_usage(call: ProviderCall, status: int, content_type: str, body: bytes) -> Usage | None:
    """The usage of a whole (non-streamed) answer, if it says one."""
    if not (200 <= status < 300 and content_type.startswith("application/json") and counted(call)):
        return None
    if _USAGE not in body:
        return None
    try:
        answer = _answer.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None
    return _usage(*_pair(answer.usage), _cached(answer.usage, answer.timings))


class StreamUsage:
    """Reads the usage of a stream's events as they pass, and takes out what iop itself
    asked for (``hide``: the caller did not ask for ``include_usage``; iop did)."""

    def __init__(self, call: ProviderCall, spec: Endpoint) -> None:
        self.on = counted(call) and spec.stream != "bytes"
        self.typed = spec.stream == "typed_sse"
        self.hide = call.usage_asked and self.on and not self.typed
        self._prompt: int | None = None
        self._completion: int | None = None
        self._cached: int | None = None

    @property
    def usage(self) -> Usage | None:
        return _usage(self._prompt, self._completion, self._cached)

    def feed(self, payloads: list[bytes]) -> list[bytes]:
        """``payloads`` as the caller is to get them, their usage noted on the way."""
        if not self.on or not payloads:
            return payloads
        # One search in C over the batch (a fast provider's batch is a whole answer), then
        # a look at each payload only from the first that may hold usage on.
        joined = b"".join(payloads) if len(payloads) > 1 else payloads[0]
        found = [at for at in (joined.find(_USAGE), joined.find(_TIMINGS)) if at >= 0]
        if not found:
            return payloads
        at = min(found)
        first = 0
        for payload in payloads:
            at -= len(payload)
            if at < 0:
                break
            first += 1
        out: list[bytes] | None = None
        for i in range(first, len(payloads)):
            payload = payloads[i]
            kept: bytes | None = payload
            if _USAGE in payload or _TIMINGS in payload:
                kept = self._read(payload)
            if kept is not payload and out is None:
                out = payloads[:i]
            if out is not None and kept is not None:
                out.append(kept)
        return payloads if out is None else out

    def _read(self, payload: bytes) -> bytes | None:
        """Note the payload's usage; what of it goes on (None: nothing)."""
        data = payload.partition(b"\n")[2] if self.typed else payload
        try:
            chunk = _chunk.decode(data)
        except (msgspec.DecodeError, RecursionError):
            return payload  # not iop's to judge: the adapter checks its shape
        counts = chunk.usage
        for holder in (chunk.response, chunk.message):
            if counts is None and holder:
                counts = _held(holder)
        prompt, completion = _pair(counts) if counts is not None or not chunk.timings else _timed_pair(chunk.timings)
        cached = _cached(counts, chunk.timings)
        if cached is not None:
            self._cached = cached
        if prompt is not None:
            self._prompt = prompt
        if completion is not None:
            self._completion = completion
        if not self.hide:
            return payload
        if counts is not None and chunk.choices == []:
            return None  # the usage-only chunk iop asked for
        if counts is None and _USAGE in payload:
            # OpenAI puts ``"usage": null`` in every chunk once usage is asked for.
            return _without_null_usage(payload)
        return payload


def _held(holder: msgspec.Raw) -> _Counts | None:
    """The ``usage`` of the object an event carries (a Responses ``response``, a Messages
    ``message``)."""
    try:
        return _answer.decode(holder).usage
    except (msgspec.DecodeError, RecursionError):
        return None


def _without_null_usage(payload: bytes) -> bytes:
    try:
        obj = _object.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        return payload
    raw = obj.get("usage")
    if raw is None or bytes(raw) != _NULL:
        return payload
    del obj["usage"]
    return msgspec.json.encode(obj)


def _count(value: object) -> int | None:
    """A token count as a provider reports it: an integer, not negative (nor a bool)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None
