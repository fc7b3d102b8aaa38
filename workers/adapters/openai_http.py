"""One adapter for every OpenAI-compatible HTTP server: vLLM, SGLang, Lemonade, Ollama
(through its ``/v1`` API) and hosted OpenAI-style APIs.

Calls go through one pooled ``aiohttp.ClientSession`` per worker (measured at ~1/20 of
httpx's CPU per call). The provider's own key comes from the env var the config
names; the caller's credentials never reach a provider. Redirects are not followed.
"""

from __future__ import annotations

import errno
import os

import aiohttp

from api.errors import provider_error_body, provider_said
from dispatcher.config import ProviderConfig
from dispatcher.endpoints import Endpoint
from dispatcher.envelope import JSON
from dispatcher.exceptions import ProviderRejected, ProviderTimeout, ProviderUnreachable
from dispatcher.jsonbody import event_type, is_json_object
from workers.adapters.base import Adapter, ProbeResult, ProviderCall, Sink, passed_headers
from workers.adapters.probes import probe_http, probe_http_busy
from workers.adapters.sse import SSEParser
from workers.usage import StreamUsage, json_usage

HttpSession = aiohttp.ClientSession

# A JSON answer larger than this is refused rather than held in memory.
MAX_BODY_BYTES = 64 * 1024 * 1024
# An error answer is read this far; a longer one is wrapped, never relayed cut.
_ERROR_BODY_BYTES = 64 * 1024


def new_session(connections: int) -> HttpSession:
    # Keep-alive pool sized to the node's total capacity; DNS cached, no cookie jar.
    connector = aiohttp.TCPConnector(limit=max(connections, 1) * 2, ttl_dns_cache=300)
    return aiohttp.ClientSession(
        connector=connector,
        cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=True,
        skip_auto_headers=("User-Agent",),
    )


def session_size(session: HttpSession) -> int:
    """The capacity ``new_session`` sized the session's pool for."""
    connector = session.connector
    return connector.limit // 2 if connector is not None else 0


class OpenAIHttpAdapter(Adapter):
    def __init__(self, provider: ProviderConfig, session: HttpSession) -> None:
        super().__init__(provider)
        assert provider.base_url is not None
        self.root = provider.base_url
        self.session = session
        self._fresh: HttpSession | None = None
        self.headers = {"Content-Type": JSON}
        self._auth: dict[str, str] = {}
        key = os.environ.get(provider.api_key_env) if provider.api_key_env else None
        if key:
            self._auth = {"Authorization": f"Bearer {key}"}
            self.headers.update(self._auth)

    async def call(self, call: ProviderCall, sink: Sink) -> None:
        timeout = aiohttp.ClientTimeout(total=self.provider.timeout_s)
        try:
            resp = await self._send(call, client_timeout=timeout)
            try:
                await self._answer(call, resp, sink)
            finally:
                resp.release()
        except TimeoutError:
            raise ProviderTimeout(
                f"provider {self.provider.id} did not answer within {self.provider.timeout_s}s"
            ) from None
        except aiohttp.ClientError as exc:
            raise ProviderUnreachable(f"provider {self.provider.id} unreachable: {in_words(exc)}") from None

    async def _send(self, call: ProviderCall, *, client_timeout: aiohttp.ClientTimeout) -> aiohttp.ClientResponse:
        """The answer's head. A pooled keep-alive connection the provider closed meanwhile
        fails before any byte of an answer: that is not the caller's problem, so the call
        is made once more, on a connection of its own."""
        url = self.root + call.upstream_path(self.provider.type)
        headers = self.headers
        if call.content_type != JSON or call.headers or not call.body:
            headers = {**self._auth, **call.headers}
            if call.body:
                headers["Content-Type"] = call.content_type
        kwargs = {"data": call.body or None, "headers": headers, "timeout": client_timeout, "allow_redirects": False}
        try:
            return await self.session.request(call.method, url, **kwargs)  # type: ignore[arg-type]
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if isinstance(exc, aiohttp.ClientConnectorError):
                raise  # nothing listens: a second try would fail the same way
            return await self._fresh_session().request(call.method, url, **kwargs)  # type: ignore[arg-type]

    def _fresh_session(self) -> HttpSession:
        if self._fresh is None:
            self._fresh = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True),
                cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=("User-Agent",),
            )
        return self._fresh

    async def _answer(self, call: ProviderCall, resp: aiohttp.ClientResponse, sink: Sink) -> None:
        await _raise_for_status(resp, self.provider.id, call.spec)
        headers = passed_headers(resp.headers.items())
        spec = call.spec
        if call.stream and spec.stream == "bytes":
            await sink.start(resp.status, resp.headers.get("Content-Type", "application/octet-stream"), headers)
            async for data in resp.content.iter_any():
                await sink.chunks([data])
            sink.ended(False)
        elif call.stream:
            await _relay_stream(resp, sink, spec, headers, StreamUsage(call, spec))
        else:
            body = await _read_capped(resp, MAX_BODY_BYTES)
            content_type = resp.content_type if "Content-Type" in resp.headers else JSON
            if content_type == JSON and not is_json_object(body):
                raise ProviderUnreachable("the provider answered with invalid JSON")
            if content_type != JSON and spec.body != "multipart":
                # Only the audio endpoints answer anything but JSON (text, srt, vtt).
                raise ProviderUnreachable(f"the provider answered {content_type}, not JSON")
            usage = json_usage(call, resp.status, content_type, body)
            if usage is not None:
                sink.usage(usage)
            await sink.done(resp.status, body, resp.headers.get("Content-Type", JSON), headers)

    async def probe(self, timeout_s: float) -> ProbeResult:
        return await probe_http(self.session, self.root, self.headers, self.provider.type, timeout_s)

    async def probe_while_busy(self, timeout_s: float) -> ProbeResult | None:
        return await probe_http_busy(self.session, self.root, self.headers, self.provider.type, timeout_s)

    async def aclose(self) -> None:
        if self._fresh is not None:
            await self._fresh.close()


def in_words(exc: aiohttp.ClientError) -> str:
    """What went wrong, as an operator would say it (not a client library's class name)."""
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the server closed the connection"
    if isinstance(exc, aiohttp.ClientConnectorError):
        if exc.os_error.errno == errno.ECONNREFUSED or "Connect call failed" in str(exc.os_error):
            reason = "connection refused"
        else:
            reason = (exc.os_error.strerror or str(exc.os_error)).lower()
        return f"{reason} ({exc.host}:{exc.port})"
    if isinstance(exc, aiohttp.ClientOSError):
        if exc.errno == errno.ECONNRESET:
            return "connection reset"
        return (exc.strerror or str(exc)).lower()
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "the answer was cut off"
    if isinstance(exc, aiohttp.ClientResponseError):
        return f"bad answer ({exc.message})"
    return str(exc) or exc.__class__.__name__


async def _raise_for_status(resp: aiohttp.ClientResponse, provider_id: str, spec: Endpoint) -> None:
    """An error status is the provider's answer, relayed as such (status, headers, body in the
    endpoint's error shape), streamed request or not: nothing has started yet. A redirect is
    not followed, and not an answer either."""
    if resp.status < 300:
        return
    body, cut = await _read_error_body(resp)
    if resp.status < 400:
        raise ProviderUnreachable(provider_said(provider_id, resp.status, body, cut))
    raise ProviderRejected(resp.status, provider_error_body(spec.errors, resp.status, body, provider_id, cut), JSON,
                           passed_headers(resp.headers.items()), provider_id)


async def _relay_stream(
    resp: aiohttp.ClientResponse, sink: Sink, spec: Endpoint, headers: dict[str, str], meter: StreamUsage
) -> None:
    if resp.content_type != "text/event-stream":
        sent = resp.content_type if "Content-Type" in resp.headers else "no content type"
        raise ProviderUnreachable(f"expected an event stream, the provider sent {sent}")
    await sink.start(resp.status, "text/event-stream", headers)
    typed = spec.stream == "typed_sse"
    parser = SSEParser(typed=typed)
    last: bytes | None = None
    async for data in resp.content.iter_any():
        payloads = parser.feed(data)
        if payloads:
            last = payloads[-1]
            await _relay_payloads(payloads, sink, typed, meter)
        if parser.done:
            break
    else:
        payloads = parser.close()
        if payloads:
            last = payloads[-1]
            await _relay_payloads(payloads, sink, typed, meter)
    if not parser.done and not (typed and last is not None and _is_terminal(last, spec)):
        # Never an invented end: the caller must be able to tell a cut stream from a whole one.
        raise ProviderUnreachable("the stream ended early" if last is not None else "the stream ended empty")
    usage = meter.usage
    if usage is not None:
        sink.usage(usage)
    sink.ended(parser.done)


def _is_terminal(payload: bytes, spec: Endpoint) -> bool:
    """Does a typed event end its stream properly (by its name, or its data's ``type``)?"""
    name, _, data = payload.partition(b"\n")
    if name:
        return name in spec.terminal
    kind = event_type(data)
    return kind is not None and kind.encode() in spec.terminal


async def _relay_payloads(payloads: list[bytes], sink: Sink, typed: bool, meter: StreamUsage) -> None:
    """Pass on the good events; the caller gets every chunk before the first bad one."""
    for i, payload in enumerate(payloads):
        if not is_json_object(payload.partition(b"\n")[2] if typed else payload):
            if i:
                await _pass_on(meter.feed(payloads[:i]), sink)
            raise ProviderUnreachable("the provider sent a stream event that is not a JSON object")
    await _pass_on(meter.feed(payloads), sink)


async def _pass_on(payloads: list[bytes], sink: Sink) -> None:
    # A batch may be only the usage chunk iop asked for: nothing of it goes on.
    if payloads:
        await sink.chunks(payloads)


async def _read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    if resp.content_length is not None and resp.content_length > limit:
        raise ProviderUnreachable(f"the provider's answer is larger than {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for data in resp.content.iter_any():
        size += len(data)
        if size > limit:
            raise ProviderUnreachable(f"the provider's answer is larger than {limit} bytes")
        chunks.append(data)
    return b"".join(chunks)


async def _read_error_body(resp: aiohttp.ClientResponse) -> tuple[bytes, bool]:
    """The first ``_ERROR_BODY_BYTES`` of an error answer, and whether it had more."""
    chunks: list[bytes] = []
    size = 0
    async for data in resp.content.iter_any():
        chunks.append(data)
        size += len(data)
        if size > _ERROR_BODY_BYTES:
            break
    body = b"".join(chunks)
    return body[:_ERROR_BODY_BYTES], size > _ERROR_BODY_BYTES
