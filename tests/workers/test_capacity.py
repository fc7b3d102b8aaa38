"""The capacity controller (workers/capacity.py) on its own: what it makes of engine readings,
of latency, and of rate-limit answers, with time given by the test."""

from __future__ import annotations

import copy
import itertools

import pytest

from workers.capacity import (
    HOLD_CAP_S,
    HOLD_MAX_S,
    HOLD_S,
    TICK_S,
    CallSample,
    Change,
    FirstTokens,
    LimitController,
    RateLimits,
    reset_s,
    retry_after_s,
)
from workers.engine_metrics import EngineLoad


def engine(running: int, waiting: int, kv: float | None = None, at: float = 0.0, at_events: bool = False) -> EngineLoad:
    return EngineLoad(running=running, waiting=waiting, kv_usage=kv, at=at, at_events=at_events)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def step(self) -> float:
        self.now += TICK_S
        return self.now


def read(ctl: LimitController, now: float, running: int, waiting: int, kv: float | None = None) -> None:
    """Two readings of the engine in a tick, as the worker makes them (every 250 ms while busy)."""
    for at in (now - TICK_S / 2, now):
        ctl.note_engine(engine(running, waiting, kv, at=at))


def tick_on(ctl: LimitController, clock: Clock, in_flight: int, first: tuple[int, int], then: tuple[int, int],
            at_events: bool = False) -> Change | None:
    """A tick after two readings of (running, waiting), half a tick apart, with iop's
    ``in_flight`` there and a backlog waiting."""
    now = clock.step()
    ctl.note_in_flight(in_flight)
    ctl.note_engine(engine(*first, at=now - TICK_S / 2, at_events=at_events))
    ctl.note_engine(engine(*then, at=now, at_events=at_events))
    return ctl.tick(now, backlog=True, external=0)


def run_engine(ctl: LimitController, clock: Clock, batch: int, ticks: int, external: int = 0,
               kv_per_request: float | None = None) -> list[int]:
    """Ticks against an engine of ``batch`` slots that iop keeps full (a backlog waits):
    it runs min(total, batch) and queues the rest; the limits after each tick. With
    ``kv_per_request``, it reports that much KV use per running request."""
    limits = []
    for _ in range(ticks):
        now = clock.step()
        own = ctl.limit - external  # iop fills its share
        total = own + external
        ctl.note_in_flight(own)
        running = min(total, batch)
        read(ctl, now, running, max(total - batch, 0),
             None if kv_per_request is None else running * kv_per_request)
        ctl.tick(now, backlog=True, external=external)
        limits.append(ctl.limit)
    return limits


def test_it_starts_safe_and_rises_to_the_engine_s_batch_then_stays_near_it() -> None:
    clock = Clock()
    ctl = LimitController.starting(1, 64)
    assert ctl.limit == 2
    limits = run_engine(ctl, clock, batch=8, ticks=60)
    assert max(limits) <= 12  # slow start overshoots by at most its last step
    assert all(8 <= x <= 9 for x in limits[10:]), limits  # settled at the knee, or one above
    assert "engine queue" in ctl.reason or "engine queue 0" in ctl.reason


def test_it_follows_a_batch_that_shrinks_and_grows_again() -> None:
    clock = Clock()
    ctl = LimitController.starting(1, 64)
    run_engine(ctl, clock, batch=16, ticks=40)
    assert 16 <= ctl.limit <= 17
    limits = run_engine(ctl, clock, batch=4, ticks=12)
    assert limits[2] == 4  # a queue in every reading of a second: down to what the engine runs
    assert all(4 <= x <= 5 for x in limits[2:]), limits
    assert ctl.reason.startswith("engine queue")
    limits = run_engine(ctl, clock, batch=10, ticks=int(3 * HOLD_S / TICK_S))
    assert 10 <= limits[-1] <= 11


def tries(limits: list[int], knee: int) -> list[int]:
    """The ticks at which the limit went above ``knee`` from it."""
    return [i for i in range(1, len(limits)) if limits[i - 1] == knee < limits[i]]


def test_a_knee_found_again_is_tried_ever_more_seldom_until_the_engine_changes() -> None:
    """Each try above the knee sends a request into the engine's queue: from the same level
    the hold after it doubles, up to HOLD_MAX_S; a fall from another level starts afresh."""
    clock = Clock()
    ctl = LimitController.starting(1, 64)
    run_engine(ctl, clock, batch=2, ticks=20)  # slow start, and its first fall
    limits = run_engine(ctl, clock, batch=2, ticks=int(4 * HOLD_MAX_S / TICK_S))
    assert min(limits) == 2
    at = tries(limits, 2)
    gaps = [(b - a) * TICK_S for a, b in itertools.pairwise(at)]
    assert len(at) >= 3, limits
    assert all(later > earlier for earlier, later in itertools.pairwise(gaps) if earlier < HOLD_MAX_S), gaps
    assert HOLD_MAX_S <= gaps[-1] <= HOLD_MAX_S + 2, gaps
    # Without the doubling, a try every HOLD_S and the ticks of its fall.
    assert len(at) < len(limits) * TICK_S / (2 * HOLD_S), at
    # The engine's batch grows: found at the next try, then one slot per tick.
    limits = run_engine(ctl, clock, batch=6, ticks=int((HOLD_MAX_S + 10) / TICK_S))
    assert 6 <= limits[-1] <= 7, limits
    # It shrinks: down at once, and the next try after HOLD_S, not after the doubled hold.
    limits = run_engine(ctl, clock, batch=3, ticks=int(3 * HOLD_S / TICK_S))
    assert 3 in limits[:4], limits
    assert tries(limits, 3), limits

def test_a_batch_cap_found_twice_is_not_tried_again_for_a_long_while() -> None:
    """The engine queues with KV room for many more: its batch cap, which moves only with a
    restart. Found a second time, the next try waits HOLD_CAP_S, not the doubling hold."""
    clock = Clock()
    ctl = LimitController.starting(1, 64)
    run_engine(ctl, clock, batch=8, ticks=int(2 * HOLD_S / TICK_S), kv_per_request=0.03)
    limits = run_engine(ctl, clock, batch=8, ticks=int((HOLD_CAP_S - 3 * HOLD_S) / TICK_S), kv_per_request=0.03)
    assert "a batch cap" in ctl.reason
    assert len(tries(limits, 8)) <= 1, tries(limits, 8)  # the doubling hold alone would try 5 times
    assert all(x <= 9 for x in limits), limits
    limits = run_engine(ctl, clock, batch=8, ticks=int(4 * HOLD_S / TICK_S), kv_per_request=0.03)
    assert tries(limits, 8), limits  # tried again once the long hold is over
    # The engine restarts with a smaller batch: followed at once (a fall is never held).
    limits = run_engine(ctl, clock, batch=4, ticks=8, kv_per_request=0.03)
    assert 4 in limits[:4], limits


def test_an_engine_back_after_being_down_is_learned_afresh_not_held_to_its_old_cap() -> None:
    """A batch cap found twice holds tries off for HOLD_CAP_S; an engine that went down and
    came back is likely a new process (another --parallel, say): its bigger batch is found
    within seconds, not after the old one's hold."""
    clock = Clock()
    ctl = LimitController.starting(1, 64)
    run_engine(ctl, clock, batch=8, ticks=int(2 * HOLD_S / TICK_S), kv_per_request=0.03)
    run_engine(ctl, clock, batch=8, ticks=int(4 * HOLD_S / TICK_S), kv_per_request=0.03)
    assert "a batch cap" in ctl.reason
    held = copy.deepcopy(ctl)
    assert ctl.restarted() is None  # no slots reported: the limit stays where it is
    limits = run_engine(ctl, clock, batch=16, ticks=int(10 / TICK_S), kv_per_request=0.03)
    assert 16 <= limits[-1] <= 17, limits
    assert limits.index(16) * TICK_S < 10, limits  # slow start again: 8, 12, 18 and back
    # Without being told, the same controller waits out the cap's hold.
    assert max(run_engine(held, clock, batch=16, ticks=int(10 / TICK_S), kv_per_request=0.03)) <= 9
    # The same engine back (a blip): two tries above its knee, then the cap's long hold again.
    ctl.restarted()
    limits = run_engine(ctl, clock, batch=16, ticks=int(60 / TICK_S), kv_per_request=0.03)
    assert len(tries([16, *limits], 16)) == 2, limits  # slow start's step up, then one slot over
    assert all(x == 16 for x in limits[-int(50 / TICK_S):]), limits


def test_an_engine_back_with_other_slots_starts_from_them() -> None:
    ctl = LimitController.starting(1, 64, start=6)
    change = ctl.restarted(12)
    assert change is not None
    assert (change.old, change.new, ctl.limit) == (6, 12, 12)
    assert change.reason == "back after being down, its slots 12: 6 → 12"
    assert ctl.restarted(12) is None  # already there
    # Within its bounds, as ever.
    assert LimitController.starting(1, 8, start=6).restarted(12) == Change(
        6, 8, "back after being down, its slots 12: 6 → 8")


def test_a_knee_where_the_kv_is_full_is_no_batch_cap() -> None:
    """Where memory stops the engine (no room for another request beside the 8 it runs), the
    knee moves with the prompts: not held as a cap (the KV rule holds rises there)."""
    clock = Clock()
    ctl = LimitController.starting(1, 64, start=10)  # what it learned before: 2 over
    limits = run_engine(ctl, clock, batch=8, ticks=4, kv_per_request=0.118)
    assert limits[-1] == 8
    assert ctl.reason.startswith("engine queue 2 at 8 running: 10 → 8"), ctl.reason
    # The same engine with memory to spare: that is its batch cap.
    ctl = LimitController.starting(1, 64, start=10)
    reasons = []
    for _ in range(4):
        run_engine(ctl, clock, batch=8, ticks=1, kv_per_request=0.05)
        reasons.append(ctl.reason)
    assert "engine queue 2 at 8 running (its KV had room for 12 more: a batch cap): 10 → 8" in reasons, reasons


def test_load_iop_does_not_send_takes_its_share_not_the_limit() -> None:
    clock = Clock()
    ctl = LimitController.starting(1, 64)
    limits = run_engine(ctl, clock, batch=8, ticks=40, external=3)
    # The limit is the engine's (8 or 9); iop's share of it is 3 less.
    assert all(8 <= x <= 9 for x in limits[15:]), limits


def home_queue_ticks(ctl: LimitController, clock: Clock, batch: int, past: int, ticks: int) -> list[int]:
    """Ticks while iop keeps ``past`` requests beyond the limit there (hits in their home's
    queue), no backlog in iop: the engine runs min(total, batch) and queues the rest."""
    limits = []
    for _ in range(ticks):
        now = clock.step()
        total = ctl.limit + past
        ctl.note_in_flight(total)
        read(ctl, now, min(total, batch), max(total - batch, 0))
        ctl.tick(now, backlog=False, external=0)
        limits.append(ctl.limit)
    return limits


def test_a_home_queue_is_no_knee_but_shows_demand() -> None:
    clock = Clock()
    # The engine queues just iop's four past the limit: the limit holds where it is.
    ctl = LimitController.starting(1, 64, start=8)
    assert home_queue_ticks(ctl, clock, batch=8, past=4, ticks=20) == [8] * 20
    # The engine runs all of them: iop's requests past the limit were demand it could run.
    ctl = LimitController.starting(1, 64, start=8)
    limits = home_queue_ticks(ctl, clock, batch=12, past=4, ticks=30)
    assert limits[-1] > 8, limits
    # It slows to a batch of 5: a queue beyond iop's own four, and the limit falls to it.
    ctl = LimitController.starting(1, 64, start=8)
    limits = home_queue_ticks(ctl, clock, batch=5, past=4, ticks=6)
    assert limits[-1] == 5, limits
    assert ctl.reason.startswith("engine queue")


def test_a_full_kv_cache_holds_the_limit() -> None:
    clock = Clock()
    ctl = LimitController.starting(1, 64, start=6)
    for _ in range(10):
        now = clock.step()
        ctl.note_in_flight(6)
        read(ctl, now, 6, 0, kv=0.97)
        ctl.tick(now, backlog=True, external=0)
    assert ctl.limit == 6


def test_slow_start_goes_no_more_than_a_slot_past_what_the_kv_holds() -> None:
    """An engine of a wide batch whose KV holds 10 requests (9.2 under KV_FULL): each running
    request uses a tenth of it, and past 10 it queues. Slow start from 8 would try 12."""
    clock = Clock()
    ctl = LimitController.starting(1, 64, start=8)
    ctl.slow_start = True
    per_request, holds = 0.1, 10
    limits, reasons = [], []
    for _ in range(20):
        now = clock.step()
        ctl.note_in_flight(ctl.limit)
        running = min(ctl.limit, holds)
        read(ctl, now, running, ctl.limit - running, kv=running * per_request)
        ctl.tick(now, backlog=True, external=0)
        limits.append(ctl.limit)
        reasons.append(ctl.reason)
    assert limits[0] == 9, limits
    assert reasons[0] == "engine queue 0, every slot busy with more waiting (its KV holds about 9): 8 → 9"
    assert max(limits) <= 10, limits
    assert 9 <= limits[-1] <= 10, limits
    # A KV far from full leaves slow start its pace.
    ctl = LimitController.starting(1, 64, start=8)
    ctl.slow_start = True
    now = clock.step()
    ctl.note_in_flight(8)
    read(ctl, now, 8, 0, kv=0.2)
    assert ctl.tick(now, backlog=True, external=0) is not None
    assert ctl.limit == 12

def test_a_share_not_all_in_use_does_not_rise() -> None:
    clock = Clock()
    ctl = LimitController.starting(1, 64, start=4)
    for _ in range(10):
        now = clock.step()
        ctl.note_in_flight(3)
        read(ctl, now, 4, 0)  # the engine runs four: one is another client's, not iop's share
        ctl.tick(now, backlog=True, external=0)
    assert ctl.limit == 4


def test_a_full_share_the_engine_runs_unqueued_rises_without_a_backlog() -> None:
    """Routing sends a job to the provider least loaded for its limit: a provider whose small
    limit is full loses the next job to one with a slot free, and no backlog forms in iop.
    The engine's word that it runs the whole limit and queues nothing is the proof a rise
    needs; waiting for a backlog held a batch-4 server at 2 while the load went elsewhere.
    The rise stops where the share is no longer all in use, and falls at the engine's queue."""
    clock = Clock()
    ctl = LimitController.starting(1, 64)
    limits, reasons = [], []
    demand = 6  # iop's requests there at most, whatever the limit (the rest went elsewhere)
    for _ in range(40):
        now = clock.step()
        own = min(ctl.limit, demand)
        ctl.note_in_flight(own)
        running = min(own, 4)  # a batch of 4
        read(ctl, now, running, own - running)
        ctl.tick(now, backlog=False, external=0)
        limits.append(ctl.limit)
        reasons.append(ctl.reason)
    assert limits[:3] == [3, 4, 5], limits  # nothing waits for it: a slot at a time, no slow start
    assert reasons[0] == "engine queue 0, every slot busy: 2 → 3"
    assert max(limits) <= 6, limits
    assert all(4 <= x <= 5 for x in limits[10:]), limits  # at the knee, or trying one above
    # With only two of iop's requests there, a limit of four is never all in use.
    ctl = LimitController.starting(1, 64, start=4)
    for _ in range(10):
        now = clock.step()
        ctl.note_in_flight(2)
        read(ctl, now, 2, 0)
        ctl.tick(now, backlog=False, external=0)
    assert ctl.limit == 4


def test_bounds_hold() -> None:
    clock = Clock()
    ctl = LimitController.starting(3, 5)
    assert ctl.limit == 3
    run_engine(ctl, clock, batch=32, ticks=30)
    assert ctl.limit == 5
    run_engine(ctl, clock, batch=1, ticks=3)
    assert ctl.limit == 3


def test_a_stale_engine_reading_says_nothing() -> None:
    clock = Clock()
    ctl = LimitController.starting(1, 64, start=8)
    now = clock.step()
    ctl.note_in_flight(8)
    read(ctl, now - 10, 4, 9)
    ctl.tick(now, backlog=True, external=0)
    assert ctl.limit == 8


def test_a_queue_that_comes_and_goes_is_not_a_knee() -> None:
    # A request that arrives during a step waits for the next one: one reading of two shows it.
    clock = Clock()
    ctl = LimitController.starting(1, 64, start=6)
    for _ in range(10):
        tick_on(ctl, clock, 6, (5, 1), (5, 0))
    assert ctl.limit == 6  # no fall; and no rise without a reading that ran all six
    # One reading that ran all of them with nothing queued proves the limit: it rises.
    assert tick_on(ctl, clock, 6, (5, 1), (6, 0)) is not None
    assert ctl.limit > 6


@pytest.mark.parametrize("at_events", [True, False])
def test_gauges_set_at_events_are_taken_at_their_latest_word(at_events: bool) -> None:
    # A limit of 5 on a batch of 4. SGLang sets its gauges as a prefill batch forms -- the
    # queue's head has just left the queue: 3 running (those before it), none waiting -- and
    # every 40th decoding step, when iop's fifth waits: 4 running, 1 waiting. Readings of
    # gauges set at every step (vLLM) that alternated so would be a request arriving mid-step.
    clock = Clock()
    ctl = LimitController.starting(1, 64, start=5)
    for _ in range(6):
        tick_on(ctl, clock, 5, (3, 0), (4, 1), at_events)
    if at_events:
        assert ctl.limit == 4
        assert ctl.reason.startswith("engine queue 1 at 4 running")
    else:
        assert ctl.limit == 5


def test_gauges_set_at_events_whose_latest_word_is_no_queue_hold() -> None:
    clock = Clock()
    ctl = LimitController.starting(1, 64, start=5)
    assert tick_on(ctl, clock, 5, (4, 1), (3, 0), at_events=True) is None
    assert ctl.limit == 5


@pytest.mark.parametrize("at_events", [True, False])
def test_a_prefill_s_gauges_count_the_batch_before_it_joined(at_events: bool) -> None:
    # iop fills a limit of 4 and the engine queues nothing. SGLang's gauges, set as the prefill
    # of the fourth forms, say 3 running: the batch it joined. Gauges set at every step
    # (vLLM) that say 3 running are a fourth not there yet: no proof.
    clock = Clock()
    ctl = LimitController.starting(1, 64, start=4)
    change = tick_on(ctl, clock, 4, (3, 0), (3, 0), at_events)
    if at_events:
        assert change is not None
        assert ctl.limit == 5
    else:
        assert change is None
        assert ctl.limit == 4


@pytest.mark.parametrize("at_events", [True, False])
def test_a_limit_past_the_knee_that_demand_seldom_fills_falls_to_what_the_engine_runs(at_events: bool) -> None:
    # Slow start took a batch-16 engine's limit to 21; iop's demand puts 18 there and the
    # engine queues 2, its KV with room to spare. It runs 16 (SGLang's gauge, set as the
    # prefill of the 16th forms, says 15): the knee is 16, not 21 less the queue of 2.
    clock = Clock()
    ctl = LimitController.starting(1, 64, start=21)
    now = clock.step()
    ctl.note_in_flight(18)
    seen = 15 if at_events else 16
    for at in (now - TICK_S / 2, now):
        ctl.note_engine(engine(seen, 2, kv=0.5, at=at, at_events=at_events))
    change = ctl.tick(now, backlog=False, external=0)
    assert change is not None
    assert ctl.limit == 16
    # At half its KV, the engine had room for as many again.
    assert ctl.reason == f"engine queue 2 at {seen} running (its KV had room for {seen} more: a batch cap): 21 → 16"
    # Load another client sends is in what the engine holds too: 14 of iop's and 4 of its.
    ctl = LimitController.starting(1, 64, start=21)
    ctl.note_in_flight(14)
    for at in (now - TICK_S / 2, now):
        ctl.note_engine(engine(seen, 2, kv=0.5, at=at, at_events=at_events))
    ctl.tick(now, backlog=False, external=4)
    assert ctl.limit == 16


def test_a_stale_running_count_does_not_drag_the_limit_down() -> None:
    # SGLang's gauges, refreshed when a prefill batch forms, count what ran before it: a
    # queue of one at 2 "running" under a limit of 8 takes a slot off, not six.
    clock = Clock()
    ctl = LimitController.starting(1, 64, start=8)
    now = clock.step()
    ctl.note_in_flight(8)
    read(ctl, now, 2, 1)
    assert ctl.tick(now, backlog=True, external=0) is not None
    assert ctl.limit == 7


# --------------------------------------------------------------------------- latency only


def stream_call(ttft: float, tpot: float = 0.02, tokens: int = 64) -> CallSample:
    return CallSample(e2e_s=ttft + tpot * (tokens - 1), ttft_s=ttft, tokens=tokens)


def simulate_latency(ctl: LimitController, clock: Clock, batch: int, ticks: int, speed: float = 1.0,
                     service_s: float = 1.3) -> list[int]:
    """An engine without metrics: calls dispatched beyond its batch wait for a slot, which
    shows in their time to first token; ``speed``: a slowdown of everything (x3: 3.0)."""
    limits = []
    for _ in range(ticks):
        now = clock.step()
        ctl.note_in_flight(ctl.limit)
        queued = max(ctl.limit - batch, 0)
        for _ in range(4):
            wait = queued * service_s * speed / batch
            ctl.observe(stream_call((0.05 * speed) + wait, tpot=0.02 * speed))
        ctl.tick(now, backlog=True, external=0)
        limits.append(ctl.limit)
    return limits


def test_latency_alone_finds_the_knee() -> None:
    clock = Clock()
    ctl = LimitController.starting(1, 64)
    limits = simulate_latency(ctl, clock, batch=8, ticks=80)
    assert all(7 <= x <= 9 for x in limits[-40:]), limits
    assert "time to first token" in ctl.reason or "latency flat" in ctl.reason


def test_a_provider_slowed_down_as_a_whole_is_not_taken_for_a_queue() -> None:
    clock = Clock()
    ctl = LimitController.starting(1, 64)
    simulate_latency(ctl, clock, batch=8, ticks=60)
    before = ctl.limit
    limits = simulate_latency(ctl, clock, batch=8, ticks=40, speed=3.0)
    assert min(limits) >= before - 1, limits


def test_latency_rises_only_on_calls_that_showed_no_queue() -> None:
    clock = Clock()
    ctl = LimitController.starting(1, 64, start=4)
    for _ in range(10):
        now = clock.step()
        ctl.note_in_flight(4)
        ctl.tick(now, backlog=True, external=0)  # no calls finished: no evidence
    assert ctl.limit == 4


def test_json_calls_judge_by_time_per_token() -> None:
    clock = Clock()
    ctl = LimitController.starting(1, 64, start=8)
    for _ in range(5):
        now = clock.step()
        ctl.note_in_flight(8)
        for _ in range(4):
            ctl.observe(CallSample(e2e_s=1.0, ttft_s=None, tokens=50))
        ctl.tick(now, backlog=False, external=0)
    now = clock.step()
    for _ in range(4):
        ctl.observe(CallSample(e2e_s=3.5, ttft_s=None, tokens=50))
    ctl.tick(now, backlog=False, external=0)
    assert ctl.limit < 8
    assert ctl.reason.startswith("time per output token")


# --------------------------------------------------------------------------- rate limits


def test_a_429_pauses_for_its_retry_after() -> None:
    rl = RateLimits()
    assert rl.answered(429, {"Retry-After": "7"}, now=1000.0)
    assert rl.paused_until == pytest.approx(1007.0)
    assert "429" in rl.reason
    rl.answered(429, {"retry-after-ms": "1500"}, now=1000.0)
    assert rl.paused_until == pytest.approx(1007.0)  # the longer of the two stands


def test_429s_without_a_header_back_off() -> None:
    rl = RateLimits()
    rl.answered(429, {}, now=0.0)
    assert rl.paused_until == pytest.approx(1.0)
    rl.answered(429, {}, now=0.0)
    assert rl.paused_until == pytest.approx(2.0)
    rl.answered(200, {}, now=0.0)
    rl.answered(429, {}, now=10.0)
    assert rl.paused_until == pytest.approx(11.0)


def test_the_requests_left_in_the_window_cap_the_limit_until_its_reset() -> None:
    rl = RateLimits()
    rl.answered(200, {"x-ratelimit-remaining-requests": "3", "x-ratelimit-reset-requests": "6m0s"}, now=0.0)
    assert rl.limit(10, now=1.0) == 3
    assert rl.limit(10, now=361.0) == 10
    rl.answered(200, {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "20ms"}, now=5.0)
    assert rl.paused_until == pytest.approx(5.02)


def test_anthropic_headers_too() -> None:
    rl = RateLimits()
    rl.answered(200, {"anthropic-ratelimit-requests-remaining": "0",
                      "anthropic-ratelimit-requests-reset": "1970-01-01T00:00:30Z"}, now=10.0)
    assert rl.paused_until == pytest.approx(30.0)


@pytest.mark.parametrize(("raw", "seconds"), [("1s", 1.0), ("6m0s", 360.0), ("20ms", 0.02), ("1h2m3s", 3723.0),
                                              ("0.5", 0.5)])
def test_reset_durations(raw: str, seconds: float) -> None:
    assert reset_s({"x": raw}, 0.0, "x") == pytest.approx(seconds)


def test_retry_after_as_a_date() -> None:
    assert retry_after_s({"retry-after": "Thu, 01 Jan 1970 00:01:40 GMT"}, 40.0) == pytest.approx(60.0)
    assert retry_after_s({"retry-after": "soon"}, 0.0) is None


def test_longer_prompts_are_not_taken_for_a_queue_for_long() -> None:
    # The calls' ratio doubles for good (prompts four times as long): the limit falls once,
    # the calls do not ease, and their new level becomes the one to judge by.
    clock = Clock()
    ctl = LimitController.starting(1, 64, start=8)
    for _ in range(6):
        now = clock.step()
        ctl.note_in_flight(8)
        for _ in range(4):
            ctl.observe(stream_call(0.05))
        ctl.tick(now, backlog=False, external=0)
    limits = []
    for _ in range(30):
        now = clock.step()
        ctl.note_in_flight(ctl.limit)
        for _ in range(4):
            ctl.observe(stream_call(0.3))
        ctl.tick(now, backlog=False, external=0)
        limits.append(ctl.limit)
    assert min(limits) >= 7, limits


def test_first_tokens_read_an_engine_queue_off_iop_s_own_streams() -> None:
    ft = FirstTokens()
    now = 0.0
    # One call at a time: each found a slot free, its first token in ~0.2 s.
    for i in range(8):
        ft.started(i, now)
        ft.first_output(i, now + 0.2)
        ft.ended(i)
        now += 1.0
    assert ft.reading(now) is None  # nothing running
    assert ft.proven == 1
    for i in range(10, 14):
        ft.started(i, now)
    # Just started: in their prefill or queued, not yet known to run.
    assert ft.reading(now + 0.1) == EngineLoad(running=0, waiting=0, kv_usage=None, at=now + 0.1)
    for i in range(10, 12):
        ft.first_output(i, now + 0.2)
    # Two decoding, two still without a first token a second later: waiting in the engine.
    later = ft.reading(now + 1.0)
    assert later is not None
    assert (later.running, later.waiting) == (2, 2)
    assert ft.proven == 2
    # Only the first of the four found a slot proven free: the three behind it may have
    # waited for one, and are no measure of the unqueued level.
    assert len(ft.clean) == 9


def test_calls_that_may_have_waited_for_a_slot_do_not_set_the_unqueued_level() -> None:
    ft = FirstTokens()
    now = 0.0
    for i in range(8):  # two at a time, both decoding: two slots proven
        ft.started((i, "a"), now)
        ft.started((i, "b"), now)
        ft.first_output((i, "a"), now + 0.2)
        ft.first_output((i, "b"), now + 0.2)
        ft.ended((i, "a"))
        ft.ended((i, "b"))
        now += 1.0
    level = ft.overdue_after()
    assert level is not None
    assert level < 1.0
    # A burst of six with two slots proven: four may wait seconds for a slot.
    for i in range(6):
        ft.started(("burst", i), now)
    for i in range(2):
        ft.first_output(("burst", i), now + 0.2)
    for i in range(2, 6):
        ft.first_output(("burst", i), now + 5.0)
    assert ft.overdue_after() == level


def test_without_enough_unqueued_calls_first_tokens_say_nothing() -> None:
    ft = FirstTokens()
    ft.started("a", 0.0)
    assert ft.reading(10.0) is None
