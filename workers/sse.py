"""Incremental Server-Sent Events parsing of a provider's streamed answer.

Only ``data:`` fields matter to an OpenAI-style stream; an event's data lines are
joined with newlines as the SSE spec says. ``[DONE]`` ends the stream.
"""

from __future__ import annotations

from dispatcher.exceptions import ProviderUnreachable

DONE = b"[DONE]"
# A single event larger than this is not a chat chunk: refuse rather than buffer forever.
MAX_EVENT_BYTES = 16 * 1024 * 1024


class SSEParser:
    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._buf = bytearray()
        self._data: list[bytes] = []
        self._data_size = 0
        self._max = max_event_bytes
        self.done = False

    def feed(self, chunk: bytes) -> list[bytes]:
        """Data payloads of the events completed by ``chunk`` (``[DONE]`` excluded)."""
        out: list[bytes] = []
        if self.done:
            return out
        self._buf += chunk
        start = 0
        buf = self._buf
        while True:
            nl = buf.find(b"\n", start)
            if nl < 0:
                break
            line = bytes(buf[start:nl])
            start = nl + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data:
                    payload = b"\n".join(self._data)
                    self._data.clear()
                    self._data_size = 0
                    if payload == DONE:
                        self.done = True
                        break
                    out.append(payload)
                continue
            if line.startswith(b"data:"):
                value = line[5:]
                if value.startswith(b" "):
                    value = value[1:]
                self._data.append(value)
                self._data_size += len(value)
                if self._data_size > self._max:
                    raise ProviderUnreachable("the provider sent an oversized stream event")
            # Comments (":"), "event:", "id:" and "retry:" carry nothing for OpenAI streams.
        del buf[:start]
        if len(buf) > self._max:
            raise ProviderUnreachable("the provider sent an oversized stream line")
        return out

    def close(self) -> list[bytes]:
        """Whatever event the stream ended in the middle of (a missing final blank line)."""
        if self.done:
            return []
        tail = self.feed(b"\n\n") if (self._buf or self._data) else []
        return tail
