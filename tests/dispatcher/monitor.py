"""A Redis server's MONITOR stream, recorded on a connection of its own and read back as
commands: who ran each (a script, or a client) and its arguments."""

from __future__ import annotations

import re
import threading
import uuid
from dataclasses import dataclass

from redis import Redis as SyncRedis

_LINE = re.compile(rb"^(\d+\.\d+) \[(\d+) ([^\]]+)\] (.*)$", re.S)
_ESCAPES = {ord("n"): b"\n", ord("r"): b"\r", ord("t"): b"\t", ord("a"): b"\a", ord("b"): b"\b",
            ord("\\"): b"\\", ord('"'): b'"'}


@dataclass(frozen=True, slots=True)
class Command:
    """One monitor line: who ran it ('lua' inside a script, else the client's address)."""

    client: str
    args: tuple[bytes, ...]

    @property
    def lua(self) -> bool:
        return self.client == "lua"

    @property
    def name(self) -> str:
        return self.args[0].decode().upper() if self.args else ""

    def text(self, i: int) -> str:
        return self.args[i].decode("utf-8", "replace")


def parse_args(text: bytes) -> tuple[bytes, ...]:
    """The arguments of a monitor line: each one quoted and escaped as ``sdscatrepr`` does."""
    out: list[bytes] = []
    i, n = 0, len(text)
    while i < n:
        if text[i] == ord(" "):
            i += 1
            continue
        assert text[i] == ord('"'), text
        i += 1
        buf = bytearray()
        while text[i] != ord('"'):
            c = text[i]
            if c == ord("\\"):
                e = text[i + 1]
                if e == ord("x"):
                    buf.append(int(text[i + 2:i + 4], 16))
                    i += 4
                    continue
                buf += _ESCAPES[e]
                i += 2
                continue
            buf.append(c)
            i += 1
        out.append(bytes(buf))
        i += 1
    return tuple(out)


def parse_line(raw: bytes | str) -> Command:
    data = raw.encode() if isinstance(raw, str) else raw
    m = _LINE.match(data)
    assert m is not None, data
    return Command(m.group(3).decode(), parse_args(m.group(4)))


class MonitorRecorder(threading.Thread):
    """Records the server's MONITOR output on a connection of its own, until ``stop``.

    The thread only stores raw lines (parsing comes later), so it keeps up with a busy
    server. ``stop`` is told the end by a marker ``ECHO`` that some client sends.
    """

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.client = SyncRedis.from_url(url)
        self.marker = f"iop-monitor-end-{uuid.uuid4().hex}".encode()
        self.raw: list[bytes] = []
        self.ready = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with self.client.monitor() as mon:  # type: ignore[no-untyped-call]
                self.ready.set()
                while True:
                    line = mon.connection.read_response()
                    data = line.encode() if isinstance(line, str) else line
                    if self.marker in data:
                        return
                    self.raw.append(data)
        except BaseException as exc:  # surfaced by commands()
            self.error = exc
        finally:
            self.ready.set()
            self.client.close()

    def begin(self) -> MonitorRecorder:
        self.start()
        assert self.ready.wait(10), "MONITOR did not start"
        assert self.error is None, self.error
        return self

    def end(self, timeout: float = 60.0) -> list[Command]:
        """After the marker was sent: wait for the thread, return every command in order."""
        self.join(timeout)
        assert not self.is_alive(), "the monitor never saw its end marker"
        assert self.error is None, self.error
        return [parse_line(r) for r in self.raw]
