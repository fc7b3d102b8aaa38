"""The OpenAI-shaped answer of a command line tool's output: a ``chat.completion`` /
``text_completion`` object, or for streamed calls the matching chunk objects, sent as
soon as the tool writes."""

from __future__ import annotations

import secrets
import time
from typing import Any

import msgspec

from workers.adapters.base import ProviderCall, Sink


class Answer:
    """Builds the OpenAI-shaped objects of one call, JSON or streamed."""

    def __init__(self, call: ProviderCall, prompt: str, options: dict[str, Any]) -> None:
        self.chat = call.endpoint == "chat/completions"
        self.target = call.target
        self.prompt = prompt
        self.include_usage = bool(options.get("include_usage"))
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.output = bytearray()  # non-streamed: the raw stdout
        self.streamed: list[str] = []  # streamed: kept only when usage must be reported
        self.sent_first = False

    def usage(self, text: str) -> dict[str, int]:
        # Whitespace words: a CLI tool reports no token counts, and a rough figure is
        # still useful for dashboards.
        prompt_tokens = len(self.prompt.split())
        completion_tokens = len(text.split())
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def whole_body(self) -> bytes:
        text = self.output.decode("utf-8", errors="replace")
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = None
        choice["finish_reason"] = "stop"
        return msgspec.json.encode(
            {
                "id": self.id,
                "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created,
                "model": self.target,
                "choices": [choice],
                "usage": self.usage(text),
            }
        )

    def chunk(self, text: str | None, finish_reason: str | None) -> bytes:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            delta: dict[str, str] = {}
            if not self.sent_first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        self.sent_first = True
        return self._envelope([choice])

    def _envelope(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        obj: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.target,
            "choices": choices,
        }
        if usage is not None:
            obj["usage"] = usage
        return msgspec.json.encode(obj)

    async def emit(self, sink: Sink, text: str) -> None:
        if not self.sent_first:
            # Started only once there is output: a command that fails before writing
            # anything still gets a proper error status instead of a broken stream.
            await sink.start(200)
        if self.include_usage:
            self.streamed.append(text)
        await sink.chunks([self.chunk(text, None)])

    async def finish_stream(self, sink: Sink) -> None:
        if not self.sent_first:
            # Empty output: the stream still opens with the assistant role.
            await self.emit(sink, "")
        payloads = [self.chunk(None if self.chat else "", "stop")]
        if self.include_usage:
            # OpenAI's stream_options.include_usage: one last chunk, no choices, the usage.
            payloads.append(self._envelope([], self.usage("".join(self.streamed))))
        await sink.chunks(payloads)
