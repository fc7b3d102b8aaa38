"""The job sink through Redis trouble: output held in order, written once Redis takes it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError, RedisError

from dispatcher import events, keys
from dispatcher.events import Assignment, Chunks, Start
from dispatcher.worker_side import WorkerSide
from tests.dispatcher.harness import Harness, make_config
from workers import sink as sink_module
from workers.sink import RedisSink

pytestmark = pytest.mark.anyio


class FlakySlots:
    """Real WorkerSide, but a write can be refused (Redis away) or have its reply lost."""

    def __init__(self, real: WorkerSide) -> None:
        self.real = real
        self.down = False
        self.lose_next_reply = False

    async def _write(self, call: Callable[[], Awaitable[Any]]) -> Any:
        if self.down:
            raise ConnectionError("Error 111 connecting to Redis")
        result = await call()
        if self.lose_next_reply:
            self.lose_next_reply = False
            raise ConnectionError("Connection lost after the write")
        return result

    async def emit(self, job: Assignment, event: bytes) -> str:
        return str(await self._write(lambda: self.real.emit(job, event)))

    async def chunks(self, job: Assignment, event: bytes) -> None:
        await self._write(lambda: self.real.chunks(job, event))


async def dispatched(h: Harness) -> Assignment:
    await h.up("a")
    job, status = await h.submit("m")
    assert status == "dispatched"
    return await h.assignment(job)


async def written(redis: Redis) -> list[events.Event]:
    return [events.decode(f[b"event"]) for _, f in await redis.xrange(keys.reply("rep1"))]


def payloads(evs: list[events.Event]) -> list[bytes]:
    """What the API relays: the chunks of each batch, a batch number seen twice dropped."""
    out: list[bytes] = []
    seen = -1
    for ev in evs:
        seq = 0 if isinstance(ev, Start) else ev.seq if isinstance(ev, Chunks) else None
        if seq is None or seq <= seen:
            continue
        seen = seq
        out += ev.chunks  # type: ignore[union-attr]
    return out


async def flaky_sink(h: Harness, hold_s: float = 60) -> tuple[Assignment, FlakySlots, RedisSink]:
    """A dispatched job and its sink, writing through slots that can fail on demand."""
    job = await dispatched(h)
    slots = FlakySlots(h.node)
    return job, slots, RedisSink(slots, job, "n1", hold_s=hold_s)  # type: ignore[arg-type]


@pytest.fixture
def h(any_redis: Redis) -> Harness:
    return Harness(any_redis, make_config({"a": 1}, {"m": ["a"]}))


async def test_output_is_held_through_an_outage_and_written_in_order(h: Harness) -> None:
    _job, slots, sink = await flaky_sink(h)
    await sink.chunks([b"1"])
    slots.down = True
    for n in range(2, 6):
        await sink.chunks([str(n).encode()])  # no error: held
    assert payloads(await written(h.redis)) == [b"1"]
    slots.down = False
    await sink.flush()
    assert payloads(await written(h.redis)) == [b"1", b"2", b"3", b"4", b"5"]
    await sink.chunks([b"6"])
    assert payloads(await written(h.redis)) == [b"1", b"2", b"3", b"4", b"5", b"6"]


async def test_the_first_output_waits_for_redis_too(h: Harness) -> None:
    job, slots, sink = await flaky_sink(h)
    slots.down = True
    await sink.chunks([b"a"])
    await sink.chunks([b"b"])
    assert not sink.started
    assert (await h.record(job.job)).output_started == 0  # still safe to dispatch again
    slots.down = False
    await sink.flush()
    assert sink.started
    evs = await written(h.redis)
    assert isinstance(evs[0], Start)
    assert payloads(evs) == [b"a", b"b"]


async def test_a_batch_whose_reply_was_lost_is_sent_again_unchanged(h: Harness) -> None:
    _job, slots, sink = await flaky_sink(h)
    await sink.chunks([b"1"])
    slots.lose_next_reply = True
    await sink.chunks([b"2"])  # written, but the worker cannot know
    await sink.chunks([b"3"])  # too soon to retry: held behind the unknown batch
    await sink.flush()
    evs = await written(h.redis)
    batches = [(e.seq, e.chunks) for e in evs if isinstance(e, Chunks)]
    assert batches == [(1, [b"2"]), (1, [b"2"]), (2, [b"3"])]  # the retry is the same batch
    assert payloads(evs) == [b"1", b"2", b"3"]


async def test_holding_is_bounded_in_time(h: Harness) -> None:
    _job, slots, sink = await flaky_sink(h, hold_s=0.2)
    slots.down = True
    await sink.chunks([b"a"])  # the first failure starts the clock
    await anyio.sleep(0.3)
    with pytest.raises(RedisError):
        await sink.chunks([b"b"])


async def test_holding_is_bounded_in_bytes(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sink_module, "HOLD_BYTES", 10)
    _job, slots, sink = await flaky_sink(h)
    slots.down = True
    await sink.chunks([b"12345"])
    with pytest.raises(RedisError):
        await sink.chunks([b"678901"])


ROLE_ONLY = b'{"id":"c1","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'
FIRST_TOKEN = b'{"id":"c1","choices":[{"index":0,"delta":{"content":"Hel"}}]}'


@pytest.mark.parametrize(("payload", "announces"), [
    (ROLE_ONLY, True),
    (b'{"choices":[{"index":0,"delta":{"role":"assistant"}}]}', True),
    (FIRST_TOKEN, False),
    (b'{"choices":[{"index":0,"delta":{"role":"assistant","content":"Hel"}}]}', False),
    (b'{"choices":[{"index":0,"delta":{"role":"assistant","tool_calls":[{"index":0}]}}]}', False),
    (b'{"choices":[{"index":0,"text":"Hel"}]}', False),  # completions: no role
    (b'{"choices":[],"usage":{"role":1}}', False),
    (b'not json with "role"', False),
])
def test_a_chunk_that_only_names_the_role_is_not_output(payload: bytes, announces: bool) -> None:
    assert sink_module.announces_only(payload) is announces


async def test_the_first_output_is_the_first_token_not_the_role(h: Harness) -> None:
    _job, _slots, sink = await flaky_sink(h)
    told: list[float] = []
    sink.on_first_output = lambda: told.append(1.0)
    await sink.chunks([ROLE_ONLY])
    assert sink.first_output_at is None
    assert told == []
    await sink.chunks([FIRST_TOKEN])
    assert sink.first_output_at is not None
    assert told == [1.0]
