"""Ollama's native API: ``/api/generate``, ``/api/chat`` (load, unload, generate), ``/api/tags``, ``/api/ps``.

Shapes from Ollama's server/routes.go (GenerateHandler, ChatHandler, ListHandler, PsHandler) and
api/types.go (GenerateResponse, ChatResponse, ListModelResponse, ProcessModelResponse).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Awaitable
from typing import Any, Final

import msgspec
from aiohttp import web

from ._common import FakeOptions, _Call, _groups, _split, _stream, _v1_headers
from ._lifecycle import Lifecycle, go_time, is_on, parse_keep_alive

_NDJSON_V1: Final = _v1_headers({"Content-Type": "application/x-ndjson"})
_OLLAMA_JSON_V1: Final = _v1_headers({"Content-Type": "application/json; charset=utf-8"})
# What the fake's /api/ps showed before it had a lifecycle, still shown with the lifecycle off.
_ALWAYS_LOADED_EXPIRY: Final = "2999-01-01T00:00:00Z"


def _details() -> dict[str, Any]:
    return {
        "parent_model": "",
        "format": "gguf",
        "family": "fake",
        "families": ["fake"],
        "parameter_size": "0B",
        "quantization_level": "F16",
    }


def _model_entry(name: str) -> dict[str, Any]:
    return {"name": name, "model": name, "size": 0, "digest": hashlib.sha256(name.encode()).hexdigest(),
            "details": _details()}


class OllamaAPI:
    def __init__(self, options: FakeOptions, lifecycle: Lifecycle) -> None:
        self.options = options
        self.lifecycle = lifecycle

    # ---------------------------------------------------------------- GET /api/tags, /api/ps

    def tags(self) -> bytes:
        models = [{**_model_entry(name), "modified_at": "2024-01-01T00:00:00Z"} for name in self.options.models]
        return msgspec.json.encode({"models": models})

    def ps(self) -> bytes:
        extra = {"size_vram": 0, "context_length": 0}
        if not is_on(self.options):
            models = [{**_model_entry(name), "expires_at": _ALWAYS_LOADED_EXPIRY, **extra}
                      for name in self.options.models]
            return msgspec.json.encode({"models": models})
        now = time.time()
        runners = [(self.lifecycle.expires_at(r, now), r.name) for r in self.lifecycle.loaded.values()]
        # As Ollama: the longest time left first.
        runners.sort(key=lambda item: -item[0])
        models = [{**_model_entry(name), "expires_at": go_time(expires), **extra} for expires, name in runners]
        return msgspec.json.encode({"models": models})

    # ---------------------------------------------------------------- POST /api/generate, /api/chat

    def generate(self, call: _Call) -> Awaitable[web.StreamResponse]:
        return self._native(call, chat=False)

    def chat(self, call: _Call) -> Awaitable[web.StreamResponse]:
        return self._native(call, chat=True)

    async def _native(self, call: _Call, chat: bool) -> web.StreamResponse:
        body = call.body
        model = call.model
        if model not in self.options.models:
            return _fail(call, 404, f"model '{model}' not found")
        raw_keep_alive = body.get("keep_alive")
        keep_alive: float | msgspec.UnsetType | None = msgspec.UNSET
        if raw_keep_alive is not None:  # null: not given, as Go leaves a nil *Duration
            try:
                keep_alive = parse_keep_alive(raw_keep_alive)
            except ValueError as exc:
                return _fail(call, 400, str(exc))
        if chat:
            messages = body.get("messages")
            if messages is not None and not isinstance(messages, list):
                return _fail(call, 400, "json: cannot unmarshal into Go struct field ChatRequest.messages")
            empty = not messages
        else:
            prompt = body.get("prompt")
            if prompt is not None and not isinstance(prompt, str):
                return _fail(call, 400, "json: cannot unmarshal into Go struct field GenerateRequest.prompt")
            empty = not prompt
        on = is_on(self.options)
        if empty and keep_alive == 0:
            if on:
                self.lifecycle.unload(model)
            return self._done(call, chat, "unload")
        runner = await self.lifecycle.acquire(model, keep_alive, "api" if empty else "request") if on else None
        try:
            if empty:
                return self._done(call, chat, "load")
            return await self._answer(call, chat, time.monotonic() - call.started)
        finally:
            if runner is not None:
                self.lifecycle.release(runner)

    def _done(self, call: _Call, chat: bool, reason: str) -> web.Response:
        answer = self._head(call, chat, "")
        answer["done"] = True
        answer["done_reason"] = reason
        return web.Response(body=msgspec.json.encode(answer), headers=call.headers(_OLLAMA_JSON_V1))

    def _head(self, call: _Call, chat: bool, text: str) -> dict[str, Any]:
        answer: dict[str, Any] = {"model": call.model, "created_at": go_time(time.time())}
        if chat:
            answer["message"] = {"role": "assistant", "content": text}
        else:
            answer["response"] = text
        return answer

    async def _answer(self, call: _Call, chat: bool, load_s: float) -> web.StreamResponse:
        n = call.tokens
        word = self.options.word
        text, pieces = _split(" ".join(f"{word}{i}" for i in range(n)))
        body = call.body
        source = body.get("messages") if chat else body.get("prompt")
        prompt_tokens = max(1, len(msgspec.json.encode(source)) // 4)
        interval_ns = call.interval_ms * 1_000_000
        load_ns = max(1, int(load_s * 1e9))
        eval_ns = max(1, interval_ns * max(0, n - 1))
        final = self._head(call, chat, "")
        final["done"] = True
        final["done_reason"] = "stop"
        if not chat and body.get("raw") is not True:
            final["context"] = list(range(1, prompt_tokens + n + 1))
        final["total_duration"] = load_ns + eval_ns + 1
        final["load_duration"] = load_ns
        final["prompt_eval_count"] = prompt_tokens
        final["prompt_eval_duration"] = 1
        final["eval_count"] = n
        final["eval_duration"] = eval_ns
        if body.get("stream") is False:
            whole = self._head(call, chat, text)
            whole.update({k: v for k, v in final.items() if k not in whole})
            return web.Response(body=msgspec.json.encode(whole), headers=call.headers(_OLLAMA_JSON_V1))
        lines = [msgspec.json.encode({**self._head(call, chat, piece), "done": False}) + b"\n" for piece in pieces]
        tail = msgspec.json.encode(final) + b"\n"
        return await _stream(call, _groups(b"", lines, tail), call.interval_ms, _NDJSON_V1)


def _fail(call: _Call, status: int, message: str) -> web.Response:
    """An error in Ollama's shape, ``{"error": message}``."""
    return web.Response(status=status, body=msgspec.json.encode({"error": message}),
                        headers=call.headers(_OLLAMA_JSON_V1))
