"""iop's health probes against llama-cpp-python's server, which they can disturb.

llama-cpp-python takes its model lock for ``GET /v1/models`` as for a completion, and by
default (``interrupt_requests``) a request waiting for that lock ends the running stream:
``data: [DONE]`` without a ``finish_reason``. A probe of the model list while a stream runs
would cut the caller's answer, and no client library would notice. Its server also has no
``GET /health``, which the ``llamacpp`` type asks first.

Each test has a llama-cpp-python server of its own: an iop system probing another would
cut these streams whatever this one does. The worker probes every 300 ms (the end-to-end
tests' ``fast_dispatch``), so a stream of over a second would meet several probes if it
could (a worker that probed regardless cut all four).
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from iop.redis_server import RedisServer
from tests.e2e.system import System, fast_dispatch
from tests.realservers.compare import Answer, send
from tests.realservers.servers import LLAMA_LONG, RealServer, start_llamacpp, unavailable

pytestmark = pytest.mark.realservers

MODEL = "tiny-long-alias"
PROVIDER = "llama"
STREAMS = 4
# Over a second of generation each on the tiny model here (measured: 1000 tokens in 1.1 s),
# within its 2048-token context.
LONG: dict[str, Any] = {"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 1200,
                        "temperature": 0, "seed": 7}
MODELS_ASKED = re.compile(r'"GET /v1/models HTTP/1\.1" 200')


@pytest.fixture
def llama_alone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    reason = unavailable("llamacpp")
    if reason is not None:
        pytest.skip(reason)
    server = start_llamacpp(tmp_path_factory.mktemp("llama-alone"), long_context=True)
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def iop_in_front(tmp: pytest.TempPathFactory, server: RealServer, provider_type: str) -> Iterator[System]:
    config = {
        "models": [{"id": MODEL, "providers": {PROVIDER: LLAMA_LONG}}],
        "nodes": [{"id": "n1", "providers": [{
            "id": PROVIDER, "type": provider_type, "base_url": server.url, "models": [LLAMA_LONG],
            # One at a time: a second stream would end the first just as a probe does.
            "capacity": 1, "endpoints": ["chat/completions", "completions"], "timeout_s": 60,
        }]}],
        "dispatch": fast_dispatch(lease_ms=6000),
        # A probe that times out on a busy machine marks the one provider unavailable for a
        # moment: the streams wait for it rather than being answered no_provider_available
        # (what is tested here is that probes never cut them).
        "queue": {"hold_when_unavailable_ms": 60_000},
    }
    with RedisServer() as redis_server:
        system = System(tmp.mktemp(f"iop-{provider_type}"), redis_server)
        system.write_config(config)
        try:
            system.worker("n1")
            system.api()
            system.wait_available(PROVIDER)
            yield system
        finally:
            system.close()


@pytest.fixture(params=["openai_api", "llamacpp"])
def iop_probing(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                llama_alone: RealServer) -> Iterator[System]:
    """iop in front of ``llama_alone``, its provider of the type the test is run with."""
    with iop_in_front(tmp_path_factory, llama_alone, request.param) as system:
        yield system


def final_payload(answer: Answer) -> dict[str, Any]:
    payloads = answer.payloads()
    assert payloads, answer.describe()
    last: dict[str, Any] = payloads[-1]
    return last


def streamed_text(answer: Answer) -> str:
    return "".join(p["choices"][0]["delta"].get("content") or "" for p in answer.payloads() if p.get("choices"))


def test_long_streams_are_never_cut_by_probes(llama_alone: RealServer, iop_probing: System) -> None:
    # Not streamed, the server's reference is never interrupted (only its streams check the lock).
    reference = send(llama_alone.url, "/v1/chat/completions", {"model": LLAMA_LONG, **LONG}).json()
    assert reference["choices"][0]["finish_reason"] == "length", reference
    expected = reference["choices"][0]["message"]["content"]

    answers: list[Answer | BaseException] = []

    def one() -> None:
        try:
            answers.append(send(iop_probing.api_url, "/v1/chat/completions",
                                {"model": MODEL, "stream": True, **LONG}, timeout=120))
        except BaseException as exc:  # shown below, not lost in the thread
            answers.append(exc)

    threads = [threading.Thread(target=one) for _ in range(STREAMS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    cut = []
    for answer in answers:
        assert isinstance(answer, Answer), repr(answer)
        assert answer.status == 200, answer.describe()
        assert answer.done, answer.describe()[-500:]
        last = final_payload(answer)
        if last["choices"][0].get("finish_reason") != "length" or streamed_text(answer) != expected:
            cut.append(f"{len(answer.events)} events, last {str(last)[:300]}")
    assert not cut, f"{len(cut)} of {STREAMS} streams came back cut:\n" + "\n".join(cut)


def test_an_idle_provider_is_probed_again(llama_alone: RealServer, iop_probing: System) -> None:
    """The streams above would pass on a worker that stopped probing: this one shows it has not."""
    asked = len(MODELS_ASKED.findall(llama_alone.log()))
    iop_probing.wait_until("another probe of the model list",
                           lambda: len(MODELS_ASKED.findall(llama_alone.log())) > asked + 2, timeout=30)


def test_the_llamacpp_type_is_available_on_llama_cpp_python(
    tmp_path_factory: pytest.TempPathFactory, llama_alone: RealServer
) -> None:
    """No ``GET /health`` there (404): the model list answers for it."""
    with iop_in_front(tmp_path_factory, llama_alone, "llamacpp") as system:
        state = system.provider(PROVIDER)
        assert state["health"] == "available", state
        assert state["reason"] == "", state
        assert LLAMA_LONG in state["reported_models"], state
        catalog = httpx.get(f"{system.api_url}/catalog", timeout=10).json()
        view = next(p for p in catalog["providers"] if p["id"] == PROVIDER)
        assert (view["health"], view["reason"]) == ("available", ""), view
        short = send(system.api_url, "/v1/chat/completions", {"model": MODEL, **LONG, "max_tokens": 8})
        assert short.status == 200, short.describe()
        assert short.json()["choices"][0]["finish_reason"] == "length"
