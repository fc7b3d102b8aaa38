"""Holding a request through a short Redis outage (``dispatcher.holding``, issue 21): the
helper on its own, the ``redis.failover_hold_ms`` setting, and ``ApiSide`` -- the submit and
the stored-response lookup held through a real Redis restart, and a submit whose reply was
lost answered as what it did (queued with its deadline, or dispatched), not 'duplicate'."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import pytest
from redis.asyncio import Redis
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    ConnectionError,
    ResponseError,
    TimeoutError,
)

from dispatcher import config as cfg
from dispatcher import keys
from dispatcher.api_side import ApiSide
from dispatcher.exceptions import ConfigError
from dispatcher.fastredis import FastRedis
from dispatcher.holding import held
from dispatcher.plans import Lane, Plans
from dispatcher.redis_conn import connect, connect_fast
from dispatcher.script_calls import ScriptCalls, SubmitStatus
from dispatcher.scripts import Scripts
from iop.redis_server import RedisServer

pytestmark = pytest.mark.anyio

QUEUE_TIMEOUT_MS = 30_000


def _now() -> float:
    return asyncio.get_running_loop().time()


class Flaky:
    """A call that fails with ``error`` ``failing`` times, then answers 'ok'."""

    def __init__(self, error: Exception, failing: int) -> None:
        self.error = error
        self.failing = failing
        self.tries = 0

    async def __call__(self) -> str:
        self.tries += 1
        if self.tries <= self.failing:
            raise self.error
        return "ok"


# --- the helper ------------------------------------------------------------------------------


@pytest.mark.parametrize("error", [ConnectionError("refused"), TimeoutError("no reply"),
                                   BusyLoadingError("LOADING Redis is loading the dataset in memory")],
                         ids=["connection", "timeout", "loading"])
async def test_a_call_is_tried_again_while_redis_is_unreachable(error: Exception) -> None:
    call = Flaky(error, failing=5)
    started = _now()
    assert await held(call, hold_s=5.0) == "ok"
    assert call.tries == 6
    # Short pauses: five failures cost 0.5 s of them (20, 40, 80, 160, 200 ms).
    assert _now() - started < 2.0


async def test_past_the_hold_the_last_failure_is_raised() -> None:
    call = Flaky(ConnectionError("still away"), failing=1_000)
    started = _now()
    with pytest.raises(ConnectionError, match="still away"):
        await held(call, hold_s=0.3)
    # Not before the hold is over, and a last try at its end.
    assert _now() - started >= 0.3
    assert call.tries >= 3


@pytest.mark.parametrize("error", [ResponseError("ERR Error running script"), AuthenticationError("WRONGPASS")],
                         ids=["script-error", "refused-login"])
async def test_what_redis_answered_is_not_held(error: Exception) -> None:
    call = Flaky(error, failing=1)
    with pytest.raises(type(error)):
        await held(call, hold_s=5.0)
    assert call.tries == 1


async def test_a_hold_of_zero_tries_once() -> None:
    call = Flaky(ConnectionError("away"), failing=1)
    with pytest.raises(ConnectionError):
        await held(call, hold_s=0.0)
    assert call.tries == 1


# --- the setting -------------------------------------------------------------------------------


def config_doc(**redis: Any) -> dict[str, Any]:
    return {
        "redis": redis,
        # Held: these jobs wait with no provider up, as the tests of a restart need.
        "queue": {"queue_timeout_ms": QUEUE_TIMEOUT_MS, "hold_when_unavailable_ms": 3_600_000},
        "models": [{"id": "m", "providers": {"p": "served"}}],
        "nodes": [{"id": "n1", "providers": [
            {"id": "p", "type": "vllm", "base_url": "http://127.0.0.1:1", "capacity": 1, "models": ["served"]}]}],
    }


def test_the_hold_defaults_to_five_seconds_and_zero_turns_it_off() -> None:
    assert cfg.parse(config_doc()).config.redis.failover_hold_ms == 5000
    assert cfg.parse(config_doc(failover_hold_ms=0)).config.redis.failover_hold_ms == 0


def test_a_negative_hold_is_reported_at_its_path() -> None:
    with pytest.raises(ConfigError) as info:
        cfg.parse(config_doc(failover_hold_ms=-1))
    assert [p.path for p in info.value.problems] == ["$.redis.failover_hold_ms"]


# --- ApiSide against a real Redis -------------------------------------------------------------------


class Api:
    """An ApiSide wired as the API wires it (scripts through the lean client)."""

    def __init__(self, server: RedisServer, hold_ms: int = 5000) -> None:
        self.config = cfg.parse(config_doc(url=server.url, failover_hold_ms=hold_ms)).config
        self.redis: Redis = connect(server.url)
        self.fast: FastRedis = connect_fast(server.url)
        self.calls = ScriptCalls(Scripts(self.redis, self.fast), self.config, Plans(self.config))
        self.side = ApiSide(self.calls, self.redis, "rep1")
        self.lane: Lane = self.calls.plans.main_lane("m")

    async def submit(self, job: str) -> Any:
        return await self.side.submit(job, self.lane, b'{"model":"m"}', "chat/completions", False)

    async def aclose(self) -> None:
        await self.fast.close()
        await self.redis.aclose()


@pytest.fixture
async def server() -> AsyncIterator[RedisServer]:
    """A Redis of this test's own: it is stopped and started again. Its AOF is fsynced on
    every write: under ``everysec`` a busy disk lets Redis put off the write of a command it
    has already answered (up to 2 s), and the SIGKILL right after would lose it."""
    with RedisServer(appendonly=True, extra_args=["--appendfsync", "always"]) as server:
        yield server


@pytest.fixture
async def api(server: RedisServer) -> AsyncIterator[Api]:
    api = Api(server)
    yield api
    await api.aclose()


async def during_a_restart(server: RedisServer, away_s: float, call: Callable[[], Awaitable[Any]]) -> Any:
    """``call()`` made while Redis is away for ``away_s`` seconds (SIGKILL, then a start on
    the same port with its AOF)."""
    server.stop(kill=True)
    async with anyio.create_task_group() as tg:
        result: list[Any] = []

        async def run() -> None:
            result.append(await call())

        tg.start_soon(run)
        await anyio.sleep(away_s)
        await anyio.to_thread.run_sync(server.start)
    return result[0]


async def test_a_submit_is_held_through_a_restart(server: RedisServer, api: Api) -> None:
    assert (await api.submit("before")).status == SubmitStatus.QUEUED  # no provider: it waits
    started = _now()
    submitted = await during_a_restart(server, 0.8, lambda: api.submit("during"))
    assert submitted.status == SubmitStatus.QUEUED
    assert _now() - started >= 0.8
    assert await api.redis.zrange(keys.queue("m"), 0, -1) == [b"before", b"during"]


async def test_a_submit_past_the_hold_fails(server: RedisServer) -> None:
    api = Api(server, hold_ms=300)
    try:
        server.stop(kill=True)
        started = _now()
        with pytest.raises(ConnectionError):
            await api.submit("during")
        assert _now() - started >= 0.3
    finally:
        await api.aclose()


async def test_the_stored_response_lookup_is_held_through_a_restart(server: RedisServer, api: Api) -> None:
    await api.calls.remember_response("resp_1", "p", "m")
    stored = await during_a_restart(server, 0.5, lambda: api.side.stored_response("resp_1"))
    assert stored is not None
    assert (stored.provider, stored.model) == ("p", "m")


def lose_the_first_reply(api: Api) -> list[str]:
    """The first submit runs, and then its connection drops before the reply is read."""
    real = api.calls.submit
    seen: list[str] = []

    async def submit(job: str, *args: Any, **kwargs: Any) -> Any:
        result = await real(job, *args, **kwargs)
        seen.append(result.status)
        if len(seen) == 1:
            raise ConnectionError("Connection to Redis lost: reset by peer")
        return result

    api.calls.submit = submit  # type: ignore[method-assign]
    return seen


async def test_a_retry_after_a_lost_reply_is_answered_queued_with_the_deadline_of_the_first(api: Api) -> None:
    seen = lose_the_first_reply(api)
    submitted = await api.submit("lost-reply")
    assert seen == [SubmitStatus.QUEUED, SubmitStatus.DUPLICATE]
    # What the relay needs to arm the queue deadline: queued, the time left of the first try.
    assert submitted.status == SubmitStatus.QUEUED
    assert QUEUE_TIMEOUT_MS - 2000 < submitted.wait_ms <= QUEUE_TIMEOUT_MS


async def test_a_retry_after_a_lost_reply_of_a_dispatch_is_answered_dispatched(api: Api) -> None:
    # The provider is up with a free slot: the first try dispatches the job.
    await api.calls.heartbeat("p", "available", [("capacity", 1), ("node", "n1")])
    seen = lose_the_first_reply(api)
    submitted = await api.submit("lost-reply")
    assert seen == [SubmitStatus.DISPATCHED, SubmitStatus.DUPLICATE]
    assert submitted.status == SubmitStatus.DISPATCHED


async def test_a_retry_after_a_lost_reply_past_its_deadline_is_answered_with_no_time_left(api: Api) -> None:
    seen = lose_the_first_reply(api)
    real = api.calls.submit

    async def late(*args: Any, **kwargs: Any) -> Any:
        # The deadline passes between the lost reply and the retry (a long hold, a short timeout).
        if seen:
            await api.redis.zadd(keys.DEADLINES, {"lost-reply": 1})
        return await real(*args, **kwargs)

    api.calls.submit = late  # type: ignore[method-assign]
    submitted = await api.submit("lost-reply")
    assert submitted.status == SubmitStatus.QUEUED
    assert submitted.wait_ms <= 0  # the relay checks the deadline at once: queue_timeout
