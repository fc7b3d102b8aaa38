"""bench/swap_fleet.py's pure parts: the best fixed placement, the demand whose popularity
rotates (seeded, the same for every target), iop's and LiteLLM's configs, and a run's
figures from its requests and its servers' counters."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import msgspec
import pytest

from bench.fleet_sim import SimConfig
from bench.prefix_fleet import UNANSWERED, Result, Run
from bench.swap_fleet import (
    SHAPES,
    Shape,
    SwapFleet,
    demand,
    epoch_of,
    figures,
    make_swap_trace,
    managed_fields,
    model_names,
    parse_args,
    place,
    placed_share,
    ranking,
    slo_of,
    start_placement,
    swap_configs,
    swap_iop_config,
    swap_litellm_config,
    zipf_weights,
)

MODELS = model_names(8)


# --------------------------------------------------------------------------- placement


def test_each_slot_goes_to_the_most_demanded_model_with_one_copy_per_server() -> None:
    # a's 100 over two copies is 50 a copy: less than b's 60 and c's 55.
    assert place({"a": 100, "b": 60, "c": 55, "d": 5}, servers=3, per_server=1) == [("a",), ("b",), ("c",)]


def test_a_model_gets_another_copy_only_when_its_demand_per_copy_beats_those_left_out() -> None:
    # a's 100 over two copies (50 each) beats b's 40; over three (33) it does not.
    assert sorted(place({"a": 100, "b": 40, "c": 20}, servers=3, per_server=1)) == [("a",), ("a",), ("b",)]
    # a's 130 over three copies (43) still beats b's 40: b is left out.
    assert sorted(place({"a": 130, "b": 40, "c": 10}, servers=3, per_server=1)) == [("a",), ("a",), ("a",)]
    # Never more copies than servers: the slots left go to b, however little it is asked for.
    assert place({"a": 1000, "b": 1}, servers=2, per_server=2) == [("a", "b"), ("a", "b")]


def test_the_placement_fits_every_copy_on_distinct_servers() -> None:
    wanted = dict(zip(MODELS, [400, 200, 133, 100, 80, 66, 57, 50], strict=True))
    for servers, per_server in ((3, 1), (3, 2), (2, 3), (4, 2)):
        held = place(wanted, servers, per_server)
        assert len(held) == servers
        assert all(len(h) == per_server and len(set(h)) == per_server for h in held)
        copies = Counter(m for h in held for m in h)
        assert copies["m0"] >= copies["m1"] >= copies["m2"]  # the hottest is never placed less


def test_models_without_demand_are_never_placed_and_slots_stay_free() -> None:
    assert place({"a": 5, "b": 0}, servers=2, per_server=2) == [("a",), ("a",)]
    assert place({}, servers=2, per_server=1) == [(), ()]


def test_the_placement_is_deterministic_on_ties() -> None:
    assert place({"b": 10, "a": 10, "c": 10}, servers=2, per_server=1) == [("a",), ("b",)]


def test_placed_share() -> None:
    assert placed_share({"a": 3, "b": 1}, [("a",), ()]) == 0.75
    assert math.isnan(placed_share({}, [("a",)]))


# --------------------------------------------------------------------------- demand


def test_zipf_weights_fall_with_rank_and_sum_to_one() -> None:
    w = zipf_weights(4, 1.0)
    assert sum(w) == pytest.approx(1.0)
    assert w[0] == pytest.approx(2 * w[1]) == pytest.approx(4 * w[3])


def test_the_ranking_rotates_by_shift_by_places_per_epoch() -> None:
    models = ["a", "b", "c", "d"]
    assert ranking(models, 0, 1) == ["a", "b", "c", "d"]
    assert ranking(models, 1, 1) == ["b", "c", "d", "a"]  # the most popular falls to the tail
    assert ranking(models, 3, 2) == ranking(models, 1, 2) == ["c", "d", "a", "b"]
    assert (epoch_of(4.99, 5.0), epoch_of(5.0, 5.0), epoch_of(100.0, 0.0)) == (0, 1, 0)


def test_the_trace_is_seeded_and_its_popularity_follows_the_epochs() -> None:
    trace = make_swap_trace(MODELS, 40.0, 60.0, 20.0, 3, 1.0, "t")
    assert len(trace) == 2400
    assert [a.body for a in trace] == [a.body for a in make_swap_trace(MODELS, 40.0, 60.0, 20.0, 3, 1.0, "t")]
    assert [a.body for a in trace] != [a.body for a in make_swap_trace(MODELS, 40.0, 60.0, 20.0, 3, 1.0, "u")]
    assert [a.at for a in trace] == sorted(a.at for a in trace)
    for epoch in range(3):
        counts = demand(trace, 20.0 * epoch, 20.0 * (epoch + 1))
        assert counts.most_common(1)[0][0] == ranking(MODELS, epoch, 3)[0]  # m0, then m3, then m6
        assert counts[ranking(MODELS, epoch, 3)[0]] > 2 * counts[ranking(MODELS, epoch, 3)[4]]
    body = msgspec.json.decode(trace[0].body)
    assert body["model"] == trace[0].model
    assert (body["stream"], body["stream_options"], body["max_tokens"]) == (True, {"include_usage": True}, 32)


def test_a_trace_holding_still_differs_only_in_which_model_a_rank_names() -> None:
    moving = make_swap_trace(MODELS, 10.0, 30.0, 10.0, 2, 1.0, "t")
    still = make_swap_trace(MODELS, 10.0, 30.0, 0.0, 2, 1.0, "t")
    assert [(a.at, a.tenant, a.prompt_tokens) for a in moving] == [(a.at, a.tenant, a.prompt_tokens) for a in still]
    assert {a.model for a in still if a.tenant == 0} == {"m0"}
    assert {a.model for a in moving if a.tenant == 0} == {"m0", "m2", "m4"}


def test_the_start_placement_is_the_first_shifts_best() -> None:
    shape = Shape("s", 1, 1.0, 10.0, 0.5)
    trace = make_swap_trace(MODELS, 20.0, 30.0, 10.0, 4, 1.0, "t")
    assert start_placement(trace, shape, 3) == place(demand(trace, 0.0, 10.0), 3, 1)
    assert start_placement(trace, Shape("s", 1, 1.0, 0.0, 0.5), 3) == place(demand(trace), 3, 1)


# --------------------------------------------------------------------------- configs


def test_iop_lists_each_model_on_the_providers_that_hold_it() -> None:
    config = swap_iop_config(["http://s0", "http://s1"], [("m0", "m1"), ("m1",)], 4, {"lifecycle": "static"})
    assert config["models"] == [{"id": "m0", "providers": {"p0": "m0"}},
                                {"id": "m1", "providers": {"p0": "m1", "p1": "m1"}}]
    provider = config["nodes"][1]["providers"][0]
    assert provider == {"id": "p1", "type": "llamacpp", "base_url": "http://s1", "capacity": 4, "models": ["m1"],
                        "lifecycle": "static"}


def test_managed_fields_follow_the_shape_and_the_override() -> None:
    shape = Shape("s", 2, 4.0, 0.0, 0.5)
    assert managed_fields(shape, {}) == {"lifecycle": "managed", "max_loaded": 2, "load_s": 4.0}
    assert managed_fields(shape, {"unload_idle_s": 1.0})["unload_idle_s"] == 1.0


def test_litellm_has_a_deployment_per_server_and_model() -> None:
    config = swap_litellm_config(["http://s0", "http://s1"], ["m0", "m1"])
    assert [(d["model_name"], d["litellm_params"]["api_base"]) for d in config["model_list"]] == [
        ("m0", "http://s0/v1"), ("m0", "http://s1/v1"), ("m1", "http://s0/v1"), ("m1", "http://s1/v1")]
    assert config["router_settings"] == {"routing_strategy": "least-busy"}


def test_each_server_swaps_with_its_preload(tmp_path: Any) -> None:
    swaps = swap_configs(["m0", "m1", "m2"], Shape("s", 2, 1.5, 0.0, 0.5), [("m0", "m1"), ("m2",)])
    fleet = SwapFleet([SimConfig()] * 2, swaps, tmp_path)
    args = fleet.server_args(1, SimConfig())
    assert args[args.index("--preload") + 1] == "m2"
    assert args[args.index("--models-max") + 1] == "2"
    assert args[args.index("--load-ms") + 1] == "1500.0"


# --------------------------------------------------------------------------- figures


def result(sent: float, ttft: float, status: int = 200) -> Result:
    return Result(sent, ttft, sent + ttft + 1, status)


def test_figures_count_the_window_and_the_servers_whole_run() -> None:
    run = Run("t", "t", [result(0.5, 0.1),  # in the warm-up: not counted
                         result(2.0, 0.5), result(3.0, 2.5),  # answered, one too slow for the SLO
                         result(4.0, math.inf, 0),  # cut off
                         result(5.0, math.inf, UNANSWERED)], window=10.0, warmup=1.0)
    stats = [{"loads": {"request": 3, "api": 1}, "unloads": {"api": 0, "lru": 2}, "cut_off": 1, "steps": 100,
              "late_steps": 5, "failed_loads": 1},
             {"loads": {"request": 2, "api": 0}, "unloads": {"api": 1, "lru": 0}, "cut_off": 0, "steps": 100,
              "late_steps": 0}]
    run.server_stats = stats
    f = figures(run, stats, wall_s=30.0, slo_s=2.0)
    assert (f.goodput, f.answered) == (0.1, 0.2)
    assert (f.loads, f.loads_per_min, f.lru_unloads, f.cut_off, f.killed_loads) == (6, 12.0, 2, 1, 1)
    assert (f.unanswered, f.errors) == (1, 1)
    assert (f.ttft_p50, f.ttft_p90) == ("∞", "∞")  # two of four never answered
    assert f.late_steps == 0.025


def test_the_slo_allows_one_load() -> None:
    assert slo_of(Shape("s", 1, 4.0, 0.0, 0.5), 0.0) == 9.0
    assert slo_of(Shape("s", 1, 4.0, 0.0, 0.5), 2500.0) == 2.5


def test_every_default_shape_has_models_to_move() -> None:
    args = parse_args([])
    assert all(args.models > args.servers * s.per_server for s in SHAPES)
    assert args.shapes == [s.name for s in SHAPES]
    with pytest.raises(SystemExit):
        parse_args(["--models", "3"])
