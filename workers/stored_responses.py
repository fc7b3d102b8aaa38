"""Noting where a stored Response was made, before its caller can ask about it again, and
forgetting it once it is deleted.

A Responses answer names its response id in the JSON body, or in the stream's
``response.created`` event. :class:`RememberingSink` sits between the adapter and the
job's sink and writes ``response id -> provider`` to Redis before that answer or event
goes on, so a caller that follows up at once (``previous_response_id``) already finds it.
A request with ``store: false`` is remembered too: the provider then answers the
follow-up itself (404), as it would without iop.

Only a create does that (:func:`stored_response_sink`): the calls on a stored Response
answer with its id too, and remembering it again would pin an id its provider just deleted
and extend the time of every id that is read. A DELETE its provider answered with success
forgets the id (:class:`ForgettingSink`), so later calls on it are iop's own 404.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

import msgspec
from redis.exceptions import RedisError

from dispatcher.endpoints import RESPONSES
from dispatcher.envelope import RequestEnvelope
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


def stored_response_sink(
    sink: Sink, request: RequestEnvelope, remember: Callable[[str], Awaitable[None]],
    forget: Callable[[str], Awaitable[None]],
) -> Sink:
    """The sink of a Responses call, by what it does to the ids iop remembers: a create
    (``POST /v1/responses``) remembers the id it made, a ``DELETE /v1/responses/{id}``
    forgets ``{id}`` once its provider deleted it, and the other calls (GET, cancel,
    input_items) change nothing."""
    if request.method == "POST" and not request.path:
        return RememberingSink(sink, remember)
    deleted = _deleted_id(request)
    if deleted is not None:
        return ForgettingSink(sink, deleted, forget)
    return sink


class _Passing:
    """Implements ``workers.adapters.base.Sink`` by handing everything on to ``inner``."""

    def __init__(self, inner: Sink) -> None:
        self.inner = inner

    async def start(
        self, status: int, content_type: str = "text/event-stream", headers: Mapping[str, str] | None = None
    ) -> None:
        await self.inner.start(status, content_type, headers)

    async def chunks(self, payloads: list[bytes]) -> None:
        await self.inner.chunks(payloads)

    async def done(
        self, status: int, body: bytes, content_type: str, headers: Mapping[str, str] | None = None
    ) -> None:
        await self.inner.done(status, body, content_type, headers)

    def ended(self, upstream_done: bool) -> None:
        self.inner.ended(upstream_done)

    def usage(self, usage: Usage) -> None:
        self.inner.usage(usage)


class RememberingSink(_Passing):
    """Remembers the id a create's answer, or its stream's ``response.created``, names."""

    def __init__(self, inner: Sink, remember: Callable[[str], Awaitable[None]]) -> None:
        super().__init__(inner)
        self._remember = remember
        self._seen = False

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

    async def _note(self, response_id: str | None) -> None:
        if not response_id:
            return
        try:
            await self._remember(response_id)
        except RedisError as exc:
            # The answer still goes out; a follow-up on it will not find its provider.
            log.warning("could not remember response %s: %s", response_id, exc)


class ForgettingSink(_Passing):
    """Forgets ``response_id`` when its provider answers the DELETE with success, before the
    answer goes on: a caller that asks again at once gets iop's 404, not the provider's."""

    def __init__(self, inner: Sink, response_id: str, forget: Callable[[str], Awaitable[None]]) -> None:
        super().__init__(inner)
        self.response_id = response_id
        self._forget = forget

    async def done(
        self, status: int, body: bytes, content_type: str, headers: Mapping[str, str] | None = None
    ) -> None:
        if status < 300:
            try:
                await self._forget(self.response_id)
            except RedisError as exc:
                # The answer still goes out; calls on the id still go to its provider, which
                # answers them 404 itself, until the id's time is up.
                log.warning("could not forget response %s: %s", self.response_id, exc)
        await self.inner.done(status, body, content_type, headers)


def _deleted_id(request: RequestEnvelope) -> str | None:
    """The id of a ``DELETE /v1/responses/{id}`` (its path: ``responses/{id}[?query]``)."""
    if request.method != "DELETE":
        return None
    prefix, _, rest = request.path.partition("?")[0].partition("/")
    return rest if prefix == RESPONSES and rest and "/" not in rest else None


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
