"""One adapter for every OpenAI-compatible HTTP server: vLLM, SGLang, Lemonade, Ollama
(through its ``/v1`` API) and hosted OpenAI-style APIs.

Calls go through one pooled ``aiohttp.ClientSession`` per worker (measured at ~1/20 of
httpx's CPU per call). The provider's own key comes from the env var the config
names; the caller's credentials never reach a provider. Redirects are not followed.
"""

from __future__ import annotations

import os

import aiohttp

from dispatcher.config import ProviderConfig
from dispatcher.exceptions import ProviderRejected, ProviderTimeout, ProviderUnreachable
from dispatcher.jsonbody import is_json_object
from workers.adapters.base import Adapter, ProbeResult, ProviderCall, Sink
from workers.adapters.probes import probe_http
from workers.adapters.sse import SSEParser

HttpSession = aiohttp.ClientSession

# A JSON answer larger than this is refused rather than held in memory.
MAX_BODY_BYTES = 64 * 1024 * 1024
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


class OpenAIHttpAdapter(Adapter):
    def __init__(self, provider: ProviderConfig, session: HttpSession) -> None:
        super().__init__(provider)
        assert provider.base_url is not None
        self.root = provider.base_url
        self.session = session
        self.headers = {"Content-Type": "application/json"}
        key = os.environ.get(provider.api_key_env) if provider.api_key_env else None
        if key:
            self.headers["Authorization"] = f"Bearer {key}"

    async def call(self, call: ProviderCall, sink: Sink) -> None:
        url = f"{self.root}/v1/{call.endpoint}"
        timeout = aiohttp.ClientTimeout(total=self.provider.timeout_s)
        try:
            async with self.session.post(
                url, data=call.body, headers=self.headers, timeout=timeout, allow_redirects=False
            ) as resp:
                await _raise_for_status(resp)
                if call.stream:
                    await _relay_stream(resp, sink)
                else:
                    body = await _read_capped(resp, MAX_BODY_BYTES)
                    if not is_json_object(body):
                        raise ProviderUnreachable("the provider answered with invalid JSON")
                    await sink.done(resp.status, body, "application/json")
        except TimeoutError:
            raise ProviderTimeout(
                f"provider {self.provider.id} did not answer within {self.provider.timeout_s}s"
            ) from None
        except aiohttp.ClientError as exc:
            raise ProviderUnreachable(
                f"provider {self.provider.id} unreachable: {exc.__class__.__name__}: {exc}"
            ) from None

    async def probe(self, timeout_s: float) -> ProbeResult:
        return await probe_http(self.session, self.root, self.headers, self.provider.type, timeout_s)


async def _raise_for_status(resp: aiohttp.ClientResponse) -> None:
    if resp.status < 300:
        return
    body = await _read_capped(resp, _ERROR_BODY_BYTES, truncate=True)
    if 400 <= resp.status < 500:
        # aiohttp reports a missing Content-Type as octet-stream; an OpenAI error is JSON.
        content_type = resp.content_type if "Content-Type" in resp.headers else "application/json"
        raise ProviderRejected(resp.status, body, content_type)
    raise ProviderUnreachable(f"provider answered {resp.status}: {body[:200].decode(errors='replace')}")


async def _relay_stream(resp: aiohttp.ClientResponse, sink: Sink) -> None:
    if resp.content_type != "text/event-stream":
        sent = resp.content_type if "Content-Type" in resp.headers else "no content type"
        raise ProviderUnreachable(f"expected an event stream, the provider sent {sent}")
    await sink.start(resp.status)
    parser = SSEParser()
    async for data in resp.content.iter_any():
        await _relay_payloads(parser.feed(data), sink)
        if parser.done:
            return
    await _relay_payloads(parser.close(), sink)


async def _relay_payloads(payloads: list[bytes], sink: Sink) -> None:
    """Pass on the good events; the caller gets every chunk before the first bad one."""
    for i, payload in enumerate(payloads):
        if not is_json_object(payload):
            if i:
                await sink.chunks(payloads[:i])
            raise ProviderUnreachable("the provider sent a stream event that is not a JSON object")
    if payloads:
        await sink.chunks(payloads)


async def _read_capped(resp: aiohttp.ClientResponse, limit: int, truncate: bool = False) -> bytes:
    if resp.content_length is not None and resp.content_length > limit and not truncate:
        raise ProviderUnreachable(f"the provider's answer is larger than {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for data in resp.content.iter_any():
        size += len(data)
        if size > limit:
            if truncate:
                chunks.append(data[: limit - (size - len(data))])
                break
            raise ProviderUnreachable(f"the provider's answer is larger than {limit} bytes")
        chunks.append(data)
    return b"".join(chunks)
