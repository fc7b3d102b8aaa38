"""What a request's prompt has in common with earlier ones, for cache-aware dispatch.

A runtime that served a prompt keeps its KV cache: vLLM and SGLang keep the attention
state of the blocks of tokens they computed (vLLM's automatic prefix caching hashes
fixed-size token blocks, each hash chained to the one before; SGLang keeps a radix tree
of token sequences), and llama.cpp's server reuses the longest common head of the
prompt a slot last held. A request sent where its head was computed before skips that
prefill -- and the head of a long conversation, or a large system prompt with its
tools, is the costly part of every turn. Dispatch can only use that if it can tell,
cheaply and before any tokenizer runs, which requests share a head.

:func:`blocks_of` approximates the runtime's token blocks with byte blocks of a
*canonical rendering* of the prompt: the parts of the request the runtime's template
renders -- tools first (templates render them into the system prompt), then the system
prompt or instructions, then the messages -- each part one record of compact JSON with
sorted keys, so that neither a client's key order nor the rest of the request
(``model``, ``stream``, sampling parameters, ``max_tokens``, ``user``...) changes
anything. Each record ends with a newline and nothing closes the list, so the rendering
of a conversation is a byte prefix of the rendering of its next turn. The blocks are
hashed chained (each hash covers the one before it), so a block's hash stands for the
whole head up to it: two requests share their first *k* hashes exactly when their
renderings share their first *k* blocks, however their tails differ. A block is 1,024
bytes, about 256 tokens; only a head match matters, so only the first
:data:`MAX_BLOCKS` are kept.

The last, partial block is kept too: it makes a short prompt, or the same prompt sent
again, comparable at all. A conversation's next turn shares every full block before it.

:func:`session_of` is the other signal: the caller's own name for a conversation
(``x-session-id``, ``user``, Anthropic's ``metadata.user_id``, the Responses API's
``previous_response_id``), for callers whose prompts change from the head on, or whose
conversation lives on the provider (a stored response's).

Neither raises on a malformed body. The body is decoded straight into the few fields
that make a prompt; when one of them has a shape the runtime would refuse, the rendering
ends where that shape is found and what came before it is hashed (nothing, when no
message or prompt came before it).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import msgspec

# About 256 tokens of English text or JSON: each block of the rendering is hashed once.
BLOCK_CHARS = 1024
# The first 64 blocks (64 KiB, ~16k tokens): where two prompts part, a head is matched.
MAX_BLOCKS = 64

SESSION_HEADER = "x-session-id"

# Sorted keys, struct fields included: a client's key order is not the prompt.
_ENCODE = msgspec.json.Encoder(order="sorted").encode
_NL = b"\n"
# What encoding a value no JSON holds (a dict body built in Python) may raise.
_UNENCODABLE = (TypeError, ValueError, OverflowError, RecursionError, msgspec.MsgspecError)


# --------------------------------------------------------------------------- the prompt's fields
# Each body type lists the fields that make the prompt, in the order they are rendered;
# a body's other fields are skipped while it is decoded. ``None`` is absent or null.


class _ChatMessage(msgspec.Struct, omit_defaults=True):
    """What of a chat message its template renders (not OpenAI's ``refusal``,
    ``annotations``, ``audio``; nor ``reasoning_content``, which templates drop from
    earlier turns). Absent and null are the same."""

    role: str
    content: str | list[Any] | None = None
    name: Any = None
    tool_calls: Any = None
    tool_call_id: Any = None


class _AnthropicMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | list[Any] | None = None


class _Chat(msgspec.Struct):
    tools: list[Any] | None = None
    messages: list[_ChatMessage] | None = None


class _Messages(msgspec.Struct):
    tools: list[Any] | None = None
    system: str | list[Any] | None = None
    messages: list[_AnthropicMessage] | None = None


class _Responses(msgspec.Struct):
    tools: list[Any] | None = None
    instructions: str | None = None
    input: str | list[dict[str, Any]] | None = None


class _Completions(msgspec.Struct):
    prompt: str | list[Any] | None = None


_Body = TypeVar("_Body", _Chat, _Messages, _Responses, _Completions)

# The item type of each body's last field, a list: a malformed item keeps those before it.
_ITEMS: dict[type[Any], Any] = {_Chat: _ChatMessage, _Messages: _AnthropicMessage, _Responses: dict[str, Any]}
_DECODERS: dict[type[Any], msgspec.json.Decoder[Any]] = {
    kind: msgspec.json.Decoder(kind) for kind in (_Chat, _Messages, _Responses, _Completions)
}
_OBJECT = msgspec.json.Decoder(dict[str, Any])


def _load(body: Mapping[str, Any] | bytes, kind: type[_Body]) -> _Body | None:
    """The prompt's fields of ``body``, as far as they have the shapes a runtime takes;
    None if the body is no JSON object at all."""
    try:
        if isinstance(body, bytes | bytearray):
            decoded: _Body = _DECODERS[kind].decode(body)
            return decoded
        return msgspec.convert(body, kind)
    except msgspec.ValidationError:
        pass  # a field of another shape: read the fields one by one
    except (msgspec.DecodeError, RecursionError):
        return None
    fields: Any = body
    if isinstance(body, bytes | bytearray):
        try:
            fields = _OBJECT.decode(body)
        except (msgspec.MsgspecError, RecursionError):
            return None
    if not isinstance(fields, Mapping):
        return None
    return _salvage(fields, kind)


def _salvage(fields: Mapping[str, Any], kind: type[_Body]) -> _Body:
    """The fields of ``kind`` before the first of another shape (those after it are left
    absent: the rendering ends there); of the last field, the list of messages or items,
    the items before the first of another shape."""
    values: dict[str, Any] = {}
    last = kind.__struct_fields__[-1]
    for info in msgspec.structs.fields(kind):
        value = fields.get(info.name)
        try:
            values[info.name] = msgspec.convert(value, info.type)
            continue
        except (msgspec.ValidationError, RecursionError):
            pass
        item_type = _ITEMS.get(kind)
        if info.name == last and item_type is not None and isinstance(value, list):
            head: list[Any] = []
            for item in value:
                try:
                    head.append(msgspec.convert(item, item_type))
                except (msgspec.ValidationError, RecursionError):
                    break
            values[info.name] = head
        break
    return kind(**values)


# --------------------------------------------------------------------------- rendering


class _Stop(Exception):
    """The rendering ends here."""


class _Full(_Stop):
    """The rendering holds all the blocks that are kept."""


class _Unencodable(_Stop):
    """A value no JSON holds (a dict body built in Python): the rendering ends before it."""


class _Rendering:
    def __init__(self, endpoint: str, limit: int) -> None:
        self.parts = [endpoint.encode(), _NL]
        self.size = len(self.parts[0]) + 1
        self.limit = limit
        # Records of the prompt itself (tools alone are none): without one, no blocks.
        self.prompt = 0

    def add(self, record: Any, prompt: bool = True) -> None:
        try:
            data = _ENCODE(record)
        except _UNENCODABLE:
            raise _Unencodable from None
        self.parts += (data, _NL)
        self.size += len(data) + 1
        self.prompt += prompt
        if self.size >= self.limit:
            raise _Full

    def data(self) -> bytes:
        return b"".join(self.parts)[: self.limit] if self.prompt else b""

    def plain(self, blocks: list[Any]) -> list[Any]:
        """Content blocks or tools as a template sees them: without Anthropic's
        ``cache_control``, a breakpoint clients move every turn (the prompt stays the same)."""
        if not any(isinstance(b, dict) and "cache_control" in b for b in blocks):
            return blocks
        return [{k: v for k, v in b.items() if k != "cache_control"} if isinstance(b, dict) else b for b in blocks]

    def tools(self, tools: list[Any] | None) -> None:
        if tools:
            self.add({"tools": self.plain(tools)}, prompt=False)


def _chat(r: _Rendering, body: _Chat) -> None:
    if body.messages is None:
        return
    r.tools(body.tools)
    for m in body.messages:
        if isinstance(m.content, list):
            m = msgspec.structs.replace(m, content=r.plain(m.content))
        r.add(m)


def _messages(r: _Rendering, body: _Messages) -> None:
    if body.messages is None:
        return
    r.tools(body.tools)
    if body.system is not None:
        r.add({"system": r.plain(body.system) if isinstance(body.system, list) else body.system})
    for m in body.messages:
        if isinstance(m.content, list):
            m = msgspec.structs.replace(m, content=r.plain(m.content))
        r.add(m)


# Of an input item, what a runtime does not render: the ids of earlier output, its status.
_UNRENDERED_ITEM_KEYS = frozenset({"id", "status"})


def _responses(r: _Rendering, body: _Responses) -> None:
    if body.input is None:
        return
    r.tools(body.tools)
    if body.instructions is not None:
        r.add({"instructions": body.instructions})
    if isinstance(body.input, str):
        r.add({"content": body.input, "role": "user"})  # the same as that one message
        return
    for item in body.input:
        record = {k: v for k, v in item.items() if k not in _UNRENDERED_ITEM_KEYS}
        if record.get("type") == "message":
            del record["type"]  # the same message as one without a type
        r.add(record)


def _completions(r: _Rendering, body: _Completions) -> None:
    prompt = body.prompt
    if isinstance(prompt, str):
        r.add(prompt)
    elif prompt:
        first = prompt[0]
        if isinstance(first, str | list):
            r.add(first)  # a batch: its first prompt, a string or a token list
        elif isinstance(first, int) and not isinstance(first, bool):
            r.add(prompt)  # one prompt as a token list


def _renderer(kind: type[_Body], render: Callable[[_Rendering, _Body], None]) -> Callable[
        [_Rendering, Mapping[str, Any] | bytes], None]:
    def run(r: _Rendering, body: Mapping[str, Any] | bytes) -> None:
        loaded = _load(body, kind)
        if loaded is not None:
            render(r, loaded)
    return run


_RENDERERS = {
    "chat/completions": _renderer(_Chat, _chat),
    "completions": _renderer(_Completions, _completions),
    "responses": _renderer(_Responses, _responses),
    "messages": _renderer(_Messages, _messages),
}


def rendering(endpoint: str, body: Mapping[str, Any] | bytes, limit: int = BLOCK_CHARS * MAX_BLOCKS) -> bytes:
    """The canonical rendering of a request's prompt, cut at ``limit`` bytes: ``b""`` for
    an endpoint without a prompt, or a body without one iop can read."""
    render = _RENDERERS.get(endpoint)
    if render is None or limit <= 0:
        return b""
    if not isinstance(body, bytes | bytearray | Mapping):
        return b""
    r = _Rendering(endpoint, limit)
    with contextlib.suppress(_Stop):
        render(r, body)
    return r.data()


def blocks_of(endpoint: str, body: dict[str, Any] | bytes, block_chars: int = BLOCK_CHARS,
              max_blocks: int = MAX_BLOCKS) -> list[str]:
    """The chained hashes of the first ``max_blocks`` blocks of ``block_chars`` bytes of
    the request's canonical prompt rendering (:func:`rendering`), the last one partial:
    ``h_i = blake2b(h_{i-1} + block_i, digest_size=8)``, in hex, ``h_{i-1}`` as its hex's
    ASCII bytes and empty for the first block. ``[]`` for an endpoint without a prompt
    (embeddings, rerank, audio...) or a body without a prompt iop can read.
    """
    if block_chars <= 0 or max_blocks <= 0:
        return []
    data = rendering(endpoint, body, block_chars * max_blocks)
    view = memoryview(data)
    hashes: list[str] = []
    previous = b""
    for start in range(0, len(data), block_chars):
        h = hashlib.blake2b(previous, digest_size=8)
        h.update(view[start:start + block_chars])
        digest = h.hexdigest()
        hashes.append(digest)
        previous = digest.encode()
    return hashes


# --------------------------------------------------------------------------- sessions

# Endpoints whose body ``user`` names the caller's end user (OpenAI's).
_USER_ENDPOINTS = frozenset({"chat/completions", "completions", "responses"})


def _named(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _header(headers: Mapping[str, str], name: str) -> object:
    value = headers.get(name)
    if value is None:
        # Headers as they came, in a plain dict: their names are not case-sensitive.
        for key, v in headers.items():
            if isinstance(key, str) and key.lower() == name:
                return v
    return value


def session_block(key: str) -> str:
    """The one block a conversation key stands for in the prefix index (``s`` + its hash:
    never equal to a prompt block's)."""
    return "s" + hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


def session_of(endpoint: str, body: dict[str, Any], headers: Mapping[str, str]) -> str | None:
    """The caller's key for the conversation a request belongs to, prefixed by where it
    was found so that keys from different sources never collide: the ``x-session-id``
    header (``h:``), else the body's ``user`` (``u:``; chat, completions, responses),
    Anthropic's ``metadata.user_id`` (``a:``), the Responses API's
    ``previous_response_id`` (``r:``). A source whose value is not a non-empty string is
    passed over; None when no source names one."""
    if (found := _named(_header(headers, SESSION_HEADER))) is not None:
        return "h:" + found
    if not isinstance(body, Mapping):
        return None
    if endpoint in _USER_ENDPOINTS and (found := _named(body.get("user"))) is not None:
        return "u:" + found
    if endpoint == "messages":
        metadata = body.get("metadata")
        if isinstance(metadata, Mapping) and (found := _named(metadata.get("user_id"))) is not None:
            return "a:" + found
    if endpoint == "responses" and (found := _named(body.get("previous_response_id"))) is not None:
        return "r:" + found
    return None
