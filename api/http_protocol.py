"""uvicorn's httptools protocol, with the two limits it lacks.

* **Header size.** httptools buffers a request's headers without bound; a client could
  send megabytes of them. Here the request line and headers together may take at most
  ``api.max_header_bytes``; past that the client gets ``431`` and the connection closes.
* **Slow headers.** A client that opens a connection and trickles its headers ties up
  a connection for as long as it likes (slowloris). The headers must be complete within
  ``api.header_timeout_s`` of the connection's opening or of a kept-alive connection's
  next first byte, else the client gets ``408`` and the connection closes.

The body is bounded by ``api.max_body_bytes`` (Litestar) and its arrival by
``api.body_timeout_s``; an idle kept-alive connection by uvicorn's own
``timeout_keep_alive`` (``api.keep_alive_s``), which the head timer leaves alone: were it
armed when a response ends, it would count the idle time too and close, at the head
timeout, a connection that a client may be reusing in that instant.

This subclasses a module uvicorn does not publish as API: pyproject.toml pins uvicorn to
the releases it was tested with.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

import msgspec
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from api.errors import error_body
from dispatcher.config import ApiConfig

_END_OF_HEAD = b"\r\n\r\n"
_TOO_LARGE = msgspec.json.encode(
    error_body("Request headers too large", "invalid_request_error", code="headers_too_large")
)
_TOO_SLOW = msgspec.json.encode(error_body("Request headers too slow", "invalid_request_error", code="request_timeout"))


def limited_protocol(api: ApiConfig) -> Callable[..., LimitedHttpToolsProtocol]:
    """What uvicorn's ``http=`` takes: the protocol with the config's limits bound to it.

    A partial, not a class with the limits set on it: ``--workers N`` starts the server
    processes with multiprocessing's spawn, which pickles the partial with its arguments
    but a class only by name, and so would lose anything set on it here.
    """
    return functools.partial(
        LimitedHttpToolsProtocol, max_head_bytes=api.max_header_bytes, head_timeout_s=api.header_timeout_s
    )


def _reply_and_close(transport: asyncio.Transport, status: bytes, message: bytes) -> None:
    transport.write(
        b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"content-length: " + str(len(message)).encode() + b"\r\n\r\n" + message
    )
    transport.close()


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, max_head_bytes: int, head_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_head_bytes = max_head_bytes
        self.head_timeout_s = head_timeout_s
        self._in_head = True
        self._head_bytes = 0
        # When the head under way must be complete (None: no head under way). One timer per
        # connection checks it, re-armed only when it fires early: a keep-alive connection's
        # requests do not each schedule and cancel a timer of their own.
        self._head_due: float | None = None
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            if self._head_due is None:
                self._arm_head_timer()  # the first byte of a kept-alive connection's next head
            end = data.find(_END_OF_HEAD)
            self._head_bytes += len(data) if end < 0 else end
            if self._head_bytes > self.max_head_bytes:
                self._disarm_head_timer()
                _reply_and_close(self.transport, b"431 Request Header Fields Too Large", _TOO_LARGE)
                return
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        # The next request on this connection starts its own head.
        self._in_head = True
        self._head_bytes = 0

    def _arm_head_timer(self) -> None:
        self._head_due = self.loop.time() + self.head_timeout_s
        if self._head_timer is None:
            self._head_timer = self.loop.call_at(self._head_due, self._head_check)

    def _disarm_head_timer(self) -> None:
        self._head_due = None

    def _head_check(self) -> None:
        self._head_timer = None
        due = self._head_due
        if due is None:
            return  # no head under way: the next one arms the timer again
        if self.loop.time() < due:
            # A later head than the one the timer was set for.
            self._head_timer = self.loop.call_at(due, self._head_check)
            return
        self._head_due = None
        self._head_too_slow()

    def _head_too_slow(self) -> None:
        if not self._in_head or self.transport.is_closing():
            return
        if self._head_bytes:
            _reply_and_close(self.transport, b"408 Request Timeout", _TOO_SLOW)
        else:
            self.transport.close()  # a connection that never sent a request
