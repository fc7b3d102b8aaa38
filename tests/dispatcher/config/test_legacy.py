"""The legacy route shape (``openai.model_routes`` + ``nodes[].adapters``): loading, conversion to
the pool shape, deprecation warnings, and every problem reported at its legacy path."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import msgspec
import pytest

from dispatcher import config as cfg
from dispatcher.config import legacy
from dispatcher.config.validation import NO_MODELS
from dispatcher.exceptions import ConfigProblem
from tests.dispatcher.config.base_config import only_problem, problems_of

# --------------------------------------------------------------------------- helpers


def ollama(**extra: Any) -> dict[str, Any]:
    return {"type": "ollama", "base_url": "http://127.0.0.1:11434", "capacity": 2, **extra}


def one_route() -> dict[str, Any]:
    return {
        "openai": {"model_routes": [{"model": "llama3", "adapter": "ollama-local", "target": "llama3:8b"}]},
        "nodes": [{"id": "n1", "adapters": {"ollama-local": ollama()}}],
    }


def several_routes_one_instance() -> dict[str, Any]:
    return {
        "openai": {"model_routes": [
            {"model": "llama3", "adapter": "ollama-local", "target": "llama3:8b"},
            {"model": "qwen", "adapter": "ollama-local", "target": "qwen3.6:35b"},
            {"model": "llama3-again", "adapter": "ollama-local", "target": "llama3:8b"},
        ]},
        "nodes": [{"id": "n1", "adapters": {"ollama-local": ollama(models=["qwen3.6:35b", "phi3"])}}],
    }


def routes_across_nodes() -> dict[str, Any]:
    return {
        "openai": {"model_routes": [
            {"model": "llama3", "adapter": "gpu1-ollama", "target": "llama3:8b"},
            {"model": "qwen", "adapter": "gpu2-vllm", "target": "Qwen/Qwen3-8B"},
            {"model": "gpt", "adapter": "hosted", "target": "gpt-4o-mini"},
            {"model": "claude", "adapter": "claude-cli", "target": "sonnet"},
        ]},
        "nodes": [
            {"id": "gpu1", "adapters": {"gpu1-ollama": ollama(base_url="http://gpu1:11434/v1/", timeout_s=120)}},
            {"id": "gpu2", "adapters": {
                "gpu2-vllm": {"type": "vllm", "base_url": "http://gpu2:8000", "capacity": 4},
                "hosted": {"type": "openai_api", "base_url": "https://api.example.com/v1",
                           "api_key_env": "OPENAI_API_KEY", "capacity": 8},
                "claude-cli": {"type": "cli", "command": ["claude", "-p", "--model", "{model}"], "capacity": 1},
            }},
        ],
    }


def mixed() -> dict[str, Any]:
    """Legacy routes next to models[]; a node with both providers[] and adapters."""
    return {
        "queue": {"max_queue": 5},
        "models": [{"id": "qwen", "display_name": "Qwen", "providers": {"p-vllm": "Qwen/Qwen3-8B"}}],
        "openai": {"model_routes": [
            {"model": "llama3", "adapter": "ollama-local", "target": "llama3:8b"},
            # A legacy route may also name a pool-shape provider (a half-migrated file).
            {"model": "qwen-direct", "adapter": "p-vllm", "target": "Qwen/Qwen3-8B"},
        ]},
        "nodes": [{
            "id": "n1",
            "providers": [{"id": "p-vllm", "type": "vllm", "base_url": "http://gpu:8000", "models": ["Qwen/Qwen3-8B"]}],
            "adapters": {"ollama-local": ollama(category="api")},
        }],
    }


def pool_shape() -> dict[str, Any]:
    prov = {"id": "p", "type": "vllm", "base_url": "http://h:1", "models": ["s"]}
    return {"models": [{"id": "m", "providers": {"p": "s"}}], "nodes": [{"id": "n", "providers": [prov]}]}


@pytest.fixture(autouse=True)
def _no_redis_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("IOP_REDIS_URL", raising=False)


# --------------------------------------------------------------------------- loading


def test_one_route_becomes_a_one_provider_model_group() -> None:
    config, warnings = cfg.parse(one_route())
    assert [m.id for m in config.models] == ["llama3"]
    assert config.models[0].providers == {"ollama-local": "llama3:8b"}
    (node, prov), *rest = list(config.providers())
    assert rest == []
    assert node.id == "n1"
    assert prov == cfg.ProviderConfig(id="ollama-local", type="ollama", models=["llama3:8b"],
                                      category="local_inference", capacity=2, base_url="http://127.0.0.1:11434")
    assert len(warnings) == 2
    assert cfg.validate(config) == []


def test_one_route_loads_like_its_pool_shape_equivalent() -> None:
    new_shape = {
        "models": [{"id": "llama3", "providers": {"ollama-local": "llama3:8b"}}],
        "nodes": [{"id": "n1", "providers": [{"id": "ollama-local", "category": "local_inference",
                                              "models": ["llama3:8b"], **ollama()}]}],
    }
    assert cfg.parse(one_route()).config == cfg.parse(new_shape).config


def test_several_routes_on_one_instance() -> None:
    config = cfg.parse(several_routes_one_instance()).config
    assert [(m.id, m.providers) for m in config.models] == [
        ("llama3", {"ollama-local": "llama3:8b"}),
        ("qwen", {"ollama-local": "qwen3.6:35b"}),
        ("llama3-again", {"ollama-local": "llama3:8b"}),
    ]
    (_, prov), *rest = list(config.providers())
    assert rest == []
    # The instance's own list first, then each missing target once, in route order.
    assert prov.models == ["qwen3.6:35b", "phi3", "llama3:8b"]
    assert prov.capacity == 2


def test_routes_across_nodes_keep_node_ownership_and_settings() -> None:
    config = cfg.parse(routes_across_nodes()).config
    assert [m.id for m in config.models] == ["llama3", "qwen", "gpt", "claude"]
    owners = {p.id: n.id for n, p in config.providers()}
    assert owners == {"gpu1-ollama": "gpu1", "gpu2-vllm": "gpu2", "hosted": "gpu2", "claude-cli": "gpu2"}
    assert [p.id for p in config.nodes[1].providers] == ["gpu2-vllm", "hosted", "claude-cli"]
    by_id = {p.id: p for _, p in config.providers()}
    assert by_id["gpu1-ollama"].base_url == "http://gpu1:11434"  # normalised like any provider
    assert by_id["gpu1-ollama"].timeout_s == 120.0
    assert by_id["hosted"].api_key_env == "OPENAI_API_KEY"
    assert by_id["hosted"].base_url == "https://api.example.com"
    assert by_id["claude-cli"].command == ["claude", "-p", "--model", "{model}"]
    assert by_id["claude-cli"].base_url is None
    assert {pid: p.category for pid, p in by_id.items()} == {
        "gpu1-ollama": "local_inference", "gpu2-vllm": "local_inference", "hosted": "api", "claude-cli": "cli"}
    assert {pid: p.models for pid, p in by_id.items()} == {
        "gpu1-ollama": ["llama3:8b"], "gpu2-vllm": ["Qwen/Qwen3-8B"], "hosted": ["gpt-4o-mini"],
        "claude-cli": ["sonnet"]}


@pytest.mark.parametrize(("ptype", "category"), sorted(cfg.DEFAULT_CATEGORY.items()))
def test_category_derived_from_type(ptype: str, category: str) -> None:
    raw = one_route()
    adapter: dict[str, Any] = {"type": ptype}
    if ptype == "cli":
        adapter["command"] = ["run", "{model}"]
    else:
        adapter["base_url"] = "http://h:1"
    raw["nodes"][0]["adapters"]["ollama-local"] = adapter
    prov = cfg.parse(raw).config.nodes[0].providers[0]
    assert prov.category == category
    assert prov.effective_category == category


def test_unset_adapter_settings_take_the_provider_defaults() -> None:
    raw = one_route()
    raw["nodes"][0]["adapters"]["ollama-local"] = {"type": "ollama", "base_url": "http://h:1"}
    prov = cfg.parse(raw).config.nodes[0].providers[0]
    defaults = cfg.ProviderConfig(id="x", type="ollama")
    assert (prov.capacity, prov.timeout_s, prov.api_key_env, prov.command) == (
        defaults.capacity, defaults.timeout_s, defaults.api_key_env, defaults.command)


def test_instance_without_routes_is_still_a_provider() -> None:
    raw = one_route()
    raw["nodes"][0]["adapters"]["spare"] = ollama(models=["phi3"])
    config = cfg.parse(raw).config
    assert [p.id for p in config.nodes[0].providers] == ["ollama-local", "spare"]
    assert config.nodes[0].providers[1].models == ["phi3"]


def test_mixed_file() -> None:
    config, warnings = cfg.parse(mixed())
    # models[] first, then the routes in order; providers[] first, then the instances.
    assert [(m.id, m.providers) for m in config.models] == [
        ("qwen", {"p-vllm": "Qwen/Qwen3-8B"}),
        ("llama3", {"ollama-local": "llama3:8b"}),
        ("qwen-direct", {"p-vllm": "Qwen/Qwen3-8B"}),
    ]
    assert config.models[0].display_name == "Qwen"
    assert [p.id for p in config.nodes[0].providers] == ["p-vllm", "ollama-local"]
    assert config.nodes[0].providers[1].category == "api"  # an explicit category wins over the type
    assert config.nodes[0].providers[0].models == ["Qwen/Qwen3-8B"]  # pool-shape providers are never extended
    assert config.max_queue(config.models[1]) == 5
    assert len(warnings) == 3


def test_route_to_a_pool_provider_needs_the_target_listed() -> None:
    raw = mixed()
    raw["openai"]["model_routes"][1]["target"] = "not-served"
    problem = only_problem(raw)
    assert problem.path == "$.openai.model_routes[1].target"
    assert "'not-served'" in problem.message
    assert "'p-vllm'" in problem.message


def test_empty_legacy_sections_are_accepted() -> None:
    config, warnings = cfg.parse({**pool_shape(), "openai": {}, "nodes": [*pool_shape()["nodes"],
                                                                       {"id": "n2", "adapters": {}}]})
    assert config.models == cfg.parse(pool_shape()).config.models
    assert config.nodes[1].providers == []
    assert warnings == []


def test_no_route_and_no_model_is_no_model() -> None:
    assert only_problem({"openai": {"model_routes": []}}) == ConfigProblem("$.models", NO_MODELS)


def test_input_is_not_modified() -> None:
    raw = mixed()
    before = copy.deepcopy(raw)
    cfg.parse(raw)
    assert raw == before


def test_redis_env_override_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IOP_REDIS_URL", "redis://override:6380/3")
    assert cfg.parse(one_route()).config.redis.url == "redis://override:6380/3"


def test_load_from_yaml(tmp_path: Path) -> None:
    text = """
openai:
  model_routes:
    - model: llama3           # external model id
      adapter: ollama-local   # adapter instance key
      target: llama3:8b       # served model name on that instance
nodes:
  - id: n1
    adapters:
      ollama-local:
        type: ollama
        base_url: http://127.0.0.1:11434
        capacity: 2
"""
    path = tmp_path / "legacy.yaml"
    path.write_text(text)
    config, warnings = cfg.load(path)
    assert config == cfg.parse(one_route()).config
    assert warnings == cfg.parse(one_route()).warnings


# --------------------------------------------------------------------------- warnings


def test_every_legacy_entry_is_warned_by_name() -> None:
    _, warnings = cfg.parse(routes_across_nodes())
    assert warnings == [
        "$.openai.model_routes[0] (llama3): legacy route; use models[] (id 'llama3', providers "
        "{gpu1-ollama: llama3:8b}) — run 'iop config migrate'",
        "$.openai.model_routes[1] (qwen): legacy route; use models[] (id 'qwen', providers "
        "{gpu2-vllm: Qwen/Qwen3-8B}) — run 'iop config migrate'",
        "$.openai.model_routes[2] (gpt): legacy route; use models[] (id 'gpt', providers "
        "{hosted: gpt-4o-mini}) — run 'iop config migrate'",
        "$.openai.model_routes[3] (claude): legacy route; use models[] (id 'claude', providers "
        "{claude-cli: sonnet}) — run 'iop config migrate'",
        "$.nodes[0].adapters.gpu1-ollama: legacy adapter instance; use nodes[0].providers[] (id 'gpu1-ollama') "
        "— run 'iop config migrate'",
        "$.nodes[1].adapters.gpu2-vllm: legacy adapter instance; use nodes[1].providers[] (id 'gpu2-vllm') "
        "— run 'iop config migrate'",
        "$.nodes[1].adapters.hosted: legacy adapter instance; use nodes[1].providers[] (id 'hosted') "
        "— run 'iop config migrate'",
        "$.nodes[1].adapters.claude-cli: legacy adapter instance; use nodes[1].providers[] (id 'claude-cli') "
        "— run 'iop config migrate'",
    ]


def test_logged_logs_the_warnings(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    """What a process that loads the file to run does: says so at start-up."""
    path = tmp_path / "legacy.yaml"
    path.write_bytes(msgspec.yaml.encode(one_route()))
    for load in (lambda: cfg.parse(one_route()).logged(), lambda: cfg.load(path).logged()):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="iop.config"):
            load()
        records = [r for r in caplog.records if r.name == "iop.config"]
        assert [r.levelno for r in records] == [logging.WARNING, logging.WARNING]
        assert records[0].getMessage().startswith("$.openai.model_routes[0] (llama3): legacy route")
        assert records[1].getMessage().startswith("$.nodes[0].adapters.ollama-local: legacy adapter instance")
        assert all("iop config migrate" in r.getMessage() for r in records)


def test_parse_and_load_do_not_log(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    path = tmp_path / "legacy.yaml"
    path.write_bytes(msgspec.yaml.encode(one_route()))
    with caplog.at_level(logging.WARNING, logger="iop.config"):
        cfg.parse(one_route())
        cfg.load(path)
    assert [r for r in caplog.records if r.name == "iop.config"] == []


def test_pool_shape_has_no_warnings(caplog: pytest.LogCaptureFixture) -> None:
    raw = pool_shape()
    with caplog.at_level(logging.WARNING, logger="iop.config"):
        assert cfg.parse(raw).warnings == []
        cfg.parse(raw).logged()
    assert caplog.records == []


# --------------------------------------------------------------------------- problems at legacy paths


def test_unknown_adapter_key() -> None:
    raw = several_routes_one_instance()
    raw["openai"]["model_routes"][1]["adapter"] = "x"
    problem = only_problem(raw)
    assert problem.path == "$.openai.model_routes[1].adapter"
    assert problem.message.startswith("no node defines adapter 'x'")
    assert "ollama-local" in problem.message  # the instances that do exist


def test_route_model_duplicates_a_models_id() -> None:
    raw = mixed()
    raw["openai"]["model_routes"][1]["model"] = "qwen"
    problem = only_problem(raw)
    assert problem.path == "$.openai.model_routes[1].model"
    assert "duplicate model id 'qwen'" in problem.message
    assert "$.models[0].id" in problem.message  # names the other definition


def test_route_model_defined_twice_in_routes() -> None:
    raw = routes_across_nodes()
    raw["openai"]["model_routes"][3]["model"] = "qwen"
    problem = only_problem(raw)
    assert problem.path == "$.openai.model_routes[3].model"
    assert "duplicate model id 'qwen'" in problem.message
    assert "$.openai.model_routes[1].model" in problem.message


def test_duplicate_models_ids_are_still_reported_at_models() -> None:
    raw = mixed()
    raw["models"].append({"id": "qwen", "providers": {"p-vllm": "Qwen/Qwen3-8B"}})
    raw["openai"]["model_routes"][0]["model"] = "qwen"
    assert sorted((p.path, p.message) for p in problems_of(raw)) == [
        ("$.models[1].id", "duplicate model id 'qwen'"),
        ("$.openai.model_routes[0].model", "duplicate model id 'qwen' (also defined at $.models[0].id)"),
    ]


@pytest.mark.parametrize(
    ("settings", "field", "words"),
    [
        ({"type": "tgi"}, "type", "unknown type 'tgi'"),
        ({"base_url": None}, "base_url", "required for type 'ollama'"),
        ({"base_url": ""}, "base_url", "required for type 'ollama'"),
        ({"base_url": "gpu1:11434"}, "base_url", "http://"),
        ({"category": "gpu"}, "category", "unknown category 'gpu'"),
        ({"capacity": -1}, "capacity", ">= 0"),
        ({"timeout_s": 0}, "timeout_s", "> 0"),
        ({"type": "cli", "base_url": None}, "command", "required for type 'cli'"),
        ({"models": ["a", "b", "a"]}, "models[2]", "duplicate served name 'a'"),
    ],
)
def test_instance_settings_problems_carry_legacy_paths(settings: dict[str, Any], field: str, words: str) -> None:
    raw = one_route()
    raw["nodes"][0]["adapters"]["ollama-local"].update(settings)
    problem = only_problem(raw)
    assert problem.path == f"$.nodes[0].adapters.ollama-local.{field}"
    assert words in problem.message


def test_missing_base_url_absent() -> None:
    raw = one_route()
    del raw["nodes"][0]["adapters"]["ollama-local"]["base_url"]
    problem = only_problem(raw)
    assert problem == ConfigProblem("$.nodes[0].adapters.ollama-local.base_url", "required for type 'ollama'")


@pytest.mark.parametrize("layout", ["same-node", "provider-first", "adapter-first"])
def test_instance_key_colliding_with_a_provider_id(layout: str) -> None:
    raw = one_route()
    prov = {"id": "ollama-local", "type": "vllm", "base_url": "http://h:1"}
    if layout == "same-node":
        raw["nodes"][0]["providers"] = [prov]
        where = "$.nodes[0].providers[0]"
    elif layout == "provider-first":
        raw["nodes"].insert(0, {"id": "n0", "providers": [prov]})
        where = "$.nodes[0].providers[0]"
    else:
        raw["nodes"].append({"id": "n2", "providers": [prov]})
        where = "$.nodes[1].providers[0]"
    node = 1 if layout == "provider-first" else 0
    problem = only_problem(raw)
    assert problem.path == f"$.nodes[{node}].adapters.ollama-local"
    assert "'ollama-local'" in problem.message
    assert where in problem.message


def test_instance_colliding_with_two_providers_keeps_the_plain_duplicate() -> None:
    raw = one_route()
    prov = {"id": "ollama-local", "type": "vllm", "base_url": "http://h:1"}
    raw["nodes"].append({"id": "n2", "providers": [prov, copy.deepcopy(prov)]})
    assert sorted(p.path for p in problems_of(raw)) == ["$.nodes[0].adapters.ollama-local",
                                                        "$.nodes[1].providers[1].id"]


def test_instance_key_defined_on_two_nodes() -> None:
    raw = routes_across_nodes()
    raw["nodes"][1]["adapters"]["gpu1-ollama"] = ollama()
    problem = only_problem(raw)
    assert problem.path == "$.nodes[1].adapters.gpu1-ollama"
    assert "$.nodes[0].adapters.gpu1-ollama" in problem.message


def test_every_problem_is_reported_at_once() -> None:
    raw = mixed()
    raw["openai"]["model_routes"].append({"model": "qwen", "adapter": "ghost", "target": "t"})
    raw["nodes"][0]["adapters"]["ollama-local"].update(type="magic", capacity=-2)
    raw["nodes"][0]["providers"][0]["capacity"] = -1
    raw["queue"]["max_queue"] = -1
    assert sorted(p.path for p in problems_of(raw)) == sorted([
        "$.openai.model_routes[2].model",
        "$.openai.model_routes[2].adapter",
        "$.nodes[0].adapters.ollama-local.type",
        "$.nodes[0].adapters.ollama-local.capacity",
        "$.nodes[0].providers[0].capacity",
        "$.queue.max_queue",
    ])


# --------------------------------------------------------------------------- structural problems


@pytest.mark.parametrize(
    ("mutate", "path", "words"),
    [
        (lambda r: r["openai"]["model_routes"][0].update(weight=2), "$.openai.model_routes[0].weight",
         "unknown field `weight`"),
        (lambda r: r["openai"].update(routes=[]), "$.openai.routes", "unknown field `routes`"),
        (lambda r: r["openai"]["model_routes"][0].pop("target"), "$.openai.model_routes[0]",
         "missing required field `target`"),
        (lambda r: r["openai"]["model_routes"][0].update(target=8), "$.openai.model_routes[0].target",
         "Expected `str`, got `int`"),
        (lambda r: r.update(openai=[]), "$.openai", "Expected `object`, got `array`"),
        (lambda r: r["openai"].update(model_routes={}), "$.openai.model_routes", "Expected `array`"),
        (lambda r: r["nodes"][0]["adapters"]["ollama-local"].update(capcity=2),
         "$.nodes[0].adapters.ollama-local.capcity", "unknown field `capcity`"),
        (lambda r: r["nodes"][0]["adapters"]["ollama-local"].update(id="x"),
         "$.nodes[0].adapters.ollama-local.id", "unknown field `id`"),
        (lambda r: r["nodes"][0]["adapters"]["ollama-local"].update(capacity="2"),
         "$.nodes[0].adapters.ollama-local.capacity", "Expected `int`, got `str`"),
        (lambda r: r["nodes"][0]["adapters"]["ollama-local"].update(capacity=None),
         "$.nodes[0].adapters.ollama-local.capacity", "got `null`"),
        (lambda r: r["nodes"][0]["adapters"]["ollama-local"].pop("type"),
         "$.nodes[0].adapters.ollama-local", "missing required field `type`"),
        (lambda r: r["nodes"][0].update(adapters=["ollama-local"]), "$.nodes[0].adapters",
         "Expected `object`, got `array`"),
        (lambda r: r["nodes"][0].update(adapters={1: ollama()}), "$.nodes[0].adapters", "(mapping key)"),
    ],
)
def test_structural_problems_carry_legacy_paths(mutate: Any, path: str, words: str) -> None:
    raw = one_route()
    mutate(raw)
    problem = only_problem(raw)
    assert problem.path == path
    assert words in problem.message


def test_structural_problems_of_several_sections_come_together() -> None:
    raw = routes_across_nodes()
    raw["openai"]["model_routes"][2]["adaptor"] = "hosted"
    raw["nodes"][0]["adapters"]["gpu1-ollama"]["capacity"] = "many"
    raw["nodes"][1]["adapters"]["hosted"]["key"] = "sk-..."
    raw["nodes"][1]["providers"] = [{"id": "p", "type": "vllm", "bogus": 1}]
    raw["queue"] = {"max_qeue": 1}
    # Every one of them, legacy and pool shape alike, in the order of the file.
    assert [(p.path, p.message) for p in problems_of(raw)] == [
        ("$.openai.model_routes[2].adaptor", "unknown field `adaptor`"),
        ("$.nodes[0].adapters.gpu1-ollama.capacity", "Expected `int`, got `str`"),
        ("$.nodes[1].adapters.hosted.key", "unknown field `key`"),
        ("$.nodes[1].providers[0].bogus", "unknown field `bogus`"),  # (written after the adapters)
        ("$.nodes[1].providers[0].base_url", "required for type 'vllm'"),
        ("$.queue.max_qeue", "unknown field `max_qeue`"),
    ]


def test_unknown_top_level_field_is_still_rejected() -> None:
    problem = only_problem({**one_route(), "opneai": {}})
    assert problem.path == "$.opneai"


# --------------------------------------------------------------------------- the conversion itself


def test_conversion_lists_its_changes() -> None:
    raw = several_routes_one_instance()
    core, parts, findings = legacy.split(raw)
    assert findings.problems == []
    assert "openai" not in core
    assert "adapters" not in core["nodes"][0]
    conversion = legacy.convert(msgspec.convert(core, type=cfg.Config), parts)
    assert conversion.problems == []
    assert conversion.changes == [
        "route $.openai.model_routes[0] -> model group 'llama3' ($.models[0]) with providers "
        "{'ollama-local': 'llama3:8b'}",
        "route $.openai.model_routes[1] -> model group 'qwen' ($.models[1]) with providers "
        "{'ollama-local': 'qwen3.6:35b'}",
        "route $.openai.model_routes[2] -> model group 'llama3-again' ($.models[2]) with providers "
        "{'ollama-local': 'llama3:8b'}",
        "adapter instance $.nodes[0].adapters.ollama-local -> provider 'ollama-local' ($.nodes[0].providers[0]), "
        "type 'ollama', category 'local_inference' (derived from the type)",
        "target 'llama3:8b' added to the models of provider 'ollama-local' (for route $.openai.model_routes[0])",
    ]


def test_pool_shape_converts_to_itself() -> None:
    raw = pool_shape()
    core, parts, findings = legacy.split(raw)
    assert (core, findings.problems, parts.empty) == (raw, [], True)
    config = msgspec.convert(core, type=cfg.Config)
    conversion = legacy.convert(config, parts)
    assert conversion.config == config
    assert (conversion.problems, conversion.warnings, conversion.changes) == ([], [], [])
