"""Health probes of every runtime (``workers/adapters/probes.py``) through the adapters that use them.

HTTP types run against the project's fake provider (started in-process on a free port), a
small aiohttp app imitating the runtimes that records what it was asked (paths, order,
headers), and a raw socket server that accepts and never answers. ``cli`` runs real
child processes (shell scripts written to ``tmp_path``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import anyio
import msgspec
import pytest
from aiohttp import web

from dispatcher.config import HTTP_TYPES, ProviderConfig
from iop.fake_provider import FakeOptions, start
from iop.redis_server import free_port
from tests.waiting import EVENTUALLY_S, eventually
from workers.adapters import probes
from workers.adapters.base import ProbeResult
from workers.adapters.cli import ENV_PASSTHROUGH, CliAdapter
from workers.adapters.factory import make_adapter
from workers.adapters.openai_http import OpenAIHttpAdapter, new_session
from workers.adapters.probes import HTTP_PROBES

pytestmark = pytest.mark.anyio

HOST = "127.0.0.1"
MODELS = ["served-model", "other-model"]
KEY_ENV = "IOP_TEST_PROBE_KEY"

TYPES = ["vllm", "sglang", "lemonade", "ollama", "llamacpp", "openai_api"]

# What each runtime is asked, in order, on a healthy probe (llamacpp: and its slots hint).
EXPECTED_PATHS = {
    "vllm": ["/health", "/v1/models"],
    "sglang": ["/health", "/v1/models"],
    "lemonade": ["/api/v1/health", "/api/v1/models"],
    "ollama": ["/api/tags", "/api/ps"],
    "llamacpp": ["/health", "/v1/models", "/props"],
    "openai_api": ["/v1/models"],
}
# The endpoint that lists the models (ollama: /api/tags, which is also its health check).
MODELS_PATH = {
    "vllm": "/v1/models",
    "sglang": "/v1/models",
    "lemonade": "/api/v1/models",
    "ollama": "/api/tags",
    "llamacpp": "/v1/models",
    "openai_api": "/v1/models",
}
# What a busy provider is asked (None: nothing), per the module docstring's second table.
BUSY_PATHS: dict[str, str | None] = {
    "vllm": "/health",
    "sglang": "/health",
    "lemonade": "/api/v1/health",
    "ollama": "/api/tags",
    "llamacpp": "/health",
    "openai_api": None,
}
# The endpoints whose failure makes the probe fail (the slots hint never does).
REQUIRED_PATHS = {t: [p for p in paths if p not in ("/props", "/slots")] for t, paths in EXPECTED_PATHS.items()}
# The slots hint the Runtime below reports (llama-server's /props total_slots).
RUNTIME_SLOTS = 4


def first_path(provider_type: str) -> str:
    return EXPECTED_PATHS[provider_type][0]


def unhealthy_reason(provider_type: str) -> str:
    """What a probe says when the runtime's first endpoint answers 503."""
    return "loading model" if provider_type == "llamacpp" else f"GET {first_path(provider_type)} answered 503"


# --------------------------------------------------------------------------- helpers


def http_provider(provider_type: str, base_url: str, api_key_env: str | None = None) -> ProviderConfig:
    return ProviderConfig(
        id="p", type=provider_type, base_url=base_url, models=["configured"], api_key_env=api_key_env
    )


@pytest.fixture(autouse=True)
def _fresh_slot_sources() -> Iterator[None]:
    """Which slots source each server root gets next, and which roots have no health
    endpoint, are remembered across probes; a test starts with none remembered (ports are
    reused between tests)."""
    probes._slots_source.clear()
    probes._no_health.clear()
    probes._health_seen.clear()
    yield
    probes._slots_source.clear()
    probes._no_health.clear()
    probes._health_seen.clear()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    s = new_session(4)
    try:
        yield s
    finally:
        await s.close()


@dataclass
class Fake:
    options: FakeOptions
    url: str


@pytest.fixture
async def fake() -> AsyncIterator[Fake]:
    options = FakeOptions(models=list(MODELS))
    port = free_port()
    runner = await start(HOST, port, options)
    try:
        yield Fake(options, f"http://{HOST}:{port}")
    finally:
        await runner.cleanup()


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def openai_list(names: list[str]) -> dict[str, object]:
    return {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "x"} for n in names]}


def ollama_list(names: list[str]) -> dict[str, object]:
    return {"models": [{"name": n, "model": n, "size": 0} for n in names]}


def llama_models(names: list[str]) -> dict[str, object]:
    """llama-server's ``GET /v1/models``: an Ollama-style ``models`` list beside the OpenAI ``data``."""
    return {
        "models": [{"name": n, "model": n, "modified_at": "", "size": "", "digest": "", "type": "model",
                    "description": "", "tags": [""], "capabilities": ["completion"], "parameters": "",
                    "details": {"parent_model": "", "format": "gguf", "family": "", "families": [""],
                                "parameter_size": "", "quantization_level": ""}} for n in names],
        "object": "list",
        "data": [{"id": n, "object": "model", "created": 1735689600, "owned_by": "llamacpp",
                  "meta": {"vocab_type": 2, "n_vocab": 151936, "n_ctx_train": 40960, "n_embd": 2560,
                           "n_params": 4022468096, "size": 2497280256}} for n in names],
    }


def llama_slot(slot_id: int, n_ctx: int = 8192, processing: bool = False) -> dict[str, object]:
    """One entry of llama-server's ``GET /slots`` (and its /props ``default_generation_settings``)."""
    return {
        "id": slot_id, "id_task": 135 if processing else -1, "n_ctx": n_ctx, "speculative": False,
        "is_processing": processing,
        "params": {"n_predict": -1, "seed": 4294967295, "temperature": 0.800000011920929, "top_k": 40,
                   "top_p": 0.949999988079071, "min_p": 0.05000000074505806, "repeat_last_n": 64,
                   "repeat_penalty": 1.0, "stop": [], "max_tokens": -1, "n_keep": 0, "ignore_eos": False,
                   "stream": True, "n_probs": 0, "chat_format": "Content-only", "reasoning_format": "none",
                   "samplers": ["penalties", "dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"],
                   "speculative.n_max": 16, "speculative.n_min": 0, "speculative.p_min": 0.75,
                   "timings_per_token": False, "lora": []},
        "next_token": {"has_next_token": True, "has_new_line": False, "n_remain": -1, "n_decoded": 0},
    }


def llama_props(total_slots: int | None, n_ctx: int = 8192) -> dict[str, object]:
    """llama-server's ``GET /props`` (``total_slots`` left out: a build that predates it)."""
    props: dict[str, object] = {
        "default_generation_settings": {**llama_slot(0, n_ctx), "prompt": ""},
        "model_path": "/models/Qwen3-4B-Q4_K_M.gguf",
        "chat_template": "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\\n' }}"
                         "{{ message.content + '<|im_end|>\\n' }}{%- endfor %}",
        "chat_template_caps": {"supports_tools": True, "supports_system_role": True},
        "modalities": {"vision": False, "audio": False},
        "media_marker": "<__media__>",
        "build_info": "b6500-2dd8a1d6",
        "is_sleeping": False,
    }
    if total_slots is not None:
        props["total_slots"] = total_slots
    return props


@dataclass
class Runtime:
    """An aiohttp app imitating every runtime's probe endpoints; records each request.

    ``overrides`` replaces the answer of one path; ``release`` frees handlers that wait on it
    (set before the server stops, so that shutting down never waits on a held request)."""

    models: list[str] = field(default_factory=lambda: list(MODELS))
    loaded: list[str] = field(default_factory=lambda: ["served-model"])
    slots: int = RUNTIME_SLOTS
    overrides: dict[str, Handler] = field(default_factory=dict)
    seen: list[tuple[str, str, str | None]] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""

    @property
    def paths(self) -> list[str]:
        return [path for _, path, _ in self.seen]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.seen.append((request.method, request.path, request.headers.get("Authorization")))
        override = self.overrides.get(request.path)
        if override is not None:
            return await override(request)
        path = request.path
        if path in ("/health", "/health_generate"):
            return web.Response()
        if path == "/api/v1/health":
            return web.json_response({"status": "ok", "model_loaded": self.models[0] if self.models else None})
        if path in ("/v1/models", "/api/v1/models"):
            return web.json_response(openai_list(self.models))
        if path == "/api/tags":
            return web.json_response(ollama_list(self.models))
        if path == "/api/ps":
            return web.json_response(ollama_list(self.loaded))
        if path == "/props":
            return web.json_response(llama_props(self.slots))
        if path == "/slots":
            return web.json_response([llama_slot(i) for i in range(self.slots)])
        return web.json_response({"error": "not found"}, status=404)

    async def hold(self, request: web.Request) -> web.StreamResponse:
        """A handler that answers only once the test is over."""
        await self.release.wait()
        return web.Response(status=503)


@contextlib.asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    port = free_port()
    try:
        await web.TCPSite(runner, HOST, port).start()
        yield f"http://{HOST}:{port}"
    finally:
        await runner.cleanup()


@pytest.fixture
async def runtime() -> AsyncIterator[Runtime]:
    rt = Runtime()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", rt.handle)
    try:
        async with serve(app) as url:
            rt.url = url
            try:
                yield rt
            finally:
                rt.release.set()
    finally:
        rt.release.set()


class SilentServer:
    """Accepts connections, reads the request head, never answers (until the test ends)."""

    def __init__(self) -> None:
        self.heads: list[bytes] = []
        self.url = ""
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            self.heads.append(await reader.readuntil(b"\r\n\r\n"))
            await reader.read()  # until the client goes away

    async def __aenter__(self) -> SilentServer:
        port = free_port()
        self._server = await asyncio.start_server(self._handle, HOST, port)
        self.url = f"http://{HOST}:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        for writer in self._writers:
            writer.close()
        self._server.close()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._server.wait_closed(), 5)


async def probe(provider_type: str, url: str, session: aiohttp.ClientSession, timeout_s: float = 5.0,
                api_key_env: str | None = None) -> ProbeResult:
    adapter = OpenAIHttpAdapter(http_provider(provider_type, url, api_key_env), session)
    with anyio.fail_after(EVENTUALLY_S + timeout_s):
        return await adapter.probe(timeout_s)


async def busy_probe(provider_type: str, url: str, session: aiohttp.ClientSession,
                     timeout_s: float = 5.0) -> ProbeResult | None:
    adapter = OpenAIHttpAdapter(http_provider(provider_type, url), session)
    with anyio.fail_after(EVENTUALLY_S + timeout_s):
        return await adapter.probe_while_busy(timeout_s)


# --------------------------------------------------------------------------- the module, the table


def test_probes_module_imports_on_its_own() -> None:
    # A fresh interpreter, so that no earlier import of workers.adapters hides the cycle.
    proc = subprocess.run(
        [sys.executable, "-c", "import workers.adapters.probes"],
        cwd=Path(__file__).resolve().parents[3], capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]




def _table_rows() -> dict[str, list[str]]:
    doc = probes.__doc__
    assert doc
    rows: dict[str, list[str]] = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and not set(cells[0]) <= set("-") and cells[0] != "type":
            rows[cells[0]] = cells[1:]
    return rows


def _paths(cell: str) -> list[str]:
    return re.findall(r"``(?:GET )?(/[^`\s]*)``", cell)


def test_docstring_table_matches_http_probes() -> None:
    rows = _table_rows()
    assert set(rows) == set(HTTP_PROBES) | {"cli"}
    assert set(HTTP_PROBES) == set(HTTP_TYPES) == set(TYPES)
    for provider_type, spec in HTTP_PROBES.items():
        health, models, loaded, slots = rows[provider_type]
        # The health column names the health endpoint, or the model list when there is none.
        assert _paths(health) == [spec.health_path or spec.models_path], provider_type
        assert _paths(models) == [spec.models_path], provider_type
        assert _paths(loaded) == ([spec.loaded_path] if spec.loaded_path else []), provider_type
        if not spec.loaded_path:
            assert loaded == "-", provider_type
        assert _paths(slots) == [path for path, _ in spec.slots_from], provider_type
        if not spec.slots_from:
            assert slots == "-", provider_type
        if spec.health_503:
            assert f'503: "{spec.health_503}"' in health, provider_type
    # cli: no HTTP endpoints at all.
    assert all(not _paths(cell) for cell in rows["cli"])


def _busy_rows() -> dict[str, str]:
    doc = probes.__doc__
    assert doc
    rows: dict[str, str] = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and not set(cells[0]) <= set("-") and cells[0] != "type":
            rows[cells[0]] = cells[1]
    return rows


def test_docstring_busy_table_matches_http_probes() -> None:
    rows = _busy_rows()
    assert set(rows) == set(HTTP_PROBES) | {"cli"}
    for provider_type, spec in HTTP_PROBES.items():
        assert _paths(rows[provider_type]) == ([spec.busy_path] if spec.busy_path else []), provider_type
        assert BUSY_PATHS[provider_type] == spec.busy_path
        if spec.busy_path is None:
            assert rows[provider_type] == "nothing"
    # The model list is never asked while busy: it is what llama-cpp-python locks its model for.
    assert all(spec.busy_path != spec.models_path for t, spec in HTTP_PROBES.items() if t != "ollama")
    assert rows["cli"] == "the same check"


def test_expected_paths_match_http_probes() -> None:
    """The order the tests below expect is the table's: health, model list, loaded list."""
    for provider_type, spec in HTTP_PROBES.items():
        expected = [p for p in (spec.health_path, spec.models_path, spec.loaded_path) if p]
        assert REQUIRED_PATHS[provider_type] == expected
        # The slots hint comes last: its first source, on a server that has not been probed yet.
        assert EXPECTED_PATHS[provider_type] == expected + [path for path, _ in spec.slots_from[:1]]
        assert MODELS_PATH[provider_type] == spec.models_path


# --------------------------------------------------------------------------- HTTP: healthy


@pytest.mark.parametrize("provider_type", TYPES)
async def test_healthy_against_the_fake(provider_type: str, fake: Fake, session: aiohttp.ClientSession) -> None:
    result = await probe(provider_type, fake.url, session)
    loaded = list(MODELS) if provider_type == "ollama" else None  # the fake's /api/ps lists every model
    assert result == ProbeResult(True, "", list(MODELS), loaded)


@pytest.mark.parametrize("provider_type", TYPES)
async def test_healthy_follows_the_reported_models(
    provider_type: str, fake: Fake, session: aiohttp.ClientSession
) -> None:
    fake.options.models = []
    assert await probe(provider_type, fake.url, session) == ProbeResult(
        True, "", [], [] if provider_type == "ollama" else None
    )
    fake.options.models = ["a", "b", "c"]
    result = await probe(provider_type, fake.url, session)
    assert result.healthy, result.reason
    assert result.models == ["a", "b", "c"]


@pytest.mark.parametrize("provider_type", TYPES)
async def test_endpoints_in_order(provider_type: str, runtime: Runtime, session: aiohttp.ClientSession) -> None:
    result = await probe(provider_type, runtime.url, session)
    assert result.healthy, result.reason
    assert runtime.seen == [("GET", p, None) for p in EXPECTED_PATHS[provider_type]]
    assert result.models == MODELS
    assert result.slots == (RUNTIME_SLOTS if provider_type == "llamacpp" else None)


async def test_ollama_loaded_comes_from_api_ps(runtime: Runtime, session: aiohttp.ClientSession) -> None:
    runtime.models = ["a:latest", "b:7b"]
    runtime.loaded = ["b:7b"]
    result = await probe("ollama", runtime.url, session)
    assert result == ProbeResult(True, "", ["a:latest", "b:7b"], ["b:7b"])
    runtime.loaded = []
    assert (await probe("ollama", runtime.url, session)).loaded == []


async def test_ollama_names_fall_back_to_model_field(runtime: Runtime, session: aiohttp.ClientSession) -> None:
    async def tags(request: web.Request) -> web.StreamResponse:
        return web.json_response({"models": [{"model": "only-model"}, {"name": "n", "model": "m"}, {"size": 1}]})

    runtime.overrides["/api/tags"] = tags
    result = await probe("ollama", runtime.url, session)
    assert result.healthy, result.reason
    assert result.models == ["only-model", "n"]


@pytest.mark.parametrize("provider_type", ["vllm", "sglang", "lemonade", "openai_api"])
async def test_openai_list_entries_without_id_are_skipped(
    provider_type: str, runtime: Runtime, session: aiohttp.ClientSession
) -> None:
    async def listing(request: web.Request) -> web.StreamResponse:
        return web.json_response({"object": "list", "data": [{"id": "a"}, {"name": "no-id"}, {"id": "b"}]})

    runtime.overrides[MODELS_PATH[provider_type]] = listing
    assert await probe(provider_type, runtime.url, session) == ProbeResult(True, "", ["a", "b"])


# --------------------------------------------------------------------------- HTTP: unhealthy


@pytest.mark.parametrize("provider_type", TYPES)
async def test_unhealthy_fake(provider_type: str, fake: Fake, session: aiohttp.ClientSession) -> None:
    fake.options.healthy = False
    result = await probe(provider_type, fake.url, session)
    assert result == ProbeResult(False, unhealthy_reason(provider_type))
    assert result.models is None
    assert result.loaded is None


@pytest.mark.parametrize("provider_type", TYPES)
async def test_health_fine_model_list_garbage(
    provider_type: str, runtime: Runtime, session: aiohttp.ClientSession
) -> None:
    async def garbage(request: web.Request) -> web.StreamResponse:
        return web.Response(body=b'{"data": [1, 2', content_type="application/json")

    path = MODELS_PATH[provider_type]
    runtime.overrides[path] = garbage
    result = await probe(provider_type, runtime.url, session)
    assert not result.healthy
    assert result.reason == f"GET {path} answered something that is not a model list"
    assert "not a model list" in result.reason
    assert result.models is None
    # Nothing after the bad list was asked.
    assert runtime.paths == EXPECTED_PATHS[provider_type][: EXPECTED_PATHS[provider_type].index(path) + 1]


@pytest.mark.parametrize(
    "payload",
    [b"not json", b"[1, 2]", b'{"data": 5}', b'{"data": [1, 2]}', b'{"data": null}',
     b'{"models": 5}', b'{"models": ["x"]}', b'{"models": null}', b"null", b'"text"'],
)
@pytest.mark.parametrize("provider_type", TYPES)
async def test_garbage_shapes_are_not_a_model_list(
    provider_type: str, payload: bytes, runtime: Runtime, session: aiohttp.ClientSession
) -> None:
    async def garbage(request: web.Request) -> web.StreamResponse:
        return web.Response(body=payload, content_type="application/json")

    path = MODELS_PATH[provider_type]
    runtime.overrides[path] = garbage
    result = await probe(provider_type, runtime.url, session)
    # A shape of the *other* family (``models`` for an OpenAI list, ``data`` for Ollama) is
    # valid JSON with the expected key missing: an empty list, not garbage.
    other_family = (provider_type == "ollama" and payload.startswith(b'{"data"')) or (
        provider_type != "ollama" and payload.startswith(b'{"models"')
    )
    if other_family:
        assert result.healthy, result.reason
        assert result.models == []
    else:
        assert result == ProbeResult(False, f"GET {path} answered something that is not a model list")


async def test_ollama_api_ps_garbage(runtime: Runtime, session: aiohttp.ClientSession) -> None:
    async def garbage(request: web.Request) -> web.StreamResponse:
        return web.Response(body=b"<html>", content_type="text/html")

    runtime.overrides["/api/ps"] = garbage
    result = await probe("ollama", runtime.url, session)
    assert result == ProbeResult(False, "GET /api/ps answered something that is not a model list")


@pytest.mark.parametrize("provider_type", TYPES)
async def test_model_list_error_status_names_the_model_path(
    provider_type: str, runtime: Runtime, session: aiohttp.ClientSession
) -> None:
    async def broken(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": "boom"}, status=500)

    path = MODELS_PATH[provider_type]
    runtime.overrides[path] = broken
    result = await probe(provider_type, runtime.url, session)
    assert result == ProbeResult(False, f"GET {path} answered 500")


@pytest.mark.parametrize("provider_type", ["vllm", "sglang", "lemonade", "llamacpp"])
async def test_health_status_other_than_200_is_unhealthy(
    provider_type: str, runtime: Runtime, session: aiohttp.ClientSession
) -> None:
    async def no_content(request: web.Request) -> web.StreamResponse:
        return web.Response(status=204)

    runtime.overrides[first_path(provider_type)] = no_content
    result = await probe(provider_type, runtime.url, session)
    assert result == ProbeResult(False, f"GET {first_path(provider_type)} answered 204")
    assert runtime.paths == [first_path(provider_type)]  # the model list is not asked for


@pytest.mark.parametrize("provider_type", TYPES)
async def test_answer_too_large(
    provider_type: str, fake: Fake, session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(probes, "MAX_PROBE_BYTES", 64)
    fake.options.models = [f"model-{i:04d}" for i in range(50)]
    result = await probe(provider_type, fake.url, session)
    assert not result.healthy
    assert result.reason == f"GET {MODELS_PATH[provider_type]} answer too large"


@pytest.mark.parametrize("provider_type", TYPES)
async def test_model_list_sent_in_pieces(
    provider_type: str, runtime: Runtime, session: aiohttp.ClientSession
) -> None:
    listing = ollama_list(MODELS) if provider_type == "ollama" else openai_list(MODELS)
    raw = json.dumps(listing).encode()

    async def in_pieces(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        await response.write(raw[: len(raw) // 2])
        await asyncio.sleep(0.2)
        await response.write(raw[len(raw) // 2 :])
        await response.write_eof()
        return response

    runtime.overrides[MODELS_PATH[provider_type]] = in_pieces
    result = await probe(provider_type, runtime.url, session)
    assert result.healthy, result.reason
    assert result.models == MODELS


# --------------------------------------------------------------------------- HTTP: timeouts, unreachable


@pytest.mark.parametrize("provider_type", TYPES)
async def test_timeout_of_a_silent_server(provider_type: str, session: aiohttp.ClientSession) -> None:
    async with SilentServer() as server:
        started = time.monotonic()
        result = await probe(provider_type, server.url, session, timeout_s=0.5)
        elapsed = time.monotonic() - started
        heads = list(server.heads)
    assert result == ProbeResult(False, f"GET {first_path(provider_type)} timed out after 0.5s")
    assert "timed out" in result.reason
    assert elapsed < EVENTUALLY_S
    assert len(heads) == 1
    assert heads[0].startswith(f"GET {first_path(provider_type)} HTTP/1.1\r\n".encode())


@pytest.mark.parametrize("provider_type", TYPES)
async def test_timeout_names_the_endpoint_that_hangs(
    provider_type: str, runtime: Runtime, session: aiohttp.ClientSession
) -> None:
    # The last endpoint the probe needs hangs, after the earlier ones answered (a hanging slots
    # hint of llamacpp does not fail the probe: test_llamacpp_hanging_hint_is_no_hint).
    last = REQUIRED_PATHS[provider_type][-1]
    runtime.overrides[last] = runtime.hold
    started = time.monotonic()
    result = await probe(provider_type, runtime.url, session, timeout_s=0.5)
    assert time.monotonic() - started < EVENTUALLY_S
    assert result == ProbeResult(False, f"GET {last} timed out after 0.5s")
    assert runtime.paths == REQUIRED_PATHS[provider_type]


@pytest.mark.parametrize("provider_type", TYPES)
async def test_unreachable(provider_type: str, session: aiohttp.ClientSession) -> None:
    result = await probe(provider_type, f"http://{HOST}:{free_port()}", session)
    assert not result.healthy
    assert result.reason.startswith(f"GET {first_path(provider_type)} failed: ")
    assert "failed" in result.reason
    assert result.models is None
    assert result.loaded is None


# --------------------------------------------------------------------------- HTTP: keys, redirects


async def test_openai_api_key_from_env_is_sent(
    fake: Fake, session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.options.api_key = "sk-probe"
    monkeypatch.setenv(KEY_ENV, "sk-probe")
    result = await probe("openai_api", fake.url, session, api_key_env=KEY_ENV)
    assert result == ProbeResult(True, "", list(MODELS))


async def test_openai_api_without_the_key_is_unhealthy(
    fake: Fake, session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.options.api_key = "sk-probe"
    monkeypatch.delenv(KEY_ENV, raising=False)
    for env in (None, KEY_ENV):
        result = await probe("openai_api", fake.url, session, api_key_env=env)
        assert result == ProbeResult(False, "GET /v1/models answered 401")
    monkeypatch.setenv(KEY_ENV, "sk-wrong")
    result = await probe("openai_api", fake.url, session, api_key_env=KEY_ENV)
    assert result == ProbeResult(False, "GET /v1/models answered 401")


@pytest.mark.parametrize("provider_type", TYPES)
async def test_the_key_header_goes_to_every_probe_endpoint(
    provider_type: str, runtime: Runtime, session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-probe")
    result = await probe(provider_type, runtime.url, session, api_key_env=KEY_ENV)
    assert result.healthy, result.reason
    assert runtime.seen == [("GET", p, "Bearer sk-probe") for p in EXPECTED_PATHS[provider_type]]


@pytest.mark.parametrize("status", [301, 302, 307, 308])
@pytest.mark.parametrize("provider_type", TYPES)
async def test_redirects_are_not_followed(
    provider_type: str, status: int, runtime: Runtime, session: aiohttp.ClientSession
) -> None:
    async def redirect(request: web.Request) -> web.StreamResponse:
        return web.Response(status=status, headers={"Location": runtime.url + request.path_qs})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", redirect)
    async with serve(app) as url:
        result = await probe(provider_type, url, session)
    assert result == ProbeResult(False, f"GET {first_path(provider_type)} answered {status}")
    assert runtime.seen == []  # the redirect's target was never asked


# --------------------------------------------------------------------------- llama.cpp (llama-server)


def status(code: int, body: dict[str, object] | None = None) -> Handler:
    async def answer(request: web.Request) -> web.StreamResponse:
        return web.json_response(body or {"error": {"code": code, "message": "x", "type": "x"}}, status=code)

    return answer


def json_answer(body: object) -> Handler:
    async def answer(request: web.Request) -> web.StreamResponse:
        return web.json_response(body)

    return answer


async def test_llamacpp_loading_model(runtime: Runtime, session: aiohttp.ClientSession) -> None:
    # What llama-server answers on /health until its model is loaded.
    runtime.overrides["/health"] = status(503, {"error": {"code": 503, "message": "Loading model",
                                                          "type": "unavailable_error"}})
    assert await probe("llamacpp", runtime.url, session) == ProbeResult(False, "loading model")
    assert runtime.paths == ["/health"]  # no model list, no slots hint
    # Any other status is named as it is.
    runtime.overrides["/health"] = status(500)
    assert await probe("llamacpp", runtime.url, session) == ProbeResult(False, "GET /health answered 500")
    # 503 means "loading" on /health only.
    runtime.overrides.pop("/health")
    runtime.overrides["/v1/models"] = status(503)
    assert await probe("llamacpp", runtime.url, session) == ProbeResult(False, "GET /v1/models answered 503")


@pytest.mark.parametrize("provider_type", ["vllm", "sglang"])
async def test_503_on_health_is_not_loading_for_other_runtimes(
    provider_type: str, runtime: Runtime, session: aiohttp.ClientSession
) -> None:
    runtime.overrides["/health"] = status(503)
    assert await probe(provider_type, runtime.url, session) == ProbeResult(False, "GET /health answered 503")


async def test_llamacpp_healthy_with_its_real_answers(runtime: Runtime, session: aiohttp.ClientSession) -> None:
    runtime.overrides["/health"] = json_answer({"status": "ok"})
    runtime.overrides["/v1/models"] = json_answer(llama_models(["qwen3-4b"]))
    runtime.overrides["/props"] = json_answer(llama_props(8, n_ctx=32768))
    result = await probe("llamacpp", runtime.url, session)
    assert result == ProbeResult(True, "", ["qwen3-4b"], None, 8)
    assert runtime.paths == ["/health", "/v1/models", "/props"]
    # Every probe asks the same three (one request for the hint, at most).
    runtime.seen.clear()
    assert (await probe("llamacpp", runtime.url, session)).slots == 8
    assert runtime.paths == ["/health", "/v1/models", "/props"]


async def test_llamacpp_props_without_total_slots_falls_back_to_slots(
    runtime: Runtime, session: aiohttp.ClientSession
) -> None:
    runtime.overrides["/props"] = json_answer(llama_props(None))
    runtime.overrides["/slots"] = json_answer([llama_slot(0, processing=True), llama_slot(1), llama_slot(2)])
    first = await probe("llamacpp", runtime.url, session)
    # This probe had its one hint request already: no hint yet, still healthy.
    assert first == ProbeResult(True, "", MODELS, None, None)
    assert runtime.paths == ["/health", "/v1/models", "/props"]
    for _ in range(2):  # the next ones ask /slots, and keep to it
        runtime.seen.clear()
        assert (await probe("llamacpp", runtime.url, session)).slots == 3
        assert runtime.paths == ["/health", "/v1/models", "/slots"]


@pytest.mark.parametrize("props_status", [404, 500])
@pytest.mark.parametrize("slots_status", [501, 404])
async def test_llamacpp_without_any_source_has_no_hint(
    props_status: int, slots_status: int, runtime: Runtime, session: aiohttp.ClientSession
) -> None:
    # --no-slots: llama-server answers /slots with 501 ("This server does not support slots endpoint.").
    runtime.overrides["/props"] = status(props_status)
    runtime.overrides["/slots"] = status(slots_status, {"error": {
        "code": 501, "message": "This server does not support slots endpoint.", "type": "not_supported_error"}})
    asked = []
    for _ in range(4):
        runtime.seen.clear()
        result = await probe("llamacpp", runtime.url, session)
        assert result == ProbeResult(True, "", MODELS, None, None)
        assert runtime.paths[:2] == ["/health", "/v1/models"]
        assert len(runtime.paths) == 3  # one hint request per probe, never more
        asked.append(runtime.paths[2])
    # Each source in turn, so that a server restarted with one of them is noticed.
    assert asked == ["/props", "/slots", "/props", "/slots"]


async def test_llamacpp_props_found_again_after_slots_is_turned_off(
    runtime: Runtime, session: aiohttp.ClientSession
) -> None:
    runtime.overrides["/props"] = json_answer(llama_props(None))
    assert (await probe("llamacpp", runtime.url, session)).slots is None
    assert (await probe("llamacpp", runtime.url, session)).slots == RUNTIME_SLOTS  # from /slots
    # Restarted: a newer build with total_slots, and --no-slots.
    runtime.overrides["/props"] = json_answer(llama_props(2))
    runtime.overrides["/slots"] = status(501)
    assert (await probe("llamacpp", runtime.url, session)).slots is None
    runtime.seen.clear()
    assert (await probe("llamacpp", runtime.url, session)).slots == 2
    assert runtime.paths[-1] == "/props"


@pytest.mark.parametrize(
    "body",
    [b"<html>", b"[1, 2]", b'{"total_slots": "four"}', b'{"total_slots": 0}', b'{"total_slots": -1}',
     b'{"total_slots": 2.5}', b"null"],
)
async def test_llamacpp_props_garbage_is_no_hint(
    body: bytes, runtime: Runtime, session: aiohttp.ClientSession
) -> None:
    async def garbage(request: web.Request) -> web.StreamResponse:
        return web.Response(body=body, content_type="application/json")

    runtime.overrides["/props"] = garbage
    assert await probe("llamacpp", runtime.url, session) == ProbeResult(True, "", MODELS, None, None)
    # The next probe tries /slots instead.
    assert (await probe("llamacpp", runtime.url, session)).slots == RUNTIME_SLOTS


@pytest.mark.parametrize("body", [b"[]", b'{"slots": []}', b"[1, 2]", b"not json"])
async def test_llamacpp_slots_garbage_is_no_hint(
    body: bytes, runtime: Runtime, session: aiohttp.ClientSession
) -> None:
    async def garbage(request: web.Request) -> web.StreamResponse:
        return web.Response(body=body, content_type="application/json")

    runtime.overrides["/props"] = status(404)
    runtime.overrides["/slots"] = garbage
    for _ in range(3):
        assert await probe("llamacpp", runtime.url, session) == ProbeResult(True, "", MODELS, None, None)


async def test_llamacpp_hanging_hint_is_no_hint(runtime: Runtime, session: aiohttp.ClientSession) -> None:
    runtime.overrides["/props"] = runtime.hold
    started = time.monotonic()
    result = await probe("llamacpp", runtime.url, session, timeout_s=0.5)
    elapsed = time.monotonic() - started
    # Healthy (health and models answered), without a hint, within the probe's own timeout.
    assert result == ProbeResult(True, "", MODELS, None, None)
    assert elapsed < EVENTUALLY_S
    assert runtime.paths == ["/health", "/v1/models", "/props"]
    # A source that did not answer is asked again (it has not said it has nothing).
    runtime.overrides.pop("/props")
    runtime.seen.clear()
    assert (await probe("llamacpp", runtime.url, session, timeout_s=0.5)).slots == RUNTIME_SLOTS
    assert runtime.paths[-1] == "/props"


async def test_llamacpp_hint_shares_the_probe_timeout(runtime: Runtime, session: aiohttp.ClientSession) -> None:
    async def slow(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(0.3)
        return web.json_response(llama_models(MODELS))

    # The model list takes most of the timeout: the hint gets only what is left.
    runtime.overrides["/v1/models"] = slow
    runtime.overrides["/props"] = runtime.hold
    started = time.monotonic()
    result = await probe("llamacpp", runtime.url, session, timeout_s=0.6)
    assert result == ProbeResult(True, "", MODELS, None, None)
    assert time.monotonic() - started < 0.6 + 1.0  # not 0.3 + a fresh 0.6


async def test_llamacpp_slot_sources_are_remembered_per_server(
    runtime: Runtime, session: aiohttp.ClientSession
) -> None:
    runtime.overrides["/props"] = status(404)
    assert (await probe("llamacpp", runtime.url, session)).slots is None  # this server: /slots next
    other = Runtime(slots=6)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", other.handle)
    async with serve(app) as url:
        other.url = url
        assert (await probe("llamacpp", url, session)).slots == 6
        assert other.paths[-1] == "/props"
    assert (await probe("llamacpp", runtime.url, session)).slots == RUNTIME_SLOTS
    assert runtime.paths[-1] == "/slots"


async def test_llamacpp_hint_carries_the_key(
    runtime: Runtime, session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    # llama-server --api-key: /health and /v1/models are public, /props and /slots are not.
    async def props(request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != "Bearer sk-llama":
            return web.json_response(
                {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}}, status=401)
        return web.json_response(llama_props(3))

    runtime.overrides["/props"] = props
    monkeypatch.setenv(KEY_ENV, "sk-llama")
    assert (await probe("llamacpp", runtime.url, session, api_key_env=KEY_ENV)).slots == 3
    monkeypatch.delenv(KEY_ENV)
    assert await probe("llamacpp", runtime.url, session, api_key_env=KEY_ENV) == ProbeResult(
        True, "", MODELS, None, None)


async def test_llamacpp_uses_the_openai_http_adapter(fake: Fake, session: aiohttp.ClientSession) -> None:
    adapter = make_adapter(http_provider("llamacpp", fake.url), session)
    assert isinstance(adapter, OpenAIHttpAdapter)
    # The project's fake has neither /props nor /slots: healthy, no hint.
    assert await adapter.probe(5.0) == ProbeResult(True, "", list(MODELS), None, None)


# --------------------------------------------------------------------------- llama-cpp-python (no /health)


def no_health(runtime: Runtime) -> None:
    """What llama-cpp-python's server (FastAPI) answers for a path it does not have."""
    runtime.overrides["/health"] = status(404, {"detail": "Not Found"})


async def test_llamacpp_without_health_is_judged_by_its_model_list(
    runtime: Runtime, session: aiohttp.ClientSession
) -> None:
    no_health(runtime)
    runtime.overrides["/props"] = status(404, {"detail": "Not Found"})
    result = await probe("llamacpp", runtime.url, session)
    # Healthy, and no slots hint: a server without /health is no llama-server.
    assert result == ProbeResult(True, "", MODELS, None, None)
    assert runtime.paths == ["/health", "/v1/models"]
    for _ in range(2):  # remembered: the model list alone from now on
        runtime.seen.clear()
        assert await probe("llamacpp", runtime.url, session) == ProbeResult(True, "", MODELS, None, None)
        assert runtime.paths == ["/v1/models"]


@pytest.mark.parametrize(("failure", "reason"), [
    ("500", "GET /v1/models answered 500"),
    ("hold", "GET /v1/models timed out after 0.5s"),
    ("garbage", "GET /v1/models answered something that is not a model list"),
])
async def test_llamacpp_without_health_names_both_probes_in_its_reason(
    failure: str, reason: str, runtime: Runtime, session: aiohttp.ClientSession
) -> None:
    no_health(runtime)
    runtime.overrides["/v1/models"] = {"500": status(500), "hold": runtime.hold, "garbage": json_answer([1])}[failure]
    for _ in range(2):  # nothing is remembered from a probe that failed: /health is asked again
        runtime.seen.clear()
        result = await probe("llamacpp", runtime.url, session, timeout_s=0.5)
        assert result == ProbeResult(False, f"GET /health answered 404; {reason}")
        assert runtime.paths == ["/health", "/v1/models"]


async def test_llamacpp_remembered_model_list_failing_sends_the_next_probe_to_health(
    runtime: Runtime, session: aiohttp.ClientSession
) -> None:
    no_health(runtime)
    assert (await probe("llamacpp", runtime.url, session)).healthy
    runtime.overrides["/v1/models"] = status(503)
    runtime.seen.clear()
    assert await probe("llamacpp", runtime.url, session) == ProbeResult(False, "GET /v1/models answered 503")
    assert runtime.paths == ["/v1/models"]
    # Restarted as llama-server: found at the next probe, slots hint and all.
    runtime.overrides.clear()
    runtime.seen.clear()
    assert await probe("llamacpp", runtime.url, session) == ProbeResult(True, "", MODELS, None, RUNTIME_SLOTS)
    assert runtime.paths == ["/health", "/v1/models", "/props"]


async def test_llamacpp_health_source_is_remembered_per_server(
    runtime: Runtime, session: aiohttp.ClientSession
) -> None:
    no_health(runtime)
    assert (await probe("llamacpp", runtime.url, session)).healthy
    other = Runtime()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", other.handle)
    async with serve(app) as url:
        for _ in range(2):
            assert (await probe("llamacpp", url, session)).slots == RUNTIME_SLOTS
        assert other.paths == ["/health", "/v1/models", "/props"] * 2
    runtime.seen.clear()
    assert (await probe("llamacpp", runtime.url, session)).healthy
    assert runtime.paths == ["/v1/models"]


@pytest.mark.parametrize("provider_type", ["vllm", "sglang", "lemonade"])
async def test_404_on_health_fails_the_other_runtimes(
    provider_type: str, runtime: Runtime, session: aiohttp.ClientSession
) -> None:
    runtime.overrides[first_path(provider_type)] = status(404)
    for _ in range(2):
        runtime.seen.clear()
        result = await probe(provider_type, runtime.url, session)
        assert result == ProbeResult(False, f"GET {first_path(provider_type)} answered 404")
        assert runtime.paths == [first_path(provider_type)]


# --------------------------------------------------------------------------- while busy


@pytest.mark.parametrize("provider_type", TYPES)
async def test_busy_probe_asks_only_the_harmless_path(
    provider_type: str, runtime: Runtime, session: aiohttp.ClientSession
) -> None:
    path = BUSY_PATHS[provider_type]
    for _ in range(2):
        runtime.seen.clear()
        result = await busy_probe(provider_type, runtime.url, session)
        if path is None:
            assert result is None
            assert runtime.seen == []  # not one request
        else:
            # Health alone: what the whole probe found (models, slots) is not asked.
            assert result == ProbeResult(True, "")
            assert runtime.paths == [path]


@pytest.mark.parametrize("provider_type", [t for t in TYPES if BUSY_PATHS[t]])
async def test_busy_probe_failures(provider_type: str, runtime: Runtime, session: aiohttp.ClientSession) -> None:
    path = BUSY_PATHS[provider_type]
    runtime.overrides[str(path)] = status(500)
    assert await busy_probe(provider_type, runtime.url, session) == ProbeResult(False, f"GET {path} answered 500")
    runtime.overrides[str(path)] = runtime.hold
    result = await busy_probe(provider_type, runtime.url, session, timeout_s=0.5)
    assert result == ProbeResult(False, f"GET {path} timed out after 0.5s")
    result = await busy_probe(provider_type, f"http://{HOST}:{free_port()}", session)
    assert result is not None
    assert result.reason.startswith(f"GET {path} failed: ")
    assert not result.healthy


async def test_busy_llamacpp_loading_model(runtime: Runtime, session: aiohttp.ClientSession) -> None:
    runtime.overrides["/health"] = status(503, {"error": {"code": 503, "message": "Loading model",
                                                          "type": "unavailable_error"}})
    assert await busy_probe("llamacpp", runtime.url, session) == ProbeResult(False, "loading model")


async def test_busy_llamacpp_without_health_is_not_asked(runtime: Runtime, session: aiohttp.ClientSession) -> None:
    no_health(runtime)
    assert (await probe("llamacpp", runtime.url, session)).healthy
    runtime.seen.clear()
    assert await busy_probe("llamacpp", runtime.url, session) is None
    assert runtime.seen == []


async def test_busy_llamacpp_learns_there_is_no_health(runtime: Runtime, session: aiohttp.ClientSession) -> None:
    # Never probed idle (a worker started while another one's jobs run there).
    no_health(runtime)
    assert await busy_probe("llamacpp", runtime.url, session) is None
    assert runtime.paths == ["/health"]  # and never the model list
    runtime.seen.clear()
    assert await busy_probe("llamacpp", runtime.url, session) is None
    assert runtime.seen == []
    # Idle: the model list answers at once.
    assert await probe("llamacpp", runtime.url, session) == ProbeResult(True, "", MODELS, None, None)
    assert runtime.paths == ["/v1/models"]


async def test_busy_probe_of_a_cli_is_its_probe(tmp_path: Path) -> None:
    out = tmp_path / "args"
    tool = executable(tmp_path / "tool", f'#!/bin/sh\nprintf "%s\\n" "$@" >> "{out}"\n')
    adapter = CliAdapter(cli_provider([str(tool)]))
    assert await adapter.probe_while_busy(5.0) == ProbeResult(True, "")
    assert out.read_text() == "--version\n"
    assert await CliAdapter(cli_provider(None)).probe_while_busy(5.0) == ProbeResult(False, "no command configured")


# --------------------------------------------------------------------------- cli


def cli_provider(command: list[str] | None, api_key_env: str | None = None) -> ProviderConfig:
    return ProviderConfig(id="c", type="cli", command=command, models=["m"], api_key_env=api_key_env)


async def cli_probe(command: list[str] | None, timeout_s: float = 5.0, api_key_env: str | None = None) -> ProbeResult:
    with anyio.fail_after(EVENTUALLY_S + timeout_s):
        return await CliAdapter(cli_provider(command, api_key_env)).probe(timeout_s)


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie waiting for some other parent counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


async def gone_eventually(pid: int) -> bool:
    """True once ``pid`` is gone, not even a zombie left; fails the test if it never goes."""
    return await eventually(lambda: not alive(pid), what=f"process {pid} gone", every=0.05)


def read_pid(path: Path) -> int:
    return int(path.read_text().strip())


def kill_quietly(*files: Path) -> None:
    """Clean-up after a test: SIGKILL the process named in each file, and its group (each script
    the probe starts leads a session of its own, so its pid is its group's id)."""
    for f in files:
        with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
            pid = read_pid(f)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGKILL)


async def test_cli_an_executable_that_runs_is_healthy() -> None:
    assert await cli_probe([sys.executable, "-c", "pass"]) == ProbeResult(True, "")


async def test_cli_runs_argv0_with_version(tmp_path: Path) -> None:
    out = tmp_path / "args"
    tool = executable(tmp_path / "tool", f'#!/bin/sh\nprintf "%s\\n" "$@" > "{out}"\nexit 3\n')
    # Later argv elements are not used; a non-zero exit of --version is not judged.
    result = await cli_probe([str(tool), "--model", "{model}"])
    assert result == ProbeResult(True, "")
    assert out.read_text() == "--version\n"


async def test_cli_missing_executable() -> None:
    result = await cli_probe(["iop-no-such-tool-anywhere", "-x"])
    assert result == ProbeResult(False, "executable 'iop-no-such-tool-anywhere' not found")
    missing = "/nonexistent/iop/tool"
    result = await cli_probe([missing])
    assert not result.healthy
    assert "not found" in result.reason


async def test_cli_no_command() -> None:
    for command in (None, []):
        assert await cli_probe(command) == ProbeResult(False, "no command configured")


async def test_cli_non_executable_file(tmp_path: Path) -> None:
    tool = tmp_path / "tool"
    tool.write_text("#!/bin/sh\nexit 0\n")
    tool.chmod(0o644)
    result = await cli_probe([str(tool)])
    assert not result.healthy
    assert str(tool) in result.reason
    assert result.models is None


async def test_cli_a_directory_is_not_an_executable(tmp_path: Path) -> None:
    result = await cli_probe([str(tmp_path)])
    assert not result.healthy


async def test_cli_executable_that_cannot_be_run(tmp_path: Path) -> None:
    tool = executable(tmp_path / "tool", "")
    tool.write_bytes(b"\x7fELF\x00\x00garbage")
    result = await cli_probe([str(tool)])
    assert not result.healthy
    assert result.reason.startswith(f"cannot run {str(tool)!r}")


async def test_cli_hanging_version_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    tool = executable(tmp_path / "tool", f'#!/bin/sh\necho $$ > "{pid_file}.tmp"\nmv "{pid_file}.tmp" "{pid_file}"\n'
                      "exec sleep 1000\n")
    try:
        started = time.monotonic()
        result = await cli_probe([str(tool)], timeout_s=1.5)
        assert time.monotonic() - started < EVENTUALLY_S
        assert result == ProbeResult(False, f"{str(tool)!r} did not finish within 1.5s")
        assert "did not finish" in result.reason
        assert pid_file.exists(), "the script never started"
        pid = read_pid(pid_file)
        # Killed and reaped by the probe itself: nothing is left, not even a zombie.
        assert await gone_eventually(pid), "still running after the probe"
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    finally:
        kill_quietly(pid_file)


async def test_cli_hanging_shell_itself_is_killed(tmp_path: Path) -> None:
    # Not exec: the shell ($$) waits for its sleep child; the shell is what the probe started.
    pid_file = tmp_path / "pid"
    tool = executable(tmp_path / "tool", f'#!/bin/sh\necho $$ > "{pid_file}.tmp"\nmv "{pid_file}.tmp" "{pid_file}"\n'
                      "sleep 1000\n")
    try:
        result = await cli_probe([str(tool)], timeout_s=1.5)
        assert not result.healthy
        assert "did not finish" in result.reason
        assert await gone_eventually(read_pid(pid_file)), "still running after the probe"
    finally:
        kill_quietly(pid_file)


async def test_cli_hanging_version_leaves_no_children(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    child_file = tmp_path / "child"
    tool = executable(
        tmp_path / "tool",
        f'#!/bin/sh\nsleep 1000 &\necho $! > "{child_file}.tmp"\nmv "{child_file}.tmp" "{child_file}"\n'
        f'echo $$ > "{pid_file}.tmp"\nmv "{pid_file}.tmp" "{pid_file}"\nwait\n',
    )
    try:
        result = await cli_probe([str(tool)], timeout_s=1.5)
        assert "did not finish" in result.reason
        assert await gone_eventually(read_pid(pid_file)), "still running after the probe"
        assert await gone_eventually(read_pid(child_file)), "still running after the probe"
    finally:
        kill_quietly(pid_file, child_file)


async def test_cli_cancelled_probe_kills_its_child(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    tool = executable(tmp_path / "tool", f'#!/bin/sh\necho $$ > "{pid_file}.tmp"\nmv "{pid_file}.tmp" "{pid_file}"\n'
                      "exec sleep 1000\n")
    try:
        with anyio.move_on_after(1.5) as scope:
            await CliAdapter(cli_provider([str(tool)])).probe(60.0)
        assert scope.cancelled_caught
        assert pid_file.exists(), "the script never started"
        assert await gone_eventually(read_pid(pid_file)), "still running after the probe"
    finally:
        kill_quietly(pid_file)


async def test_cli_probe_gets_the_minimal_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "env.json"
    tool = executable(
        tmp_path / "tool",
        f"#!{sys.executable}\nimport json, os\n"
        f"open({str(out)!r}, 'w').write(json.dumps(dict(os.environ)))\n",
    )
    monkeypatch.setenv("IOP_TEST_PROBE_SECRET", "do-not-leak")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "do-not-leak-either")
    monkeypatch.setenv(KEY_ENV, "sk-cli")
    monkeypatch.setenv("PATH", os.environ.get("PATH", "") or "/usr/bin:/bin")

    assert await cli_probe([str(tool)]) == ProbeResult(True, "")
    env = msgspec.json.decode(out.read_bytes(), type=dict[str, str])
    assert "IOP_TEST_PROBE_SECRET" not in env
    assert "AWS_SECRET_ACCESS_KEY" not in env
    assert KEY_ENV not in env  # not configured for this provider
    assert env["PATH"] == os.environ["PATH"]
    # Python itself may add LC_CTYPE (PEP 538 locale coercion) when no locale is given.
    assert set(env) <= set(ENV_PASSTHROUGH) | {"LC_CTYPE"}
    assert "do-not-leak" not in json.dumps(env)

    # The provider's own key (its api_key_env) is the one extra variable it gets.
    out.unlink()
    assert await cli_probe([str(tool)], api_key_env=KEY_ENV) == ProbeResult(True, "")
    env = msgspec.json.decode(out.read_bytes(), type=dict[str, str])
    assert env[KEY_ENV] == "sk-cli"
    assert "IOP_TEST_PROBE_SECRET" not in env
    assert set(env) <= set(ENV_PASSTHROUGH) | {"LC_CTYPE", KEY_ENV}


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
async def test_a_probe_the_worker_itself_stalled_through_is_made_again(
    runtime: Runtime, session: aiohttp.ClientSession, busy: bool,
) -> None:
    # The worker froze (SIGSTOP, swapped out, a long pause) while its first /health waited: its
    # timer fires long after it was due. That proves nothing about the provider, which answers
    # the probe made again at once.
    first = True

    async def first_hangs(request: web.Request) -> web.StreamResponse:
        nonlocal first
        if first:
            first = False
            return await runtime.hold(request)
        return web.Response()

    runtime.overrides["/health"] = first_hangs
    loop = asyncio.get_running_loop()
    # The whole loop stops, as a frozen process does, for more than twice the timeout (which
    # leaves the probe made again a whole second, even on a busy machine).
    loop.call_later(0.05, time.sleep, 2.5)
    if busy:
        result = await busy_probe("vllm", runtime.url, session, timeout_s=1.0)
    else:
        result = await probe("vllm", runtime.url, session, timeout_s=1.0)
    assert result is not None
    assert result.healthy, result
    assert runtime.paths.count("/health") == 2


async def test_a_provider_that_is_silent_on_time_is_unavailable(
    runtime: Runtime, session: aiohttp.ClientSession,
) -> None:
    # The counterpart: a timeout that fired when due is the provider's, and is not retried.
    runtime.overrides["/health"] = runtime.hold
    # A timeout long enough that even a loaded machine's loop fires it within twice its time.
    result = await busy_probe("vllm", runtime.url, session, timeout_s=1.0)
    assert result is not None
    assert not result.healthy
    assert result.reason == "GET /health timed out after 1s"
    assert runtime.paths == ["/health"]


async def test_engine_metrics_of_a_llamacpp_server_are_read_only_once_it_showed_its_health(
        fake: Fake, session: aiohttp.ClientSession) -> None:
    # llama-cpp-python (no /health) is asked nothing while busy; llama-server, once a whole
    # probe found its /health (workers/engine_metrics.py).
    assert probes.lacks_health(fake.url)
    result = await probe("llamacpp", fake.url, session)
    assert result.healthy
    assert not probes.lacks_health(fake.url)
