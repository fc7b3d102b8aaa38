"""A request as it waits in Redis for its worker, when the body alone does not say it all.

Most requests are a JSON body POSTed to the endpoint's path: then the stored body is that
body, as it came. Anything else -- another method (``GET /v1/responses/{id}``), a path
below the endpoint (``responses/{id}/cancel``), a multipart body (audio uploads), or
caller headers a provider needs (``anthropic-version``), or with tracing on the request
span's ``traceparent`` -- is stored as a
:class:`RequestEnvelope`: a NUL byte, which no JSON or multipart body starts with, then
the msgpack-encoded envelope. Workers read either with :func:`unwrap`.
"""

from __future__ import annotations

import msgspec

JSON = "application/json"
MARK = b"\x00"

# Caller headers a provider needs to understand the request, passed on as they came.
FORWARDED_HEADERS = ("anthropic-version", "anthropic-beta", "openai-beta")


class RequestEnvelope(msgspec.Struct, frozen=True, array_like=True):
    body: bytes = b""
    method: str = "POST"
    # Under /v1, when it is not the endpoint's own path.
    path: str = ""
    content_type: str = JSON
    headers: dict[str, str] = {}
    # The W3C traceparent of the API's request span, for the worker's (dispatcher/tracing.py);
    # never sent to the provider. Empty while tracing is off. Last: workers that predate it
    # ignore it, and envelopes without it decode.
    traceparent: str = ""

    @property
    def plain(self) -> bool:
        """Nothing but a JSON body POSTed to the endpoint: stored as the bare body."""
        return (self.method == "POST" and not self.path and self.content_type == JSON and not self.headers
                and not self.traceparent)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(RequestEnvelope)


def wrap(envelope: RequestEnvelope) -> bytes:
    """What to store for ``envelope``."""
    if envelope.plain:
        return envelope.body
    if envelope.traceparent:
        return MARK + _encoder.encode(envelope)
    # Without tracing, the five fields it always had: the same bytes as before traceparent was.
    e = envelope
    return MARK + _encoder.encode((e.body, e.method, e.path, e.content_type, e.headers))


def unwrap(stored: bytes) -> RequestEnvelope:
    if stored[:1] == MARK:
        return _decoder.decode(stored[1:])
    return RequestEnvelope(stored)
