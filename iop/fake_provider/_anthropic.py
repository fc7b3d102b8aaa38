"""The Anthropic Messages API of the fake provider: ``/v1/messages`` and ``/v1/messages/count_tokens``."""

from __future__ import annotations

import secrets
from typing import Any

from aiohttp import web

from ._common import _Call, _count_words, _event, _groups, _stream, _text


def _input_tokens(body: dict[str, Any]) -> int:
    """Words in the text of ``system`` and ``messages``: what count_tokens answers and usage reports."""
    return max(1, _count_words(body.get("system")) + _count_words(body.get("messages")))


def _bad_messages(call: _Call) -> web.Response | None:
    messages = call.body.get("messages")
    if messages is None:
        return call.fail(400, "messages: Field required")
    if not isinstance(messages, list):
        return call.fail(400, "messages: Input should be a valid list")
    return None


def _ev(name: str, **fields: Any) -> bytes:
    return _event(name, {"type": name, **fields})


async def messages(call: _Call) -> web.StreamResponse:
    body: dict[str, Any] = call.body
    if "max_tokens" not in body:
        return call.fail(400, "max_tokens: Field required")
    max_tokens = body["max_tokens"]
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        return call.fail(400, "max_tokens: Input should be a valid integer greater than or equal to 1")
    problem = _bad_messages(call)
    if problem is not None:
        return problem
    n = min(call.tokens, max_tokens)
    stop_reason = "max_tokens" if max_tokens < call.tokens else "end_turn"
    text, pieces = _text(n)
    usage = {
        "input_tokens": _input_tokens(body),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": n,
    }
    message = {
        "id": "msg_fake" + secrets.token_hex(12),
        "type": "message",
        "role": "assistant",
        "model": call.model,
        "content": [{"type": "text", "text": text}],
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": usage,
    }
    if not call.stream:
        return call.json(message)
    start = {**message, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}
    first = b"".join(
        (
            _ev("message_start", message=start),
            _ev("content_block_start", index=0, content_block={"type": "text", "text": ""}),
            _ev("ping"),
        )
    )
    contents = [_ev("content_block_delta", index=0, delta={"type": "text_delta", "text": p}) for p in pieces]
    tail = b"".join(
        (
            _ev("content_block_stop", index=0),
            _ev("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": None}, usage={"output_tokens": n}),
            _ev("message_stop"),
        )
    )
    return await _stream(call, _groups(first, contents, tail), call.interval_ms)


async def count_tokens(call: _Call) -> web.StreamResponse:
    problem = _bad_messages(call)
    if problem is not None:
        return problem
    return call.json({"input_tokens": _input_tokens(call.body)})
