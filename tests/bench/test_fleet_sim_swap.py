"""bench/fleet_sim.py's model swapping (``--models``), as llama.cpp's llama-server does it in
router mode: ``GET /models`` and its states, ``POST /models/load`` and ``/models/unload``,
autoload on a request, the least recently used model unloaded at ``--models-max`` (busy or
not: its requests cut off; a load killed), the counters of ``/sim/stats`` and what
``/sim/reset`` restores. Real HTTP against servers started in this event loop; steps of
1 ms; nothing here asserts a duration: where a load must still be under way, it is given
far longer than the test needs, and the test asserts on states and their order."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import aiohttp
import pytest

from bench.fleet_sim import (
    LOADED,
    LOADING,
    UNLOADED,
    Router,
    SimConfig,
    SwapConfig,
    parse_args,
    parse_command,
    start,
    swap_args,
)
from iop.redis_server import free_port

pytestmark = pytest.mark.anyio

FAST = SimConfig(kv_blocks=64, block_tokens=4, max_batch=4, prefill_budget=64, step_ms=1.0,
                 prefill_ms_per_token=0.0, decode_ms_per_seq=0.0, max_tokens=3)
LONG_MS = 60_000.0  # a load that does not end while the test looks at it

ServeSwap = Callable[..., Awaitable[str]]  # (SwapConfig, SimConfig = FAST) -> its base URL
ROOMY = replace(FAST, kv_blocks=4096)  # room for an answer that runs until it is cut off


@pytest.fixture
async def serve_swap() -> AsyncIterator[ServeSwap]:
    runners = []

    async def one(swap: SwapConfig, config: SimConfig = FAST) -> str:
        port = free_port()
        runners.append(await start(config, "127.0.0.1", port, swap))
        return f"http://127.0.0.1:{port}"

    yield one
    for runner in runners:
        await runner.cleanup()


def chat(model: str | None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hello there"}], **extra}
    if model is not None:
        body["model"] = model
    return body


async def call(method: str, url: str, body: Any = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.request(method, url, json=body) as resp:
        return resp.status, await resp.json(content_type=None)


async def statuses(url: str) -> dict[str, str]:
    status, listed = await call("GET", f"{url}/models")
    assert status == 200
    return {m["id"]: m["status"]["value"] for m in listed["data"]}


async def until(url: str, model: str, state: str) -> None:
    # Polled: the server is another's loop's as far as the client knows, with nothing to wait on.
    while (await statuses(url))[model] != state:  # noqa: ASYNC110
        await asyncio.sleep(0.005)


async def stats(url: str) -> dict[str, Any]:
    status, data = await call("GET", f"{url}/sim/stats")
    assert status == 200
    return dict(data)


async def test_models_lists_every_model_with_its_state_as_the_router_does(serve_swap: ServeSwap) -> None:
    url = await serve_swap(SwapConfig(models=("a", "b", "c"), models_max=2, load_ms=LONG_MS, preload=("a",)))
    status, listed = await call("GET", f"{url}/models")
    assert status == 200
    assert listed["object"] == "list"
    first = listed["data"][0]
    assert sorted(first) == ["aliases", "architecture", "can_remove", "created", "id", "object", "owned_by",
                             "source", "status", "tags"]
    assert (first["id"], first["object"], first["owned_by"]) == ("a", "model", "llamacpp")
    assert sorted(first["status"]) == ["args", "value"]
    assert await statuses(url) == {"a": LOADED, "b": UNLOADED, "c": UNLOADED}
    assert (await call("GET", f"{url}/v1/models"))[1]["data"] == listed["data"]  # the same list at both paths
    assert (await call("POST", f"{url}/models/load", {"model": "b"})) == (200, {"success": True})
    assert await statuses(url) == {"a": LOADED, "b": LOADING, "c": UNLOADED}


async def test_load_and_unload_through_the_api(serve_swap: ServeSwap) -> None:
    url = await serve_swap(SwapConfig(models=("a", "b"), models_max=2, load_ms=1.0))
    assert await statuses(url) == {"a": UNLOADED, "b": UNLOADED}
    assert await call("POST", f"{url}/models/load", {"model": "b"}) == (200, {"success": True})
    await until(url, "b", LOADED)
    status, error = await call("POST", f"{url}/models/load", {"model": "b"})
    assert (status, error["error"]["message"], error["error"]["type"]) == (
        400, "model is already running", "invalid_request_error")
    status, error = await call("POST", f"{url}/models/load", {"model": "zz"})
    assert (status, error["error"]) == (404, {"code": 404, "message": "model is not found", "type": "not_found_error"})
    assert await call("POST", f"{url}/models/unload", {"model": "b"}) == (200, {"success": True})
    assert await statuses(url) == {"a": UNLOADED, "b": UNLOADED}
    status, error = await call("POST", f"{url}/models/unload", {"model": "b"})
    assert (status, error["error"]["message"]) == (400, "model is not running")
    status, error = await call("POST", f"{url}/models/unload", {"model": "zz"})
    assert (status, error["error"]["message"]) == (400, "model is not found")
    s = await stats(url)
    assert (s["loads"], s["unloads"]) == ({"request": 0, "api": 1}, {"api": 1, "lru": 0})


async def test_a_request_autoloads_its_model_and_waits_for_the_load(serve_swap: ServeSwap) -> None:
    url = await serve_swap(SwapConfig(models=("a", "b"), models_max=2, load_ms=LONG_MS, preload=("a",)))
    async with aiohttp.ClientSession() as http:
        answer = asyncio.create_task(http.post(f"{url}/v1/chat/completions", json=chat("b", stream=True)))
        await until(url, "b", LOADING)
        await asyncio.sleep(0.05)
        assert not answer.done()  # not even its headers: the router holds it until b is loaded
        s = await stats(url)
        assert s["loads"] == {"request": 1, "api": 0}
        assert s["models"]["b"] == {"status": LOADING, "running": 0, "waiting": 0, "requests": 0}
        # Its load was LONG_MS: unload it and load it again, quickly, through the API; the
        # waiting request fails as it does on llama-server when its load is killed.
        assert await call("POST", f"{url}/models/unload", {"model": "b"}) == (200, {"success": True})
        resp = await answer
        assert resp.status == 500
        assert (await resp.json())["error"] == {"code": 500, "message": "model name=b failed to load",
                                                "type": "server_error"}
    _, listed = await call("GET", f"{url}/models")
    failed = next(m for m in listed["data"] if m["id"] == "b")["status"]
    assert (failed["value"], failed["failed"], failed["exit_code"]) == (UNLOADED, True, 1)
    assert (await stats(url))["failed_loads"] == 1


async def test_a_request_for_an_unloaded_model_is_answered_after_its_load(serve_swap: ServeSwap) -> None:
    url = await serve_swap(SwapConfig(models=("a", "b"), models_max=2, load_ms=1.0))
    status, answer = await call("POST", f"{url}/v1/chat/completions", chat("b"))
    assert (status, answer["model"]) == (200, "b")
    assert await statuses(url) == {"a": UNLOADED, "b": LOADED}
    s = await stats(url)
    assert s["loads"] == {"request": 1, "api": 0}
    assert (s["requests"], s["models"]["b"]["requests"]) == (1, 1)


async def test_requests_the_router_refuses(serve_swap: ServeSwap) -> None:
    url = await serve_swap(SwapConfig(models=("a",), load_ms=1.0))
    status, error = await call("POST", f"{url}/v1/chat/completions", chat(None))
    assert (status, error["error"]["message"]) == (400, "model name is missing from the request")
    status, error = await call("POST", f"{url}/v1/chat/completions", chat("zz"))
    assert (status, error["error"]["message"]) == (400, "model 'zz' not found")
    assert (await stats(url))["loads"] == {"request": 0, "api": 0}


async def test_the_least_recently_used_model_is_unloaded_at_models_max(serve_swap: ServeSwap) -> None:
    url = await serve_swap(SwapConfig(models=("a", "b", "c"), models_max=2, load_ms=1.0, preload=("a", "b")))
    assert (await call("POST", f"{url}/v1/chat/completions", chat("a")))[0] == 200  # a used after b now
    assert (await call("POST", f"{url}/v1/chat/completions", chat("c")))[0] == 200
    assert await statuses(url) == {"a": LOADED, "b": UNLOADED, "c": LOADED}
    assert (await call("POST", f"{url}/v1/chat/completions", chat("b")))[0] == 200  # a is the LRU now
    assert await statuses(url) == {"a": UNLOADED, "b": LOADED, "c": LOADED}
    s = await stats(url)
    assert (s["loads"], s["unloads"], s["cut_off"]) == ({"request": 2, "api": 0}, {"api": 0, "lru": 2}, 0)
    assert s["requests"] == 3  # the engines unloaded since count too


async def test_a_busy_model_is_unloaded_all_the_same_and_its_requests_cut_off(serve_swap: ServeSwap) -> None:
    url = await serve_swap(SwapConfig(models=("a", "b"), models_max=1, load_ms=1.0, preload=("a",)), ROOMY)
    async with aiohttp.ClientSession() as http:
        long = await http.post(f"{url}/v1/chat/completions", json=chat("a", stream=True, max_tokens=10_000))
        assert long.status == 200
        assert (await long.content.readline()).startswith(b"data: ")  # a is generating
        status, _ = await call("POST", f"{url}/v1/chat/completions", chat("b"))
        assert status == 200
        lines = []
        with pytest.raises(aiohttp.ClientPayloadError):  # noqa: PT012 - from whichever read finds the end
            async for line in long.content:
                lines.append(line)
        assert b"data: [DONE]\n" not in lines
    assert await statuses(url) == {"a": UNLOADED, "b": LOADED}
    s = await stats(url)
    assert (s["cut_off"], s["unloads"], s["running"]) == (1, {"api": 0, "lru": 1}, 0)


async def test_a_json_request_cut_off_is_a_500(serve_swap: ServeSwap) -> None:
    url = await serve_swap(SwapConfig(models=("a", "b"), models_max=1, load_ms=1.0, preload=("a",)), ROOMY)
    waiting = asyncio.create_task(call("POST", f"{url}/v1/chat/completions", chat("a", max_tokens=10_000)))
    while (await stats(url))["running"] == 0:  # noqa: ASYNC110 - polled, as in until()
        await asyncio.sleep(0.005)
    assert (await call("POST", f"{url}/models/load", {"model": "b"}))[0] == 200  # a is evicted at once
    status, error = await waiting
    assert (status, error["error"]["type"]) == (500, "server_error")


async def test_reset_unloads_everything_and_loads_the_preload_again(serve_swap: ServeSwap) -> None:
    url = await serve_swap(SwapConfig(models=("a", "b", "c"), models_max=2, load_ms=1.0, preload=("a", "c")))
    assert (await call("POST", f"{url}/v1/chat/completions", chat("b")))[0] == 200
    assert await statuses(url) == {"a": UNLOADED, "b": LOADED, "c": LOADED}
    assert await call("POST", f"{url}/sim/reset") == (200, {"reset": True})
    assert await statuses(url) == {"a": LOADED, "b": UNLOADED, "c": LOADED}
    s = await stats(url)
    assert (s["requests"], s["loads"], s["unloads"], s["cut_off"]) == (0, {"request": 0, "api": 0},
                                                                        {"api": 0, "lru": 0}, 0)


async def test_reset_waits_for_a_load(serve_swap: ServeSwap) -> None:
    url = await serve_swap(SwapConfig(models=("a",), load_ms=LONG_MS))
    assert (await call("POST", f"{url}/models/load", {"model": "a"}))[0] == 200
    status, error = await call("POST", f"{url}/sim/reset")
    assert (status, error["error"]["message"]) == (409, "a model is loading")


async def test_control_reaches_every_models_engine(serve_swap: ServeSwap) -> None:
    url = await serve_swap(SwapConfig(models=("a", "b"), load_ms=1.0, preload=("a",)))
    assert (await call("POST", f"{url}/sim/control", {"max_batch": 2}))[0] == 200
    assert (await call("POST", f"{url}/v1/chat/completions", chat("b")))[0] == 200
    assert (await stats(url))["config"]["max_batch"] == 2


async def test_metrics_name_their_model(serve_swap: ServeSwap) -> None:
    url = await serve_swap(SwapConfig(models=("a", "b"), load_ms=1.0, preload=("a",)))
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/metrics", params={"model": "a"}) as resp:
            assert resp.status == 200
            assert 'model_name="a"' in await resp.text()
        refused: list[tuple[dict[str, str], str]] = [({}, "model name is missing from the request"),
                                                     ({"model": "b"}, "model is not loaded")]
        for params, message in refused:
            async with http.get(f"{url}/metrics", params=params) as resp:
                assert resp.status == 400
                assert (await resp.json())["error"]["message"] == message
        async with http.get(f"{url}/get_load") as resp:
            assert resp.status == 404  # llama-server has none of SGLang's endpoints
    assert await statuses(url) == {"a": LOADED, "b": UNLOADED}  # a scrape loads nothing


async def test_props_say_router_and_models_max(serve_swap: ServeSwap) -> None:
    url = await serve_swap(SwapConfig(models=("a", "b"), models_max=3, load_ms=1.0, preload=("a",)))
    status, props = await call("GET", f"{url}/props")
    assert (status, props["role"], props["max_instances"], props["models_autoload"]) == (200, "router", 3, True)
    status, child = await call("GET", f"{url}/props?model=a")
    assert (status, child["total_slots"], child["model_alias"]) == (200, FAST.max_batch, "a")
    status, error = await call("GET", f"{url}/props?model=b")
    assert (status, error["error"]["message"]) == (400, "model is not loaded")


async def test_without_models_there_is_no_router() -> None:
    port = free_port()
    runner = await start(FAST, "127.0.0.1", port)
    try:
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as http, http.get(f"{url}/models") as resp:
            assert resp.status == 404
        s = await stats(url)
        assert not {"models", "loads", "swap"} & set(s)
    finally:
        await runner.cleanup()


async def test_the_router_unloads_by_last_use_loading_or_not() -> None:
    router = Router(FAST, SwapConfig(models=("a", "b", "c"), models_max=2, load_ms=LONG_MS, preload=("a", "b")))
    router.preload()

    def states() -> dict[str, str]:
        return {n: i.status for n, i in router.instances.items()}

    try:
        router.instances["b"].last_used = time.monotonic()  # b used after a's preload
        router.load("c", "api")
        assert states() == {"a": UNLOADED, "b": LOADED, "c": LOADING}
        router.load("a", "api")  # b was used before c's load began
        assert states() == {"a": LOADING, "b": UNLOADED, "c": LOADING}
        router.load("b", "api")  # c, still loading, is the least recently used: killed
        assert states() == {"a": LOADING, "b": LOADING, "c": UNLOADED}
        assert (router.instances["c"].failed, router.failed_loads) == (True, 1)
        assert (router.loads, router.unloads) == ({"request": 0, "api": 3}, {"api": 0, "lru": 3})
    finally:
        await asyncio.gather(*router.stop(), return_exceptions=True)


def test_swap_settings_on_the_command_line() -> None:
    swap = SwapConfig(models=("m0", "m1", "m2"), models_max=2, load_ms=1500.0, preload=("m1",))
    config, parsed, host, port = parse_command(["--port", "9", *swap_args(swap)])
    assert (config, parsed, host, port) == (SimConfig(), swap, "127.0.0.1", 9)
    assert parse_command(["--port", "9"])[1] is None
    assert parse_args(["--port", "9", *swap_args(swap)]) == (SimConfig(), "127.0.0.1", 9)
    assert replace(swap, preload=()).problems() == []


@pytest.mark.parametrize(("argv", "message"), [
    (["--preload", "a"], "need --models"),
    (["--models", "a,b", "--preload", "c"], "not in --models"),
    (["--models", "a,b", "--models-max", "1", "--preload", "a,b"], "exceeds models_max"),
    (["--models", "a,a"], "distinct"),
])
def test_bad_swap_settings_are_refused(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_command(["--port", "9", *argv])
    assert message in capsys.readouterr().err
