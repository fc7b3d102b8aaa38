"""Noting where a stored Response was made, before its caller can ask about it again.

A Responses answer names its response id in the JSON body, or in the stream's
``response.created`` event. :class:`RememberingSink` sits between the adapter and the
job's sink and writes ``response id -> provider`` to Redis before that answer or event
goes on, so a caller that follows up at once (``previous_response_id``) already finds it.
A request with ``store: false`` is remembered too: the provider then answers the
follow-up itself (404), as it would without iop.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

import msgspec
from redis.exceptions import RedisError

from dispatcher.events import Usage
from workers.adapters.base import Sink

log = logging.getLogger("iop.worker")

_CREATED = b"response.created\n"


class _Id(msgspec.Struct, frozen=True):
    id: str | None = None


class _Created(msgspec.Struct, frozen=True):
    response: _Id = _Id()


_id = msgspec.json.Decoder(_Id)
_created = msgspec.json.Decoder(_Created)


class RememberingSink:
    """Implements ``workers.adapters.base.Sink`` around ``inner``."""

    def __init__(self, inner: Sink, remember: Callable[[str], Awaitable[None]]) -> None:
        self.inner = inner
        self._remember = remember
        self._seen = False

    async def start(
        self, status: int, content_type: str = "text/event-stream", headers: Mapping[str, str] | None = None
    ) -> None:
        await self.inner.start(status, content_type, headers)

    async def chunks(self, payloads: list[bytes]) -> None:
        if not self._seen:
            for payload in payloads:
                if payload.startswith(_CREATED):
                    self._seen = True
                    await self._note(_created_id(payload[len(_CREATED):]))
                    break
        await self.inner.chunks(payloads)

    async def done(
        self, status: int, body: bytes, content_type: str, headers: Mapping[str, str] | None = None
    ) -> None:
        if status < 300:
            await self._note(_answer_id(body))
        await self.inner.done(status, body, content_type, headers)

    def ended(self, upstream_done: bool) -> None:
        self.inner.ended(upstream_done)

    def usage(self, usage: Usage) -> None:
        self.inner.usage(usage)

    async def _note(self, response_id: str | None) -> None:
        if not response_id:
            return
        try:
            await self._remember(response_id)
        except RedisError as exc:
            # The answer still goes out; a follow-up on it will not find its provider.
            log.warning("could not remember response %s: %s", response_id, exc)


def _answer_id(body: bytes) -> str | None:
    try:
        return _id.decode(body).id
    except (msgspec.DecodeError, RecursionError):
        return None


def _created_id(data: bytes) -> str | None:
    try:
        return _created.decode(data).response.id
    except (msgspec.DecodeError, RecursionError):
        return None
