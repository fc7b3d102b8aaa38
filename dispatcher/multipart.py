"""Just enough ``multipart/form-data`` to read and set a form's small text fields (``model``,
``stream``) without touching its file parts: the upload goes on byte for byte.
"""

from __future__ import annotations

import re

from dispatcher.exceptions import InvalidRequest

_BOUNDARY = re.compile(r'boundary=(?:"([^"]+)"|([^;\s]+))', re.IGNORECASE)
_NAME = re.compile(rb'\bname="([^"]*)"', re.IGNORECASE)


def boundary(content_type: str) -> bytes:
    m = _BOUNDARY.search(content_type)
    if m is None:
        raise InvalidRequest("A multipart/form-data body needs a boundary in its Content-Type")
    return (m.group(1) or m.group(2)).encode()


def _parts(body: bytes, content_type: str) -> list[tuple[int, int, int, bytes]]:
    """(part start, value start, value end, field name) of each part."""
    delim = b"--" + boundary(content_type)
    parts: list[tuple[int, int, int, bytes]] = []
    pos = body.find(delim)
    if pos < 0:
        raise InvalidRequest("The multipart/form-data body has no part")
    while True:
        start = pos + len(delim)
        if body[start:start + 2] == b"--":
            return parts
        head_end = body.find(b"\r\n\r\n", start)
        nxt = body.find(b"\r\n" + delim, start)
        if head_end < 0 or nxt < 0 or head_end > nxt:
            raise InvalidRequest("The multipart/form-data body is malformed")
        m = _NAME.search(body, start, head_end)
        parts.append((start, head_end + 4, nxt, m.group(1) if m else b""))
        pos = nxt + 2


def fields(body: bytes, content_type: str, names: tuple[str, ...]) -> dict[str, str]:
    """The values of the named fields that the form has."""
    wanted = {n.encode() for n in names}
    return {
        name.decode(): body[vs:ve].decode(errors="replace")
        for _, vs, ve, name in _parts(body, content_type)
        if name in wanted
    }


def with_field(body: bytes, content_type: str, name: str, value: str) -> bytes:
    """``body`` with the value of every field called ``name`` set to ``value``."""
    out = bytearray()
    last = 0
    for _, vs, ve, field in _parts(body, content_type):
        if field == name.encode():
            out += body[last:vs]
            out += value.encode()
            last = ve
    out += body[last:]
    return bytes(out)
