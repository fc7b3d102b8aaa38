"""Redis SIGKILLed and restarted on the same port, with its AOF, while JSON and streamed
requests run on a slow provider -- real processes throughout.

The contract (docs/OPERATIONS.md, "Redis outages"): an outage shorter than two lease periods --
including one longer than ``replica_ttl_ms`` and one longer than a lease -- costs a
request that was already dispatched nothing but time: it is answered 200 (a stream
with every chunk, in order, then ``[DONE]``), the provider runs it exactly once, a
client that hangs up right after the outage (or during it) still stops its provider
call, no worker or API process dies, and afterwards every slot is back with no lease
left. Also when Redis is back for only a second between two such outages.

Also here, because they are about processes leaving the node stream's consumer group:
a job that Redis hands to a worker that is draining (SIGTERM) goes back at once to a
live worker, and a worker that exits gracefully leaves no consumer behind.

Every request carries a marker (its ``user`` field) and its own provider timings (the
fake provider's ``body_overrides``), and the fake provider logs each execution, so
"exactly once" is counted at the provider, per request.
"""

from __future__ import annotations

import json
import math
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from dispatcher import keys
from iop.redis_server import RedisServer
from tests.e2e.system import (
    Fake,
    Planned,
    Proc,
    System,
    answer_problem,
    fast_dispatch,
    http_provider,
    leftovers,
    redis_outage,
)

LEASE_MS = 3000
REPLICA_TTL_MS = 1500


def dispatch(lease_ms: int = LEASE_MS, **overrides: Any) -> dict[str, Any]:
    return fast_dispatch(lease_ms, **{"replica_ttl_ms": REPLICA_TTL_MS, "drain_grace_s": 5, **overrides})


# AOF flushes to the kernel before Redis answers, but appendfsync is everysec: leave the
# writes of the requests a second to reach the disk before Redis is killed.
FSYNC_S = 1.2


def configure(system: System, capacity: int = 16, **dispatch_overrides: Any) -> None:
    """Model 'm' on provider 'p' (node n1, fake 'f'); the provider timeout (60 s) is far
    beyond anything a test waits for, so it never ends a call."""
    system.write_config({
        "dispatch": dispatch(**dispatch_overrides),
        "queue": {"max_queue": 100, "queue_timeout_ms": 30_000},
        "models": [{"id": "m", "providers": {"p": "served"}}],
        "nodes": [{"id": "n1", "providers": [
            http_provider("p", "vllm", system.port("f"), capacity, ["served"], timeout_s=60)]}],
    })


def tracked_fake(system: System) -> Fake:
    fake = system.fake("f", "--models", "served")
    fake.hooks(track_executions=True, body_overrides=True)
    return fake


def assert_settled(system: System, providers: list[str], models: list[str], timeout: float = 30) -> None:
    try:
        system.wait_until("no slot, lease, queued job or job state left",
                          lambda: not any(leftovers(system, providers, models).values()), timeout=timeout)
    except TimeoutError:
        pytest.fail(f"left behind: {leftovers(system, providers, models)}\n{system.logs()}")


# --- requests and their checks -------------------------------------------------------------


class Background(threading.Thread):
    """One call run in a thread; ``result`` is its value or the exception it raised."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.result: Any = None
        self.finished_at: float | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except Exception as exc:
            self.result = exc
        finally:
            self.finished_at = time.monotonic()


def executions_by_marker(fake: Fake) -> Counter[str | None]:
    return Counter(e["marker"] for e in fake.executions())


# --- 1. outages of several lengths under JSON and streamed requests -----------------------------


def outage_plan(apis: list[str], outage_s: float) -> list[Planned]:
    """What runs at the provider across an outage that starts FSYNC_S after every request
    reached it: JSON answers ready during and after the outage; streams that run across
    it, that start during it, that start after it and that end during it."""
    kill, back = FSYNC_S, FSYNC_S + outage_s
    middle = (kill + back) / 2
    interval = 150
    across = math.ceil((back + 1.0) / (interval / 1000))
    ends_during = max(2, int((middle - 0.1) / (interval / 1000)))
    shapes = [
        ("json-answered-during", False, middle, 3, 0),
        ("json-answered-after", False, back + 0.8, 3, 0),
        ("stream-across", True, 0.1, across, interval),
        ("stream-starts-during", True, middle, 10, interval),
        ("stream-starts-after", True, back + 0.5, 8, 100),
        ("stream-ends-during", True, 0.1, ends_during, interval),
    ]
    return [
        Planned(f"{name}-{i}", api, stream, int(delay * 1000), tokens, interval_ms)
        for i, api in enumerate(apis)
        for name, stream, delay, tokens, interval_ms in shapes
    ]


@pytest.mark.parametrize(
    "outage_s",
    [
        pytest.param(LEASE_MS / 1000 / 5, id="under-a-third-of-a-lease"),  # 0.6 s
        pytest.param((REPLICA_TTL_MS + LEASE_MS) / 2000, id="over-replica-ttl-under-a-lease"),  # 2.25 s
        pytest.param(LEASE_MS / 1000 * 1.5, id="over-a-lease-under-two"),  # 4.5 s
    ],
)
def test_dispatched_requests_survive_a_redis_outage(aof_system: System, outage_s: float) -> None:
    system = aof_system
    configure(system)
    fake = tracked_fake(system)
    workers = [system.worker("n1", f"worker-{i}") for i in (1, 2)]
    apis = [system.api(f"api-{i}") for i in (1, 2)]
    system.wait_available("p")
    for worker in workers:
        system.wait_serving(worker)

    plan = outage_plan([system.api_url_of(a.name) for a in apis], outage_s)
    requests = [Background(planned.send) for planned in plan]
    for request in requests:
        request.start()
    system.wait_until("every request running at the provider", lambda: fake.stats()["in_flight"] == len(plan),
                      timeout=15)
    time.sleep(FSYNC_S)
    redis_outage(system, outage_s)

    for request in requests:
        request.join(timeout=90)
    problems = {p.marker: answer_problem(p, r.result) for p, r in zip(plan, requests, strict=True)}
    problems = {marker: problem for marker, problem in problems.items() if problem is not None}
    assert problems == {}, f"{json.dumps(problems, indent=1)}\n{system.logs()}"

    # The system still takes new work.
    after = Planned("after-the-outage", system.api_url_of("api-1"), True, 0, 4, 20)
    assert answer_problem(after, after.send()) is None

    executed = executions_by_marker(fake)
    assert executed == Counter({p.marker: 1 for p in [*plan, after]}), system.logs()
    assert [p.name for p in [*workers, *apis] if not p.alive()] == []
    assert_settled(system, ["p"], ["m"])


def after_next_reader_retry(api: Proc, earliest: float, latest: float) -> None:
    """Wait until ``earliest`` (monotonic), then until the API's reply reader next fails to
    reconnect (its log says so) -- its next try is then a whole backoff period away -- or
    until ``latest``."""
    time.sleep(max(0.0, earliest - time.monotonic()))
    seen = api.log().count("reading replies failed")
    while api.log().count("reading replies failed") == seen and time.monotonic() < latest:
        time.sleep(0.01)


def test_two_outages_in_quick_succession(aof_system: System) -> None:
    """Redis is back for one second between two outages; from the first going down to the
    second ending, less than two leases pass. The answers the workers write in that second
    are delivered, not given up as lost, and no dispatched request is answered 503.

    The schedule is adversarial: each outage ends right after the API's reply reader failed
    a reconnection attempt (so it does not read during that second, nor at once after the
    second outage), and the requests started a fifth of a second apart, so that some
    request's watchdog looks for its job inside that second (and finds it finished) and
    again right after the second outage."""
    system = aof_system
    up_s = 1.0
    configure(system)
    fake = tracked_fake(system)
    workers = [system.worker("n1", f"worker-{i}") for i in (1, 2)]
    api = system.api()
    system.wait_available("p")
    for worker in workers:
        system.wait_serving(worker)

    count, spacing = 16, 0.2
    kill_at = count * spacing + FSYNC_S  # from the first start
    ready_at = kill_at + 1.5  # every answer is ready during the first outage
    starts = [i * spacing for i in range(count)]
    plan = [Planned(f"{'stream' if i % 3 == 0 else 'json'}-{i}", system.api_url, i % 3 == 0,
                    int((ready_at - start) * 1000), 3, 50 if i % 3 == 0 else 0)
            for i, start in enumerate(starts)]
    requests = [Background(planned.send) for planned in plan]
    first = time.monotonic()
    for start, request in zip(starts, requests, strict=True):
        time.sleep(max(0.0, first + start - time.monotonic()))
        request.start()
    system.wait_until("every request running at the provider", lambda: fake.stats()["in_flight"] == len(plan),
                      timeout=15)
    time.sleep(max(0.0, first + kill_at - time.monotonic()))
    down = time.monotonic()
    system.redis_server.stop(kill=True)
    after_next_reader_retry(api, down + 3.0, down + 3.5)
    system.redis_server.start()
    time.sleep(up_s)
    system.redis_server.stop(kill=True)
    after_next_reader_retry(api, time.monotonic() + 0.3, down + 2 * LEASE_MS / 1000 - 0.5)
    system.redis_server.start()
    span = time.monotonic() - down
    system.redis.close()
    system.redis = Redis.from_url(system.redis_server.url)

    for request in requests:
        request.join(timeout=90)
    problems = {p.marker: answer_problem(p, r.result) for p, r in zip(plan, requests, strict=True)}
    problems = {marker: problem for marker, problem in problems.items() if problem is not None}
    assert problems == {}, f"Redis away {span:.1f}s in all\n{json.dumps(problems, indent=1)}\n{system.logs()}"
    assert executions_by_marker(fake) == Counter({p.marker: 1 for p in plan}), system.logs()
    assert [p.name for p in [*workers, api] if not p.alive()] == []
    assert_settled(system, ["p"], ["m"])


# --- 2. a client that hangs up as the outage ends (or during it) ----------------------------------


def open_raw(api_url: str, body: dict[str, Any]) -> socket.socket:
    """A request on a bare socket, so the test decides when the connection closes."""
    data = json.dumps(body).encode()
    port = int(api_url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize(
    ("outage_s", "hang_up_at"),
    [(0.6, "after"), (2.2, "after"), (2.2, "during")],
    ids=["short-outage", "over-replica-ttl", "hang-up-during-outage"],
)
def test_hang_up_at_the_end_of_an_outage_aborts_the_provider_call(
    aof_system: System, stream: bool, outage_s: float, hang_up_at: str
) -> None:
    system = aof_system
    configure(system, capacity=2)
    fake = tracked_fake(system)
    workers = [system.worker("n1")]
    api = system.api()
    system.wait_available("p")
    # A JSON answer that never comes; a stream that goes on for a minute.
    planned = Planned("hangs-up", system.api_url, stream, 600_000 if not stream else 0,
                      600 if stream else 1, 100 if stream else 0)
    sock = open_raw(system.api_url, planned.body())
    try:
        system.wait_until("provider running the request", lambda: fake.stats()["in_flight"] == 1, timeout=15)
        if stream:
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        time.sleep(FSYNC_S)
        if hang_up_at == "during":
            system.redis_server.stop(kill=True)
            time.sleep(outage_s / 2)
            sock.close()
            time.sleep(outage_s / 2)
            # Read before Redis is back: from then on the hang-up may (and should) end the call.
            survived = fake.stats()
            system.redis_server.start()
            system.redis.close()
            system.redis = Redis.from_url(system.redis_server.url)
        else:
            redis_outage(system, outage_s)
            survived = fake.stats()
    finally:
        sock.close()  # the moment Redis answers again (if still open)
    # The call went on through the outage: only the hang-up can end it now.
    assert (survived["in_flight"], survived["disconnected"]) == (1, 0), (survived, system.logs())

    # The provider timeout (60 s) and the stream's own length (60 s) are far away: the call
    # ending this soon is the hang-up's doing.
    try:
        system.wait_until("provider call aborted", lambda: fake.stats()["disconnected"] == 1, timeout=20)
    except TimeoutError:
        pytest.fail(f"the provider call outlived its client: {fake.stats()}\n{system.logs()}")
    assert fake.stats()["completed"] == 0
    assert executions_by_marker(fake) == Counter({"hangs-up": 1})
    assert_settled(system, ["p"], ["m"])
    assert [p.name for p in [*workers, api] if not p.alive()] == []


# --- 3. a job handed to a draining worker ---------------------------------------------------------


class CommandLog(threading.Thread):
    """Redis MONITOR in a thread: (server time, client kind, argv) of every command, those run
    by scripts included."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.monitor = Redis.from_url(url).monitor()
        self.entries: list[tuple[float, str, list[str]]] = []

    def start(self) -> None:
        self.monitor.__enter__()  # MONITOR is on once this returns
        super().start()

    def run(self) -> None:
        try:
            for command in self.monitor.listen():
                self.entries.append((float(command["time"]), command["client_type"], command["command"].split(" ")))
        except Exception:  # closed
            return

    def close(self) -> None:
        self.monitor.__exit__()
        self.join(timeout=5)

    def reads(self) -> list[tuple[float, str]]:
        """(when, consumer) of every blocking XREADGROUP for new entries."""
        return [(t, argv[3]) for t, _, argv in list(self.entries)
                if argv[:1] == ["XREADGROUP"] and "BLOCK" in argv and argv[-1] == ">"]

    def reads_of(self, consumer: str) -> list[float]:
        return [t for t, c in self.reads() if c == consumer]

    def dispatches(self, node_key: str) -> list[float]:
        """When a script appended to a node stream (a dispatch)."""
        return [t for t, kind, argv in list(self.entries) if kind == "lua" and argv[:2] == ["XADD", node_key]]


def test_job_delivered_to_a_draining_worker_goes_back_at_once(tmp_path: Path, redis_server: RedisServer) -> None:
    lease_ms = 6000
    block_s = 2.0  # a worker's XREADGROUP blocks min(2 s, a third of a lease) on the server
    system = System(tmp_path, redis_server)
    log: CommandLog | None = None
    try:
        configure(system, capacity=2, lease_ms=lease_ms, drain_grace_s=20)
        fake = tracked_fake(system)
        leaving = system.worker("n1", "worker-leaving")
        api = system.api()
        system.wait_available("p")
        system.wait_serving(leaving)
        # A long job keeps the leaving worker alive (draining) through the whole scenario.
        long_job = Planned("long", system.api_url, False, 12_000, 2)
        long_request = Background(long_job.send)
        long_request.start()
        system.wait_until("long job running on the leaving worker", lambda: fake.stats()["in_flight"] == 1)
        staying = system.worker("n1", "worker-staying")
        system.wait_serving(staying)
        leaving_id = system.worker_id(leaving)

        log = CommandLog(redis_server.url)
        log.start()
        # Freeze the staying worker until its own blocked read has timed out on the server:
        # then the leaving worker is the only consumer Redis can hand a new entry to.
        staying.signal(signal.SIGSTOP)
        try:
            time.sleep(block_s + 0.4)
            # SIGTERM right after the leaving worker starts a fresh blocked read, so that
            # read stays open on the server for close to block_s after the signal.
            seen = len(log.reads_of(leaving_id))
            system.wait_until("the leaving worker blocks on a fresh read",
                              lambda: len(log.reads_of(leaving_id)) > seen, timeout=10)
            term_at = time.time()
            leaving.signal(signal.SIGTERM)
            system.wait_until("the leaving worker draining", lambda: "draining" in leaving.log(), timeout=5)
            submitted = time.monotonic()
            job = Planned("handed-back", system.api_url, False, 0, 2)
            request = Background(job.send)
            request.start()
        finally:
            # Its next heartbeat makes the provider available again and dispatches the job.
            staying.signal(signal.SIGCONT)
        request.join(timeout=60)
        answered_after = (request.finished_at or time.monotonic()) - submitted

        # The scenario happened: at the dispatch, the leaving worker's read was the oldest
        # one still blocked on the server, so Redis delivered the entry to it.
        after_term = [t for t in log.dispatches(keys.node("n1")) if t > term_at]
        assert after_term, f"the job was never dispatched\n{system.logs()}"
        dispatched_at = after_term[0]
        blocked = sorted((t, c) for t, c in log.reads() if dispatched_at - block_s < t < dispatched_at)
        oldest = blocked[0][1] if blocked else None
        assert oldest == leaving_id, (
            f"scenario not reached: reads blocked at the dispatch {blocked}, leaving worker {leaving_id}")

        assert answer_problem(job, request.result) is None, (request.result, system.logs())
        # Handed back at once, not when its lease runs out (the long job still holds the
        # leaving worker for seconds more).
        assert answered_after < lease_ms / 1000 / 2, (answered_after, system.logs())
        long_request.join(timeout=30)
        assert answer_problem(long_job, long_request.result) is None
        assert leaving.wait(timeout=30) == 0
        assert executions_by_marker(fake) == Counter({"long": 1, "handed-back": 1})
        assert_settled(system, ["p"], ["m"])
        assert staying.alive()
        assert api.alive()
    finally:
        if log is not None:
            log.close()
        system.close()


# --- 4. a worker that exits leaves the consumer group ---------------------------------------------


def consumers(system: System, node: str) -> dict[str, int]:
    """Consumer name -> pending entries, of the node stream's group."""
    return {c["name"].decode() if isinstance(c["name"], bytes) else c["name"]: int(c["pending"])
            for c in system.redis.xinfo_consumers(keys.node(node), keys.NODE_GROUP)}


def test_gracefully_stopped_worker_leaves_the_consumer_group(tmp_path: Path, redis_server: RedisServer) -> None:
    system = System(tmp_path, redis_server)
    try:
        configure(system, capacity=2)
        fake = tracked_fake(system)
        worker = system.worker("n1")
        system.api()
        system.wait_available("p")
        system.wait_serving(worker)
        old_id = system.worker_id(worker)
        # Redis adds a consumer to the group when it first hands it an entry.
        first = Planned("first", system.api_url, False, 0, 2)
        assert answer_problem(first, first.send()) is None
        assert consumers(system, "n1") == {old_id: 0}

        # Stopped while a job runs: the job finishes within the grace period, then the worker exits.
        job = Planned("during-drain", system.api_url, True, 500, 3, 100)
        request = Background(job.send)
        request.start()
        system.wait_until("job running", lambda: fake.stats()["in_flight"] == 1)
        worker.signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0
        request.join(timeout=30)
        assert answer_problem(job, request.result) is None
        # Gone as the process exits, not after some idle period.
        assert consumers(system, "n1") == {}, worker.log()

        worker.start()
        system.wait_until("the restarted worker serving", lambda: system.worker_id(worker) != old_id)
        new_id = system.worker_id(worker)
        system.wait_available("p")
        second = Planned("second", system.api_url, False, 0, 2)
        assert answer_problem(second, second.send()) is None
        assert consumers(system, "n1") == {new_id: 0}
        assert_settled(system, ["p"], ["m"])
    finally:
        system.close()
