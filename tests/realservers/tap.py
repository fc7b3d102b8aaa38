"""A TCP forwarder in front of a real server that notes the request line of each HTTP
request passing through, with when it passed: what a server that logs no requests
(llama-server) was asked, and while what.

The bytes go through untouched, both ways, so an answer through the tap is the server's.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from dataclasses import dataclass, field

from iop.redis_server import free_port

# A request line at the start of a read: keep-alive requests each start a read of their own
# in practice (the client waits for the answer to the one before).
_REQUEST_LINE = re.compile(rb"(?:^|\r\n)(GET|POST|PUT|DELETE|HEAD|OPTIONS) (\S+) HTTP/1\.[01]\r\n")


@dataclass(frozen=True)
class Seen:
    at: float  # time.monotonic()
    method: str
    path: str


@dataclass
class Tap:
    upstream_port: int
    port: int = field(default_factory=free_port)
    seen: list[Seen] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def requests(self, method: str, path: str, since: float = 0.0, until: float = float("inf")) -> int:
        """How many ``method path`` requests passed between ``since`` and ``until``."""
        with self._lock:
            return sum(1 for s in self.seen if s.method == method and s.path == path and since <= s.at <= until)

    def close(self) -> None:
        self._stopped.set()
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                sock.close()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, requests: bool) -> None:
        try:
            while data := src.recv(65536):
                if requests:
                    now = time.monotonic()
                    with self._lock:
                        self.seen += [Seen(now, m.group(1).decode(), m.group(2).decode())
                                      for m in _REQUEST_LINE.finditer(data)]
                dst.sendall(data)
        except OSError:
            pass
        finally:
            # The other direction may still be sending (a half-closed connection).
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
