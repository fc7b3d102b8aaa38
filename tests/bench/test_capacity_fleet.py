"""bench/capacity_fleet.py's pure logic: each server's nominal capacity from the cost model,
the traces, goodput with unanswered requests, the goals' verdicts, how a limit's moving and
settling is read from its samples, and the iop configs it writes (checked by iop's own
config parser). Nothing here starts a fleet or times anything."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest

from bench import capacity_fleet as cf
from bench.fleet_sim import SimConfig
from bench.prefix_fleet import MODEL, UNANSWERED, Result, Run, make_trace
from dispatcher import config as cfg

SEED = "test-30"


def mean_prompt_tokens() -> float:
    sample = make_trace(cf.W, "unique", 20.0, 50.0, SEED, 16)  # what nominal_capacity samples
    return sum(a.prompt_tokens for a in sample) / len(sample)


def test_each_server_has_the_capacity_of_its_own_costs() -> None:
    prompt = mean_prompt_tokens()
    rates = cf.server_rates(cf.HETERO, cf.W, "unique", SEED)
    for sim, rate in zip(cf.HETERO, rates, strict=True):
        b = sim.max_batch  # the KV holds every server's whole batch
        ms = sim.prefill_ms_per_token * prompt + 63 * (sim.step_ms + sim.decode_ms_per_seq * b) / b
        assert rate == pytest.approx(1000 / ms)
    assert rates[0] > rates[1] > rates[2]  # batches 8/4/2 on ever slower steps


def test_a_server_whose_kv_holds_fewer_requests_runs_fewer() -> None:
    prompt = mean_prompt_tokens()
    blocks = math.ceil((prompt + cf.W.output_tokens) / 16)
    small = replace(cf.HETERO[0], kv_blocks=2 * blocks + 1)  # room for 2 of its 8
    (rate,) = cf.server_rates([small], cf.W, "unique", SEED)
    ms = small.prefill_ms_per_token * prompt + 63 * (small.step_ms + small.decode_ms_per_seq * 2) / 2
    assert rate == pytest.approx(1000 / ms)


def test_traces_offer_their_rate_and_differ_by_seed() -> None:
    mine = make_trace(cf.W, "unique", 2.5, 20.0, SEED, 16)
    other = make_trace(cf.W, "unique", 2.5, 20.0, SEED + "-external", 16)
    assert len(mine) == len(other) == 50
    assert all(0 <= a.at < 20.0 for a in mine)
    assert [a.at for a in mine] == sorted(a.at for a in mine)
    assert mine == make_trace(cf.W, "unique", 2.5, 20.0, SEED, 16)  # the same for every target
    assert {a.body for a in mine}.isdisjoint({a.body for a in other})
    assert msgspec.json.decode(mine[0].body)["model"] == MODEL


def run_of(results: list[Result], warmup: float = 2.0, window: float = 10.0) -> Run:
    return Run("t", "t", results, window=window, warmup=warmup)


def test_goodput_counts_answers_within_the_slo_of_the_window() -> None:
    run = run_of([
        Result(1.0, 0.1, 2.0, 200),  # in the warm-up: not counted
        Result(3.0, 0.5, 4.0, 200),  # good
        Result(4.0, 1.5, 6.0, 200),  # answered, too late
        Result(5.0, math.inf, math.inf, UNANSWERED),
        Result(6.0, math.inf, 6.1, 503),
        Result(7.0, 0.9, 8.0, 200),  # good
        Result(8.0, 0.2, math.inf, UNANSWERED),  # its first token came, its end did not: not good
    ])
    assert run.goodput(1.0) == pytest.approx(2 / 10)
    assert cf.unanswered(run) == 2
    assert cf.errors(run) == 1
    assert cf.ttfts_ms(run) == [500.0, 1500.0, math.inf, math.inf, 900.0, 200.0]


def test_the_best_fixed_setting_and_the_hetero_verdicts() -> None:
    goodput = {"iop-batch": 2.0, "iop-16": 2.5, "rr": 3.0, "iop-auto": 2.45, "iop-auto-latency": 2.2}
    assert cf.best_fixed(goodput) == ("iop-16", 2.5)  # rr is not a fixed capacity of iop's
    assert cf.best_fixed({"rr": 1.0}) is None
    rows = cf.hetero_goals(1.0, goodput, {name: 0 for name in goodput})
    assert rows[0][2].startswith("**met**: 2.45 req/s, 98% of the best fixed setting, iop-16")
    assert rows[1][2].startswith("**missed**: 2.20 req/s, 88%")
    lost = cf.hetero_goals(1.0, goodput, {**{name: 0 for name in goodput}, "iop-auto": 3})
    assert lost[0][2].startswith("**missed**")  # ahead on goodput, but it left requests unanswered
    shed = cf.hetero_goals(1.0, goodput, {name: 0 for name in goodput}, {"iop-auto": 12})
    assert shed[0][2].startswith("**met**")  # a refusal is an answer: nothing left unanswered
    assert shed[0][2].endswith("lost 0, refused 12")
    absent = cf.hetero_goals(0.8, {"iop-batch": 2.0}, {"iop-batch": 0})
    assert absent[0][2] == "not measured (the best fixed setting, iop-batch: 2.00 req/s)"


def test_shape_verdicts_want_the_better_fixed_on_both_and_the_router_on_goodput() -> None:
    fixed = {"iop-batch": (10.0, 0.60), "iop-4x": (11.0, 0.55)}
    met = cf.shape_goals("s", {**fixed, "iop-auto": (11.0, 0.60), "sglang-router": (10.5, 0.7)})
    assert met[0][2].startswith("**met**")
    assert cf.shape_goals("s", {**fixed, "iop-auto": (11.5, 0.58)})[0][2].startswith("**missed**")
    assert cf.shape_goals("s", {**fixed, "iop-auto": (11.5, 0.6), "sglang-router": (12.0, 0.7)})[0][2].startswith(
        "**missed**")
    assert cf.shape_goals("s", fixed)[0][2].startswith("not measured")


def test_the_external_goal_is_judged_against_the_blind_fixed_capacities() -> None:
    p90 = {"iop-batch-blind": 2000.0, "iop-batch": 900.0, "iop-auto": 1000.0}
    met = cf.external_goal(p90, {"iop-auto": 0})
    assert "**met** against the blind fixed capacities" in met
    assert "0.50x iop-batch-blind's" in met
    assert "1.11x iop-batch's" in met
    assert "**missed**" in cf.external_goal(p90, {"iop-auto": 2})  # it lost requests
    assert "**missed**" in cf.external_goal({**p90, "iop-auto": 1500.0}, {"iop-auto": 0})
    assert cf.external_goal({"iop-batch": 900.0}, {}).startswith("**Goal** (auto's TTFT p90 ≤ 0.7x the fixed "
                                                                  "capacities', nothing lost): not measured")



def test_external_pools_the_requests_of_its_repeats() -> None:
    target = cf.make_target("iop-auto", cf.HETERO, cf.parse_args([]), Path("/tmp"))
    stats = [{"steps": 100, "late_steps": 1}]

    def measured(ttfts_s: list[float], late: int) -> cf.Measured:
        iop = Run("t", "t", [Result(3.0 + i, t, 9.0 + i, 200) if t < math.inf else
                             Result(3.0 + i, t, t, UNANSWERED) for i, t in enumerate(ttfts_s)], window=10.0,
                  warmup=2.0, server_stats=[{"steps": 100, "late_steps": late}])
        other = Run("o", "o", [Result(3.0, 0.1, 4.0, 200), Result(4.0, math.inf, math.inf, UNANSWERED)],
                    window=10.0, warmup=2.0, server_stats=stats)
        return cf.Measured(target, runs={"iop": iop, "other": other}, final={"p0": 8}, seconds=10.0)

    # Two runs of ten requests: each run's p90 is its 9th slowest, the pooled one the 18th of 20.
    first = measured([0.1 * k for k in range(1, 11)], late=1)  # 0.1 .. 1.0 s
    second = measured([0.05 * k for k in range(1, 10)] + [math.inf], late=3)  # one never answered
    row, p90, lost = cf.external_row("auto", [first, second], 1.0, 2.0, per_run=True)
    pooled = sorted(cf.ttfts_ms(first.runs["iop"]) + cf.ttfts_ms(second.runs["iop"]))
    assert p90 == pooled[17] == 900.0
    assert lost == 1  # the second run's unanswered request
    assert row[0] == "auto"
    assert row[1] == f"{(1.0 + 0.9) / 2:.2f}"  # the runs' mean goodput: 10 and 9 good of 10 s each
    assert row[3] == "900"  # the pooled p90
    assert row[5] == "900 / 450"  # each run's own
    assert row[6] == "1"
    assert row[8] == "2"  # the other client's unanswered, one per run
    assert row[9] == "8"  # the last run's limits
    assert row[10] == "3.0%"  # the worst run's late steps
    alone, p90_alone, _ = cf.external_row("auto", [first], 1.0, 2.0)
    assert len(alone) == len(row) - 1  # no column of each run's p90
    assert p90_alone == 900.0
    with pytest.raises(SystemExit):
        cf.parse_args(["--repeat", "0"])

def test_the_blind_baseline_is_capacity_batch_with_the_servers_metrics_off() -> None:
    target = cf.make_target("iop-batch-blind", cf.HETERO, cf.parse_args([]), Path("/tmp"))
    assert isinstance(target, cf.CapacityIop)
    assert target.metrics_off
    assert target.settings == [{"capacity": s.max_batch} for s in cf.HETERO]
    assert "servers' metrics off" in target.label
    assert not cf.make_target("iop-batch", cf.HETERO, cf.parse_args([]), Path("/tmp")).metrics_off  # type: ignore[attr-defined]


def test_a_run_with_load_shedding_has_its_own_docs_section() -> None:
    assert cf.section_of(cf.parse_args([]), "hetero") == "capacity-hetero"
    shed = cf.parse_args(["--queue", '{"refuse_predicted_over_ms": 700}'])
    assert cf.section_of(shed, "shapes") == "capacity-shapes-shed"
    assert cf.section_of(cf.parse_args(["--queue", '{"max_queue": 10}']), "shapes") == "capacity-shapes"


def test_a_limit_is_read_for_when_it_moved_and_settled() -> None:
    series = [(0.0, 8), (5.0, 8), (10.0, 8), (10.5, 8), (11.0, 6), (12.0, 4), (13.0, 5), (14.0, 3), (15.0, 3),
              (20.0, 3), (25.0, 3)]
    assert cf.value_at(series, 10.2) == 8
    assert cf.value_at(series, -1.0) is None
    assert cf.first_move(series, 10.0) == pytest.approx(1.0)
    # Ends at 3: within ±25% (2.25-3.75) from 14 s on; the 5 at 13 s was outside.
    assert cf.settled_after(series, 10.0) == (pytest.approx(4.0), 3)
    assert cf.first_move([(0.0, 8), (20.0, 8)], 10.0) is None
    assert cf.settled_after([(0.0, 4), (11.0, 4), (12.0, 8)], 10.0)[0] is None  # still moving at the end


def test_limits_show_the_end_and_the_window() -> None:
    m = cf.Measured(cf.RoundRobin(), samples=[(1.0, {"p0": 2, "p1": 4}), (5.0, {"p0": 6, "p1": 4}),
                                              (9.0, {"p0": 5, "p1": 4})], final={"p0": 5, "p1": 4})
    assert cf.limits(m) == "5/4 (window 2-6/4)"
    assert cf.limits(m, after=4.0) == "5/4 (window 5-6/4)"
    assert cf.limits(cf.Measured(cf.RoundRobin())) == "-"
    assert cf.limits(cf.Measured(cf.RoundRobin(), final={"p0": 3})) == "3"  # nothing sampled


def test_iop_configs_are_iops_own_and_carry_each_providers_settings() -> None:
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"]
    settings = cf.settings_for("iop-batch", cf.HETERO, 16, cf.AUTO_PROVIDER)
    config = cf.fleet_config(urls, cf.HETERO, settings, {"mode": "prefix"}, tenants=cf.TENANTS)
    parsed = cfg.parse(config).config  # what iop itself reads
    providers = [p for node in parsed.nodes for p in node.providers]
    assert [(p.type, p.capacity, p.base_url) for p in providers] == [
        ("vllm", 8, urls[0]), ("sglang", 4, urls[1]), ("vllm", 2, urls[2])]
    assert parsed.models[0].affinity is not None
    assert [k.name for k in parsed.api.keys] == list(cf.TENANTS)
    assert [s["capacity"] for s in cf.settings_for("iop-4x", cf.HETERO, 16, cf.AUTO_PROVIDER)] == [32, 16, 8]
    assert [s["capacity"] for s in cf.settings_for("iop-16", cf.HETERO, 16, cf.AUTO_PROVIDER)] == [16] * 3
    auto = cf.settings_for("iop-auto", cf.HETERO, 16, {"capacity": "auto", "max_capacity": 64})
    assert auto == [{"capacity": "auto", "max_capacity": 64}] * 3
    assert cf.fleet_config(urls, cf.HETERO, auto, None)["nodes"][2]["providers"][0]["max_capacity"] == 64
    # --queue: merged over the queue section, which iop reads as such.
    shed = cfg.parse(cf.fleet_config(urls, cf.HETERO, auto, None, queue={"refuse_predicted_over_ms": 1000})).config
    assert (shed.queue.refuse_predicted_over_ms, shed.queue.max_queue) == (1000, 100_000)


def test_a_target_iop_refuses_is_reported_with_iops_line() -> None:
    target = cf.CapacityIop("iop-auto", cf.HETERO[:1], [{"capacity": 4, "no_such_setting": 1}])
    why = target.skip_reason()
    assert why is not None
    assert why.startswith("not available: $.nodes[0].providers[0]")
    assert "no_such_setting" in why
    assert cf.CapacityIop("iop-batch", cf.HETERO[:1], [{"capacity": 8}]).skip_reason() is None


def test_engine_types_follow_the_metrics_served() -> None:
    assert [cf.engine_type(s) for s in cf.HETERO] == ["vllm", "sglang", "vllm"]
    assert cf.engine_type(SimConfig(metrics="none")) == "vllm"


def test_every_shape_is_a_different_fleet() -> None:
    sims = {s.name: s.sims(cf.W, SEED) for s in cf.SHAPES}
    assert len(cf.SHAPES) >= 3
    for field in ("step_ms", "prefill_ms_per_token", "kv_blocks", "max_batch"):
        assert len({getattr(v[0], field) for v in sims.values()}) == len(cf.SHAPES), field


def test_the_command_states_what_differs_from_the_defaults() -> None:
    assert cf.command(cf.parse_args([]), "hetero") == cf.COMMAND
    args = cf.parse_args(["--scenarios", "hetero", "--seconds", "30",
                          "--auto-provider", '{"capacity": "auto", "x": 1}'])
    assert cf.command(args, "hetero") == (f"{cf.COMMAND} --scenarios hetero --seconds 30 "
                                          "--auto-provider '{\"capacity\": \"auto\", \"x\": 1}'")
    assert cf.command(cf.parse_args(["--quick"]), "cost") == f"{cf.COMMAND} --quick --scenarios cost"
    with pytest.raises(SystemExit):
        cf.parse_args(["--auto-provider", "[1]"])
