"""Health probes, one cheap check per runtime, each with a short timeout.

| type       | health check                        | models it reports                  | loaded models   | slots hint |
|------------|-------------------------------------|------------------------------------|-----------------|------------|
| vllm       | ``GET /health`` answers 200         | ``GET /v1/models`` (``data[].id``) | -               | -          |
| sglang     | ``GET /health`` answers 200         | ``GET /v1/models``                 | -               | -          |
| lemonade   | ``GET /api/v1/health`` answers 200  | ``GET /api/v1/models``             | -               | -          |
| ollama     | ``GET /api/tags`` answers 200       | ``/api/tags`` (``models[].name``)  | ``GET /api/ps`` | -          |
| llamacpp   | ``GET /health`` answers 200 (503: "loading model") | ``GET /v1/models`` | - | ``/props`` or ``/slots`` |
| openai_api | ``GET /v1/models`` answers 200 (with the provider's key) | ``/v1/models`` | -              | -          |
| cli        | the executable resolves and runs (``argv[0] --version``) | the configured ``models`` | - | - |

| type       | asked while busy                    |
|------------|-------------------------------------|
| vllm       | ``GET /health``                     |
| sglang     | ``GET /health``                     |
| lemonade   | ``GET /api/v1/health``              |
| ollama     | ``GET /api/tags``                   |
| llamacpp   | ``GET /health``, if the server has it |
| openai_api | nothing                             |
| cli        | the same check                      |

**While busy** (the provider runs requests, iop's or another worker's of the node) the worker
asks only what the second table says, and only every ``busy_probe_interval_ms``: its traffic
is its health meanwhile (a failed call marks it unavailable, workers/provider_state.py). A probe must
never be what disturbs a running request, and some servers are disturbed by one:
llama-cpp-python's server takes its model lock for ``GET /v1/models`` as for a completion,
and by default (``interrupt_requests``) a request waiting for that lock ends the running
stream with ``[DONE]`` and no ``finish_reason``. So:

* vllm: ``/health`` reads the engine's error flag; sglang: ``/health`` answers at once, or
  runs a one-token request that the server skips while it runs others; lemonade:
  ``/api/v1/health`` reports the server's own state (which model is loaded); ollama:
  ``/api/tags`` lists the model files. None of them waits for a model, so they are asked
  while busy too.
* llamacpp: llama-server answers ``/health`` outside its slots. A server without one (404:
  llama-cpp-python) has its model list answer for it, and nothing harmless to ask: while
  busy it is not asked at all. Which path answers for health is remembered per server:
  after a 404 the next probes ask ``/v1/models`` alone (the reason of a failure names both:
  ``GET /health answered 404; GET /v1/models timed out after 2s``), and once that fails
  the next probe starts from ``/health`` again.
* openai_api: behind the type may be anything, llama-cpp-python included, and its only
  check is the model list: nothing is asked while busy.
* cli: ``--version`` runs in a process of its own, beside the running ones.

The slots hint is llama-server's number of parallel slots (its ``--parallel``): the
``total_slots`` field of ``GET /props``, else the length of the list ``GET /slots`` answers.
It is shown beside the configured capacity and never used for dispatch. It costs one
request at most per probe, asked only once the provider is healthy, only of a server that
answers ``/health`` (llama-cpp-python has neither source), and within the same
timeout; when that request fails, times out or answers something else, the probe is still
healthy, without a hint. Which source is asked is remembered per server: ``/props`` first; when it gives no
``total_slots`` the next probe asks ``/slots`` (which ``--no-slots`` turns off: 501), and
when that gives nothing either, the one after asks ``/props`` again.
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


class _LlamaProps(msgspec.Struct):
    total_slots: int | None = None


def _props_slots(body: bytes) -> int | None:
    """llama-server's ``GET /props``: its ``total_slots``."""
    return msgspec.json.decode(body, type=_LlamaProps).total_slots


def _slots_length(body: bytes) -> int | None:
    """llama-server's ``GET /slots``: one object per slot."""
    return len(msgspec.json.decode(body, type=list[dict[str, object]]))


@dataclass(frozen=True)
class HttpProbe:
    models_path: str
    parse: Callable[[bytes], list[str]]
    health_path: str | None = None
    loaded_path: str | None = None
    # The reason given when the health endpoint answers 503 (llama-server: still loading).
    health_503: str | None = None
    # A 404 of the health endpoint hands the check to the model list (llama-cpp-python has
    # no /health); which one answers is remembered per server.
    health_404_to_models: bool = False
    # Where the slots hint may come from, in order of preference (one is asked per probe).
    slots_from: tuple[tuple[str, Callable[[bytes], int | None]], ...] = ()
    # The one path asked while the provider is busy: one that cannot disturb the requests it
    # runs (the module docstring says why each); None: nothing is asked while busy.
    busy_path: str | None = None


HTTP_PROBES: dict[str, HttpProbe] = {
    "vllm": HttpProbe("/v1/models", _openai_names, health_path="/health", busy_path="/health"),
    "sglang": HttpProbe("/v1/models", _openai_names, health_path="/health", busy_path="/health"),
    "lemonade": HttpProbe("/api/v1/models", _openai_names, health_path="/api/v1/health",
                          busy_path="/api/v1/health"),
    "ollama": HttpProbe("/api/tags", _ollama_names, loaded_path="/api/ps", busy_path="/api/tags"),
    "llamacpp": HttpProbe("/v1/models", _openai_names, health_path="/health", health_503="loading model",
                          health_404_to_models=True, busy_path="/health",
                          slots_from=(("/props", _props_slots), ("/slots", _slots_length))),
    "openai_api": HttpProbe("/v1/models", _openai_names),
}

# Per server root: the index in ``slots_from`` to ask next. A source that gives no hint
# hands the next probe to the following one, so a probe never asks more than one of them.
_slots_source: dict[str, int] = {}
# Server roots whose health endpoint answered 404: their model list answers for it.
_no_health: set[str] = set()
# Servers whose /health answered a whole probe (llama-server): their engine metrics may be read.
_health_seen: set[str] = set()
_MAX_REMEMBERED = 1024


class _Failed(Exception):
    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


async def _get(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> bytes:
    async with session.get(url, headers=headers, allow_redirects=False) as resp:
        if resp.status != 200:
            raise _Failed(f"answered {resp.status}", resp.status)
        body = bytearray()
        async for data in resp.content.iter_any():
            body += data
            if len(body) > MAX_PROBE_BYTES:
                raise _Failed("answer too large")
        return bytes(body)


def lacks_health(root: str) -> bool:
    """Whether the server at ``root`` has not (yet) shown a ``/health`` to a whole probe, or
    answered it 404 since (llama-cpp-python behind the ``llamacpp`` type): such a server is
    asked nothing while busy, engine metrics included (workers/engine_metrics.py)."""
    return root not in _health_seen or root in _no_health


def _worker_stalled(started: float, timeout_s: float) -> bool:
    """Did a probe that timed out take far longer than its timeout? Then the worker itself
    was frozen meanwhile (stopped, swapped out, a long pause of its loop) and its timer fired
    late: the provider's silence is not proven, and the probe is made again."""
    return asyncio.get_running_loop().time() - started > 2 * timeout_s


async def probe_http(
    session: aiohttp.ClientSession, root: str, headers: dict[str, str], provider_type: str, timeout_s: float,
    *, again: bool = True,
) -> ProbeResult:
    """The whole probe of an idle provider: health, models (and loaded models, slots hint)."""
    started = asyncio.get_running_loop().time()
    spec = HTTP_PROBES[provider_type]
    health_path = None if spec.health_404_to_models and root in _no_health else spec.health_path
    path = health_path or spec.models_path
    # "GET /health answered 404" once the model list answers for a missing health endpoint.
    fell_back = ""
    deadline = asyncio.get_running_loop().time() + timeout_s
    try:
        async with asyncio.timeout_at(deadline):
            if health_path:
                try:
                    await _get(session, root + health_path, headers)
                except _Failed as exc:
                    if not (exc.status == 404 and spec.health_404_to_models):
                        raise
                    fell_back = f"GET {health_path} {exc}"
            path = spec.models_path
            models = spec.parse(await _get(session, root + spec.models_path, headers))
            loaded = None
            if spec.loaded_path:
                path = spec.loaded_path
                loaded = spec.parse(await _get(session, root + spec.loaded_path, headers))
    except (TimeoutError, _Failed, aiohttp.ClientError, msgspec.DecodeError, TypeError, AttributeError) as exc:
        if isinstance(exc, TimeoutError) and again and _worker_stalled(started, timeout_s):
            return await probe_http(session, root, headers, provider_type, timeout_s, again=False)
        # A server that stops answering its model list may have been replaced: the next
        # probe asks for its health endpoint again.
        _no_health.discard(root)
        reason = _failure(exc, path, timeout_s, spec.health_503 if path == spec.health_path else None)
        return ProbeResult(False, f"{fell_back}; {reason}" if fell_back else reason)
    if fell_back:
        _remember(_no_health, root)
    answers_health = health_path is not None and not fell_back
    if answers_health:
        _remember(_health_seen, root)
    slots = await _slots_hint(session, root, headers, spec, deadline) if spec.slots_from and answers_health else None
    return ProbeResult(True, "", models, loaded, slots)


async def probe_http_busy(
    session: aiohttp.ClientSession, root: str, headers: dict[str, str], provider_type: str, timeout_s: float,
    *, again: bool = True,
) -> ProbeResult | None:
    """The probe of a busy provider: only its ``busy_path``, health alone (no models); None
    when nothing can be asked without disturbing what it runs."""
    started = asyncio.get_running_loop().time()
    spec = HTTP_PROBES[provider_type]
    path = spec.busy_path
    if path is None or (path == spec.health_path and spec.health_404_to_models and root in _no_health):
        return None
    try:
        async with asyncio.timeout(timeout_s):
            await _get(session, root + path, headers)
    except _Failed as exc:
        if exc.status == 404 and path == spec.health_path and spec.health_404_to_models:
            # Learnt while busy: this server has no health endpoint, and its model list may
            # not be asked now. The next idle probe asks that.
            _remember(_no_health, root)
            return None
        return ProbeResult(False, _failure(exc, path, timeout_s, spec.health_503 if path == spec.health_path else None))
    except (TimeoutError, aiohttp.ClientError) as exc:
        if isinstance(exc, TimeoutError) and again and _worker_stalled(started, timeout_s):
            return await probe_http_busy(session, root, headers, provider_type, timeout_s, again=False)
        return ProbeResult(False, _failure(exc, path, timeout_s, None))
    return ProbeResult(True, "")


def _failure(exc: Exception, path: str, timeout_s: float, reason_503: str | None) -> str:
    """Why a probe of ``path`` failed, as the catalog shows it."""
    if isinstance(exc, TimeoutError):
        return f"GET {path} timed out after {timeout_s:g}s"
    if isinstance(exc, _Failed):
        if exc.status == 503 and reason_503:
            return reason_503
        return f"GET {path} {exc}"
    if isinstance(exc, aiohttp.ClientError):
        return f"GET {path} failed: {exc.__class__.__name__}: {exc}"
    return f"GET {path} answered something that is not a model list"


def _remember(roots: set[str], root: str) -> None:
    if root not in roots and len(roots) >= _MAX_REMEMBERED:
        roots.clear()
    roots.add(root)


async def _slots_hint(
    session: aiohttp.ClientSession, root: str, headers: dict[str, str], spec: HttpProbe, deadline: float
) -> int | None:
    """One request, to the source remembered for ``root``, within what is left of the probe's
    timeout. Never fails the probe: None when there is no positive count. A source that
    answered without one (another status, another shape, no ``total_slots``) hands the next
    probe to the next source; one that timed out or could not be reached is asked again."""
    index = _slots_source.get(root, 0) % len(spec.slots_from)
    path, parse = spec.slots_from[index]
    slots: int | None = None
    answered = True
    try:
        async with asyncio.timeout_at(deadline):
            slots = parse(await _get(session, root + path, headers))
    except (TimeoutError, aiohttp.ClientError):
        answered = False
    except (_Failed, msgspec.DecodeError, TypeError):
        pass
    if slots is not None and slots <= 0:
        slots = None
    if slots is None and answered:
        index = (index + 1) % len(spec.slots_from)
    if root not in _slots_source and len(_slots_source) >= _MAX_REMEMBERED:
        _slots_source.clear()
    _slots_source[root] = index
    return slots


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
