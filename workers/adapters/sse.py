"""Incremental Server-Sent Events parsing of a provider's streamed answer.

Only ``data:`` fields matter to an OpenAI-style stream; an event's data lines are
joined with newlines as the SSE spec says. A *typed* stream (Responses, Messages: events
with ``event:`` lines) keeps each event's name: its payloads are ``name + "\n" + data``
(``dispatcher/endpoints.py``). Lines may end in ``\\n``, ``\\r\\n`` or
``\\r``; a leading byte-order mark is dropped. ``[DONE]`` ends the stream.
"""

from __future__ import annotations

from dispatcher.exceptions import ProviderUnreachable

DONE = b"[DONE]"
BOM = b"\xef\xbb\xbf"
# A single event larger than this is not a chat chunk: refuse rather than buffer forever.
MAX_EVENT_BYTES = 16 * 1024 * 1024
_FIELD_SLACK = len(b"data: ")


class SSEParser:
    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES, typed: bool = False) -> None:
        self._typed = typed
        self._name = b""
        self._buf = bytearray()
        self._searched = 0  # bytes of _buf already known to hold no line end
        self._data: list[bytes] = []
        self._data_size = 0  # data bytes of the event so far
        self._max = max_event_bytes
        self._skip_lf = False  # the previous chunk ended in \r: a leading \n belongs to it
        self._at_start = True
        self.done = False

    def feed(self, chunk: bytes) -> list[bytes]:
        """Data payloads of the events completed by ``chunk`` (``[DONE]`` excluded)."""
        out: list[bytes] = []
        if self.done or not chunk:
            return out
        if self._skip_lf:
            self._skip_lf = False
            if chunk.startswith(b"\n"):
                chunk = chunk[1:]
        if b"\r" in chunk:
            chunk = chunk.replace(b"\r\n", b"\n")
            self._skip_lf = chunk.endswith(b"\r")
            chunk = chunk.replace(b"\r", b"\n")
        buf = self._buf
        buf += chunk
        if self._at_start:
            if len(buf) < len(BOM) and BOM.startswith(bytes(buf)):
                return out  # maybe a BOM cut in two: wait for more
            self._at_start = False
            if buf.startswith(BOM):
                del buf[: len(BOM)]
        start = 0
        nl = buf.find(b"\n", self._searched)
        while nl >= 0:
            line = bytes(buf[start:nl])
            start = nl + 1
            if self._line(line, out):
                break
            nl = buf.find(b"\n", start)
        del buf[:start]
        self._searched = len(buf)
        # An unfinished line is judged like the data it may become (plus room for its field name).
        if self._data_size + len(buf) > self._max + _FIELD_SLACK:
            raise ProviderUnreachable("the provider sent an oversized stream event")
        return out

    def _line(self, line: bytes, out: list[bytes]) -> bool:
        """Take one line; True once ``[DONE]`` ended the stream."""
        if not line:
            if self._data:
                payload = b"\n".join(self._data)
                self._data.clear()
                self._data_size = 0
                if payload == DONE:
                    self.done = True
                    return True
                out.append(self._name + b"\n" + payload if self._typed else payload)
            self._name = b""
            return False
        if line.startswith(b"data:"):
            value = line[5:]
            if value.startswith(b" "):
                value = value[1:]
            self._data.append(value)
            self._data_size += len(value)
            if self._data_size > self._max:
                raise ProviderUnreachable("the provider sent an oversized stream event")
        elif self._typed and line.startswith(b"event:"):
            self._name = line[6:].strip()
        # Comments (":"), "id:" and "retry:" carry nothing for OpenAI streams.
        return False

    def close(self) -> list[bytes]:
        """Whatever event the stream ended in the middle of (a missing final blank line)."""
        if self.done or not (self._buf or self._data):
            return []
        self._skip_lf = False
        return self.feed(b"\n\n")
