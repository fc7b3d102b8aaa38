"""llama.cpp's own ``llama-server`` in router mode (``--models-dir`` with three tiny GGUFs of
other weights, ``--models-max``), driven through iop's ``ModelRuntime``
(``workers/adapters/model_runtime.py``): what it reports, loads and unloads, its eviction at
``--models-max``, and that a loaded model answers a chat request. Each load spawns a real
llama-server instance of the router's; a tiny model loads in about a second here."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

from dispatcher.config import ProviderConfig
from dispatcher.exceptions import ModelLifecycleFailed
from tests.realservers.servers import LLAMA_ROUTER_MODELS, RealServer, start_llama_router, unavailable
from workers.adapters.model_runtime import LlamaRouterRuntime, RuntimeModels, model_runtime

pytestmark = [pytest.mark.realservers, pytest.mark.anyio]

A, B, C = LLAMA_ROUTER_MODELS
BROKEN = "not-a-model"
CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 4,
                        "temperature": 0, "seed": 7}


def router(tmp_path: Path, models_max: int, broken: tuple[str, ...] = ()) -> Iterator[RealServer]:
    reason = unavailable("llama-server")
    if reason is not None:
        pytest.skip(reason)
    server = start_llama_router(tmp_path, models_max, broken=broken)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def router1(tmp_path: Path) -> Iterator[RealServer]:
    yield from router(tmp_path, 1)


@pytest.fixture
def router2(tmp_path: Path) -> Iterator[RealServer]:
    yield from router(tmp_path, 2)


@pytest.fixture
def router_broken(tmp_path: Path) -> Iterator[RealServer]:
    yield from router(tmp_path, 2, broken=(BROKEN,))


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def runtime_of(server: RealServer, session: aiohttp.ClientSession) -> LlamaRouterRuntime:
    prov = ProviderConfig(id="router", type="llamacpp", base_url=server.url, models=list(LLAMA_ROUTER_MODELS),
                          lifecycle="managed", load_timeout_s=120)
    rt = model_runtime(prov, session)
    assert isinstance(rt, LlamaRouterRuntime)
    return rt


def states(**given: str) -> dict[str, str]:
    return {name: given.get(name.replace("-", "_"), "unloaded") for name in LLAMA_ROUTER_MODELS}


async def chat(server: RealServer, model: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=120) as client:
        return await client.post(f"{server.url}/v1/chat/completions", json={"model": model, **CHAT})


async def test_the_routers_own_words(router1: RealServer) -> None:
    """The shapes model_runtime.py reads, as this llama-server answers them."""
    async with httpx.AsyncClient(timeout=30) as client:
        listed = (await client.get(f"{router1.url}/models")).json()
        props = (await client.get(f"{router1.url}/props")).json()
    assert listed["object"] == "list"
    assert sorted(m["id"] for m in listed["data"]) == sorted(LLAMA_ROUTER_MODELS)
    assert {m["status"]["value"] for m in listed["data"]} == {"unloaded"}
    assert (props["role"], props["max_instances"]) == ("router", 1)


async def test_models_max_1_loads_one_at_a_time(router1: RealServer, session: aiohttp.ClientSession) -> None:
    rt = runtime_of(router1, session)
    assert await rt.models() == RuntimeModels(states(), max_loaded=1)

    await rt.load(A)
    assert (await rt.models()).states == states(tiny_a="loaded")
    answer = await chat(router1, A)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"]
    await rt.load(A)  # loaded already ("model is already running"): a success

    # At --models-max the router unloads the least recently used model before it loads another.
    await rt.load(B)
    assert (await rt.models()).states == states(tiny_b="loaded")

    await rt.unload(B)
    assert (await rt.models()).states == states()
    await rt.unload(B)  # not loaded ("model is not running"): a success

    # The router's 404 "model is not found" reaches the client as its HTTP layer's 404.
    with pytest.raises(ModelLifecycleFailed, match="could not load tiny-z: File Not Found"):
        await rt.load("tiny-z")


async def test_a_request_for_an_unloaded_model_loads_it(
    router1: RealServer, session: aiohttp.ClientSession,
) -> None:
    """The router's autoload (on by default): a request is a load too, and evicts like one. A
    worker managing the router must expect its models to change under it (it reads them back
    every probe), or start the router with --no-models-autoload."""
    rt = runtime_of(router1, session)
    await rt.load(A)
    answer = await chat(router1, C)
    assert answer.status_code == 200, answer.text
    assert (await rt.models()).states == states(tiny_c="loaded")


async def test_models_max_2_evicts_the_least_recently_used(
    router2: RealServer, session: aiohttp.ClientSession,
) -> None:
    rt = runtime_of(router2, session)
    assert (await rt.models()).max_loaded == 2
    await rt.load(A)
    await rt.load(B)
    assert (await rt.models()).states == states(tiny_a="loaded", tiny_b="loaded")
    # B was loaded after A, but A answers a request after that: B is the least recently used.
    answer = await chat(router2, A)
    assert answer.status_code == 200, answer.text
    await rt.load(C)
    assert (await rt.models()).states == states(tiny_a="loaded", tiny_c="loaded")
    for name in (A, B, C):
        await rt.unload(name)
    assert (await rt.models()).states == states()


async def test_a_model_whose_instance_cannot_load_fails_its_load(
    router_broken: RealServer, session: aiohttp.ClientSession,
) -> None:
    """The router answers the load at once; the instance it spawned exits on the file, which
    the router reports as ``unloaded`` with ``failed`` and the exit code."""
    rt = runtime_of(router_broken, session)
    assert (await rt.models()).states[BROKEN] == "unloaded"
    with pytest.raises(ModelLifecycleFailed, match=f"could not load {BROKEN}: its llama-server instance exited "
                                                   r"with code \d+ while loading"):
        await rt.load(BROKEN)
    async with httpx.AsyncClient(timeout=30) as client:
        listed = (await client.get(f"{router_broken.url}/models")).json()
    status = next(m["status"] for m in listed["data"] if m["id"] == BROKEN)
    assert (status["value"], status["failed"]) == ("unloaded", True)
    assert status["exit_code"] != 0
    # The others load as before.
    await rt.load(A)
    assert (await rt.models()).states[A] == "loaded"
