"""The runtimes' model-lifecycle APIs (``workers/adapters/model_runtime.py``), each against a
small aiohttp app that answers as that runtime does: the shapes and status codes are those
of llama.cpp's tools/server/server-models.cpp (router mode), Ollama's server/routes.go and
api/types.go, Lemonade's src/cpp/server/server.cpp and router.cpp, and vLLM's
entrypoints/serve/dev/sleep/api_router.py. A load a runtime carries out after its answer
finishes when the test says so, once it saw the runtime being polled."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from dispatcher.config import ProviderConfig
from dispatcher.exceptions import ModelLifecycleFailed, ProviderTimeout, ProviderUnreachable
from iop.redis_server import free_port
from tests.waiting import eventually
from workers.adapters import model_runtime as mr
from workers.adapters.model_runtime import (
    LemonadeRuntime,
    LlamaRouterRuntime,
    ModelRuntime,
    OllamaRuntime,
    RuntimeModels,
    VllmSleepRuntime,
    model_runtime,
    words_of,
)

pytestmark = pytest.mark.anyio

HOST = "127.0.0.1"
KEY_ENV = "IOP_TEST_RUNTIME_KEY"


@contextlib.asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    port = free_port()
    try:
        await web.TCPSite(runner, HOST, port).start()
        yield f"http://{HOST}:{port}"
    finally:
        await runner.cleanup()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def provider(ptype: str, url: str, models: list[str] | None = None, **extra: Any) -> ProviderConfig:
    return ProviderConfig(id="p", type=ptype, base_url=url, models=models or [], **extra)


class Recorder:
    """What a fake runtime was asked, in order: ``(method, path_qs, json body or None)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.auth: list[str | None] = []

    async def note(self, request: web.Request) -> Any:
        body = await request.json() if request.can_read_body else None
        self.calls.append((request.method, request.path_qs, body))
        self.auth.append(request.headers.get("Authorization"))
        return body

    def paths(self) -> list[str]:
        return [f"{m} {p}" for m, p, _ in self.calls]


def llama_error(code: int, message: str, kind: str) -> web.Response:
    # server-common.cpp format_error_response, wrapped by res_err / ex_wrapper.
    return web.json_response({"error": {"code": code, "message": message, "type": kind}}, status=code)


# ---------------------------------------------------------------------- llama.cpp router


class LlamaRouter(Recorder):
    """llama-server in router mode. A load answers once its instance is spawned ("loading");
    the test ends it (``finish``). An unload answers at once and the instance goes at the next
    read of the list (the router's monitor thread)."""

    def __init__(self, names: list[str], models_max: int = 2) -> None:
        super().__init__()
        self.status: dict[str, dict[str, Any]] = {n: {"value": "unloaded"} for n in names}
        self.models_max = models_max
        self.used: dict[str, float] = {}
        self.stopping: set[str] = set()
        # The next POST /models/load answers this (server.cpp ex_wrapper: a runtime_error is a 500).
        self.refuse: str | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/models", self.models)
        app.router.add_get("/props", self.props)
        app.router.add_post("/models/load", self.load)
        app.router.add_post("/models/unload", self.unload)
        return app

    def running(self, name: str) -> bool:
        return self.status[name]["value"] in ("loaded", "loading", "sleeping")

    async def models(self, request: web.Request) -> web.Response:
        await self.note(request)
        for name in self.stopping:
            self.status[name] = {"value": "unloaded", "args": ["llama-server"]}
        self.stopping.clear()
        data = [{"id": n, "aliases": [], "tags": [], "object": "model", "owned_by": "llamacpp", "created": 0,
                 "status": {**s, "args": ["llama-server", "--port", "0"]} if s["value"] != "unloaded" else s,
                 "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
                 "source": "models_dir", "can_remove": False}
                for n, s in self.status.items()]
        return web.json_response({"data": data, "object": "list"})

    async def props(self, request: web.Request) -> web.Response:
        await self.note(request)
        return web.json_response({
            "role": "router", "max_instances": self.models_max, "models_autoload": True,
            "model_alias": "llama-server", "model_path": "none",
            "default_generation_settings": {"params": {}, "n_ctx": 0}, "build_info": "b0",
        })

    async def load(self, request: web.Request) -> web.Response:
        name = (await self.note(request))["model"]
        if name not in self.status:
            # The handler's 404 "model is not found" goes out as the HTTP layer's own 404 body
            # (as the real llama-server answered it: tests/realservers/test_llama_router.py).
            return llama_error(404, "File Not Found", "not_found_error")
        if self.running(name):
            return llama_error(400, "model is already running", "invalid_request_error")
        if self.refuse:
            return llama_error(500, self.refuse, "server_error")
        # unload_lru: at --models-max the least recently used loaded model goes first.
        running = [n for n in self.status if self.running(n)]
        if self.models_max and len(running) >= self.models_max:
            victim = min(running, key=lambda n: self.used.get(n, 0.0))
            self.status[victim] = {"value": "unloaded"}
        self.status[name] = {"value": "loading"}
        self.used[name] = time.monotonic()
        return web.json_response({"success": True})

    async def unload(self, request: web.Request) -> web.Response:
        name = (await self.note(request))["model"]
        if name not in self.status:
            return llama_error(400, "model is not found", "invalid_request_error")
        if not self.running(name):
            return llama_error(400, "model is not running", "invalid_request_error")
        self.stopping.add(name)
        return web.json_response({"success": True})

    def finish(self, name: str, exit_code: int = 0) -> None:
        """The instance of ``name`` came up (exit_code 0), or exited while loading."""
        self.status[name] = ({"value": "loaded"} if exit_code == 0
                             else {"value": "unloaded", "failed": True, "exit_code": exit_code})

    def reads_while_loading(self, name: str) -> int:
        """GET /models reads since the last POST /models/load of ``name``."""
        posts = [i for i, (m, p, b) in enumerate(self.calls) if p == "/models/load" and b == {"model": name}]
        return sum(1 for _, p, _ in self.calls[posts[-1] + 1:] if p == "/models") if posts else 0


@pytest.fixture
async def llama() -> AsyncIterator[tuple[LlamaRouter, str]]:
    fake = LlamaRouter(["tiny-a", "tiny-b", "tiny-c"])
    async with serve(fake.app()) as url:
        yield fake, url


async def test_llama_states_and_models_max(llama: tuple[LlamaRouter, str], session: aiohttp.ClientSession) -> None:
    fake, url = llama
    fake.status["tiny-a"] = {"value": "loaded"}
    fake.status["tiny-b"] = {"value": "loading"}
    fake.status["tiny-c"] = {"value": "sleeping"}
    rt = model_runtime(provider("llamacpp", url), session)
    assert isinstance(rt, LlamaRouterRuntime)
    # A sleeping instance keeps its slot, and a request wakes it without a load.
    assert await rt.models() == RuntimeModels({"tiny-a": "loaded", "tiny-b": "loading", "tiny-c": "loaded"}, 2)
    fake.status["tiny-a"] = {"value": "unloaded", "failed": True, "exit_code": 1}
    fake.models_max = 0  # --models-max 0: no limit
    assert await rt.models() == RuntimeModels({"tiny-a": "unloaded", "tiny-b": "loading", "tiny-c": "loaded"})


async def test_llama_load_returns_early_and_is_polled(
    llama: tuple[LlamaRouter, str], session: aiohttp.ClientSession,
) -> None:
    fake, url = llama
    rt = LlamaRouterRuntime(provider("llamacpp", url), session)
    load = asyncio.ensure_future(rt.load("tiny-a"))
    await eventually(lambda: fake.reads_while_loading("tiny-a") >= 2, what="the load polled twice")
    assert not load.done()
    assert (await rt.models()).states["tiny-a"] == "loading"
    fake.finish("tiny-a")
    await asyncio.wait_for(load, 10)
    assert (await rt.models()).states == {"tiny-a": "loaded", "tiny-b": "unloaded", "tiny-c": "unloaded"}
    assert ("POST", "/models/load", {"model": "tiny-a"}) in fake.calls


async def test_llama_load_at_models_max_evicts_the_least_recently_used(
    llama: tuple[LlamaRouter, str], session: aiohttp.ClientSession,
) -> None:
    fake, url = llama
    rt = LlamaRouterRuntime(provider("llamacpp", url), session)
    for name in ("tiny-a", "tiny-b", "tiny-c"):
        load = asyncio.ensure_future(rt.load(name))
        await eventually(lambda n=name: fake.status[n]["value"] == "loading")
        fake.finish(name)
        await asyncio.wait_for(load, 10)
    assert (await rt.models()).states == {"tiny-a": "unloaded", "tiny-b": "loaded", "tiny-c": "loaded"}


async def test_llama_instance_that_exits_while_loading_fails_the_load(
    llama: tuple[LlamaRouter, str], session: aiohttp.ClientSession,
) -> None:
    fake, url = llama
    rt = LlamaRouterRuntime(provider("llamacpp", url), session)
    load = asyncio.ensure_future(rt.load("tiny-b"))
    await eventually(lambda: fake.reads_while_loading("tiny-b") >= 1)
    fake.finish("tiny-b", exit_code=1)
    with pytest.raises(ModelLifecycleFailed, match="tiny-b: its llama-server instance exited with code 1"):
        await asyncio.wait_for(load, 10)


async def test_llama_refusal_is_in_its_own_words(
    llama: tuple[LlamaRouter, str], session: aiohttp.ClientSession,
) -> None:
    fake, url = llama
    rt = LlamaRouterRuntime(provider("llamacpp", url), session)
    fake.refuse = "model limit reached, try again later"
    with pytest.raises(ModelLifecycleFailed, match="provider p could not load tiny-a: model limit reached, try again"):
        await rt.load("tiny-a")
    with pytest.raises(ModelLifecycleFailed, match="could not load nope: File Not Found"):
        await rt.load("nope")


async def test_llama_loading_a_loaded_model_and_unloading_an_unloaded_one_succeed(
    llama: tuple[LlamaRouter, str], session: aiohttp.ClientSession,
) -> None:
    fake, url = llama
    fake.status["tiny-a"] = {"value": "loaded"}
    rt = LlamaRouterRuntime(provider("llamacpp", url), session)
    await rt.load("tiny-a")  # 400 "model is already running"
    await rt.unload("tiny-b")  # 400 "model is not running"
    assert (await rt.models()).states == {"tiny-a": "loaded", "tiny-b": "unloaded", "tiny-c": "unloaded"}


async def test_llama_loading_one_being_loaded_waits_for_it(
    llama: tuple[LlamaRouter, str], session: aiohttp.ClientSession,
) -> None:
    fake, url = llama
    fake.status["tiny-c"] = {"value": "loading"}
    rt = LlamaRouterRuntime(provider("llamacpp", url), session)
    load = asyncio.ensure_future(rt.load("tiny-c"))
    await eventually(lambda: fake.reads_while_loading("tiny-c") >= 2)
    assert not load.done()
    fake.finish("tiny-c")
    await asyncio.wait_for(load, 10)


async def test_llama_unload_waits_for_the_instance_to_go(
    llama: tuple[LlamaRouter, str], session: aiohttp.ClientSession,
) -> None:
    fake, url = llama
    fake.status["tiny-a"] = {"value": "loaded"}
    rt = LlamaRouterRuntime(provider("llamacpp", url), session)
    await rt.unload("tiny-a")
    assert fake.status["tiny-a"]["value"] == "unloaded"
    # The answer came while it still ran: the list was read until it had gone.
    assert fake.paths()[-2:] == ["POST /models/unload", "GET /models"]


async def test_a_load_past_load_timeout_s_times_out(
    llama: tuple[LlamaRouter, str], session: aiohttp.ClientSession,
) -> None:
    fake, url = llama
    rt = LlamaRouterRuntime(provider("llamacpp", url, load_timeout_s=0.3), session)
    with pytest.raises(ProviderTimeout, match=re.escape("provider p did not load tiny-a within 0.3s")):
        await rt.load("tiny-a")  # nothing finishes it
    assert fake.status["tiny-a"]["value"] == "loading"
    assert fake.reads_while_loading("tiny-a") >= 1


async def test_a_llama_server_not_in_router_mode_holds_its_one_model(session: aiohttp.ClientSession) -> None:
    async def models(_: web.Request) -> web.Response:
        return web.json_response(
            {"models": [{"name": "m", "model": "m"}], "object": "list", "data": [{"id": "m", "object": "model"}]})

    async def props(_: web.Request) -> web.Response:
        return web.json_response({"total_slots": 4, "model_alias": "m"})

    app = web.Application()
    # A single-model server: /models lists its model with no status, /props has no role.
    app.router.add_get("/models", models)
    app.router.add_get("/props", props)
    async with serve(app) as url:
        assert await LlamaRouterRuntime(provider("llamacpp", url), session).models() == RuntimeModels({"m": "loaded"})


# ---------------------------------------------------------------------- Ollama


class Ollama(Recorder):
    """Ollama's /api: names carry their tag; a load with no prompt answers once loaded, an
    unload only expires the runner, which leaves /api/ps at the next read."""

    def __init__(self, names: list[str]) -> None:
        super().__init__()
        self.names = names
        self.loaded: list[str] = []
        self.expiring: set[str] = set()
        self.too_big: set[str] = set()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/tags", self.tags)
        app.router.add_get("/api/ps", self.ps)
        app.router.add_post("/api/generate", self.generate)
        return app

    def resolve(self, name: str) -> str:
        return name if ":" in name else f"{name}:latest"

    async def tags(self, request: web.Request) -> web.Response:
        await self.note(request)
        return web.json_response({"models": [
            {"name": n, "model": n, "modified_at": "2026-01-01T00:00:00Z", "size": 1, "digest": "d",
             "details": {"format": "gguf", "family": "llama"}} for n in self.names]})

    async def ps(self, request: web.Request) -> web.Response:
        await self.note(request)
        self.loaded = [n for n in self.loaded if n not in self.expiring]
        self.expiring.clear()
        return web.json_response({"models": [
            {"name": n, "model": n, "size": 1, "digest": "d", "details": {}, "expires_at": "2318-01-01T00:00:00Z",
             "size_vram": 1, "context_length": 4096} for n in self.loaded]})

    async def generate(self, request: web.Request) -> web.Response:
        body = await self.note(request)
        name = self.resolve(body["model"])
        if name not in self.names:
            return web.json_response({"error": f"model '{body['model']}' not found"}, status=404)
        done = {"model": body["model"], "created_at": "2026-01-01T00:00:00Z", "response": "", "done": True}
        if body.get("prompt", "") == "" and body.get("keep_alive") == 0:
            self.expiring.add(name)
            return web.json_response({**done, "done_reason": "unload"})
        if name in self.too_big:
            return web.json_response(
                {"error": "model requires more system memory (7.4 GiB) than is available (3.1 GiB)"}, status=500)
        if name not in self.loaded:
            self.loaded.append(name)
        return web.json_response({**done, "done_reason": "load"})


@pytest.fixture
async def ollama() -> AsyncIterator[tuple[Ollama, str]]:
    fake = Ollama(["qwen3:latest", "llama3:8b", "phi:latest"])
    async with serve(fake.app()) as url:
        yield fake, url


async def test_ollama_states_under_the_configs_names(
    ollama: tuple[Ollama, str], session: aiohttp.ClientSession,
) -> None:
    fake, url = ollama
    fake.loaded = ["qwen3:latest"]
    rt = model_runtime(provider("ollama", url, ["qwen3", "llama3:8b"]), session)
    assert isinstance(rt, OllamaRuntime)
    # The config's "qwen3" is Ollama's "qwen3:latest"; a model the config does not name keeps Ollama's.
    assert await rt.models() == RuntimeModels({"qwen3": "loaded", "llama3:8b": "unloaded", "phi:latest": "unloaded"})


async def test_ollama_load_and_unload(ollama: tuple[Ollama, str], session: aiohttp.ClientSession) -> None:
    fake, url = ollama
    rt = OllamaRuntime(provider("ollama", url, ["qwen3", "llama3:8b"]), session)
    await rt.load("llama3:8b")
    assert fake.calls[-1] == ("POST", "/api/generate", {"model": "llama3:8b", "keep_alive": -1, "stream": False})
    assert (await rt.models()).states["llama3:8b"] == "loaded"
    await rt.load("llama3:8b")  # again: still a success
    await rt.unload("llama3:8b")
    assert ("POST", "/api/generate", {"model": "llama3:8b", "keep_alive": 0, "stream": False}) in fake.calls
    # The unload answered while the runner was still listed: /api/ps was read until it went.
    assert fake.paths()[-1] == "GET /api/ps"
    assert fake.loaded == []
    await rt.unload("llama3:8b")  # not loaded: a success
    await rt.unload("qwen3")


async def test_ollama_load_failure_in_its_words(ollama: tuple[Ollama, str], session: aiohttp.ClientSession) -> None:
    fake, url = ollama
    fake.too_big.add("qwen3:latest")
    rt = OllamaRuntime(provider("ollama", url, ["qwen3"]), session)
    with pytest.raises(ModelLifecycleFailed, match=r"could not load qwen3: model requires more system memory"):
        await rt.load("qwen3")
    with pytest.raises(ModelLifecycleFailed, match="could not load gone: model 'gone' not found"):
        await rt.load("gone")


# ---------------------------------------------------------------------- Lemonade


class Lemonade(Recorder):
    def __init__(self, names: list[str], max_models: int = 2) -> None:
        super().__init__()
        self.names = names
        self.loaded: dict[str, str] = {}
        self.max_models = max_models
        self.broken: set[str] = set()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/v1/models", self.models)
        app.router.add_get("/api/v1/health", self.health)
        app.router.add_post("/api/v1/load", self.load)
        app.router.add_post("/api/v1/unload", self.unload)
        return app

    async def models(self, request: web.Request) -> web.Response:
        await self.note(request)
        return web.json_response({"object": "list", "data": [
            {"id": n, "object": "model", "created": 0, "owned_by": "lemonade", "checkpoint": f"org/{n}",
             "recipe": "llamacpp", "downloaded": True, "labels": []} for n in self.names]})

    async def health(self, request: web.Request) -> web.Response:
        await self.note(request)
        limit = self.max_models
        return web.json_response({
            "status": "ok", "version": "10.0.0",
            "model_loaded": next(reversed(self.loaded), None),
            "all_models_loaded": [
                {"model_name": n, "checkpoint": f"org/{n}", "type": "llm", "device": "gpu", "recipe": "llamacpp",
                 "status": s, "backend_alive": True, "loaded": True, "pinned": False, "pid": 1,
                 "backend_url": "http://127.0.0.1:8001/v1", "recipe_options": {}} for n, s in self.loaded.items()],
            "max_models": {t: limit for t in ("llm", "embedding", "reranking", "transcription", "image", "tts")},
            "pinned_models": {}, "update_check_done": True,
        })

    async def load(self, request: web.Request) -> web.Response:
        name = (await self.note(request))["model_name"]
        if name not in self.names:
            return web.json_response({"error": {
                "message": f"Model '{name}' was not found. Use 'lemonade list' to see all available models.",
                "type": "model_not_found", "code": "model_not_found"}}, status=404)
        if name in self.broken:
            return web.json_response({"error": {
                "message": "llama-server failed to start: ggml_vulkan: Device memory allocation of size 4294967296 "
                           "failed.", "type": "model_load_error", "code": "model_load_error"}}, status=500)
        self.loaded[name] = "ready"  # declarative: loading a loaded model is a no-op
        return web.json_response({"status": "success", "model_name": name, "checkpoint": f"org/{name}",
                                  "recipe": "llamacpp"})

    async def unload(self, request: web.Request) -> web.Response:
        body = await self.note(request)
        name = (body or {}).get("model_name") or (body or {}).get("model") or ""
        if not name:
            self.loaded.clear()
            return web.json_response({"status": "success", "message": "All models unloaded successfully"})
        if name not in self.loaded:
            return web.json_response({"error": f"Model not loaded: {name}"}, status=404)
        del self.loaded[name]
        return web.json_response({"status": "success", "message": "Model unloaded successfully", "model_name": name})


@pytest.fixture
async def lemonade() -> AsyncIterator[tuple[Lemonade, str]]:
    fake = Lemonade(["Qwen3-0.6B-GGUF", "Gemma-3-1b-it-GGUF", "nomic-embed-text-v1-GGUF"])
    async with serve(fake.app()) as url:
        yield fake, url


async def test_lemonade_states_and_max_loaded(
    lemonade: tuple[Lemonade, str], session: aiohttp.ClientSession,
) -> None:
    fake, url = lemonade
    fake.loaded = {"Qwen3-0.6B-GGUF": "in_use", "Gemma-3-1b-it-GGUF": "loading"}
    rt = model_runtime(provider("lemonade", url), session)
    assert isinstance(rt, LemonadeRuntime)
    assert await rt.models() == RuntimeModels(
        {"Qwen3-0.6B-GGUF": "loaded", "Gemma-3-1b-it-GGUF": "loading", "nomic-embed-text-v1-GGUF": "unloaded"}, 2)
    fake.max_models = -1  # max_loaded_models -1: no limit
    fake.loaded = {"Qwen3-0.6B-GGUF": "evicting"}
    assert (await rt.models()) == RuntimeModels(dict.fromkeys(fake.names, "unloaded"))


async def test_lemonade_load_and_unload_name_their_model(
    lemonade: tuple[Lemonade, str], session: aiohttp.ClientSession,
) -> None:
    fake, url = lemonade
    rt = LemonadeRuntime(provider("lemonade", url), session)
    await rt.load("Qwen3-0.6B-GGUF")
    await rt.load("Gemma-3-1b-it-GGUF")
    await rt.load("Gemma-3-1b-it-GGUF")  # loaded already: a success
    assert ("POST", "/api/v1/load", {"model_name": "Gemma-3-1b-it-GGUF"}) in fake.calls
    await rt.unload("Qwen3-0.6B-GGUF")
    # Only that one: an unload without a name would have unloaded every model.
    assert fake.loaded == {"Gemma-3-1b-it-GGUF": "ready"}
    await rt.unload("Qwen3-0.6B-GGUF")  # 404 "Model not loaded": a success
    assert (await rt.models()).states["Qwen3-0.6B-GGUF"] == "unloaded"


async def test_lemonade_load_failure_in_its_words(
    lemonade: tuple[Lemonade, str], session: aiohttp.ClientSession,
) -> None:
    fake, url = lemonade
    fake.broken.add("Gemma-3-1b-it-GGUF")
    rt = LemonadeRuntime(provider("lemonade", url), session)
    with pytest.raises(ModelLifecycleFailed, match="Device memory allocation of size 4294967296 failed"):
        await rt.load("Gemma-3-1b-it-GGUF")
    with pytest.raises(ModelLifecycleFailed, match="Model 'Nope' was not found"):
        await rt.load("Nope")


# ---------------------------------------------------------------------- vLLM sleep mode


class Vllm(Recorder):
    """vLLM's dev endpoints: /sleep and /wake_up answer once done, with an empty 200."""

    def __init__(self, sleep_mode: bool = True) -> None:
        super().__init__()
        self.sleeping = False
        self.sleep_mode = sleep_mode
        self.wake_error: str | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        if self.sleep_mode:
            app.router.add_get("/is_sleeping", self.is_sleeping)
            app.router.add_post("/sleep", self.sleep)
            app.router.add_post("/wake_up", self.wake_up)
        return app

    async def models(self, request: web.Request) -> web.Response:
        await self.note(request)
        return web.json_response({"object": "list", "data": [
            {"id": "qwen", "object": "model", "created": 0, "owned_by": "vllm", "root": "Qwen/Qwen3-0.6B",
             "parent": None, "max_model_len": 4096}]})

    async def is_sleeping(self, request: web.Request) -> web.Response:
        await self.note(request)
        return web.json_response({"is_sleeping": self.sleeping})

    async def sleep(self, request: web.Request) -> web.Response:
        await self.note(request)
        self.sleeping = True
        return web.Response(status=200)

    async def wake_up(self, request: web.Request) -> web.Response:
        await self.note(request)
        if self.wake_error:
            return web.json_response({"error": {"message": self.wake_error, "type": "InternalServerError",
                                                 "param": None, "code": 500}}, status=500)
        self.sleeping = False
        return web.Response(status=200)


async def test_vllm_sleep_is_unload_and_wake_up_is_load(session: aiohttp.ClientSession) -> None:
    fake = Vllm()
    async with serve(fake.app()) as url:
        rt = model_runtime(provider("vllm", url), session)
        assert isinstance(rt, VllmSleepRuntime)
        assert await rt.models() == RuntimeModels({"qwen": "loaded"}, 1)
        await rt.load("qwen")  # awake already: a success
        await rt.unload("qwen")
        assert ("POST", "/sleep?level=1&mode=wait", None) in fake.calls
        assert await rt.models() == RuntimeModels({"qwen": "unloaded"}, 1)
        await rt.unload("qwen")
        await rt.load("qwen")
        assert ("POST", "/wake_up", None) in fake.calls
        assert await rt.models() == RuntimeModels({"qwen": "loaded"}, 1)
        fake.sleeping = True
        fake.wake_error = "CUDA out of memory. Tried to allocate 2.00 GiB"
        with pytest.raises(ModelLifecycleFailed, match="could not load qwen: CUDA out of memory"):
            await rt.load("qwen")


async def test_vllm_without_sleep_mode_says_so(session: aiohttp.ClientSession) -> None:
    async with serve(Vllm(sleep_mode=False).app()) as url:
        with pytest.raises(ModelLifecycleFailed, match="VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode"):
            await VllmSleepRuntime(provider("vllm", url), session).models()


# ---------------------------------------------------------------------- every runtime


RUNTIMES: dict[str, type[ModelRuntime]] = {
    "llamacpp": LlamaRouterRuntime, "ollama": OllamaRuntime, "lemonade": LemonadeRuntime, "vllm": VllmSleepRuntime,
}


async def test_types_without_such_an_api_have_none(session: aiohttp.ClientSession) -> None:
    for ptype in ("sglang", "openai_api"):
        assert model_runtime(provider(ptype, "http://127.0.0.1:1"), session) is None
    assert model_runtime(ProviderConfig(id="c", type="cli", command=["true"]), session) is None
    for ptype, cls in RUNTIMES.items():
        assert type(model_runtime(provider(ptype, "http://127.0.0.1:1"), session)) is cls


@pytest.mark.parametrize("ptype", list(RUNTIMES))
async def test_an_unreachable_runtime(ptype: str, session: aiohttp.ClientSession) -> None:
    rt = RUNTIMES[ptype](provider(ptype, f"http://{HOST}:{free_port()}"), session)
    with pytest.raises(ProviderUnreachable, match=r"provider p unreachable: .*connection refused"):
        await rt.models()
    with pytest.raises(ProviderUnreachable):
        await rt.load("m")
    with pytest.raises(ProviderUnreachable):
        await rt.unload("m")


@pytest.mark.parametrize("ptype", list(RUNTIMES))
async def test_a_runtime_that_never_answers_a_read(
    ptype: str, session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(mr, "READ_TIMEOUT_S", 0.2)
    accepted = asyncio.Event()

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set()
        await reader.read()  # until the client gives up
        writer.close()

    server = await asyncio.start_server(hold, HOST, 0)
    port = server.sockets[0].getsockname()[1]
    try:
        rt = RUNTIMES[ptype](provider(ptype, f"http://{HOST}:{port}"), session)
        with pytest.raises(ProviderUnreachable, match=r"did not answer GET /\S+ within 0.2s"):
            await rt.models()
        assert accepted.is_set()
    finally:
        server.close()


async def test_the_providers_key_goes_along(
    llama: tuple[LlamaRouter, str], session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake, url = llama
    monkeypatch.setenv(KEY_ENV, "sk-runtime")
    await LlamaRouterRuntime(provider("llamacpp", url, api_key_env=KEY_ENV), session).models()
    assert len(fake.auth) == 2  # /models and /props
    assert set(fake.auth) == {"Bearer sk-runtime"}


def test_words_of_each_runtimes_error_shape() -> None:
    assert words_of(b'{"error": {"code": 400, "message": "model is not running", "type": "x"}}') == (
        "model is not running")
    assert words_of(b'{"error": "model \'a\' not found"}') == "model 'a' not found"
    assert words_of(b'{"status": "error", "message": "Model not found: a"}') == "Model not found: a"
    assert words_of(b'{"detail": "Not Found"}') == "Not Found"
    assert words_of(b"<html>\n  Bad   Gateway</html>") == "<html> Bad Gateway</html>"
    assert words_of(b"") == "an empty answer"
    assert words_of(b"x" * 5000).endswith("…")
