"""The runtimes' own model-lifecycle APIs: which models a runtime holds, and asking it to load
or unload one (docs/PROVIDERS.md "Models that load and unload"; the worker's loop that uses
them: workers/model_lifecycle.py).

| type     | its models                          | load                     | unload                       |
|----------|-------------------------------------|--------------------------|------------------------------|
| llamacpp | ``GET /models``, ``GET /props``     | ``POST /models/load``    | ``POST /models/unload``      |
| ollama   | ``GET /api/tags``, ``GET /api/ps``  | ``POST /api/generate``   | ``POST /api/generate``       |
| lemonade | ``GET /api/v1/models``, ``/health`` | ``POST /api/v1/load``    | ``POST /api/v1/unload``      |
| vllm     | ``GET /v1/models``, ``/is_sleeping``| ``POST /wake_up``        | ``POST /sleep?level=1``      |

sglang, openai_api and cli have no such API (``model_runtime`` answers None): their models
are static.

* llamacpp: llama.cpp's ``llama-server`` in router mode (``--models-dir``, ``--models-max``;
  tools/server/server-models.cpp). ``/models`` lists ``data[].id`` with ``status.value``;
  ``/props`` says ``role: "router"`` and ``max_instances`` (its ``--models-max``, 0: no
  limit), which is ``max_loaded``. Load and unload send ``{"model": name}``.
  ``/models/load`` answers once the model's instance is spawned (status ``loading``), so the
  load is polled until ``loaded``; an instance that exits while loading shows ``unloaded``
  with ``failed: true`` and its ``exit_code`` (its own words are in the router's log only).
  At ``--models-max`` the router unloads its least recently used idle model itself before
  it loads another. ``sleeping`` (``--sleep-idle-seconds``) counts as loaded: the instance
  keeps its slot and a request wakes it without a load. Loading a running model answers
  400 "model is already running", unloading one that is not 400 "model is not running":
  both are read back from ``/models`` and taken as done.
* ollama: ``/api/tags`` lists every model (``models[].name``), ``/api/ps`` the loaded ones.
  Load is ``/api/generate`` with no prompt and ``keep_alive: -1`` (held until iop unloads
  it), unload the same with ``keep_alive: 0`` (server/routes.go GenerateHandler). The load
  answers once the model is loaded (``done_reason: "load"``); the unload only marks the
  runner expired (``done_reason: "unload"``), so ``/api/ps`` is polled until it is gone.
  ``/api/ps`` lists a model still loading too: Ollama says nothing of it, so it reads as
  loaded. Ollama names a model with its tag (``qwen3:latest``); a config that names it
  ``qwen3`` finds it under that name.
* lemonade: ``/api/v1/models`` lists ``data[].id``, ``/api/v1/health`` the loaded ones
  (``all_models_loaded[].model_name``, their ``status``) and ``max_models``; load and unload
  send ``{"model_name": name}`` (src/cpp/server/server.cpp). ``/api/v1/load`` answers once
  loaded, and is a no-op for a loaded model; ``/api/v1/unload`` with no ``model_name`` would
  unload every model, so a name is always sent. ``max_loaded_models`` is per model type; the
  ``llm`` one is taken (-1: no limit).
* vllm: sleep mode (``VLLM_SERVER_DEV_MODE=1``, ``--enable-sleep-mode``;
  entrypoints/serve/dev/sleep/api_router.py): its one model is unloaded while it sleeps
  (``GET /is_sleeping``: ``{"is_sleeping": bool}``), max_loaded 1. Both calls answer once the
  engine has slept or woken; the state is read back all the same. Level 1 keeps the weights
  in CPU memory, so a wake is quick; ``mode=wait`` lets running requests finish first (vLLMs
  before that parameter ignore it).

Every load and unload is bounded by the provider's ``load_timeout_s`` (``ProviderTimeout``); a
runtime that cannot be reached, or does not answer a read within ``READ_TIMEOUT_S``, is
``ProviderUnreachable``; a runtime that refuses is ``ModelLifecycleFailed`` with its words.
"""

from __future__ import annotations

import abc
import asyncio
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import aiohttp
import msgspec

from dispatcher.config import ProviderConfig
from dispatcher.envelope import JSON
from dispatcher.exceptions import ModelLifecycleFailed, ProviderTimeout, ProviderUnreachable
from workers.adapters.openai_http import in_words

LOADED = "loaded"
LOADING = "loading"
UNLOADED = "unloaded"

# One read of a runtime's state (a model list, a health): they answer at once, loading or not.
READ_TIMEOUT_S = 10.0
# A runtime's answer larger than this is not a model list.
MAX_ANSWER_BYTES = 4 * 1024 * 1024
# Polls of a load or unload the runtime carries out after its answer: first soon (a tiny model
# loads in milliseconds), then four times a second: the requests waiting for a load start at
# its next poll, and a read of the model list costs the runtime nothing next to a load.
POLL_FIRST_S = 0.05
POLL_MAX_S = 0.25
# How much of a runtime's error answer its words may take.
_WORDS = 500

# No aiohttp timeout of its own: every call here is bounded by asyncio.timeout, so that a
# read's and a whole load's limits are told apart.
_NO_TIMEOUT = aiohttp.ClientTimeout(total=None)


class RuntimeModels(msgspec.Struct, frozen=True):
    # Served name -> LOADED | LOADING | UNLOADED, for every model the runtime reports.
    states: dict[str, str]
    # How many models it holds at once, where the runtime says.
    max_loaded: int | None = None


def words_of(body: bytes) -> str:
    """What a runtime said in an error answer: the ``message`` of an OpenAI-style error, the
    ``error`` string of Ollama's and Lemonade's, a ``message`` or FastAPI's ``detail``; else
    the body itself, whitespace folded."""
    try:
        doc = msgspec.json.decode(body)
    except msgspec.DecodeError:
        doc = None
    if isinstance(doc, dict):
        error = doc.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return _cut(error["message"])
        for said in (error, doc.get("message"), doc.get("detail")):
            if isinstance(said, str) and said:
                return _cut(said)
    text = " ".join(body[: _WORDS * 4].decode(errors="replace").split())
    return _cut(text) if text else "an empty answer"


def _cut(text: str) -> str:
    return text if len(text) <= _WORDS else text[:_WORDS] + "…"


class ModelRuntime(abc.ABC):
    """One provider's runtime, as far as its models go. Loading a loaded model and unloading
    an unloaded one succeed."""

    def __init__(self, provider: ProviderConfig, session: aiohttp.ClientSession) -> None:
        assert provider.base_url is not None
        self.provider = provider
        # The server root (dispatcher/config/loading.py normalise_base_url: no /v1).
        self.root = provider.base_url
        self.session = session
        self.headers = {"Content-Type": JSON}
        key = os.environ.get(provider.api_key_env) if provider.api_key_env else None
        if key:
            self.headers["Authorization"] = f"Bearer {key}"

    @abc.abstractmethod
    async def models(self) -> RuntimeModels:
        """Every model the runtime reports, each with its state; ``ProviderUnreachable`` when it
        cannot be asked, ``ModelLifecycleFailed`` when its answer is not what it should be."""

    async def load(self, served: str) -> None:
        """Returns once ``served`` is loaded."""
        await self._within("load", served, self._load(served))

    async def unload(self, served: str) -> None:
        """Returns once ``served`` is no longer loaded."""
        await self._within("unload", served, self._unload(served))

    @abc.abstractmethod
    async def _load(self, served: str) -> None: ...

    @abc.abstractmethod
    async def _unload(self, served: str) -> None: ...

    # ------------------------------------------------------------------ helpers

    @property
    def _name(self) -> str:
        return f"provider {self.provider.id}"

    def _failed(self, what: str, served: str, words: str) -> ModelLifecycleFailed:
        return ModelLifecycleFailed(f"{self._name} could not {what} {served}: {words}")

    async def _within(self, what: str, served: str, op: Awaitable[None]) -> None:
        limit = self.provider.load_timeout_s
        try:
            async with asyncio.timeout(limit) as whole:
                await op
        except TimeoutError:
            if whole.expired():
                raise ProviderTimeout(f"{self._name} did not {what} {served} within {limit:g}s") from None
            raise

    async def _call(
        self, method: str, path: str, body: Mapping[str, Any] | None = None, *, read: bool = True,
    ) -> tuple[int, bytes]:
        """One request: its status and body. ``read``: a state read, bounded by READ_TIMEOUT_S;
        otherwise an action that may take as long as the load (the caller's bound)."""
        data = msgspec.json.encode(body) if body is not None else None
        try:
            async with asyncio.timeout(READ_TIMEOUT_S if read else None) as mine:
                async with self.session.request(
                    method, self.root + path, data=data, headers=self.headers, allow_redirects=False,
                    timeout=_NO_TIMEOUT,
                ) as resp:
                    answer = bytearray()
                    async for chunk in resp.content.iter_any():
                        answer += chunk
                        if len(answer) > MAX_ANSWER_BYTES:
                            raise ModelLifecycleFailed(f"{self._name}: {method} {path} answered more than "
                                                       f"{MAX_ANSWER_BYTES} bytes")
                    return resp.status, bytes(answer)
        except TimeoutError:
            if mine.expired():
                raise ProviderUnreachable(
                    f"{self._name} did not answer {method} {path} within {READ_TIMEOUT_S:g}s") from None
            raise
        except aiohttp.ClientError as exc:
            raise ProviderUnreachable(f"{self._name} unreachable: {method} {path}: {in_words(exc)}") from None

    async def _get(self, path: str, shape: type[Any]) -> Any:
        """A state read that must answer 200 with ``shape``."""
        status, body = await self._call("GET", path)
        if status != 200:
            raise ModelLifecycleFailed(f"{self._name}: GET {path} answered {status}: {words_of(body)}")
        try:
            return msgspec.json.decode(body, type=shape)
        except msgspec.DecodeError as exc:
            raise ModelLifecycleFailed(
                f"{self._name}: GET {path} answered something else than expected: {exc}") from None

    async def _state(self, served: str) -> str:
        """``served``'s state alone (what a poll reads): the cheapest read that says it."""
        return (await self.models()).states.get(served, UNLOADED)

    async def _until(self, done: Callable[[], Awaitable[bool]]) -> None:
        """Poll ``done`` until it is true (the caller's ``_within`` bounds the wait)."""
        pause = POLL_FIRST_S
        while not await done():
            await asyncio.sleep(pause)
            pause = min(pause * 2, POLL_MAX_S)

    async def _until_unloaded(self, served: str) -> None:
        async def gone() -> bool:
            return await self._state(served) == UNLOADED

        await self._until(gone)

    def _served(self, names: Iterable[str]) -> str:
        """The name a model goes by here: of its names (the runtime's first), the one the
        provider's ``models`` use, so that the worker finds it under its served name."""
        names = list(names)
        for name in names:
            if name in self.provider.models:
                return name
        return names[0]


# ---------------------------------------------------------------------- llama.cpp router


class _LlamaStatus(msgspec.Struct):
    value: str = LOADED
    failed: bool = False
    exit_code: int | None = None


class _LlamaModel(msgspec.Struct):
    id: str
    # A llama-server not in router mode lists its one model without a status: it holds it.
    status: _LlamaStatus = msgspec.field(default_factory=_LlamaStatus)


class _LlamaModels(msgspec.Struct):
    data: list[_LlamaModel] = []


class _LlamaProps(msgspec.Struct):
    role: str | None = None
    max_instances: int | None = None


# Router statuses (server-models.h server_model_status_to_string) -> iop's states.
_LLAMA_STATES = {"loaded": LOADED, "sleeping": LOADED, "loading": LOADING}


class LlamaRouterRuntime(ModelRuntime):
    async def _entries(self) -> dict[str, _LlamaStatus]:
        listed = await self._get("/models", _LlamaModels)
        return {self._served([m.id]): m.status for m in listed.data}

    async def _state(self, served: str) -> str:
        entry = (await self._entries()).get(served)
        return UNLOADED if entry is None else _LLAMA_STATES.get(entry.value, UNLOADED)

    async def models(self) -> RuntimeModels:
        entries = await self._entries()
        props = await self._get("/props", _LlamaProps)
        # --models-max 0 is no limit; a server not in router mode says nothing.
        limit = props.max_instances if props.role == "router" and props.max_instances else None
        return RuntimeModels({name: _LLAMA_STATES.get(s.value, UNLOADED) for name, s in entries.items()}, limit)

    async def _load(self, served: str) -> None:
        status, body = await self._call("POST", "/models/load", {"model": served}, read=False)
        if status != 200 and await self._state(served) not in (LOADED, LOADING):
            raise self._failed("load", served, words_of(body))

        # The answer came once the instance was spawned (status "loading"): what follows is
        # this load's outcome.
        async def loaded() -> bool:
            entry = (await self._entries()).get(served)
            if entry is None:
                raise self._failed("load", served, "the router no longer lists it")
            state = _LLAMA_STATES.get(entry.value, UNLOADED)
            if state == UNLOADED:
                raise self._failed("load", served, (
                    f"its llama-server instance exited with code {entry.exit_code} while loading (see the router's log)"
                    if entry.failed else f"it became {entry.value} before it was loaded"))
            return state == LOADED

        await self._until(loaded)

    async def _unload(self, served: str) -> None:
        status, body = await self._call("POST", "/models/unload", {"model": served}, read=False)
        if status != 200 and await self._state(served) != UNLOADED:
            raise self._failed("unload", served, words_of(body))
        await self._until_unloaded(served)


# ---------------------------------------------------------------------- Ollama


class _OllamaModel(msgspec.Struct):
    name: str = ""
    model: str = ""


class _OllamaModels(msgspec.Struct):
    models: list[_OllamaModel] = []


class OllamaRuntime(ModelRuntime):
    def _names(self, listed: _OllamaModels) -> list[str]:
        out = []
        for m in listed.models:
            name = m.name or m.model
            if name:
                # Ollama says "qwen3:latest" of the model a config may call "qwen3".
                bare = name.removesuffix(":latest")
                out.append(self._served([name, bare] if bare != name else [name]))
        return out

    async def _state(self, served: str) -> str:
        return LOADED if served in self._names(await self._get("/api/ps", _OllamaModels)) else UNLOADED

    async def models(self) -> RuntimeModels:
        available = self._names(await self._get("/api/tags", _OllamaModels))
        loaded = self._names(await self._get("/api/ps", _OllamaModels))
        states = dict.fromkeys(available, UNLOADED)
        states.update(dict.fromkeys(loaded, LOADED))
        return RuntimeModels(states)

    async def _load(self, served: str) -> None:
        # No prompt: Ollama loads the model and answers (done_reason "load"); keep_alive -1
        # holds it until iop unloads it.
        status, body = await self._call("POST", "/api/generate", {"model": served, "keep_alive": -1, "stream": False},
                                        read=False)
        if status != 200:
            raise self._failed("load", served, words_of(body))

    async def _unload(self, served: str) -> None:
        status, body = await self._call("POST", "/api/generate", {"model": served, "keep_alive": 0, "stream": False},
                                        read=False)
        if status != 200 and await self._state(served) != UNLOADED:
            raise self._failed("unload", served, words_of(body))
        # Its runner is only marked expired: it goes a moment later.
        await self._until_unloaded(served)


# ---------------------------------------------------------------------- Lemonade


class _LemonadeModel(msgspec.Struct):
    id: str


class _LemonadeModels(msgspec.Struct):
    data: list[_LemonadeModel] = []


class _LemonadeLoaded(msgspec.Struct):
    model_name: str
    # Older Lemonades list loaded models without a status.
    status: str = "ready"


class _LemonadeHealth(msgspec.Struct):
    model_loaded: str | None = None
    all_models_loaded: list[_LemonadeLoaded] | None = None
    max_models: dict[str, int] = {}


# Router states (model_types.h model_state_to_string) -> iop's: "ready", "in_use",
# "downsizing", "downsized" hold the model; "evicting" is on its way out.
_LEMONADE_STATES = {"loading": LOADING, "evicting": UNLOADED, "unloaded": UNLOADED}


class LemonadeRuntime(ModelRuntime):
    def _loaded(self, health: _LemonadeHealth) -> dict[str, str]:
        if health.all_models_loaded is not None:
            return {self._served([m.model_name]): _LEMONADE_STATES.get(m.status, LOADED)
                    for m in health.all_models_loaded}
        return {self._served([health.model_loaded]): LOADED} if health.model_loaded else {}

    async def _state(self, served: str) -> str:
        return self._loaded(await self._get("/api/v1/health", _LemonadeHealth)).get(served, UNLOADED)

    async def models(self) -> RuntimeModels:
        listed = await self._get("/api/v1/models", _LemonadeModels)
        health = await self._get("/api/v1/health", _LemonadeHealth)
        states = {self._served([m.id]): UNLOADED for m in listed.data}
        states.update(self._loaded(health))
        limit = health.max_models.get("llm")
        return RuntimeModels(states, limit if limit is not None and limit > 0 else None)

    async def _load(self, served: str) -> None:
        # Answers once loaded; a model loaded already is a no-op.
        status, body = await self._call("POST", "/api/v1/load", {"model_name": served}, read=False)
        if status != 200:
            raise self._failed("load", served, words_of(body))

    async def _unload(self, served: str) -> None:
        status, body = await self._call("POST", "/api/v1/unload", {"model_name": served}, read=False)
        if status != 200 and await self._state(served) != UNLOADED:
            raise self._failed("unload", served, words_of(body))
        await self._until_unloaded(served)


# ---------------------------------------------------------------------- vLLM sleep mode


class _OpenAIModel(msgspec.Struct):
    id: str


class _OpenAIModels(msgspec.Struct):
    data: list[_OpenAIModel] = []


class _Sleeping(msgspec.Struct):
    is_sleeping: bool


class VllmSleepRuntime(ModelRuntime):
    async def _sleeping(self) -> bool:
        status, body = await self._call("GET", "/is_sleeping")
        if status == 404:
            raise ModelLifecycleFailed(f"{self._name} has no GET /is_sleeping: vLLM's sleep mode needs "
                                       "VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode")
        if status != 200:
            raise ModelLifecycleFailed(f"{self._name}: GET /is_sleeping answered {status}: {words_of(body)}")
        try:
            return msgspec.json.decode(body, type=_Sleeping).is_sleeping
        except msgspec.DecodeError as exc:
            raise ModelLifecycleFailed(f"{self._name}: GET /is_sleeping answered something else than expected: "
                                       f"{exc}") from None

    async def models(self) -> RuntimeModels:
        listed = await self._get("/v1/models", _OpenAIModels)
        state = UNLOADED if await self._sleeping() else LOADED
        return RuntimeModels({self._served([m.id]): state for m in listed.data}, 1)

    async def _act(self, what: str, served: str, path: str, asleep: bool) -> None:
        status, body = await self._call("POST", path, read=False)
        if status != 200:
            raise self._failed(what, served, words_of(body))

        async def there() -> bool:
            return await self._sleeping() == asleep

        await self._until(there)

    async def _load(self, served: str) -> None:
        await self._act("load", served, "/wake_up", asleep=False)

    async def _unload(self, served: str) -> None:
        await self._act("unload", served, "/sleep?level=1&mode=wait", asleep=True)


_RUNTIMES: dict[str, type[ModelRuntime]] = {
    "llamacpp": LlamaRouterRuntime,
    "ollama": OllamaRuntime,
    "lemonade": LemonadeRuntime,
    "vllm": VllmSleepRuntime,
}


def model_runtime(provider: ProviderConfig, session: aiohttp.ClientSession) -> ModelRuntime | None:
    """The model-lifecycle API of ``provider``'s runtime; None for a type that has none
    (sglang, openai_api, cli: static models). Whether iop uses it is the config's
    (``ProviderConfig.manages_models``): a vLLM without sleep mode or a llama-server not in
    router mode is ``lifecycle: static``."""
    cls = _RUNTIMES.get(provider.type)
    if cls is None or provider.base_url is None:
        return None
    return cls(provider, session)
