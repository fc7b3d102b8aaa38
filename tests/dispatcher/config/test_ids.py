"""Ids that would make the same Redis key as other ids, or not survive where they travel,
are refused with their path and the reason (dispatcher/keys.py, dispatcher/plans.py)."""

from __future__ import annotations

import copy
from typing import Any

import msgspec
import pytest

from dispatcher import config as cfg
from dispatcher.plans import Plans
from tests.dispatcher.config.base_config import base, only_problem, problems_of, provider


def pool(*providers: str, rerank: tuple[str, ...] = (), bands: bool = False) -> dict[str, Any]:
    """Model m1 on ``providers``; those in ``rerank`` alone serve rerank (a lane of their
    own); ``bands``: priority bands standard (the default) and batch."""
    raw = base()
    raw["nodes"][0]["providers"] = [
        {"id": pid, "type": "vllm", "base_url": f"http://gpu{i}:8000", "models": ["served-m1"],
         "endpoints": ["chat/completions", "rerank"] if pid in rerank else ["chat/completions"]}
        for i, pid in enumerate(providers)
    ]
    raw["models"][0]["providers"] = {pid: "served-m1" for pid in providers}
    if bands:
        raw["api"]["priorities"] = ["standard", "batch"]
    return raw


def shared_queues(raw: dict[str, Any]) -> dict[str, set[tuple[str, tuple[str, ...], int]]]:
    """Queue keys that more than one lane (model, providers, band) would use, were ``raw``
    taken as it is (decoded, not validated)."""
    config = msgspec.convert(raw, type=cfg.Config)
    plans = Plans(config)
    users: dict[str, set[tuple[str, tuple[str, ...], int]]] = {}
    every = [*plans.endpoint_lane.values(), *plans.provider_lane.values(),
             *(lane for lanes in plans.lanes_by_model.values() for lane in lanes)]
    for lane in every:
        users.setdefault(lane.queue, set()).add((lane.model, lane.providers, lane.band))
    return {key: lanes for key, lanes in users.items() if len(lanes) > 1}


def with_model(raw: dict[str, Any], model_id: str) -> dict[str, Any]:
    raw["models"].append({"id": model_id, "providers": {"p1": "served-m1"}})
    return raw


# Each refused separator: a config in which it makes two lanes share a queue, where the
# problem is reported, and what it says.
COLLISIONS = [
    pytest.param(with_model(pool("p1", "p2", rerank=("p2",)), "m1|p2"), "$.models[1].id",
                 "'|' is not allowed in a model id: it separates the model from its lane in queue keys",
                 id="model-pipe"),
    pytest.param(with_model(pool("p1", bands=True), "m1#batch"), "$.models[1].id",
                 "'#' is not allowed in a model id: it separates the model from its priority band in queue keys",
                 id="model-hash"),
    pytest.param(pool("p1", "p2", "p1,p2", rerank=("p1", "p2")), "$.nodes[0].providers[2].id",
                 "',' is not allowed in a provider id: it separates the providers of a lane in queue keys",
                 id="provider-comma"),
    pytest.param(pool("p2", "p2#batch", bands=True), "$.nodes[0].providers[1].id",
                 "'#' is not allowed in a provider id: it separates a lane from its priority band in queue keys",
                 id="provider-hash"),
]


@pytest.mark.parametrize(("raw", "path", "message"), COLLISIONS)
def test_an_id_holding_a_separator_would_share_a_queue_and_is_refused(
    raw: dict[str, Any], path: str, message: str
) -> None:
    assert shared_queues(copy.deepcopy(raw)), "the case collides nowhere: it proves nothing"
    problem = only_problem(raw)
    assert problem.path == path
    assert message in problem.message


@pytest.mark.parametrize(("name", "char", "why"), [
    ("team~a", "'~'", "it separates the tenant from the request in a flow-controlled job id"),
    ("team:a", "':'", "it separates the tenant from the model in its counters"),
])
def test_a_tenant_name_that_holds_a_separator_is_told_which_and_why(name: str, char: str, why: str) -> None:
    raw = base()
    raw["api"]["keys"] = [{"name": name, "key_env": "TEAM_A_KEY"}]
    problem = only_problem(raw)
    assert problem.path == "$.api.keys[0].name"
    assert f"{char} is not allowed in a tenant name: {why}" in problem.message


@pytest.mark.parametrize(("where", "what"), [
    ("model", "model id"), ("provider", "provider id"), ("node", "node id"), ("band", "band name"),
])
@pytest.mark.parametrize(("bad", "refusal"), [
    ("a\tb", "control characters ('\\t') are not allowed"),
    ("a\nb", "control characters ('\\n') are not allowed"),
    ("a\x00b", "control characters ('\\x00') are not allowed"),
    ("a\n", "control characters ('\\n') are not allowed"),  # said once, not as whitespace too
    (" a", "leading or trailing whitespace is not allowed"),
    ("a ", "leading or trailing whitespace is not allowed"),
])
def test_control_characters_and_outer_whitespace_are_refused(where: str, what: str, bad: str, refusal: str) -> None:
    raw = base()
    if where == "model":
        raw["models"][0]["id"] = bad
        path = "$.models[0].id"
    elif where == "provider":
        provider(raw)["id"] = bad
        raw["models"][0]["providers"] = {bad: "served-m1"}
        path = "$.nodes[0].providers[0].id"
    elif where == "node":
        raw["nodes"][0]["id"] = bad
        path = "$.nodes[0].id"
    else:
        raw["api"]["priorities"] = ["interactive", bad]
        raw["api"]["default_priority"] = "interactive"
        path = "$.api.priorities[1]"
    problem = only_problem(raw)
    assert problem.path == path
    assert f"{refusal} in a {what}: " in problem.message


def test_the_default_band_is_checked_when_it_is_the_only_one() -> None:
    raw = base()
    raw["api"]["default_priority"] = "standard\n"
    problem = only_problem(raw)
    assert problem.path == "$.api.default_priority"
    assert "are not allowed in a band name" in problem.message


def test_every_id_problem_is_reported_at_once() -> None:
    raw = base()
    raw["models"][0]["id"] = "m|1#x"
    provider(raw)["id"] = "p,1"
    raw["models"][0]["providers"] = {"p,1": "served-m1"}
    messages = [(p.path, p.message) for p in problems_of(raw)]
    assert [(path, msg.split(": ")[1]) for path, msg in messages] == [  # in the order of the file
        ("$.models[0].id", "'|' is not allowed in a model id"),
        ("$.models[0].id", "'#' is not allowed in a model id"),
        ("$.nodes[0].providers[0].id", "',' is not allowed in a provider id"),
    ]


@pytest.mark.parametrize("model_id", ["qwen3.6:35b", "org/model:tag", "a,b", "Llama 3 8B", "gpt-4o~mini"])
def test_ids_as_runtimes_name_models_stay_valid(model_id: str) -> None:
    """Ollama's tags (':'), Hugging Face names ('/'), inner spaces: none of them collides."""
    raw = base()
    raw["models"][0]["id"] = model_id
    raw["api"]["priorities"] = ["interactive", "batch|bulk,#1"]
    raw["api"]["default_priority"] = "interactive"
    provider(raw)["id"] = "gpu-a:vllm|1"
    raw["models"][0]["providers"] = {"gpu-a:vllm|1": "served-m1"}
    assert cfg.validate(cfg.parse(raw).config) == []
    assert shared_queues(raw) == {}
