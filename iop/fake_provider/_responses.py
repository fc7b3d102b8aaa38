"""The OpenAI Responses API of the fake provider: ``/v1/responses`` and its stored responses."""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from typing import Any, Final

from aiohttp import web

from ._common import _Call, _groups, _Sequenced, _stream, _text

_MAX_STORED: Final = 10_000
_MAX_ITEMS_PAGE: Final = 100


class _Stored:
    __slots__ = ("background", "items", "response")

    def __init__(self, response: dict[str, Any], items: list[dict[str, Any]], background: bool) -> None:
        self.response = response
        self.items = items
        self.background = background


def _item_id(prefix: str) -> str:
    return prefix + secrets.token_hex(24)


def _input_items(value: Any) -> list[dict[str, Any]] | None:
    """The input items of a request's ``input`` as the API lists them (ids, typed content), or None when
    ``input`` has no valid shape."""
    if isinstance(value, str):
        content: Any = [{"type": "input_text", "text": value}]
        return [{"id": _item_id("msg_"), "type": "message", "role": "user", "status": "completed", "content": content}]
    if not isinstance(value, list):
        return None
    items: list[dict[str, Any]] = []
    for entry in value:
        if not isinstance(entry, dict):
            return None
        item = dict(entry)
        type_ = item.get("type")
        if type_ is None and "role" in item:
            type_ = item["type"] = "message"
        if type_ == "message":
            content = item.get("content")
            if isinstance(content, str):
                kind = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": kind, "text": content}]
            item.setdefault("status", "completed")
        if not isinstance(item.get("id"), str):
            item = {"id": _item_id("msg_" if type_ == "message" else "item_"), **item}
        items.append(item)
    return items


def _response_object(
    rid: str, model: str, body: dict[str, Any], previous: str | None, store: bool, background: bool
) -> dict[str, Any]:
    """A response as created, before any output: status ``in_progress``."""
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "background": background,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": body.get("max_tool_calls"),
        "model": model,
        "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": previous,
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "service_tier": body.get("service_tier") or "default",
        "store": store,
        "temperature": body.get("temperature", 1.0),
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p", 1.0),
        "truncation": body.get("truncation") or "disabled",
        "usage": None,
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }


class ResponsesAPI:
    """``/v1/responses`` of one fake instance, with its own store of responses."""

    def __init__(self) -> None:
        self.stored: OrderedDict[str, _Stored] = OrderedDict()

    def _not_found(self, call: _Call, rid: str) -> web.Response:
        return call.fail(404, f"Response with id '{rid}' not found.")

    def _lookup(self, call: _Call) -> tuple[str, _Stored | None]:
        rid = call.request.match_info["response_id"]
        return rid, self.stored.get(rid)

    async def create(self, call: _Call) -> web.StreamResponse:
        body: dict[str, Any] = call.body
        previous = body.get("previous_response_id")
        if previous is not None:
            if not isinstance(previous, str):
                message = "Invalid type for 'previous_response_id': expected a string."
                return call.fail(400, message, param="previous_response_id", code="invalid_type")
            if previous not in self.stored:
                message = f"Previous response with id '{previous}' not found."
                return call.fail(404, message, param="previous_response_id", code="previous_response_not_found")
        items = _input_items(body.get("input", []))
        if items is None:
            message = "Invalid type for 'input': expected a string or an array of input items."
            return call.fail(400, message, param="input", code="invalid_type")
        store = body.get("store") is not False
        background = body.get("background") is True
        n = call.tokens
        text, pieces = _text(n)
        rid = _item_id("resp_")
        mid = _item_id("msg_")
        input_tokens = max(1, len(call.raw) // 4)
        usage = {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": n,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + n,
        }
        created = _response_object(rid, call.model, body, previous, store, background)
        part: dict[str, Any] = {"type": "output_text", "annotations": [], "logprobs": [], "text": text}
        output: dict[str, Any] = {"id": mid, "type": "message", "status": "completed", "role": "assistant"}
        output["content"] = [part]
        final = {**created, "status": "completed", "output": [output], "usage": usage}
        if store:
            self.stored[rid] = _Stored(final, items, background)
            if len(self.stored) > _MAX_STORED:
                self.stored.popitem(last=False)
        if not call.stream:
            # A background response is answered at once, queued; retrieving it shows it completed.
            return call.json({**created, "status": "queued"} if background else final)
        event = _Sequenced()
        where = {"item_id": mid, "output_index": 0, "content_index": 0}
        started = {"id": mid, "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        first = b"".join(
            (
                event("response.created", response=created),
                event("response.in_progress", response=created),
                event("response.output_item.added", output_index=0, item=started),
                event("response.content_part.added", **where, part={**part, "text": ""}),
            )
        )
        contents = [event("response.output_text.delta", **where, delta=piece, logprobs=[]) for piece in pieces]
        tail = b"".join(
            (
                event("response.output_text.done", **where, text=text, logprobs=[]),
                event("response.content_part.done", **where, part=part),
                event("response.output_item.done", output_index=0, item=output),
                event("response.completed", response=final),
            )
        )
        return await _stream(call, _groups(first, contents, tail), call.interval_ms)

    async def retrieve(self, call: _Call) -> web.StreamResponse:
        rid, stored = self._lookup(call)
        if stored is None:
            return self._not_found(call, rid)
        return call.json(stored.response)

    async def delete(self, call: _Call) -> web.StreamResponse:
        rid, stored = self._lookup(call)
        if stored is None:
            return self._not_found(call, rid)
        del self.stored[rid]
        return call.json({"id": rid, "object": "response", "deleted": True})

    async def cancel(self, call: _Call) -> web.StreamResponse:
        rid, stored = self._lookup(call)
        if stored is None:
            return self._not_found(call, rid)
        if not stored.background:
            return call.fail(400, "Cannot cancel a synchronous response.")
        stored.response = {**stored.response, "status": "cancelled"}
        return call.json(stored.response)

    async def input_items(self, call: _Call) -> web.StreamResponse:
        rid, stored = self._lookup(call)
        if stored is None:
            return self._not_found(call, rid)
        query = call.request.query
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            return call.fail(400, "Invalid value for 'order': expected 'asc' or 'desc'.", param="order")
        try:
            limit = int(query.get("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= _MAX_ITEMS_PAGE:
            return call.fail(400, "Invalid 'limit': expected an integer between 1 and 100.", param="limit")
        items = stored.items if order == "asc" else stored.items[::-1]
        after = query.get("after")
        if after is not None:
            ids = [item["id"] for item in items]
            items = items[ids.index(after) + 1 :] if after in ids else []
        page = items[:limit]
        return call.json(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(items) > limit,
            }
        )
