"""Deadlines and fallbacks through real processes: a request whose deadline its queue cannot
meet is refused at once (503 deadline_unmeetable) and one it can meet is served; a model
that cannot take a request at once hands it to its fallbacks in order, the answer naming
the model that took it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from dispatcher import keys
from iop.redis_server import RedisServer
from tests.e2e.system import System, http_provider

SLOW_MS = 300


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[System]:
    sys_ = System(tmp_path_factory.mktemp("admission"), redis_server)
    sys_.write_config({
        "queue": {"max_queue": 100, "queue_timeout_ms": 60_000},
        "models": [
            # m: one slot, nothing may wait; its fallbacks: one whose provider is down, then m3.
            {"id": "m", "providers": {"p": "served"}, "max_queue": 0, "fallbacks": ["gone", "m3"]},
            {"id": "gone", "providers": {"pd": "served"}},
            {"id": "m3", "providers": {"p3": "served"}},
            {"id": "solo", "providers": {"ps": "served"}},
        ],
        "nodes": [{"id": "n1", "providers": [
            http_provider("p", "vllm", sys_.port("f"), 1, ["served"]),
            http_provider("pd", "vllm", sys_.port("nobody"), 1, ["served"]),
            http_provider("p3", "vllm", sys_.port("f3"), 4, ["served"]),
            http_provider("ps", "vllm", sys_.port("fs"), 1, ["served"]),
        ]}],
    })
    with sys_:
        sys_.fake("f", "--models", "served", "--tokens", "1", "--delay-ms", str(SLOW_MS))
        sys_.fake("f3", "--models", "served", "--tokens", "1")
        sys_.fake("fs", "--models", "served", "--tokens", "1", "--delay-ms", str(SLOW_MS))
        sys_.worker("n1")
        sys_.api()
        for pid in ("p", "p3", "ps"):
            sys_.wait_available(pid)
        yield sys_


def chat(system: System, model: str, headers: dict[str, str] | None = None, **extra: Any) -> httpx.Response:
    return httpx.post(f"{system.api_url}/v1/chat/completions", headers=headers or {}, timeout=60,
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}], **extra})


def in_background(system: System, model: str, n: int) -> list[threading.Thread]:
    threads = [threading.Thread(target=chat, args=(system, model)) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def test_fallbacks_take_it_in_order_and_the_answer_names_the_model(system: System) -> None:
    busy = in_background(system, "m", 1)
    system.wait_until("m's slot taken", lambda: system.in_flight("p") == 1, timeout=10)
    answer = chat(system, "m")  # m is full and may not queue; "gone" has no provider up
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-iop-model"] == "m3"
    assert answer.json()["model"] == "m3"
    for t in busy:
        t.join()
    # Free again, m takes its own.
    own = chat(system, "m")
    assert own.status_code == 200
    assert own.headers["x-iop-model"] == "m"
    assert own.json()["model"] == "m"
    metrics = httpx.get(f"{system.api_url}/metrics", timeout=10).text
    assert 'iop_fallbacks_total{fallback="m3",model="m"} 1.0' in metrics


def test_a_deadline_the_queue_cannot_meet_is_refused_at_once(system: System) -> None:
    # One slot of 300 ms per request: fourteen requests make a queue of about four seconds,
    # and its drain rate is known once nine have left it (a block of eight intervals).
    backlog = in_background(system, "solo", 14)
    system.wait_until("a drain rate measured", lambda: system.in_flight("ps") == 1 and _drained(system), timeout=20)
    started = time.monotonic()
    refused = chat(system, "solo", {"x-iop-deadline-ms": "200"})
    took = time.monotonic() - started
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "deadline_unmeetable"
    assert int(refused.headers["retry-after"]) >= 1
    assert took < 1.0  # not after waiting: the queue ahead of it is seconds long
    # A deadline it can meet: it waits and is served.
    served = chat(system, "solo", {"x-iop-deadline-ms": "30000"})
    assert served.status_code == 200
    for t in backlog:
        t.join()


def _drained(system: System) -> bool:
    """Some queue's drain interval is known (lua/lib/drain_rate.lua note_drain: '<start>|<n>|<interval>';
    the hash's shed counters, keys.shed_field, are not intervals)."""
    return any(v.split(b"|")[2] for f, v in system.redis.hgetall(keys.QUEUE_RATES).items()
               if not f.endswith(b"|shed"))


def test_a_bad_deadline_is_a_clear_400(system: System) -> None:
    answer = chat(system, "solo", {"x-iop-deadline-ms": "soon"})
    assert answer.status_code == 400
    assert "x-iop-deadline-ms" in answer.json()["error"]["message"]
