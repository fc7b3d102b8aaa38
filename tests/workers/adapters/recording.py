"""A sink that records what an adapter reports (workers/adapters/base.py ``Sink``)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio

from dispatcher.events import Usage


class RecordingSink:
    """Records what the adapter reports; ``on_first_chunk`` runs inside the first ``chunks()``."""

    def __init__(self, on_first_chunk: Callable[[], Awaitable[None]] | None = None) -> None:
        self.events: list[str] = []
        self.started: list[int] = []
        self.payloads: list[bytes] = []
        self.answer: tuple[int, bytes, str] | None = None
        self.headers: dict[str, str] = {}
        self.reported_usage: Usage | None = None
        self.got_chunk = anyio.Event()
        self._on_first_chunk = on_first_chunk

    async def start(self, status: int, content_type: str = "text/event-stream",
                    headers: Mapping[str, str] | None = None) -> None:
        self.events.append("start")
        self.started.append(status)
        self.headers = dict(headers or {})

    async def chunks(self, payloads: list[bytes]) -> None:
        self.events.append("chunks")
        self.payloads.extend(payloads)
        if not self.got_chunk.is_set():
            self.got_chunk.set()
            if self._on_first_chunk is not None:
                await self._on_first_chunk()

    async def done(self, status: int, body: bytes, content_type: str,
                   headers: Mapping[str, str] | None = None) -> None:
        self.events.append("done")
        self.answer = (status, body, content_type)
        self.headers = dict(headers or {})

    def ended(self, upstream_done: bool) -> None:
        self.events.append("ended" if upstream_done else "ended without [DONE]")

    def usage(self, usage: Usage) -> None:
        self.reported_usage = usage

    @property
    def objects(self) -> list[dict[str, Any]]:
        return [json.loads(p) for p in self.payloads]

    def json(self) -> dict[str, Any]:
        assert self.answer is not None
        result: dict[str, Any] = json.loads(self.answer[1])
        return result

    def streamed_text(self) -> str:
        parts = []
        for obj in self.objects:
            for choice in obj["choices"]:
                parts.append(choice["delta"].get("content") or "" if "delta" in choice else choice["text"])
        return "".join(parts)
