"""A node's cancel channel (workers/cancels.py), against a private redis-server: a cancel
published there aborts the job's run here, or waits for the job; every subscription,
the first and each after the connection was lost, asks for a renewal at once (it reports
the cancels published while nobody listened)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest
from redis.asyncio import Redis

from dispatcher import keys
from dispatcher.events import Assignment
from iop.redis_server import RedisServer
from tests.waiting import EVENTUALLY_S, eventually
from workers.cancels import CancelListener
from workers.leases import CANCELLED, Runs

pytestmark = pytest.mark.anyio

NODE = "n1"


def job(name: str) -> Assignment:
    return Assignment(entry_id="1-0", job=name, fence=1, provider="p", target="t", model="m", lane="",
                      replica="r1", endpoint="chat/completions", stream=False, attempt=1, submitted_ms=0,
                      dispatched_ms=0, body=b"")


class Subscriptions:
    """Counts the renewals the listener asks for: one per subscription."""

    def __init__(self) -> None:
        self.count = 0
        self._changed = anyio.Event()

    def renew_now(self) -> None:
        self.count += 1
        self._changed.set()
        self._changed = anyio.Event()

    async def until(self, count: int) -> None:
        with anyio.fail_after(EVENTUALLY_S):
            while self.count < count:
                await self._changed.wait()


@pytest.fixture
async def listening(redis_server: RedisServer, redis: Redis) -> AsyncIterator[tuple[Runs, Subscriptions]]:
    listener_redis = Redis.from_url(redis_server.url)
    runs = Runs(keep_s=60)
    subscriptions = Subscriptions()
    listener = CancelListener(listener_redis, NODE, runs, subscriptions.renew_now)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.run)
            await subscriptions.until(1)
            yield runs, subscriptions
            tg.cancel_scope.cancel()
    finally:
        await listener_redis.aclose()



async def test_a_published_cancel_aborts_the_running_job(listening: tuple[Runs, Subscriptions], redis: Redis) -> None:
    runs, _ = listening
    mine, other = runs.start(job("j1")), runs.start(job("j2"))
    await redis.publish(keys.cancel_channel(NODE), "j1")
    await eventually(lambda: mine.abort_reason is not None)
    assert mine.abort_reason == CANCELLED
    assert mine.scope.cancel_called
    assert other.abort_reason is None


async def test_a_cancel_of_a_job_not_here_yet_waits_for_it(listening: tuple[Runs, Subscriptions], redis: Redis) -> None:
    runs, _ = listening
    await redis.publish(keys.cancel_channel(NODE), "j1")
    await eventually(lambda: "j1" in runs.early_cancels)
    assert runs.start(job("j1")).abort_reason == CANCELLED


async def test_another_node_cancels_are_not_heard(listening: tuple[Runs, Subscriptions], redis: Redis) -> None:
    runs, _ = listening
    running = runs.start(job("j1"))
    await redis.publish(keys.cancel_channel("n2"), "j1")
    await redis.publish(keys.cancel_channel(NODE), "marker")  # heard after the other one, if that were
    await eventually(lambda: "marker" in runs.early_cancels)
    assert running.abort_reason is None


async def test_the_listener_subscribes_again_after_losing_its_connection(
    listening: tuple[Runs, Subscriptions], redis: Redis
) -> None:
    runs, subscriptions = listening
    killed = await redis.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
    assert killed >= 1
    await subscriptions.until(2)  # subscribed again, and a renewal asked for what it missed
    running = runs.start(job("j1"))
    await redis.publish(keys.cancel_channel(NODE), "j1")
    await eventually(lambda: running.abort_reason is not None)


class _BrokenOnce:
    """A pubsub whose first listen fails as uvloop fails a write on a transport the server
    closed (a RuntimeError, which redis-py does not turn into a ConnectionError)."""

    failures = 1

    async def subscribe(self, channel: str) -> None:
        pass

    async def listen(self) -> AsyncIterator[dict[str, object]]:
        if _BrokenOnce.failures:
            _BrokenOnce.failures -= 1
            raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")
        await anyio.sleep_forever()
        yield {}

    async def aclose(self) -> None:
        pass


class _BrokenRedis:
    def pubsub(self) -> _BrokenOnce:
        return _BrokenOnce()


async def test_a_transport_error_while_reconnecting_does_not_end_the_listener() -> None:
    subscriptions = Subscriptions()
    listener = CancelListener(_BrokenRedis(), NODE, Runs(keep_s=60), subscriptions.renew_now)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        tg.start_soon(listener.run)
        await subscriptions.until(2)  # subscribed again after the failure
        tg.cancel_scope.cancel()
