"""The config: decoding, cross-checks (every problem with its path), defaults and normalisation."""

from __future__ import annotations

import copy
import textwrap
from pathlib import Path
from typing import Any

import msgspec
import pytest

from dispatcher import config as cfg
from dispatcher.config.validation import NO_MODELS
from dispatcher.exceptions import ConfigError, ConfigProblem
from tests.dispatcher.config.base_config import base, only_problem, problems_of, provider
from tests.dispatcher.config.one_model import ONE_MODEL_YAML
from tests.dispatcher.config.yaml_text import load_text

# --------------------------------------------------------------------------- helpers


def decode_problem(text: str) -> ConfigProblem:
    with pytest.raises(ConfigError) as info:
        load_text(text)
    assert len(info.value.problems) == 1, info.value.problems
    return info.value.problems[0]


@pytest.fixture(autouse=True)
def _no_redis_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """``IOP_REDIS_URL`` from the outer environment must not leak into these tests."""
    monkeypatch.delenv("IOP_REDIS_URL", raising=False)


# --------------------------------------------------------------------------- the base is valid


def test_base_config_is_valid() -> None:
    config = cfg.parse(base()).config
    assert cfg.validate(config) == []
    assert [m.id for m in config.models] == ["m1"]
    assert config.models[0].display_name == "Model one"
    (node, prov), *rest = list(config.providers())
    assert rest == []
    assert (node.id, prov.id, prov.type, prov.capacity) == ("n1", "p1", "vllm", 2)
    assert config.api.api_keys_env == "IOP_API_KEYS"
    assert config.api.max_body_bytes == 1024
    assert config.redis.url == "redis://localhost:6379/0"


def test_valid_multi_node_multi_model_config_loads(tmp_path: Path) -> None:
    text = textwrap.dedent(
        """
        redis:
          url: redis://redis.internal:6379/2
        api:
          api_keys_env: IOP_KEYS
          max_body_bytes: 2097152
        queue:
          max_queue: 50
          queue_timeout_ms: 20000
        models:
          - id: "qwen3.6:35b"
            display_name: Qwen 3.6 35B
            providers:
              gpu1-vllm: Qwen/Qwen3.6-35B-A3B
              gpu2-ollama: qwen3.6:35b-q4_K_M
            max_queue: 5
          - id: gpt-4o-mini
            providers:
              openai: gpt-4o-mini
            queue_timeout_ms: 1000
          - id: claude-cli
            providers:
              claude: sonnet
        nodes:
          - id: gpu1
            providers:
              - id: gpu1-vllm
                type: vllm
                base_url: http://gpu1:8000/v1/
                models: [Qwen/Qwen3.6-35B-A3B]
                capacity: 4
          - id: gpu2
            providers:
              - id: gpu2-ollama
                type: ollama
                base_url: http://gpu2:11434
                models: [qwen3.6:35b-q4_K_M, llama3:8b]
                capacity: 1
                timeout_s: 120
              - id: openai
                type: openai_api
                base_url: https://api.openai.com/v1
                api_key_env: OPENAI_API_KEY
                models: [gpt-4o-mini]
                capacity: 8
              - id: claude
                type: cli
                command: [claude, -p, --model, "{model}"]
                models: [sonnet]
                capacity: 0
        """
    )
    path = tmp_path / "iop.yaml"
    path.write_text(text)
    config = cfg.load(path).config

    qwen = config.model("qwen3.6:35b")
    assert qwen is not None
    assert qwen.display_name == "Qwen 3.6 35B"
    assert qwen.providers == {"gpu1-vllm": "Qwen/Qwen3.6-35B-A3B", "gpu2-ollama": "qwen3.6:35b-q4_K_M"}
    assert config.max_queue(qwen) == 5
    assert config.queue_timeout_ms(qwen) == 20000

    mini = config.model("gpt-4o-mini")
    assert mini is not None
    assert config.max_queue(mini) == 50
    assert config.queue_timeout_ms(mini) == 1000

    assert config.model("nope") is None
    assert [n.id for n in config.nodes] == ["gpu1", "gpu2"]
    gpu2 = config.node("gpu2")
    assert gpu2 is not None
    assert [p.id for p in gpu2.providers] == ["gpu2-ollama", "openai", "claude"]
    assert config.node("gpu3") is None

    by_id = {p.id: (n.id, p) for n, p in config.providers()}
    assert set(by_id) == {"gpu1-vllm", "gpu2-ollama", "openai", "claude"}
    assert by_id["gpu1-vllm"][0] == "gpu1"
    assert by_id["gpu1-vllm"][1].base_url == "http://gpu1:8000"
    assert by_id["openai"][1].base_url == "https://api.openai.com"
    assert by_id["openai"][1].api_key_env == "OPENAI_API_KEY"
    assert by_id["openai"][1].effective_category == "api"
    assert by_id["gpu2-ollama"][1].timeout_s == 120.0
    assert by_id["gpu2-ollama"][1].effective_category == "local_inference"
    assert by_id["claude"][1].command == ["claude", "-p", "--model", "{model}"]
    assert by_id["claude"][1].capacity == 0
    assert by_id["claude"][1].effective_category == "cli"
    assert config.redis.url == "redis://redis.internal:6379/2"


def test_config_is_frozen() -> None:
    config = cfg.parse(base()).config
    with pytest.raises(AttributeError):
        config.models[0].id = "other"


# --------------------------------------------------------------------------- cross-field rules


def test_model_references_provider_no_node_defines() -> None:
    raw = base()
    raw["models"][0]["providers"]["p9"] = "served-m1"
    problem = only_problem(raw)
    assert problem.path == "$.models[0].providers.p9"
    assert "'p9'" in problem.message
    assert "no node defines" in problem.message


def test_served_name_missing_from_provider_models() -> None:
    raw = base()
    raw["models"][0]["providers"]["p1"] = "not-served"
    problem = only_problem(raw)
    assert problem.path == "$.models[0].providers.p1"
    assert "'not-served'" in problem.message
    assert "'p1'" in problem.message


def test_duplicate_model_id_points_at_the_second() -> None:
    raw = base()
    raw["models"].append({"id": "m1", "providers": {"p1": "served-m1"}})
    problem = only_problem(raw)
    assert problem.path == "$.models[1].id"
    assert "duplicate model id" in problem.message
    assert "'m1'" in problem.message


def test_duplicate_node_id_points_at_the_second() -> None:
    raw = base()
    raw["nodes"].append({"id": "n1", "providers": []})
    problem = only_problem(raw)
    assert problem.path == "$.nodes[1].id"
    assert "duplicate node id" in problem.message
    assert "'n1'" in problem.message


def test_duplicate_provider_id_across_nodes() -> None:
    raw = base()
    raw["nodes"].append(
        {
            "id": "n2",
            "providers": [
                {"id": "p1", "type": "sglang", "base_url": "http://gpu2:30000", "models": ["served-m1"]}
            ],
        }
    )
    problem = only_problem(raw)
    assert problem.path == "$.nodes[1].providers[0].id"
    assert "duplicate provider id" in problem.message
    assert "'p1'" in problem.message


def test_duplicate_provider_id_within_one_node() -> None:
    raw = base()
    raw["nodes"][0]["providers"].append(copy.deepcopy(provider(raw)))
    problem = only_problem(raw)
    assert problem.path == "$.nodes[0].providers[1].id"
    assert "'p1'" in problem.message


def test_duplicate_served_name_within_a_provider() -> None:
    raw = base()
    provider(raw)["models"] = ["served-m1", "other", "served-m1"]
    problem = only_problem(raw)
    assert problem.path == "$.nodes[0].providers[0].models[2]"
    assert "'served-m1'" in problem.message


def test_model_with_no_providers() -> None:
    raw = base()
    raw["models"][0]["providers"] = {}
    problem = only_problem(raw)
    assert problem.path == "$.models[0].providers"
    assert "at least one provider" in problem.message


def test_model_without_providers_field_is_a_decode_error() -> None:
    raw = base()
    del raw["models"][0]["providers"]
    problem = only_problem(raw)
    assert problem.path == "$.models[0]"
    assert "`providers`" in problem.message
    assert "missing required field" in problem.message


def test_unknown_provider_type() -> None:
    raw = base()
    provider(raw)["type"] = "tgi"
    problem = only_problem(raw)
    assert problem.path == "$.nodes[0].providers[0].type"
    assert "'tgi'" in problem.message
    for known in cfg.PROVIDER_TYPES:
        assert known in problem.message


def test_unknown_category() -> None:
    raw = base()
    provider(raw)["category"] = "cloud"
    problem = only_problem(raw)
    assert problem.path == "$.nodes[0].providers[0].category"
    assert "'cloud'" in problem.message
    for known in cfg.CATEGORIES:
        assert known in problem.message


@pytest.mark.parametrize("ptype", ["vllm", "sglang", "lemonade", "ollama", "openai_api"])
@pytest.mark.parametrize("missing", ["absent", "null", "empty"])
def test_http_type_needs_base_url(ptype: str, missing: str) -> None:
    raw = base()
    prov = provider(raw)
    prov["type"] = ptype
    if missing == "absent":
        del prov["base_url"]
    else:
        prov["base_url"] = None if missing == "null" else ""
    problem = only_problem(raw)
    assert problem.path == "$.nodes[0].providers[0].base_url"
    assert "required" in problem.message
    assert repr(ptype) in problem.message


def test_base_url_must_be_http() -> None:
    raw = base()
    provider(raw)["base_url"] = "gpu1:8000"
    problem = only_problem(raw)
    assert problem.path == "$.nodes[0].providers[0].base_url"
    assert "http://" in problem.message


@pytest.mark.parametrize("command", [None, []])
def test_cli_needs_command(command: list[str] | None) -> None:
    raw = base()
    prov = provider(raw)
    prov.update(type="cli", base_url=None)
    if command is not None:
        prov["command"] = command
    problem = only_problem(raw)
    assert problem.path == "$.nodes[0].providers[0].command"
    assert "required" in problem.message
    assert "'cli'" in problem.message


def test_cli_does_not_need_base_url() -> None:
    raw = base()
    prov = provider(raw)
    prov.update(type="cli", command=["my-llm", "--stdin"])
    del prov["base_url"]
    config = cfg.parse(raw).config
    assert config.nodes[0].providers[0].base_url is None
    assert config.nodes[0].providers[0].command == ["my-llm", "--stdin"]


def test_capacity_auto_and_its_bounds() -> None:
    raw = base()
    provider(raw).update(capacity="auto", min_capacity=2, max_capacity=32)
    prov = cfg.parse(raw).config.nodes[0].providers[0]
    assert prov.auto
    assert prov.capacity_bounds == (2, 32)
    assert prov.fixed_capacity == 32  # the most it may learn: what a node's HTTP pool is sized for
    provider(raw).update(min_capacity=8, max_capacity=4)
    assert [(p.path, p.message) for p in problems_of(raw)] == [
        ("$.nodes[0].providers[0].max_capacity", "must not be below min_capacity (8), got 4")]
    fixed = base()
    provider(fixed).update(capacity=4, max_capacity=8)
    assert [(p.path, p.message) for p in problems_of(fixed)] == [
        ("$.nodes[0].providers[0].max_capacity", "only with capacity: auto (a fixed capacity is its own bound)")]
    word = base()
    provider(word).update(capacity="lots")
    [problem] = problems_of(word)
    assert problem.message == "Invalid enum value 'lots' (expected an integer or one of: auto)"


def test_ejection_settings() -> None:
    raw = base()
    raw["ejection"] = {"base_s": 60, "max_s": 30}
    assert [(p.path, p.message) for p in problems_of(raw)] == [
        ("$.ejection.max_s", "must not be shorter than base_s (60), got 30")]
    raw["ejection"] = {"max_ejected_percent": 101}
    [problem] = problems_of(raw)
    assert problem.path == "$.ejection.max_ejected_percent"


def test_negative_capacity() -> None:
    raw = base()
    provider(raw)["capacity"] = -1
    problem = only_problem(raw)
    assert problem.path == "$.nodes[0].providers[0].capacity"
    assert ">= 0" in problem.message


def test_zero_capacity_is_allowed() -> None:
    raw = base()
    provider(raw)["capacity"] = 0
    assert cfg.parse(raw).config.nodes[0].providers[0].capacity == 0


@pytest.mark.parametrize("timeout", [0, -1.5])
def test_provider_timeout_must_be_positive(timeout: float) -> None:
    raw = base()
    provider(raw)["timeout_s"] = timeout
    problem = only_problem(raw)
    assert problem.path == "$.nodes[0].providers[0].timeout_s"
    assert "> 0" in problem.message


def test_empty_ids() -> None:
    raw = base()
    raw["nodes"].append({"id": "", "providers": []})
    problem = only_problem(raw)
    assert problem.path == "$.nodes[1].id"
    assert "empty" in problem.message

    raw = base()
    raw["models"].append({"id": "", "providers": {"p1": "served-m1"}})
    problem = only_problem(raw)
    assert problem.path == "$.models[1].id"
    assert "empty" in problem.message


# --------------------------------------------------------------------------- range checks


@pytest.mark.parametrize(
    ("section", "field", "value", "expected"),
    [
        ("queue", "max_queue", -1, ">= 0"),
        ("queue", "queue_timeout_ms", 0, "> 0"),
        ("queue", "queue_timeout_ms", -5, "> 0"),
        ("api", "max_body_bytes", 0, "> 0"),
        ("dispatch", "lease_ms", 0, "> 0"),
        ("dispatch", "heartbeat_ttl_ms", -1, "> 0"),
        ("dispatch", "probe_interval_ms", 0, "> 0"),
        ("dispatch", "probe_timeout_ms", 0, "> 0"),
        ("dispatch", "reap_interval_ms", 0, "> 0"),
        ("dispatch", "max_attempts", 0, "> 0"),
        ("dispatch", "drain_grace_s", -0.5, ">= 0"),
    ],
)
def test_section_range_checks(section: str, field: str, value: float, expected: str) -> None:
    raw = base()
    raw.setdefault(section, {})[field] = value
    problems = problems_of(raw)
    mine = [p for p in problems if p.path == f"$.{section}.{field}"]
    assert len(mine) == 1, problems
    assert expected in mine[0].message
    # heartbeat_ttl_ms <= 0 also makes the default interval too long: nothing else may show up.
    others = {p.path for p in problems} - {f"$.{section}.{field}"}
    assert others <= {"$.dispatch.heartbeat_interval_ms"}


def test_heartbeat_interval_must_be_shorter_than_ttl() -> None:
    raw = base()
    raw["dispatch"] = {"heartbeat_interval_ms": 10_000, "heartbeat_ttl_ms": 10_000}
    problem = only_problem(raw)
    assert problem.path == "$.dispatch.heartbeat_interval_ms"
    assert "heartbeat_ttl_ms" in problem.message

    raw["dispatch"] = {"heartbeat_interval_ms": 9_999, "heartbeat_ttl_ms": 10_000}
    assert cfg.parse(raw).config.dispatch.heartbeat_interval_ms == 9_999


def test_zero_values_allowed_where_documented() -> None:
    raw = base()
    raw["queue"]["max_queue"] = 0
    raw["models"][0]["max_queue"] = 0
    raw["dispatch"] = {"drain_grace_s": 0}
    config = cfg.parse(raw).config
    assert config.queue.max_queue == 0
    assert config.max_queue(config.models[0]) == 0
    assert config.dispatch.drain_grace_s == 0


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [("max_queue", -1, ">= 0"), ("queue_timeout_ms", 0, "> 0"), ("queue_timeout_ms", -1, "> 0")],
)
def test_model_queue_overrides_range(field: str, value: int, expected: str) -> None:
    raw = base()
    raw["models"][0][field] = value
    problem = only_problem(raw)
    assert problem.path == f"$.models[0].{field}"
    assert expected in problem.message


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [("mode", "lru", "Invalid enum value 'lru' (expected one of: off, prefix, session)"),
     ("load_bound", 0.9, "must be between 1 and 100, got 0.9"),
     ("load_floor", 1.5, "must be between 0 and 1, got 1.5"), ("load_floor", -0.1, "must be between 0 and 1, got -0.1"),
     ("index_max_blocks", 10, "must be between 16 and 10000000, got 10"), ("look_ahead", 65, "between 0 and 64"),
     ("max_wait_ms", -1, "between 0 and 60000"), ("weight", 2, "unknown field")],
)
def test_model_affinity_range(field: str, value: object, expected: str) -> None:
    raw = base()
    raw["models"][0]["affinity"] = {"mode": "prefix", field: value}
    problem = only_problem(raw)
    assert problem.path == f"$.models[0].affinity.{field}"
    assert expected in problem.message, problem.message


@pytest.mark.parametrize(("field", "value", "expected"), [
    ("requests_per_minute", 0, ">= 1"), ("tokens_per_minute", -5, ">= 1"), ("tokens_per_day", 0, ">= 1"),
    ("output_tokens_if_unset", -1, ">= 0"), ("requests_per_second", 5, "unknown field"),
])
def test_tenant_limits_range(field: str, value: int, expected: str) -> None:
    raw = base()
    raw["api"]["keys"] = [{"name": "t", "key_sha256": "0" * 64, "limits": {field: value}}]
    problem = only_problem(raw)
    assert problem.path == f"$.api.keys[0].limits.{field}"
    assert expected in problem.message


@pytest.mark.parametrize(("fallbacks", "path", "expected"), [
    ({"m1": ["nope"]}, "$.models[0].fallbacks[0]", "unknown model 'nope'"),
    ({"m1": ["m1"]}, "$.models[0].fallbacks[0]", "its own fallback"),
    ({"m1": ["m2", "m2"]}, "$.models[0].fallbacks[1]", "listed twice"),
    ({"m1": ["m2"], "m2": ["m1"]}, "$.models[0].fallbacks[0]", "loop: m1 -> m2 -> m1"),
])
def test_model_fallbacks_are_checked(fallbacks: dict[str, list[str]], path: str, expected: str) -> None:
    raw = base()
    raw["models"].append({"id": "m2", "providers": {"p1": "served-m1"}})
    for model in raw["models"]:
        model["fallbacks"] = fallbacks.get(model["id"], [])
    problems = problems_of(raw)
    assert any(p.path == path and expected in p.message for p in problems), problems


def test_a_refuse_predicted_over_ms_below_1_is_refused() -> None:
    raw = base()
    raw["queue"]["refuse_predicted_over_ms"] = 0
    assert only_problem(raw).path == "$.queue.refuse_predicted_over_ms"


@pytest.mark.parametrize(("dispatch", "period"), [
    ({}, 1000), ({"replica_ttl_ms": 3000}, 749), ({"lease_ms": 6000}, 999), ({"lease_ms": 3000}, 499),
    ({"replica_ttl_ms": 3000, "reap_interval_ms": 500}, 500),
])
def test_the_reaper_period_default_never_fails_validation(dispatch: dict[str, int], period: int) -> None:
    raw = base()
    raw["dispatch"] = dispatch
    d = cfg.parse(raw).config.dispatch
    assert d.reap_period_ms == period
    assert 2 * d.reap_period_ms < d.observation_gap_ms


def test_a_reap_interval_set_too_long_is_still_refused() -> None:
    raw = base()
    raw["dispatch"] = {"replica_ttl_ms": 3000, "reap_interval_ms": 1000}
    assert only_problem(raw).path == "$.dispatch.reap_interval_ms"


# --------------------------------------------------------------------------- all problems at once


def test_several_errors_are_all_reported_in_one_config_error() -> None:
    raw = base()
    raw["models"][0]["providers"]["p9"] = "x"  # unknown provider
    raw["models"].append({"id": "m1", "providers": {}})  # duplicate id + no providers
    raw["nodes"][0]["providers"].append(
        {"id": "p2", "type": "cli", "models": ["a"], "capacity": -3}  # no command, negative capacity
    )
    raw["nodes"].append(
        {
            "id": "n1",  # duplicate node id
            "providers": [
                {"id": "p1", "type": "vllm", "base_url": "http://x"},  # duplicate provider id
                {"id": "p3", "type": "ollama", "category": "gpu"},  # no base_url, bad category
                {"id": "p4", "type": "magic", "base_url": "http://y"},  # unknown type
            ],
        }
    )
    raw["queue"]["max_queue"] = -1
    raw["dispatch"] = {"max_attempts": 0}

    with pytest.raises(ConfigError) as info:
        cfg.parse(raw)
    problems = info.value.problems
    paths = [p.path for p in problems]
    assert sorted(paths) == sorted(
        [
            "$.models[0].providers.p9",
            "$.models[1].id",
            "$.models[1].providers",
            "$.nodes[0].providers[1].command",
            "$.nodes[0].providers[1].capacity",
            "$.nodes[1].id",
            "$.nodes[1].providers[0].id",
            "$.nodes[1].providers[1].base_url",
            "$.nodes[1].providers[1].category",
            "$.nodes[1].providers[2].type",
            "$.queue.max_queue",
            "$.dispatch.max_attempts",
        ]
    )
    # The exception text lists every problem as "path: message", one per line.
    lines = str(info.value).splitlines()
    assert len(lines) == len(problems)
    for problem in problems:
        assert f"{problem.path}: {problem.message}" in lines


EVERY_KIND = """
models:
  - id: m1
    providers: {p1: served-m1, ghost: x}     # a provider no node defines (cross-field)
    max_queue: "5"                            # the wrong type
  - id: m1                                    # a duplicate model id
    providers: {p1: served-m1}
    fallbacks: [m1]                           # its own fallback (cross-field)
  - providers: {p1: served-m1}                # no id
nodes:
  - id: n1
    providers:
      - {id: p1, type: vllm, base_url: "http://gpu1:8000", models: [served-m1], capcity: 2}   # unknown field
      - {id: p1, type: sglang, base_url: "http://gpu2:30000"}                                 # duplicate id
  - id: n1                                    # a duplicate node id
    providers:
      - {id: p3, type: ollama, capacity: -2, timeout_s: soon}   # no base_url; out of range; the wrong type
queue:
  queue_timeout_ms: 0                         # out of range
dispatch:
  heartbeat_interval_ms: 20000                # not shorter than heartbeat_ttl_ms (cross-field)
api:
  keys:
    - {name: web, key_sha256: "0000", max_in_flight: 0}   # not a sha256; out of range
    - {name: web, key_env: WEB_KEY}                        # a duplicate key name
"""


def test_every_kind_of_problem_is_reported_in_one_pass_in_the_order_of_the_file() -> None:
    with pytest.raises(ConfigError) as info:
        load_text(EVERY_KIND)
    assert [(p.path, p.message) for p in info.value.problems] == [
        ("$.models[0].providers.ghost", "no node defines provider 'ghost'"),
        ("$.models[0].max_queue", "Expected `int | null`, got `str`"),
        ("$.models[1].id", "duplicate model id 'm1'"),
        ("$.models[1].fallbacks[0]", "a model cannot be its own fallback"),
        ("$.models[2]", "Object missing required field `id`"),
        ("$.nodes[0].providers[0].capcity", "unknown field `capcity`"),
        ("$.nodes[0].providers[1].id", "duplicate provider id 'p1'"),
        ("$.nodes[1].id", "duplicate node id 'n1'"),
        ("$.nodes[1].providers[0].capacity", "must be >= 0, got -2 (0 keeps the provider out of rotation)"),
        ("$.nodes[1].providers[0].timeout_s", "Expected `float`, got `str`"),
        ("$.nodes[1].providers[0].base_url", "required for type 'ollama'"),  # (a field not written: after its provider)
        ("$.queue.queue_timeout_ms", "must be > 0, got 0"),
        ("$.dispatch.heartbeat_interval_ms", "must be shorter than heartbeat_ttl_ms (20000 >= 10000)"),
        ("$.api.keys[0].key_sha256", "must be 64 hex digits (sha256 of the key)"),
        ("$.api.keys[0].max_in_flight", "must be >= 1, got 0"),
        ("$.api.keys[1].name", "duplicate key name 'web'"),
    ]


def test_a_check_is_not_held_against_the_file_for_a_value_it_got_wrong() -> None:
    # Each time the value a rule would read is the one reported: nothing more is said.
    raw = base()
    provider(raw)["id"] = ["p1"]  # the providers' ids are not all known: no "no node defines provider 'p1'"
    assert [p.path for p in problems_of(raw)] == ["$.nodes[0].providers[0].id"]
    raw = base()
    provider(raw)["models"] = [7]  # nor "served name 'served-m1' is not in provider 'p1' models"
    assert [p.path for p in problems_of(raw)] == ["$.nodes[0].providers[0].models[0]"]
    raw = base()
    raw["dispatch"] = {"heartbeat_ttl_ms": "10s", "heartbeat_interval_ms": 20_000}  # nor against the default ttl
    assert [p.path for p in problems_of(raw)] == ["$.dispatch.heartbeat_ttl_ms"]
    raw = base()
    raw["models"].append({"id": "m2", "providers": {"p1": "served-m1"}, "fallbacks": ["m3"]})
    raw["models"].append({"id": {"name": "m3"}, "providers": {"p1": "served-m1"}})  # nor "unknown model 'm3'"
    assert [p.path for p in problems_of(raw)] == ["$.models[2].id"]
    raw = base()
    raw["api"]["keys"] = [{"name": "web", "key_env": 5}]  # nor "give exactly one of key_env and key_sha256"
    assert [p.path for p in problems_of(raw)] == ["$.api.keys[0].key_env"]
    # A rule that reads only values the file got right still applies.
    raw = base()
    raw["models"][0]["providers"]["ghost"] = "x"
    raw["queue"]["max_queue"] = "ten"
    assert [p.path for p in problems_of(raw)] == ["$.queue.max_queue", "$.models[0].providers.ghost"]


def test_validate_returns_problems_without_raising() -> None:
    raw = base()
    raw["models"][0]["providers"] = {"p9": "x"}
    config = msgspec.convert(raw, type=cfg.Config)
    assert cfg.validate(config) == [
        ConfigProblem("$.models[0].providers.p9", "no node defines provider 'p9'")
    ]


# --------------------------------------------------------------------------- decoding errors


def test_unknown_top_level_field() -> None:
    problem = decode_problem(ONE_MODEL_YAML + "modles: []\n")
    assert problem.path == "$.modles"
    assert "`modles`" in problem.message
    assert "unknown field" in problem.message


def test_unknown_nested_field_reports_its_path() -> None:
    raw = base()
    provider(raw)["capcity"] = 3
    problem = only_problem(raw)
    assert problem.path == "$.nodes[0].providers[0].capcity"
    assert "`capcity`" in problem.message

    raw = base()
    raw["queue"]["timeout"] = 3
    problem = only_problem(raw)
    assert problem.path == "$.queue.timeout"
    assert "`timeout`" in problem.message

    raw = base()
    raw["models"][0]["alias"] = "m"
    problem = only_problem(raw)
    assert problem.path == "$.models[0].alias"
    assert "`alias`" in problem.message


@pytest.mark.parametrize(
    ("mutate", "path", "expected"),
    [
        (lambda r: provider(r).update(capacity="2"), "$.nodes[0].providers[0].capacity",
         "expected an integer or one of: auto"),
        (lambda r: provider(r).update(capacity=True), "$.nodes[0].providers[0].capacity", "`bool`"),
        (lambda r: provider(r).update(command="echo hi"), "$.nodes[0].providers[0].command", "`str`"),
        (lambda r: provider(r).update(models="served-m1"), "$.nodes[0].providers[0].models", "`str`"),
        (lambda r: provider(r).update(models=["served-m1", 7]), "$.nodes[0].providers[0].models[1]", "`int`"),
        (lambda r: provider(r).update(type=["vllm"]), "$.nodes[0].providers[0].type", "`array`"),
        (lambda r: r["models"][0].update(providers=["p1"]), "$.models[0].providers", "`object`"),
        (lambda r: r["models"][0]["providers"].update(p1=3), "$.models[0].providers.p1", "`int`"),
        (lambda r: r.update(models={"id": "m1"}), "$.models", "`array`"),
        (lambda r: r.update(models=["m1"]), "$.models[0]", "`str`"),
        (lambda r: r.update(nodes=None), "$.nodes", "`null`"),
        (lambda r: r.update(nodes=[None]), "$.nodes[0]", "`null`"),
        (lambda r: r["queue"].update(max_queue=1.5), "$.queue.max_queue", "`float`"),
        (lambda r: r.update(redis="redis://x"), "$.redis", "`str`"),
    ],
)
def test_wrong_type_reports_its_path(mutate: Any, path: str, expected: str) -> None:
    # Alone: what the rest of the file is checked against stands in for the bad value, and
    # no check is held against the file for what only follows from it (a model's provider
    # no node defines, when the nodes are not a list; no model, when models[] is not one).
    raw = base()
    mutate(raw)
    problem = only_problem(raw)
    assert problem.path == path
    assert expected in problem.message


def test_wrong_type_from_yaml_reports_its_path() -> None:
    problem = decode_problem(ONE_MODEL_YAML + "  - id: n1\n    providers:\n      - id: p1\n        type: [vllm]\n")
    assert problem.path == "$.nodes[1].providers[0].type"
    assert "Expected `str`" in problem.message


def test_non_string_mapping_key_reports_its_path() -> None:
    problem = decode_problem("models:\n  - id: m1\n    providers: {1: served}\n")
    assert problem.path == "$.models[0].providers"
    assert "`str`" in problem.message
    assert "mapping key" in problem.message


@pytest.mark.parametrize("text", ["models: [1,\n", "a: b: c\n", "nodes:\n  - id: n1\n   bad: indent\n"])
def test_yaml_syntax_error(text: str) -> None:
    problem = decode_problem(text)
    assert problem.path == "$"
    assert problem.message.startswith("not valid YAML:")
    assert "line" in problem.message


def test_multiple_yaml_documents_are_rejected() -> None:
    problem = decode_problem("models: []\n---\nnodes: []\n")
    assert problem.path == "$"
    assert "not valid YAML" in problem.message


@pytest.mark.parametrize("text", ["- models\n- nodes\n", "just a string\n", "42\n"])
def test_non_mapping_document(text: str) -> None:
    problem = decode_problem(text)
    assert problem == ConfigProblem("$", "the config must be a mapping")


@pytest.mark.parametrize("raw", [[], "x", 3])
def test_parse_non_mapping(raw: Any) -> None:
    assert only_problem(raw) == ConfigProblem("$", "the config must be a mapping")


@pytest.mark.parametrize("text", ["", "\n\n", "# nothing configured yet\n", "---\n", "models: []\n",
                                  "queue: {max_queue: 7}\n", "nodes: [{id: n1}]\n"])
def test_a_config_without_a_model_is_refused(text: str) -> None:
    # It would start, and answer every request 404: say what is missing instead.
    assert decode_problem(text) == ConfigProblem("$.models", NO_MODELS)


def test_an_empty_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_bytes(b"")
    with pytest.raises(ConfigError) as info:
        cfg.load(path)
    assert info.value.problems == [ConfigProblem("$.models", NO_MODELS)]


def test_one_model_on_one_provider_is_enough() -> None:
    config = load_text(ONE_MODEL_YAML).config
    assert [m.id for m in config.models] == ["m"]
    assert config.redis.url is None
    assert config.api == cfg.ApiConfig()
    assert config.queue == cfg.QueueConfig(max_queue=100, queue_timeout_ms=30_000)
    assert config.dispatch == cfg.DispatchConfig()
    assert cfg.validate(config) == []


def test_unset_fields_of_a_section_keep_their_defaults() -> None:
    config = load_text("queue:\n  max_queue: 7\n" + ONE_MODEL_YAML).config
    assert config.queue.max_queue == 7
    assert config.queue.queue_timeout_ms == 30_000


# --------------------------------------------------------------------------- load()


def test_load_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope" / "iop.yaml"
    with pytest.raises(ConfigError) as info:
        cfg.load(path)
    (problem,) = info.value.problems
    assert problem.path == "$"
    assert str(path) in problem.message
    assert "cannot read" in problem.message
    assert "No such file or directory" in problem.message


def test_load_directory_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        cfg.load(tmp_path)
    (problem,) = info.value.problems
    assert str(tmp_path) in problem.message
    assert "cannot read" in problem.message


def test_load_reports_validation_problems(tmp_path: Path) -> None:
    path = tmp_path / "iop.yaml"
    path.write_text(msgspec.yaml.encode(base()).decode().replace("served-m1\n", "served-m2\n", 1))
    with pytest.raises(ConfigError) as info:
        cfg.load(str(path))
    assert [p.path for p in info.value.problems] == ["$.models[0].providers.p1"]


# --------------------------------------------------------------------------- redis env override


def test_redis_url_env_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IOP_REDIS_URL", "redis://override:6380/3")
    assert cfg.parse(base()).config.redis.url == "redis://override:6380/3"


def test_redis_url_env_applies_without_redis_section(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IOP_REDIS_URL", "redis://override:6380/3")
    assert load_text(ONE_MODEL_YAML).config.redis.url == "redis://override:6380/3"


def test_redis_url_from_file_when_env_unset() -> None:
    assert cfg.parse(base()).config.redis.url == "redis://localhost:6379/0"


def test_empty_redis_env_does_not_blank_the_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IOP_REDIS_URL", "")
    assert cfg.parse(base()).config.redis.url == "redis://localhost:6379/0"


# --------------------------------------------------------------------------- base_url normalisation


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://h:8000/v1/", "http://h:8000"),
        ("http://h:8000/v1", "http://h:8000"),
        ("http://h:8000/", "http://h:8000"),
        ("http://h:8000", "http://h:8000"),
        ("https://api.example.com/v1", "https://api.example.com"),
        ("http://h:8000/api/v1/", "http://h:8000/api"),
        ("http://h:8000/v10", "http://h:8000/v10"),
        ("http://h:8000/xv1", "http://h:8000/xv1"),
    ],
)
def test_normalise_base_url(url: str, expected: str) -> None:
    assert cfg.normalise_base_url(url) == expected


def test_base_url_is_normalised_on_load() -> None:
    raw = base()
    provider(raw)["base_url"] = "http://h:8000/v1/"
    assert cfg.parse(raw).config.nodes[0].providers[0].base_url == "http://h:8000"


# --------------------------------------------------------------------------- categories


@pytest.mark.parametrize(
    ("ptype", "category"),
    [
        ("vllm", "local_inference"),
        ("sglang", "local_inference"),
        ("lemonade", "local_inference"),
        ("ollama", "local_inference"),
        ("openai_api", "api"),
        ("cli", "cli"),
    ],
)
def test_category_derived_from_type(ptype: str, category: str) -> None:
    raw = base()
    prov = provider(raw)
    prov["type"] = ptype
    if ptype == "cli":
        prov.update(base_url=None, command=["run-model"])
    loaded = cfg.parse(raw).config.nodes[0].providers[0]
    assert loaded.category is None
    assert loaded.effective_category == category


def test_explicit_category_wins_over_type() -> None:
    raw = base()
    provider(raw)["category"] = "api"  # a vllm hosted elsewhere, billed like an API
    loaded = cfg.parse(raw).config.nodes[0].providers[0]
    assert loaded.category == "api"
    assert loaded.effective_category == "api"


# --------------------------------------------------------------------------- queue defaults


def test_queue_settings_fall_back_to_queue_section() -> None:
    config = cfg.parse(base()).config
    model = config.models[0]
    assert model.max_queue is None
    assert model.queue_timeout_ms is None
    assert config.max_queue(model) == 10
    assert config.queue_timeout_ms(model) == 5000


def test_queue_settings_fall_back_to_builtin_defaults() -> None:
    raw = base()
    del raw["queue"]
    config = cfg.parse(raw).config
    assert config.max_queue(config.models[0]) == 100
    assert config.queue_timeout_ms(config.models[0]) == 30_000


def test_per_model_queue_overrides() -> None:
    raw = base()
    raw["models"][0].update(max_queue=3, queue_timeout_ms=750)
    raw["models"].append({"id": "m2", "providers": {"p1": "served-m1"}, "max_queue": 0})
    config = cfg.parse(raw).config
    m1, m2 = config.models
    assert (config.max_queue(m1), config.queue_timeout_ms(m1)) == (3, 750)
    # max_queue 0 is an override (not "unset"): the queue default must not leak through.
    assert (config.max_queue(m2), config.queue_timeout_ms(m2)) == (0, 5000)


def test_provider_defaults() -> None:
    raw = base()
    prov = provider(raw)
    del prov["capacity"]
    config = cfg.parse(raw).config
    loaded = config.nodes[0].providers[0]
    assert loaded.capacity == 1
    assert loaded.timeout_s == 600.0
    assert loaded.api_key_env is None
    assert loaded.command is None


# --------------------------------------------------------------------------- secrets in the file


def test_secrets_written_into_the_file_are_warned_about() -> None:
    raw = base()
    raw["redis"] = {"url": "redis://iop:hunter2@10.0.0.9:6379/0"}
    raw["api"]["api_keys_env"] = "sk-live-0123456789abcdefghij"
    provider(raw)["base_url"] = "http://admin:pw@10.0.0.5:8000"
    provider(raw)["api_key_env"] = "not a variable name"
    _, warnings = cfg.parse(raw)
    assert "$.redis.url: holds a password" in warnings[0]
    assert any(w.startswith("$.api.api_keys_env: looks like a key") for w in warnings)
    assert any(w.startswith("$.nodes[0].providers[0].base_url: holds a password") for w in warnings)
    assert any(w.startswith("$.nodes[0].providers[0].api_key_env: looks like a key") for w in warnings)
    # None of them quotes the secret itself.
    assert not any("hunter2" in w or "0123456789" in w for w in warnings)


def test_secret_looking_cli_arguments_are_warned_about() -> None:
    raw = base()
    raw["nodes"][0]["providers"].append({"id": "tool", "type": "cli", "models": ["t"],
                                         "command": ["llm", "--api-key=abc123", "--model", "{model}"]})
    _, warnings = cfg.parse(raw)
    assert warnings == ["$.nodes[0].providers[1].command[1]: looks like a secret; pass it through api_key_env"]


def test_a_clean_file_has_no_secret_warnings() -> None:
    assert cfg.parse(base()).warnings == []


def test_the_environment_url_is_not_the_files_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IOP_REDIS_URL", "redis://iop:hunter2@10.0.0.9:6379/0")
    config, warnings = cfg.parse(base())
    assert config.redis.url == "redis://iop:hunter2@10.0.0.9:6379/0"
    assert warnings == []
