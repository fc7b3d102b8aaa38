"""Running one job (workers/job_run.py): the provider's call through a real HTTP adapter to
the project's fake provider (iop.fake_provider), and how the run ends -- which final event,
which finish mode, what its provider's health is told -- recorded by stand-ins for the
worker's Redis side and its provider state (the scripts themselves are tested in
tests/dispatcher, the whole path in tests/e2e)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from dispatcher import events
from dispatcher.config import parse
from dispatcher.events import Assignment, Done, End, Failed, Start
from dispatcher.exceptions import ProviderError
from dispatcher.live import LiveSample
from dispatcher.script_calls import EmitOutcome, FinishOutcome
from iop.fake_provider import FakeOptions, start
from iop.redis_server import free_port
from tests.waiting import EVENTUALLY_S, eventually
from workers.capacity import CallSample
from workers.job_run import JobRunner
from workers.leases import SHUTDOWN, Running, Runs
from workers.runtime import ProviderAdapters

pytestmark = pytest.mark.anyio

HOST = "127.0.0.1"
NODE = "n1"


@dataclass
class Finished:
    job: str
    event: events.Event | None
    mode: str
    tokens: int
    verdict: str = ""


class RecordingSide:
    """Stands in for ``WorkerSide``: the writes a run makes, and their answers."""

    def __init__(self, finish_failures: int = 0) -> None:
        self.finished: list[Finished] = []
        self.emitted: list[events.Event] = []
        self.later: list[bytes] = []
        self.finish_failures = finish_failures  # the next finishes fail as if Redis were away
        self.emit_outcome = EmitOutcome.OK

    async def emit(self, job: Assignment, event: bytes) -> EmitOutcome:
        self.emitted.append(events.decode(event))
        return self.emit_outcome

    async def chunks(self, job: Assignment, event: bytes) -> None:
        self.later.append(event)

    async def finish(self, job: Assignment, event: bytes | None, *, mode: str = "done", tokens: int = 0,
                     prompt: int = 0, cached: int = 0, verdict: str = "",
                     live: LiveSample | None = None) -> FinishOutcome:
        if self.finish_failures:
            self.finish_failures -= 1
            raise RedisConnectionError("Redis away")
        self.finished.append(Finished(job.job, events.decode(event) if event is not None else None, mode, tokens,
                                      verdict))
        return FinishOutcome.RELEASED


@dataclass
class RecordingProviders:
    """Stands in for ``ProviderState``: what the runs told of their providers."""

    told: list[tuple[str, str]] = field(default_factory=list)

    def answered(self, provider_id: str) -> None:
        self.told.append(("answered", provider_id))

    def call_failed(self, provider_id: str, exc: ProviderError) -> None:
        self.told.append(("call_failed", provider_id))

    def probe_now(self, provider_id: str) -> None:
        self.told.append(("probe_now", provider_id))


@dataclass
class RecordingCapacity:
    """Stands in for ``CapacityControl``: the calls the runs reported, with their samples."""

    samples: list[tuple[str, CallSample | None, int]] = field(default_factory=list)
    streams: list[str] = field(default_factory=list)

    def call_started(self, provider_id: str, key: object) -> None:
        self.streams.append(provider_id)

    def first_output(self, provider_id: str, key: object) -> None:
        pass

    def call_ended(self, provider_id: str, key: object) -> None:
        pass

    def called(self, provider_id: str, sample: CallSample | None, status: int, headers: dict[str, str]) -> None:
        self.samples.append((provider_id, sample, status))


@dataclass
class Runner:
    runner: JobRunner
    side: RecordingSide
    providers: RecordingProviders
    runs: Runs
    options: FakeOptions


@pytest.fixture
async def runner() -> AsyncIterator[Runner]:
    options = FakeOptions(models=["t"], tokens=3)
    port = free_port()
    fake = await start(HOST, port, options)
    config = parse({
        "models": [{"id": "m", "providers": {"p": "t"}}],
        "nodes": [{"id": NODE, "providers": [{"id": "p", "type": "openai_api", "base_url": f"http://{HOST}:{port}",
                                              "models": ["t"], "capacity": 2, "timeout_s": 10}]}],
        "dispatch": {"lease_ms": 3000},
    }).config
    adapters = ProviderAdapters()
    adapters.open(config.nodes[0])
    side = RecordingSide()
    providers = RecordingProviders()
    runs = Runs(keep_s=60)
    job_runner = JobRunner(side, NODE, adapters, runs, providers, config.dispatch.lease_ms)  # type: ignore[arg-type]
    try:
        yield Runner(job_runner, side, providers, runs, options)
    finally:
        await adapters.aclose()
        await fake.cleanup()


def chat_job(name: str = "j1", stream: bool = False, provider: str = "p", endpoint: str = "chat/completions",
             fence: int = 1, queued: bool = False) -> Assignment:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}).encode()
    return Assignment(entry_id="1-0", job=name, fence=fence, provider=provider, target="t", model="m", lane="",
                      replica="r1", endpoint=endpoint, stream=stream, attempt=1, submitted_ms=0, dispatched_ms=0,
                      body=body, queued=queued)



# --------------------------------------------------------------------------- answers


async def test_an_answer_is_finished_and_its_provider_told_it_answered(runner: Runner) -> None:
    with anyio.fail_after(EVENTUALLY_S):
        await runner.runner.run(chat_job())
    [finished] = runner.side.finished
    assert finished.job == "j1"
    assert finished.mode == "done"
    assert isinstance(finished.event, Done)
    assert finished.event.status == 200
    assert json.loads(finished.event.body)["choices"][0]["message"]["content"]
    assert finished.tokens == 3  # from the answer's usage
    assert finished.verdict == "ok"  # for the evidence finish keeps of its 5xx (lua/lib/evidence.lua)
    assert runner.providers.told == [("answered", "p")]
    assert len(runner.runs) == 0  # its run ended with it


async def test_a_stream_goes_out_as_it_comes_then_ends(runner: Runner) -> None:
    with anyio.fail_after(EVENTUALLY_S):
        await runner.runner.run(chat_job(stream=True))
    assert isinstance(runner.side.emitted[0], Start)  # the first output, through emit
    [finished] = runner.side.finished
    assert isinstance(finished.event, End)
    assert finished.mode == "done"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_call_sent_to_a_home_queue_is_no_latency_sample(runner: Runner, stream: bool) -> None:
    """A job sent past the provider's limit (to wait in its home's engine queue) waited there
    by design: the limit's controller hears of its answer, but not of its latency."""
    capacity = RecordingCapacity()
    runner.runner._capacity = capacity  # type: ignore[assignment]
    with anyio.fail_after(EVENTUALLY_S):
        await runner.runner.run(chat_job("within", stream=stream))
        await runner.runner.run(chat_job("queued", stream=stream, queued=True))
    [(_, within, status), (_, queued, queued_status)] = capacity.samples
    assert (status, queued_status) == (200, 200)
    assert isinstance(within, CallSample)
    assert queued is None
    # Its first token still tells the engine's queue where the engine reports none.
    assert capacity.streams == (["p", "p"] if stream else [])


# --------------------------------------------------------------------------- failures


@pytest.mark.parametrize("status", [500, 502, 503])
async def test_a_provider_5xx_fails_the_job_for_a_retry_and_is_evidence_not_a_verdict(runner: Runner,
                                                                                    status: int) -> None:
    runner.options.fail_status = status
    with anyio.fail_after(EVENTUALLY_S):
        await runner.runner.run(chat_job())
    [finished] = runner.side.finished
    assert isinstance(finished.event, Failed)
    assert finished.event.status == status
    assert finished.mode == "retry"  # no output yet: another provider of its lane may take it
    # The provider stays in rotation: the 5xx may be the request's fault; finish weighs it
    # with the evidence of other requests (lua/lib/evidence.lua).
    assert finished.verdict == str(status)
    assert runner.providers.told == []


async def test_a_provider_that_refuses_connections_leaves_at_once(runner: Runner) -> None:
    job = chat_job()
    adapter = runner.runner._adapters.for_job("p")
    assert adapter is not None
    adapter.root = f"http://{HOST}:{free_port()}"  # nothing listens there
    with anyio.fail_after(EVENTUALLY_S):
        await runner.runner.run(job)
    [finished] = runner.side.finished
    assert isinstance(finished.event, Failed)
    assert finished.mode == "retry"
    assert finished.verdict == ""  # out already: nothing for the evidence
    # Out of rotation at once; probed once the job released its slot.
    assert runner.providers.told == [("call_failed", "p"), ("probe_now", "p")]


async def test_a_provider_4xx_is_the_caller_business(runner: Runner) -> None:
    runner.options.fail_status = 400
    with anyio.fail_after(EVENTUALLY_S):
        await runner.runner.run(chat_job())
    [finished] = runner.side.finished
    assert isinstance(finished.event, Failed)
    assert finished.event.status == 400
    assert finished.mode == "done"
    assert finished.verdict == "ok"  # it answered: a 4xx says it works
    assert runner.providers.told == []


async def test_a_job_for_a_provider_not_here_fails_without_a_call(runner: Runner) -> None:
    with anyio.fail_after(EVENTUALLY_S):
        await runner.runner.run(chat_job(provider="elsewhere"))
    [finished] = runner.side.finished
    assert isinstance(finished.event, Failed)
    assert f"node {NODE} cannot run" in finished.event.message
    assert runner.providers.told == []


# --------------------------------------------------------------------------- aborts


async def test_a_job_cancelled_before_it_came_is_not_called(runner: Runner) -> None:
    runner.options.fail_status = 502  # a call would tell its provider it failed
    runner.runs.cancel("j1")
    with anyio.fail_after(EVENTUALLY_S):
        await runner.runner.run(chat_job())
    [finished] = runner.side.finished
    assert finished.event is None  # nothing to write: its client left
    assert finished.mode == "done"
    assert runner.providers.told == []


async def test_a_cancel_stops_a_running_call(runner: Runner) -> None:
    runner.options.hang = True
    with anyio.fail_after(EVENTUALLY_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(runner.runner.run, chat_job())
            await eventually(lambda: len(runner.runs) == 1)
            runner.runs.cancel("j1")
    [finished] = runner.side.finished
    assert finished.event is None
    assert finished.mode == "done"


async def test_a_job_given_up_at_shutdown_goes_back_to_its_queue(runner: Runner) -> None:
    runner.options.hang = True
    with anyio.fail_after(EVENTUALLY_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(runner.runner.run, chat_job())
            await eventually(lambda: len(runner.runs) == 1)
            runner.runs.abort_all(SHUTDOWN)
    [finished] = runner.side.finished
    assert finished.mode == "requeue"
    assert isinstance(finished.event, Failed)
    assert finished.event.code == "worker_lost"


async def test_a_stream_whose_client_left_ends_without_its_final_event(runner: Runner) -> None:
    runner.side.emit_outcome = EmitOutcome.CANCELLED
    with anyio.fail_after(EVENTUALLY_S):
        await runner.runner.run(chat_job(stream=True))
    [finished] = runner.side.finished
    assert finished.event is None
    assert runner.providers.told == []  # the provider did nothing wrong


# --------------------------------------------------------------------------- finishing


async def test_a_finish_waits_out_a_short_redis_outage(runner: Runner) -> None:
    runner.side.finish_failures = 3
    with anyio.fail_after(EVENTUALLY_S):
        await runner.runner.run(chat_job())
    [finished] = runner.side.finished
    assert isinstance(finished.event, Done)
    assert len(runner.runs) == 0


async def test_a_finish_is_left_to_the_lease_after_a_long_outage() -> None:
    side = RecordingSide(finish_failures=10**9)
    runs = Runs(keep_s=60)
    # A lease of 1 ms: the answer is held two of them, then left to the reaper.
    job_runner = JobRunner(side, NODE, ProviderAdapters(), runs,  # type: ignore[arg-type]
                           RecordingProviders(), lease_ms=1)  # type: ignore[arg-type]
    job = chat_job()
    with anyio.fail_after(EVENTUALLY_S):
        await job_runner.finish(Running(job), None, Failed(502, "x", "y"))
    assert side.finished == []


async def test_a_hand_back_requeues_the_job_unstarted(runner: Runner) -> None:
    with anyio.fail_after(EVENTUALLY_S):
        await runner.runner.hand_back(chat_job())
    [finished] = runner.side.finished
    assert finished.mode == "requeue"
    assert isinstance(finished.event, Failed)
    assert finished.event.code == "worker_lost"
    assert runner.providers.told == []
