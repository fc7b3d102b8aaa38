"""Scale on one machine (issue 6, item 2): 3 API processes, 2 nodes, 2 worker processes
on one of them, one Redis, 32 concurrent clients spread over the API processes.

Providers: n1 has p1 (capacity 3) and p2 (capacity 1), n2 has p3 (capacity 2); group
``pool`` is served by all three, group ``duo`` by p2 and p3 (so the two groups compete
for p2 and p3). Fake providers answer after a few ms, JSON and streams, so requests
overlap and queue.

Checked:

* every request gets exactly one successful answer, from a candidate of its group;
* every provider's in_flight, sampled from Redis in a tight loop, stays in
  [0, capacity], and some provider reaches its capacity; the fakes never see more than
  their capacity at once;
* FIFO across replicas and the lowest-ratio split, from the server's own record of what
  the scripts did (below).

How the dispatch history is rebuilt from ``MONITOR``
----------------------------------------------------
A thread records every command the server runs, from before the load until a marker
``ECHO`` after it. Scripts are atomic, so the commands a script runs (client ``lua``)
appear together and in execution order; the test replays them:

* ``ZADD {iop}:q:<model> <seq> <job>`` -- a job joins its group queue with its submit
  seq (``INCR {iop}:seq`` in ``submit``); ``ZREM {iop}:q:<model> <job>`` -- it leaves
  it. A job joining twice would be a requeue: none may happen here.
* ``HINCRBY {iop}:p:<p> in_flight +1/-1`` (dispatch / release), ``HSET ... in_flight``
  (``reconcile``) and ``HSETNX ... in_flight 0`` (``heartbeat``) -- each provider's
  in_flight over time, starting from 0 (the system is idle when the monitor starts).
* ``HSET {iop}:p:<p> ... health <h> ... hb_exp <ms> ... capacity <c>`` (``heartbeat``)
  -- whether ``pump`` could choose the provider: available, heartbeat not expired at
  the dispatch's time, capacity > 0.
* A dispatch is ``HINCRBY {iop}:p:<p> in_flight 1`` followed, in the same script, by
  ``XADD {iop}:n:<node> * j <job> f <fence> p <p> ... m <model> rep <replica> ...
  t1 <now> ... b <body>``. The state just before that ``HINCRBY`` is the state ``pump``
  chose from; ``t1`` is the ``now`` it compared heartbeats with; ``b`` is the request
  body, whose unique content ties the dispatch to the HTTP request.

From that: per group, the dispatched jobs' seqs increase strictly (and each dispatched
job was the head of its queue); at each dispatch the chosen provider was eligible and
not full, and every other eligible, not full candidate of the group had a ratio
in_flight/capacity at least as high -- compared exactly as integer cross-products, ties
to the lower in_flight, then the lower provider id; no other group had an older waiting
head with a free candidate (oldest head first); and the replayed in_flight never left
[0, capacity], ends at 0, and agrees with every value ``reconcile`` wrote.
"""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import anyio
import httpx
import pytest

from dispatcher import keys
from iop.redis_server import RedisServer
from tests.dispatcher.monitor import Command, MonitorRecorder
from tests.e2e.system import InFlightSampler, System, http_provider

pytestmark = pytest.mark.anyio

CAPACITY = {"p1": 3, "p2": 1, "p3": 2}
NODE_OF = {"p1": "n1", "p2": "n1", "p3": "n2"}
GROUPS = {"pool": ["p1", "p2", "p3"], "duo": ["p2", "p3"]}
APIS = ("api-1", "api-2", "api-3")
CLIENTS = 32
REQUESTS = 300


def served(model: str, pid: str) -> str:
    return f"{model}-on-{pid}"


@pytest.fixture
def system(tmp_path: object, redis_server: RedisServer) -> Iterator[System]:
    sys_ = System(tmp_path, redis_server)  # type: ignore[arg-type]
    sys_.write_config({
        "queue": {"max_queue": REQUESTS, "queue_timeout_ms": 120_000},
        "models": [{"id": m, "providers": {p: served(m, p) for p in ps}} for m, ps in GROUPS.items()],
        "nodes": [
            {"id": node, "providers": [
                http_provider(pid, "vllm", sys_.port(pid), CAPACITY[pid],
                              [served(m, pid) for m, ps in GROUPS.items() if pid in ps])
                for pid in CAPACITY if NODE_OF[pid] == node
            ]}
            for node in ("n1", "n2")
        ],
    })
    try:
        for pid in CAPACITY:
            sys_.fake(pid, "--delay-ms", "15", "--tokens", "3", "--token-interval-ms", "2")
        workers = [sys_.worker("n1", "worker-n1-a"), sys_.worker("n1", "worker-n1-b"), sys_.worker("n2", "worker-n2")]
        for name in APIS:
            sys_.api(name)
        sys_.wait_available(*CAPACITY)
        for w in workers:
            sys_.wait_serving(w)
        yield sys_
    finally:
        sys_.close()


# --- replaying the monitor stream -------------------------------------------------------------

@dataclass
class Prov:
    inf: int = 0
    cap: int = 0
    health: str = ""
    hb_exp: int = 0

    def eligible(self, now: int) -> bool:
        """What lua/lib/pump.lua's state() calls ok."""
        return self.health == "available" and self.hb_exp >= now and self.cap > 0


@dataclass
class Dispatch:
    job: str
    model: str
    provider: str
    replica: str
    tag: str  # the request's unique content
    now: int
    before: dict[str, Prov]  # every provider just before the dispatch's HINCRBY
    heads: dict[str, int | None]  # every group's oldest waiting seq, just before it


@dataclass
class History:
    seq: dict[str, int] = field(default_factory=dict)
    dispatches: list[Dispatch] = field(default_factory=list)
    in_flight_range: dict[str, tuple[int, int]] = field(default_factory=dict)
    final: dict[str, int] = field(default_factory=dict)
    requeues: list[str] = field(default_factory=list)
    reconciled: list[tuple[str, int, int]] = field(default_factory=list)  # (provider, replayed, written)
    increments: int = 0
    decrements: int = 0


def replay(commands: list[Command], initial: dict[str, dict[str, str]]) -> History:
    """``initial``: every provider hash, read after the monitor started and before the load."""
    provs = {
        p: Prov(int(h.get("in_flight", 0)), int(h.get("capacity", 0)), h.get("health", ""), int(h.get("hb_exp", 0)))
        for p, h in initial.items()
    }
    pkeys = {keys.provider(p): p for p in CAPACITY}
    qkeys = {keys.queue(m): m for m in GROUPS}
    queues: dict[str, dict[str, int]] = {m: {} for m in GROUPS}
    lo = dict.fromkeys(CAPACITY, 0)
    hi = dict.fromkeys(CAPACITY, 0)
    hist = History()
    entered: set[str] = set()  # jobs that were put in a queue
    pending: tuple[str, dict[str, Prov], dict[str, int | None]] | None = None

    def set_inf(pid: str, value: int) -> None:
        provs[pid].inf = value
        lo[pid] = min(lo[pid], value)
        hi[pid] = max(hi[pid], value)

    for cmd in commands:
        if not cmd.lua:
            pending = None
            continue
        name, a = cmd.name, cmd.args
        key = cmd.text(1) if len(a) > 1 else ""
        if key in qkeys:
            queue = queues[qkeys[key]]
            if name == "ZADD":
                seq, job = int(a[2]), cmd.text(3)
                if job in entered:
                    hist.requeues.append(job)
                entered.add(job)
                hist.seq.setdefault(job, seq)
                queue[job] = seq
            elif name == "ZREM":
                queue.pop(cmd.text(2), None)
        elif key == keys.JOBS and name == "HSET":
            # A job dispatched as its empty queue's head never enters it (lua/submit.lua):
            # its submit sequence is in its record.
            hist.seq.setdefault(cmd.text(2), int(json.loads(a[3])["seq"]))
        elif key in pkeys:
            pid = pkeys[key]
            if name == "HINCRBY" and cmd.text(2) == "in_flight":
                delta = int(a[3])
                if delta == 1:
                    heads = {m: min(q.values(), default=None) for m, q in queues.items()}
                    snapshot = {p: Prov(s.inf, s.cap, s.health, s.hb_exp) for p, s in provs.items()}
                    pending = (pid, snapshot, heads)
                    hist.increments += 1
                else:
                    assert delta == -1, cmd
                    hist.decrements += 1
                set_inf(pid, provs[pid].inf + delta)
            elif name == "HSET":
                fields = dict(zip(a[2::2], a[3::2], strict=True))
                if b"in_flight" in fields:
                    written = int(fields[b"in_flight"])
                    hist.reconciled.append((pid, provs[pid].inf, written))
                    set_inf(pid, written)
                if b"capacity" in fields:
                    provs[pid].cap = int(fields[b"capacity"])
                if b"health" in fields:
                    provs[pid].health = fields[b"health"].decode()
                if b"hb_exp" in fields:
                    provs[pid].hb_exp = int(fields[b"hb_exp"])
        elif name == "XADD" and key.startswith(keys.node("")):
            f = dict(zip(a[3::2], a[4::2], strict=True))
            assert pending is not None, f"a dispatch without its in_flight increment: {cmd}"
            pid, snapshot, heads = pending
            pending = None
            assert f[b"provider"].decode() == pid, cmd
            assert key == keys.node(NODE_OF[pid]), cmd
            body = json.loads(f[b"body"])
            hist.dispatches.append(Dispatch(
                job=f[b"job"].decode(), model=f[b"model"].decode(), provider=pid, replica=f[b"replica"].decode(),
                tag=body["messages"][0]["content"], now=int(f[b"dispatched_ms"]), before=snapshot, heads=heads,
            ))
    hist.final = {p: s.inf for p, s in provs.items()}
    hist.in_flight_range = {p: (lo[p], hi[p]) for p in CAPACITY}
    return hist


def beats(a: str, sa: Prov, b: str, sb: Prov) -> bool:
    """Does candidate a come before b under the lowest-ratio rule (exact, integer)?"""
    left, right = sa.inf * sb.cap, sb.inf * sa.cap
    return left < right or (left == right and (sa.inf < sb.inf or (sa.inf == sb.inf and a < b)))


def free(s: Prov, now: int) -> bool:
    return s.eligible(now) and s.inf < s.cap


# --- the test ---------------------------------------------------------------------------------

async def test_three_apis_two_nodes_fifo_and_lowest_ratio_split(system: System) -> None:
    urls = [f"http://127.0.0.1:{system.port(name)}" for name in APIS]
    rng = random.Random(6)
    plan = [(rng.choice(["pool", "pool", "duo"]), rng.random() < 0.5) for _ in range(REQUESTS)]
    tags = [f"scale-request-{i:04d}" for i in range(REQUESTS)]
    answers: dict[int, list[str]] = {i: [] for i in range(REQUESTS)}
    answered_by: dict[int, str] = {}

    monitor = MonitorRecorder(system.redis_server.url).begin()
    # The replay starts from this state: heartbeats rewrite it absolutely, so a heartbeat
    # recorded before this read changes nothing the load's dispatches see.
    initial = {p: system.provider(p) for p in CAPACITY}
    assert all(int(h["in_flight"]) == 0 for h in initial.values()), initial
    sampler = InFlightSampler(system, list(CAPACITY))
    sampler.start()

    async def one(client: httpx.AsyncClient, i: int) -> None:
        model, stream = plan[i]
        url = f"{urls[i % len(urls)]}/v1/chat/completions"
        body = {"model": model, "stream": stream, "messages": [{"role": "user", "content": tags[i]}]}
        if stream:
            async with client.stream("POST", url, json=body) as resp:
                text = (await resp.aread()).decode()
                ok = resp.status_code == 200 and text.endswith("data: [DONE]\n\n") and text.count("[DONE]") == 1
        else:
            resp = await client.post(url, json=body)
            ok = resp.status_code == 200 and resp.json()["model"] == model
        answers[i].append("ok" if ok else f"bad-{resp.status_code}")
        answered_by[i] = resp.headers.get("x-iop-provider", "?")

    todo = iter(range(REQUESTS))

    async def client_loop(client: httpx.AsyncClient) -> None:
        for i in todo:  # shared: each request is taken by exactly one of the clients
            await one(client, i)

    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    try:
        async with httpx.AsyncClient(timeout=120, limits=limits) as client, anyio.create_task_group() as tg:
            for _ in range(CLIENTS):
                tg.start_soon(client_loop, client)
    finally:
        sampler.stop_flag.set()
        sampler.join()
        system.redis.echo(monitor.marker)
        monitor.join(60)
    commands = monitor.end()

    # Every request got exactly one answer, a success, from a candidate of its group.
    assert Counter(tuple(v) for v in answers.values()) == Counter({("ok",): REQUESTS}), system.logs()
    for i, (model, _) in enumerate(plan):
        assert answered_by[i] in GROUPS[model], (i, model, answered_by[i])

    # Sampled in_flight within [0, capacity], and contention really happened.
    assert len(sampler.samples) > 10
    for sample in sampler.samples:
        for pid, value in sample.items():
            assert 0 <= value <= CAPACITY[pid], (pid, value)
    assert any(max(s[p] for s in sampler.samples) == CAPACITY[p] for p in CAPACITY), "no provider was ever full"
    for pid, cap in CAPACITY.items():
        stats = system.fakes[pid].stats()
        assert 1 <= stats["max_in_flight"] <= cap, (pid, stats)

    # --- the replayed history ---
    hist = replay(commands, initial)
    # One dispatch per request, no requeue, each to the provider that answered it.
    assert hist.requeues == []
    assert len(hist.dispatches) == REQUESTS
    by_tag = {d.tag: d for d in hist.dispatches}
    assert sorted(by_tag) == tags
    for i, tag in enumerate(tags):
        d = by_tag[tag]
        assert (d.model, d.provider) == (plan[i][0], answered_by[i]), (i, d)
    assert len({d.job for d in hist.dispatches}) == REQUESTS
    # The jobs really came from all three API processes.
    assert len({d.replica for d in hist.dispatches}) == len(APIS)

    # Replayed in_flight: within [0, capacity] all along, 0 at the end, reconcile agreed.
    for pid, (low, high) in hist.in_flight_range.items():
        assert low >= 0, (pid, low)
        assert high <= CAPACITY[pid], (pid, high)
    assert any(high == CAPACITY[p] for p, (_, high) in hist.in_flight_range.items())
    assert hist.final == dict.fromkeys(CAPACITY, 0)
    assert hist.increments == hist.decrements == REQUESTS
    assert [r for r in hist.reconciled if r[1] != r[2]] == []

    queued_somewhere = 0
    for model, candidates in GROUPS.items():
        mine = [d for d in hist.dispatches if d.model == model]
        assert mine, model
        # FIFO across replicas: dispatch order is submit order, and each was its queue's head.
        seqs = [hist.seq[d.job] for d in mine]
        assert all(a < b for a, b in itertools.pairwise(seqs)), (model, seqs)
        for d in mine:
            head = d.heads[model]
            assert head is None or head > hist.seq[d.job], (model, d, head)
            queued_somewhere += head is not None
        # The split: the chosen candidate beat every other free candidate of the group.
        for d in mine:
            chosen = d.before[d.provider]
            assert d.provider in candidates
            assert free(chosen, d.now), (d, chosen)
            for other in candidates:
                if other != d.provider and free(d.before[other], d.now):
                    assert beats(d.provider, chosen, other, d.before[other]), (model, d.provider, other, d.before)
        # Oldest head first: no other group had an older waiting job with a free candidate.
        for d in mine:
            for other_model, other_cands in GROUPS.items():
                head = d.heads[other_model]
                if other_model != model and head is not None and head < hist.seq[d.job]:
                    assert not any(free(d.before[p], d.now) for p in other_cands), (d, other_model, head)
    # Jobs really waited, and dispatches had a real choice: order and split were tested
    # under contention, not on an idle system.
    assert queued_somewhere > 0
    assert any(sum(free(d.before[p], d.now) for p in GROUPS[d.model]) > 1 for d in hist.dispatches)
