"""Health probes, one cheap check per runtime, each with a short timeout.

| type       | health check                          | models it reports                | loaded models |
|------------|---------------------------------------|----------------------------------|---------------|
| vllm       | ``GET /health`` answers 200           | ``GET /v1/models`` (``data[].id``) | -           |
| sglang     | ``GET /health`` answers 200           | ``GET /v1/models``               | -             |
| lemonade   | ``GET /api/v1/health`` answers 200    | ``GET /api/v1/models``           | -             |
| ollama     | ``GET /api/tags`` answers 200         | ``/api/tags`` (``models[].name``)  | ``GET /api/ps`` |
| openai_api | ``GET /v1/models`` answers 200 (with the provider's key) | ``/v1/models`` | -            |
| cli        | the executable resolves and runs (``argv[0] --version``) | the configured ``models`` | - |
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import msgspec

from workers.adapters.base import ProbeResult

MAX_PROBE_BYTES = 4 * 1024 * 1024


class _OpenAIList(msgspec.Struct):
    data: list[dict[str, object]] = []


class _OllamaList(msgspec.Struct):
    models: list[dict[str, object]] = []


def _openai_names(body: bytes) -> list[str]:
    return [str(m["id"]) for m in msgspec.json.decode(body, type=_OpenAIList).data if "id" in m]


def _ollama_names(body: bytes) -> list[str]:
    return [str(m.get("name") or m.get("model")) for m in msgspec.json.decode(body, type=_OllamaList).models
            if m.get("name") or m.get("model")]


@dataclass(frozen=True)
class HttpProbe:
    models_path: str
    parse: Callable[[bytes], list[str]]
    health_path: str | None = None
    loaded_path: str | None = None


HTTP_PROBES: dict[str, HttpProbe] = {
    "vllm": HttpProbe("/v1/models", _openai_names, health_path="/health"),
    "sglang": HttpProbe("/v1/models", _openai_names, health_path="/health"),
    "lemonade": HttpProbe("/api/v1/models", _openai_names, health_path="/api/v1/health"),
    "ollama": HttpProbe("/api/tags", _ollama_names, loaded_path="/api/ps"),
    "openai_api": HttpProbe("/v1/models", _openai_names),
}


class _Failed(Exception):
    pass


async def _get(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> bytes:
    async with session.get(url, headers=headers, allow_redirects=False) as resp:
        if resp.status != 200:
            raise _Failed(f"answered {resp.status}")
        body = bytearray()
        async for data in resp.content.iter_any():
            body += data
            if len(body) > MAX_PROBE_BYTES:
                raise _Failed("answer too large")
        return bytes(body)


async def probe_http(
    session: aiohttp.ClientSession, root: str, headers: dict[str, str], provider_type: str, timeout_s: float
) -> ProbeResult:
    spec = HTTP_PROBES[provider_type]
    path = spec.health_path or spec.models_path
    try:
        async with asyncio.timeout(timeout_s):
            if spec.health_path:
                await _get(session, root + spec.health_path, headers)
            path = spec.models_path
            models = spec.parse(await _get(session, root + spec.models_path, headers))
            loaded = None
            if spec.loaded_path:
                path = spec.loaded_path
                loaded = spec.parse(await _get(session, root + spec.loaded_path, headers))
    except TimeoutError:
        return ProbeResult(False, f"GET {path} timed out after {timeout_s:g}s")
    except _Failed as exc:
        return ProbeResult(False, f"GET {path} {exc}")
    except aiohttp.ClientError as exc:
        return ProbeResult(False, f"GET {path} failed: {exc.__class__.__name__}: {exc}")
    except (msgspec.DecodeError, TypeError, AttributeError):
        return ProbeResult(False, f"GET {path} answered something that is not a model list")
    return ProbeResult(True, "", models, loaded)


async def probe_command(argv0: str, env: dict[str, str], timeout_s: float) -> ProbeResult:
    """The executable resolves and can be started; its ``--version`` exit status is not judged
    (many tools have no such flag), only that it runs and ends."""
    path = shutil.which(argv0)
    if path is None:
        return ProbeResult(False, f"executable {argv0!r} not found")
    try:
        proc = await asyncio.create_subprocess_exec(
            path, "--version", stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL, env=env, start_new_session=True,
        )
    except OSError as exc:
        return ProbeResult(False, f"cannot run {argv0!r}: {exc.strerror}")
    try:
        async with asyncio.timeout(timeout_s):
            await proc.wait()
    except TimeoutError:
        return ProbeResult(False, f"{argv0!r} did not finish within {timeout_s:g}s")
    finally:
        if proc.returncode is None:
            # Timed out or cancelled: the tool and whatever it started go, and are reaped.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await asyncio.shield(proc.wait())
    return ProbeResult(True, "")
