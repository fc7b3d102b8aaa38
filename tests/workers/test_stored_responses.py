"""Where a stored Response was made is noted before its answer or first event goes on."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from dispatcher.events import Usage
from workers.stored_responses import RememberingSink

pytestmark = pytest.mark.anyio


class Log:
    def __init__(self, fail: bool = False) -> None:
        self.steps: list[str] = []
        self.fail = fail

    async def remember(self, response_id: str) -> None:
        if self.fail:
            raise RedisConnectionError("down")
        self.steps.append(f"remember {response_id}")

    async def start(self, status: int, content_type: str = "text/event-stream",
                    headers: Mapping[str, str] | None = None) -> None:
        self.steps.append("start")

    async def chunks(self, payloads: list[bytes]) -> None:
        self.steps.append(f"chunks {len(payloads)}")

    async def done(self, status: int, body: bytes, content_type: str,
                   headers: Mapping[str, str] | None = None) -> None:
        self.steps.append(f"done {status}")

    def ended(self, upstream_done: bool) -> None:
        self.steps.append("ended")

    def usage(self, usage: Usage) -> None:
        self.steps.append(f"usage {usage.prompt}/{usage.completion}")


async def test_a_json_answer_is_remembered_before_it_goes_on() -> None:
    log = Log()
    sink = RememberingSink(log, log.remember)
    await sink.done(200, b'{"id":"resp_1","object":"response","model":"x"}', "application/json")
    assert log.steps == ["remember resp_1", "done 200"]


async def test_an_error_or_an_answer_without_id_is_not() -> None:
    log = Log()
    sink = RememberingSink(log, log.remember)
    await sink.done(404, b'{"id":"resp_1"}', "application/json")
    await sink.done(200, b"not json", "application/json")
    await sink.done(200, b'{"object":"response"}', "application/json")
    assert log.steps == ["done 404", "done 200", "done 200"]


async def test_a_stream_is_remembered_at_response_created_once() -> None:
    log = Log()
    sink = RememberingSink(log, log.remember)
    await sink.start(200)
    created = b'response.created\n{"type":"response.created","response":{"id":"resp_9","model":"x"}}'
    await sink.chunks([created, b'response.in_progress\n{"type":"response.in_progress"}'])
    await sink.chunks([b'response.created\n{"type":"response.created","response":{"id":"resp_other"}}'])
    sink.ended(False)
    assert log.steps == ["start", "remember resp_9", "chunks 2", "chunks 1", "ended"]


async def test_redis_away_does_not_stop_the_answer() -> None:
    log = Log(fail=True)
    sink = RememberingSink(log, log.remember)
    await sink.done(200, b'{"id":"resp_1"}', "application/json")
    assert log.steps == ["done 200"]
