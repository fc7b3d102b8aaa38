"""Real servers (session scope, one per kind) and an iop system in front of each.

Each iop system has a private redis-server, one node worker and one API process
(tests/e2e/system.py); its providers are the real server, as type ``openai_api`` with
the endpoints that server speaks (llama.cpp's own llama-server: as type ``llamacpp``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from iop.redis_server import RedisServer
from tests.e2e.system import System
from tests.realservers.servers import (
    LITELLM_CLAUDE,
    LITELLM_EMBED,
    LITELLM_GPT,
    LITELLM_LOOP,
    LLAMA_CHAT,
    LLAMA_EMBED,
    LLAMA_SERVED,
    LLAMA_SLOTS,
    STARTERS,
    RealServer,
    unavailable,
)

# The ids callers use through iop (never the served names, so a rename shows).
TINY = "tiny"
TINY_EMBED = "tiny-embedding"
SLOTS_ALIAS = "tiny-slots-alias"
LLAMA_SERVER_ID = "llama-server"
GPT = "gpt-alias"
CLAUDE = "claude-alias"
EMBED = "embed-alias"
LOOP = "loop-alias"
IOP_KEY = "iop-real-key"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call":
        item.stash[_REPORT] = report
    return report


_REPORT = pytest.StashKey[pytest.TestReport]()


def _start(kind: str, tmp: pytest.TempPathFactory) -> RealServer:
    reason = unavailable(kind)
    if reason is not None:
        pytest.skip(reason)
    return STARTERS[kind](tmp.mktemp(kind))


def _serve(kind: str, tmp: pytest.TempPathFactory) -> Iterator[RealServer]:
    server = _start(kind, tmp)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def llamacpp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    yield from _serve("llamacpp", tmp_path_factory)


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    yield from _serve("llama-server", tmp_path_factory)


@pytest.fixture(scope="session")
def litellm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    yield from _serve("litellm", tmp_path_factory)


def _provider(pid: str, server: RealServer, endpoints: list[str]) -> dict[str, Any]:
    return {"id": pid, "type": "openai_api", "base_url": server.url, "capacity": 2,
            "models": sorted(set(server.models.values())), "endpoints": endpoints, "timeout_s": 60}


def _system(tmp: pytest.TempPathFactory, name: str, config: dict[str, Any],
            env: dict[str, str] | None = None) -> Iterator[System]:
    with RedisServer() as redis_server:
        system = System(tmp.mktemp(f"iop-{name}"), redis_server)
        system.env.update(env or {})
        system.write_config(config)
        try:
            system.worker("n1")
            system.api()
            system.wait_available(name)
            yield system
        finally:
            system.close()


@pytest.fixture(scope="session")
def iop_llamacpp(tmp_path_factory: pytest.TempPathFactory, llamacpp: RealServer) -> Iterator[System]:
    """iop in front of llama-cpp-python: ``tiny`` -> tiny-chat, ``tiny-embedding`` -> tiny-embed."""
    yield from _system(tmp_path_factory, "llamacpp", {
        "models": [
            {"id": TINY, "providers": {"llamacpp": LLAMA_CHAT}},
            {"id": TINY_EMBED, "providers": {"llamacpp": LLAMA_EMBED}},
        ],
        "nodes": [{"id": "n1", "providers": [
            # llama-cpp-python answers one request at a time (it holds a lock around its model).
            {**_provider("llamacpp", llamacpp, ["chat/completions", "completions", "embeddings"]), "capacity": 1},
        ]}],
    })


def llama_server_provider(server: RealServer, base_url: str | None = None) -> dict[str, Any]:
    """llama-server as a provider of type ``llamacpp``, as many at a time as it has slots
    (``stream_usage`` at its default, off for the type: llama-server ends every stream with
    its counts unasked)."""
    return {"id": LLAMA_SERVER_ID, "type": "llamacpp", "base_url": base_url or server.url,
            "capacity": LLAMA_SLOTS, "models": [LLAMA_SERVED], "endpoints": ["chat/completions", "completions"],
            "timeout_s": 60}


@pytest.fixture(scope="session")
def iop_llama_server(tmp_path_factory: pytest.TempPathFactory, llama_server: RealServer) -> Iterator[System]:
    """iop in front of llama-server: ``tiny-slots-alias`` -> tiny-slots."""
    yield from _system(tmp_path_factory, LLAMA_SERVER_ID, {
        "models": [{"id": SLOTS_ALIAS, "providers": {LLAMA_SERVER_ID: LLAMA_SERVED}}],
        "nodes": [{"id": "n1", "providers": [llama_server_provider(llama_server)]}],
    })


@pytest.fixture(scope="session")
def iop_litellm(tmp_path_factory: pytest.TempPathFactory, litellm: RealServer) -> Iterator[System]:
    """iop in front of LiteLLM's proxy, with caller keys (Bearer or x-api-key)."""
    yield from _system(tmp_path_factory, "litellm", {
        "api": {"api_keys_env": "IOP_REAL_KEYS"},
        "models": [
            {"id": GPT, "providers": {"litellm": LITELLM_GPT}},
            {"id": CLAUDE, "providers": {"litellm": LITELLM_CLAUDE}},
            {"id": EMBED, "providers": {"litellm": LITELLM_EMBED}},
            {"id": LOOP, "providers": {"litellm": LITELLM_LOOP}},
        ],
        "nodes": [{"id": "n1", "providers": [
            _provider("litellm", litellm,
                      ["chat/completions", "responses", "messages", "messages/count_tokens", "embeddings"]),
        ]}],
    }, env={"IOP_REAL_KEYS": IOP_KEY})


@pytest.fixture(autouse=True)
def _logs_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """A failed test shows the logs of the servers and iop processes it used."""
    yield
    report = request.node.stash.get(_REPORT, None)
    if report is None or not report.failed:
        return
    for name in ("iop_llamacpp", "iop_llama_server", "iop_litellm", "llamacpp", "llama_server", "litellm"):
        if name not in request.fixturenames:
            continue
        value = request.getfixturevalue(name)
        text = value.logs() if isinstance(value, System) else value.log()[-4000:]
        report.sections.append((f"log of {name}", text))
