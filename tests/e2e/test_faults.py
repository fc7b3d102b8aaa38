"""Fault injection with real processes: workers and API servers killed, stopped or
frozen, providers failing, clients hanging up, Redis going away.

Every case ends with: the client got exactly one answer, every provider's in_flight
equals its live leases (zero once all is done), nothing waits forever, and no job
state is left behind. Timings are short (``FAST``) so that leases expire quickly; the
only time bounds asserted are generous "does not hang" ones.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dispatcher import keys
from iop.redis_server import RedisServer
from tests.e2e.system import Fake, System, fast_dispatch, http_provider

FAST = fast_dispatch()
MESSAGES = [{"role": "user", "content": "hi"}]


def one_pool(sys_: System, capacity: int = 1, queue: dict[str, Any] | None = None, **provider: Any) -> None:
    """Model 'm' on provider 'p' (node n1, fake 'f'), with the FAST timings."""
    sys_.write_config({
        "dispatch": FAST,
        "queue": queue or {"max_queue": 50, "queue_timeout_ms": 30_000},
        "models": [{"id": "m", "providers": {"p": "served"}}],
        "nodes": [{"id": "n1", "providers": [
            http_provider("p", "vllm", sys_.port("f"), capacity, ["served"], **provider)]}],
    })


@pytest.fixture
def system(tmp_path: Path, redis_server: RedisServer) -> Iterator[System]:
    sys_ = System(tmp_path, redis_server)
    yield sys_
    sys_.close()


def settled(system: System, *providers: str) -> None:
    """Wait until nothing holds a slot, then check no job state is left."""
    system.wait_until(
        "all slots released",
        lambda: all(system.in_flight(p) == 0 for p in providers) and system.redis.zcard(keys.LEASES) == 0,
        timeout=30,
    )
    assert system.redis.hlen(keys.JOBS) == 0
    assert system.redis.hlen(keys.BODIES) == 0
    assert system.redis.zcard(keys.DEADLINES) == 0


def post(system: System, body: dict[str, Any] | None = None, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{system.api_url}/v1/chat/completions",
                      json=body or {"model": "m", "messages": MESSAGES}, timeout=timeout)


class Background(threading.Thread):
    """One request run in a thread; ``result`` is the response or the exception."""

    def __init__(self, fn: Any) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.result: Any = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except Exception as exc:
            self.result = exc


def stream_events(system: System, body: dict[str, Any], on_first: Any = None) -> list[str]:
    """The data payloads of a streamed answer; ``on_first`` runs after the first one."""
    payloads: list[str] = []
    with httpx.stream("POST", f"{system.api_url}/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                payloads.append(line[len("data: "):])
                if len(payloads) == 1 and on_first is not None:
                    on_first()
    return payloads


def busy(fake: Fake, n: int = 1) -> Any:
    return lambda: fake.stats()["in_flight"] >= n


# --- 1. a worker dies ------------------------------------------------------------------


def test_worker_killed_before_output_the_job_runs_again(system: System) -> None:
    one_pool(system)
    fake = system.fake("f", "--models", "served")
    doomed = system.worker("n1", "worker-doomed")
    system.api()
    system.wait_available("p")
    # Long enough that the first run is still going when its worker dies, however slowly the
    # survivor starts on a busy machine; the run after it answers at once.
    fake.control(delay_ms=20_000)
    request = Background(lambda: post(system))
    request.start()
    system.wait_until("job running on the doomed worker", busy(fake))
    survivor = system.worker("n1", "worker-survivor")
    system.wait_serving(survivor)
    fake.control(delay_ms=0)
    doomed.kill()
    request.join(timeout=60)
    resp = request.result
    assert isinstance(resp, httpx.Response), resp
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == "m"
    # The provider saw the request twice: the first run was cut off with its worker.
    stats = fake.stats()
    assert stats["total"] == 2
    assert stats["disconnected"] == 1
    settled(system, "p")
    assert survivor.alive()


def test_worker_killed_after_output_the_stream_ends_with_worker_lost(system: System) -> None:
    one_pool(system)
    fake = system.fake("f", "--models", "served", "--tokens", "20", "--token-interval-ms", "300")
    doomed = system.worker("n1", "worker-doomed")
    system.api()
    system.wait_available("p")
    payloads = stream_events(system, {"model": "m", "messages": MESSAGES, "stream": True}, on_first=doomed.kill)
    assert json.loads(payloads[0])["model"] == "m"
    last = json.loads(payloads[-1])
    assert last["error"]["code"] == "worker_lost"
    assert "[DONE]" not in payloads
    # Output had reached the client: the job was not run a second time.
    assert fake.stats()["total"] == 1
    settled(system, "p")


def test_worker_killed_on_json_request_with_no_other_worker_fails_cleanly(system: System) -> None:
    one_pool(system)
    fake = system.fake("f", "--models", "served")
    worker = system.worker("n1")
    system.api()
    system.wait_available("p")
    fake.control(delay_ms=60_000)
    request = Background(lambda: post(system))
    request.start()
    system.wait_until("job running", busy(fake))
    worker.kill()
    request.join(timeout=60)
    resp = request.result
    assert isinstance(resp, httpx.Response), resp
    # Its provider goes stale with its only worker: the retry waits for it, and a reaper
    # round then answers that no provider is up.
    assert resp.status_code in (502, 503), resp.text
    assert resp.json()["error"]["code"] in ("worker_lost", "no_provider_available")
    settled(system, "p")


def test_frozen_worker_is_fenced_when_it_wakes_up(system: System) -> None:
    one_pool(system)
    fake = system.fake("f", "--models", "served")
    frozen = system.worker("n1", "worker-frozen")
    system.api()
    system.wait_available("p")
    # Long enough that the frozen worker is still waiting for its answer when it is stopped,
    # however long the survivor takes to start on a busy machine.
    fake.control(delay_ms=4000)
    request = Background(lambda: post(system))
    request.start()
    system.wait_until("job running", busy(fake))
    system.wait_serving(system.worker("n1", "worker-survivor"))
    frozen.signal(signal.SIGSTOP)
    try:
        request.join(timeout=60)
    finally:
        frozen.signal(signal.SIGCONT)
    resp = request.result
    assert isinstance(resp, httpx.Response), resp
    assert resp.status_code == 200, (resp.text, system.logs())
    # The frozen worker wakes up and finishes its (taken over) copy: refused, nothing moves.
    system.wait_until("the frozen worker's call ended", lambda: fake.stats()["in_flight"] == 0, timeout=30)
    settled(system, "p")
    assert fake.stats()["total"] == 2


def test_an_entry_delivered_to_a_worker_that_does_not_run_it_is_handed_back(system: System) -> None:
    """What a failover that loses a worker's finish leaves: a node stream entry pending for a
    live worker that is not running it, and a lease nobody renews. The worker hands it back
    at a renewal instead of leaving the slot taken until the lease runs out."""
    system.write_config({
        # A long provider heartbeat TTL: the provider stays dispatchable while its worker is
        # stopped; a lease (6 s) long enough that expiring it would be a different path.
        "dispatch": fast_dispatch(6000, heartbeat_ttl_ms=8000),
        "models": [{"id": "m", "providers": {"p": "served"}}],
        "nodes": [{"id": "n1", "providers": [http_provider("p", "vllm", system.port("f"), 1, ["served"])]}],
    })
    system.fake("f", "--models", "served")
    worker = system.worker("n1")
    system.api()
    system.wait_available("p")
    assert post(system).status_code == 200  # the worker's consumer exists in the group
    consumer = system.worker_id(worker)

    worker.signal(signal.SIGSTOP)
    time.sleep(2.5)  # its blocked read (a third of a lease at most) has ended on the server
    request = Background(lambda: post(system))
    request.start()
    system.wait_until("dispatched", lambda: system.redis.xlen(keys.node("n1")) == 1)
    # Delivered to the worker's consumer, but never to the worker itself.
    stolen = system.redis.xreadgroup(keys.NODE_GROUP, consumer, {keys.node("n1"): ">"}, count=10)
    assert len(stolen[0][1]) == 1
    worker.signal(signal.SIGCONT)

    request.join(timeout=30)
    assert isinstance(request.result, httpx.Response), request.result
    assert request.result.status_code == 200, request.result.text
    logs = system.logs()
    assert "delivered here but not running" in worker.log(), logs
    assert "expired: requeued" not in logs  # handed back, not left to its lease
    settled(system, "p")


# --- 2. a worker is stopped -----------------------------------------------------------------


def test_sigterm_lets_running_jobs_finish_and_exits_zero(system: System) -> None:
    one_pool(system, capacity=2)
    fake = system.fake("f", "--models", "served")
    worker = system.worker("n1")
    system.api()
    system.wait_available("p")
    fake.control(delay_ms=1000)
    request = Background(lambda: post(system))
    request.start()
    system.wait_until("job running", busy(fake))
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    request.join(timeout=30)
    assert isinstance(request.result, httpx.Response)
    assert request.result.status_code == 200
    assert fake.stats()["total"] == 1
    # Nothing new goes to a draining worker's providers.
    assert system.provider("p")["health"] == "unavailable"
    settled(system, "p")


def test_sigterm_past_the_grace_period_hands_the_job_to_another_worker(system: System) -> None:
    one_pool(system)
    fake = system.fake("f", "--models", "served")
    leaving = system.worker("n1", "worker-leaving")
    system.api()
    system.wait_available("p")
    fake.control(delay_ms=8000)  # longer than drain_grace_s
    request = Background(lambda: post(system))
    request.start()
    system.wait_until("job running", busy(fake))
    fake.control(delay_ms=0)  # the second attempt is quick
    # Started now, so the first attempt surely ran on the leaving worker.
    system.wait_serving(system.worker("n1", "worker-staying"))
    leaving.signal(signal.SIGTERM)
    assert leaving.wait(timeout=30) == 0
    request.join(timeout=60)
    assert isinstance(request.result, httpx.Response)
    assert request.result.status_code == 200, request.result.text
    assert fake.stats()["total"] == 2
    settled(system, "p")


# --- 3. an API process is killed ----------------------------------------------------------------


def test_killed_api_process_jobs_are_cancelled_and_slots_freed(system: System) -> None:
    one_pool(system)
    fake = system.fake("f", "--models", "served")
    system.worker("n1")
    api = system.api("api-doomed")
    system.wait_available("p")
    fake.control(hang=True)
    running = Background(lambda: post(system))
    waiting = Background(lambda: post(system))
    running.start()
    system.wait_until("job running", busy(fake))
    waiting.start()
    system.wait_until("one job waiting", lambda: system.redis.zcard(keys.queue("m")) == 1)
    api.kill()
    # The running call is aborted upstream, the waiting one dropped, the slot freed.
    system.wait_until("upstream call aborted", lambda: fake.stats()["disconnected"] == 1, timeout=30)
    settled(system, "p")
    assert system.redis.zcard(keys.queue("m")) == 0
    for request in (running, waiting):
        request.join(timeout=10)
        assert isinstance(request.result, httpx.HTTPError)  # the connection died with the API


# --- 4. the client hangs up ------------------------------------------------------------------------


def _raw_request(system: System, body: dict[str, Any]) -> socket.socket:
    data = json.dumps(body).encode()
    port = int(system.api_url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_cancels_the_upstream_call(system: System, stream: bool) -> None:
    one_pool(system)
    fake = system.fake("f", "--models", "served", "--tokens", "50", "--token-interval-ms", "200")
    system.worker("n1")
    system.api()
    system.wait_available("p")
    if not stream:
        fake.control(hang=True)
    sock = _raw_request(system, {"model": "m", "messages": MESSAGES, "stream": stream})
    system.wait_until("provider generating", busy(fake))
    if stream:
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    sock.close()
    system.wait_until("upstream call closed", lambda: fake.stats()["disconnected"] == 1, timeout=10)
    settled(system, "p")
    assert fake.stats()["completed"] == 0


# --- 5. Redis goes away -----------------------------------------------------------------------------


def test_redis_outage_answers_503_then_recovers_without_restarts(tmp_path: Path) -> None:
    with RedisServer() as redis_server:
        system = System(tmp_path, redis_server)
        try:
            one_pool(system, capacity=2)
            system.fake("f", "--models", "served")
            worker = system.worker("n1")
            api = system.api()
            system.wait_available("p")
            assert post(system).status_code == 200

            redis_server.stop(kill=True)
            started = time.monotonic()
            resp = post(system, timeout=30)
            assert resp.status_code == 503
            assert resp.json()["error"]["code"] == "redis_unavailable"
            assert time.monotonic() - started < 10  # generous: it does not hang
            assert httpx.get(f"{system.api_url}/readyz").status_code == 503

            redis_server.start()  # back, and empty
            system.redis = type(system.redis).from_url(redis_server.url)
            system.wait_available("p")  # the worker registered its provider again
            system.wait_until("API ready again",
                              lambda: httpx.get(f"{system.api_url}/readyz").status_code == 200)
            resp = post(system)
            assert resp.status_code == 200, resp.text
            assert worker.alive()
            assert api.alive()
            settled(system, "p")
        finally:
            system.close()


def test_queued_jobs_survive_a_redis_restart_with_aof(tmp_path: Path) -> None:
    with RedisServer(appendonly=True) as redis_server:
        system = System(tmp_path, redis_server)
        try:
            one_pool(system)
            fake = system.fake("f", "--models", "served")
            system.worker("n1")
            system.api()
            system.wait_available("p")
            fake.control(delay_ms=2500)
            requests = [Background(lambda: post(system)) for _ in range(3)]
            requests[0].start()
            system.wait_until("job running", busy(fake))
            for request in requests[1:]:
                request.start()
            system.wait_until("two jobs waiting", lambda: system.redis.zcard(keys.queue("m")) == 2)
            time.sleep(1.2)  # appendfsync everysec
            redis_server.restart()
            system.redis = type(system.redis).from_url(redis_server.url)
            assert system.redis.zcard(keys.queue("m")) in (1, 2)  # one may have been dispatched
            fake.control(delay_ms=0)
            for request in requests:
                request.join(timeout=60)
                assert isinstance(request.result, httpx.Response), request.result
                assert request.result.status_code == 200, request.result.text
            settled(system, "p")
        finally:
            system.close()


# --- 6. the provider fails its probe or dies -------------------------------------------------------


def test_a_request_to_a_model_with_no_provider_up_is_answered_at_once(system: System) -> None:
    one_pool(system)
    fake = system.fake("f", "--models", "served")
    system.worker("n1")
    system.api()
    system.wait_available("p")
    fake.control(healthy=False)
    system.wait_until("provider marked unavailable", lambda: system.provider("p")["health"] == "unavailable",
                      timeout=10)
    started = time.monotonic()
    resp = post(system)
    # At once, not after queue_timeout_ms (30 s here); saying why, and when to come back.
    assert time.monotonic() - started < 5
    assert resp.status_code == 503, resp.text
    error = resp.json()["error"]
    assert error["code"] == "no_provider_available"
    assert error["message"].startswith("No provider of 'm' is available (p: ")
    assert "503" in error["message"]  # the probe's own words
    assert resp.headers["retry-after"] == "5"
    assert fake.stats()["total"] == 0
    settled(system, "p")


def test_a_waiting_request_is_answered_when_its_last_provider_goes_down(system: System) -> None:
    one_pool(system)
    fake = system.fake("f", "--models", "served")
    system.worker("n1")
    system.api()
    system.wait_available("p")
    fake.control(delay_ms=60_000)
    running = Background(lambda: post(system))
    running.start()
    system.wait_until("job running", busy(fake))
    waiting = Background(lambda: post(system))
    waiting.start()
    system.wait_until("job waiting", lambda: system.redis.zcard(keys.queue("m")) == 1)
    fake.control(healthy=False)
    waiting.join(timeout=20)
    assert isinstance(waiting.result, httpx.Response)
    assert waiting.result.status_code == 503
    assert waiting.result.json()["error"]["code"] == "no_provider_available"
    fake.control(delay_ms=0)
    running.join(timeout=90)


def test_a_model_that_holds_keeps_requests_until_its_provider_is_back(system: System) -> None:
    one_pool(system, queue={"max_queue": 50, "queue_timeout_ms": 30_000, "hold_when_unavailable_ms": 20_000})
    fake = system.fake("f", "--models", "served")
    system.worker("n1")
    system.api()
    system.wait_available("p")
    fake.control(healthy=False)
    system.wait_until("provider marked unavailable", lambda: system.provider("p")["health"] == "unavailable",
                      timeout=10)
    assert "503" in system.provider("p")["reason"]
    request = Background(lambda: post(system))
    request.start()
    system.wait_until("job waiting", lambda: system.redis.zcard(keys.queue("m")) == 1)
    assert fake.stats()["total"] == 0
    fake.control(healthy=True)
    request.join(timeout=30)
    assert isinstance(request.result, httpx.Response)
    assert request.result.status_code == 200
    settled(system, "p")


def test_provider_dying_mid_request_is_502_and_marked_unavailable(system: System) -> None:
    one_pool(system)
    fake = system.fake("f", "--models", "served")
    system.worker("n1")
    system.api()
    system.wait_available("p")
    fake.control(hang=True)
    request = Background(lambda: post(system))
    request.start()
    system.wait_until("job running", busy(fake))
    fake.proc.kill()
    request.join(timeout=30)
    assert isinstance(request.result, httpx.Response)
    assert request.result.status_code == 502
    assert request.result.json()["error"]["code"] == "provider_error"
    system.wait_until("provider marked unavailable", lambda: system.provider("p")["health"] == "unavailable",
                      timeout=10)
    settled(system, "p")


# --- 8. deadlines and overflow under load ---------------------------------------------------------


def test_overflow_and_deadlines_are_exact_under_load(system: System) -> None:
    timeout_ms = 1000
    one_pool(system, queue={"max_queue": 5, "queue_timeout_ms": timeout_ms}, timeout_s=20)
    fake = system.fake("f", "--models", "served")
    system.worker("n1")
    system.api()
    system.wait_available("p")
    fake.control(delay_ms=6000)
    first = Background(lambda: post(system))
    first.start()
    system.wait_until("slot taken", busy(fake))

    def timed() -> tuple[int, str, float]:
        started = time.monotonic()
        resp = post(system)
        return resp.status_code, resp.json()["error"]["code"], time.monotonic() - started

    crowd = [Background(timed) for _ in range(20)]
    for request in crowd:
        request.start()
    for request in crowd:
        request.join(timeout=60)
    results = [r.result for r in crowd]
    full = [r for r in results if r[0] == 429]
    timed_out = [r for r in results if r[0] == 503]
    assert len(full) == 15
    assert len(timed_out) == 5
    assert {r[1] for r in full} == {"queue_full"}
    assert {r[1] for r in timed_out} == {"queue_timeout"}
    for _, _, waited in timed_out:
        # Never before the deadline; after it by at most a reap interval plus generous slack.
        assert timeout_ms / 1000 <= waited < timeout_ms / 1000 + FAST["reap_interval_ms"] / 1000 + 3
    first.join(timeout=30)
    assert first.result.status_code == 200
    settled(system, "p")
