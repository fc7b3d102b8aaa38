"""``iop config migrate``: the pool-shape file it prints loads to exactly the config the legacy
file loads to, passes ``iop config check``, and says what changed; broken input exits 2 with
problems at their legacy paths. Also: ``config check`` prints the deprecation warnings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import yaml

from dispatcher import config as cfg
from dispatcher.config.validation import NO_MODELS
from iop.cli import main

ROOT = Path(__file__).resolve().parents[2]

ONE_ROUTE = """
# One id, one instance.
openai:
  model_routes:
    - model: llama3           # external model id
      adapter: ollama-local   # adapter instance key
      target: llama3:8b       # served model name on that instance
nodes:
  - id: n1
    adapters:                 # adapter instances owned by the node
      ollama-local:
        type: ollama
        base_url: http://127.0.0.1:11434
        capacity: 2
"""

SEVERAL_ROUTES_ONE_INSTANCE = """
redis:
  url: redis://redis.internal:6379/2
openai:
  model_routes:
    - {model: llama3, adapter: ollama-local, target: "llama3:8b"}
    - {model: "qwen3.6:35b", adapter: ollama-local, target: "qwen3.6:35b-q4_K_M"}
    - {model: llama3-alias, adapter: ollama-local, target: "llama3:8b"}
nodes:
  - id: n1
    adapters:
      ollama-local:
        type: ollama
        base_url: http://127.0.0.1:11434/v1/
        capacity: 3
        timeout_s: 120
        models: ["qwen3.6:35b-q4_K_M", phi3]
queue: {max_queue: 7, queue_timeout_ms: 9000}
"""

ROUTES_ACROSS_NODES = """
api:
  api_keys_env: IOP_KEYS
openai:
  model_routes:
    - {model: llama3, adapter: gpu1-ollama, target: "llama3:8b"}
    - {model: qwen, adapter: gpu2-vllm, target: Qwen/Qwen3-8B}
    - {model: gpt-4o-mini, adapter: hosted, target: gpt-4o-mini}
    - {model: claude, adapter: claude-cli, target: sonnet}
nodes:
  - id: gpu1
    adapters:
      gpu1-ollama: {type: ollama, base_url: "http://gpu1:11434", capacity: 1}
  - id: gpu2
    adapters:
      gpu2-vllm: {type: vllm, base_url: "http://gpu2:8000/v1", capacity: 4, category: api}
      hosted: {type: openai_api, base_url: "https://api.example.com/v1", api_key_env: OPENAI_API_KEY, capacity: 8}
      claude-cli: {type: cli, command: [claude, -p, --model, "{model}"], capacity: 1}
      spare: {type: lemonade, base_url: "http://gpu2:8001", models: [phi3]}
dispatch:
  lease_ms: 20000
demo:
  fake_providers:
    - {port: 9101, tokens: 4}
"""

MIXED = """
queue:
  max_queue: 5
models:
  - id: qwen
    display_name: Qwen 3 8B
    providers: {p-vllm: Qwen/Qwen3-8B, ollama-local: "qwen3:8b"}
    max_queue: 2
openai:
  model_routes:
    - {model: llama3, adapter: ollama-local, target: "llama3:8b"}
    - {model: qwen-direct, adapter: p-vllm, target: Qwen/Qwen3-8B}
nodes:
  - id: n1
    providers:
      - {id: p-vllm, type: vllm, base_url: "http://gpu:8000", models: [Qwen/Qwen3-8B]}
    adapters:
      ollama-local: {type: ollama, base_url: "http://127.0.0.1:11434", models: ["qwen3:8b"]}
  - id: n2
    providers:
      - {id: p-other, type: sglang, base_url: "http://gpu2:30000", models: [x]}
"""

# Ids and names YAML would read as something else when written bare.
TRICKY = """
openai:
  model_routes:
    - {model: "yes", adapter: "a: b", target: "null"}
    - {model: "1.0", adapter: "a: b", target: "#not-a-comment"}
    - {model: "- dash", adapter: "a: b", target: "'quoted'"}
    - {model: "ünïcode", adapter: "a: b", target: "[x]"}
nodes:
  - id: "007"
    adapters:
      "a: b": {type: vllm, base_url: "http://h:1"}
"""

LEGACY = {
    "one-route": ONE_ROUTE,
    "several-routes-one-instance": SEVERAL_ROUTES_ONE_INSTANCE,
    "routes-across-nodes": ROUTES_ACROSS_NODES,
    "mixed": MIXED,
    "tricky-names": TRICKY,
}

NEW_SHAPE = """
models:
  - id: m1
    providers: {p1: served-1}
nodes:
  - id: n1
    providers:
      - {id: p1, type: vllm, base_url: "http://127.0.0.1:9", models: [served-1]}
"""

CONFLICTING_IDS = """
models:
  - id: llama3
    providers: {p1: served-1}
openai:
  model_routes:
    - {model: qwen, adapter: ollama-local, target: "qwen:7b"}
    - {model: llama3, adapter: ollama-local, target: "llama3:8b"}
    - {model: qwen, adapter: ollama-local, target: "qwen:14b"}
nodes:
  - id: n1
    providers:
      - {id: p1, type: vllm, base_url: "http://127.0.0.1:9", models: [served-1]}
    adapters:
      ollama-local: {type: ollama, base_url: "http://127.0.0.1:11434"}
"""

UNKNOWN_ADAPTER = """
openai:
  model_routes:
    - {model: llama3, adapter: ollama-local, target: "llama3:8b"}
    - {model: qwen, adapter: x, target: "qwen:7b"}
nodes:
  - id: n1
    adapters:
      ollama-local: {type: ollama, base_url: "http://127.0.0.1:11434"}
      p1: {type: tgi, capacity: -1}
  - id: n2
    providers:
      - {id: p1, type: vllm, base_url: "http://127.0.0.1:9"}
"""

INVALID = {
    "conflicting-ids": (CONFLICTING_IDS, {
        "$.openai.model_routes[1].model": "duplicate model id 'llama3' (also defined at $.models[0].id)",
        "$.openai.model_routes[2].model": "duplicate model id 'qwen' (also defined at $.openai.model_routes[0].model)",
    }),
    "unknown-adapter": (UNKNOWN_ADAPTER, {
        "$.openai.model_routes[1].adapter": "no node defines adapter 'x'",
        "$.nodes[0].adapters.p1.type": "unknown type 'tgi'",
        "$.nodes[0].adapters.p1.capacity": "must be >= 0",
        "$.nodes[0].adapters.p1": "has the id of the provider at $.nodes[1].providers[0]",
    }),
    "unknown-field": ("openai:\n  model_routes:\n    - {model: m, adapter: a, target: t, weight: 3}\n", {
        "$.openai.model_routes[0].adapter": "no node defines adapter 'a'",  # (reported with it: every problem)
        "$.openai.model_routes[0].weight": "unknown field `weight`",
    }),
}


def run_iop(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "IOP_REDIS_URL"}
    return subprocess.run([sys.executable, "-m", "iop", *args], capture_output=True, text=True,
                          timeout=60, env=env, cwd=ROOT)


def call_main(*args: str) -> int:
    try:
        return main(list(args))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1


def migrate(path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert call_main("config", "migrate", str(path)) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return out


@pytest.fixture(autouse=True)
def _no_redis_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("IOP_REDIS_URL", raising=False)


@pytest.fixture(params=sorted(LEGACY))
def legacy_file(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    path = tmp_path / f"{request.param}.yaml"
    path.write_text(LEGACY[request.param])
    return path


# --------------------------------------------------------------------------- same routing


def test_migrated_file_loads_to_the_same_config(
    legacy_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    migrated = tmp_path / "migrated.yaml"
    migrated.write_text(migrate(legacy_file, capsys))
    before, warnings = cfg.load(legacy_file)
    after, after_warnings = cfg.load(migrated)
    assert warnings  # it was legacy
    assert after_warnings == []
    assert after == before
    assert msgspec.structs.asdict(after) == msgspec.structs.asdict(before)
    # Spelled out, the things routing depends on.
    assert [(m.id, m.providers) for m in after.models] == [(m.id, m.providers) for m in before.models]
    assert [(n.id, p) for n, p in after.providers()] == [(n.id, p) for n, p in before.providers()]


def test_migrated_file_has_no_legacy_sections_and_keeps_the_others(
    legacy_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = migrate(legacy_file, capsys)
    old = yaml.safe_load(legacy_file.read_text())
    new = yaml.safe_load(out)
    assert "openai" not in new
    assert all("adapters" not in node for node in new["nodes"])
    for section in ("redis", "api", "queue", "dispatch", "demo"):
        assert new.get(section) == old.get(section), section
    # models[] entries that were already there are copied as written.
    assert new["models"][: len(old.get("models", []))] == old.get("models", [])
    assert [k for k in new if k != "models"] == [k for k in old if k not in ("openai", "models")]


def test_migrated_file_passes_config_check(
    legacy_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    migrated = tmp_path / "migrated.yaml"
    migrated.write_text(migrate(legacy_file, capsys))
    assert call_main("config", "check", str(migrated)) == 0
    out, err = capsys.readouterr()
    assert "OK" in out
    assert err == ""  # no deprecation warning left
    # The same model lines as the legacy file's check.
    assert call_main("config", "check", str(legacy_file)) == 0
    assert capsys.readouterr().out.splitlines()[1:] == out.splitlines()[1:]


def test_migrating_twice_changes_nothing_more(
    legacy_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    once = tmp_path / "once.yaml"
    once.write_text(migrate(legacy_file, capsys))
    twice = migrate(once, capsys)
    assert twice.startswith(f"# {once}: no legacy entries; nothing to migrate.\n")
    assert yaml.safe_load(twice) == yaml.safe_load(once.read_text())


def test_migrate_ignores_the_redis_url_env(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The env override is a run-time setting: it must not be written into the migrated file."""
    path = tmp_path / "legacy.yaml"
    path.write_text(SEVERAL_ROUTES_ONE_INSTANCE)
    monkeypatch.setenv("IOP_REDIS_URL", "redis://elsewhere:1/0")
    assert yaml.safe_load(migrate(path, capsys))["redis"] == {"url": "redis://redis.internal:6379/2"}


# --------------------------------------------------------------------------- the header


def header_of(text: str) -> list[str]:
    lines: list[str] = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return lines


def test_header_lists_every_change(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "legacy.yaml"
    path.write_text(SEVERAL_ROUTES_ONE_INSTANCE)
    header = header_of(migrate(path, capsys))
    assert header[0] == f"# Migrated by 'iop config migrate' from {path}: the legacy route shape"
    changes = [line.removeprefix("#   ") for line in header if line.startswith("#   ")]
    assert changes == [
        "route $.openai.model_routes[0] -> model group 'llama3' ($.models[0]) with providers "
        "{'ollama-local': 'llama3:8b'}",
        "route $.openai.model_routes[1] -> model group 'qwen3.6:35b' ($.models[1]) with providers "
        "{'ollama-local': 'qwen3.6:35b-q4_K_M'}",
        "route $.openai.model_routes[2] -> model group 'llama3-alias' ($.models[2]) with providers "
        "{'ollama-local': 'llama3:8b'}",
        "adapter instance $.nodes[0].adapters.ollama-local -> provider 'ollama-local' ($.nodes[0].providers[0]), "
        "type 'ollama', category 'local_inference' (derived from the type)",
        "target 'llama3:8b' added to the models of provider 'ollama-local' (for route $.openai.model_routes[0])",
    ]


def test_header_names_every_route_instance_and_category(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "legacy.yaml"
    path.write_text(ROUTES_ACROSS_NODES)
    header = "\n".join(header_of(migrate(path, capsys)))
    for ri in range(4):
        assert f"route $.openai.model_routes[{ri}] -> model group" in header
    for key, category, how in [("gpu1-ollama", "local_inference", "derived from the type"),
                               ("gpu2-vllm", "api", "as configured"), ("hosted", "api", "derived from the type"),
                               ("claude-cli", "cli", "derived from the type"),
                               ("spare", "local_inference", "derived from the type")]:
        assert f"adapters.{key} -> provider {key!r}" in header
        assert f"category {category!r} ({how})" in header
    for target, key in [("llama3:8b", "gpu1-ollama"), ("Qwen/Qwen3-8B", "gpu2-vllm"),
                        ("gpt-4o-mini", "hosted"), ("sonnet", "claude-cli")]:
        assert f"target {target!r} added to the models of provider {key!r}" in header
    assert "'phi3' added" not in header  # spare already listed it


def test_migrated_providers_show_category_and_added_targets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "legacy.yaml"
    path.write_text(SEVERAL_ROUTES_ONE_INSTANCE)
    node = yaml.safe_load(migrate(path, capsys))["nodes"][0]
    assert node == {"id": "n1", "providers": [{
        "id": "ollama-local", "type": "ollama", "category": "local_inference",
        "base_url": "http://127.0.0.1:11434/v1/",  # as written; loading normalises it either way
        "capacity": 3, "timeout_s": 120, "models": ["qwen3.6:35b-q4_K_M", "phi3", "llama3:8b"],
    }]}


def test_new_shape_file_is_left_as_it_is(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "new.yaml"
    path.write_text(NEW_SHAPE)
    out = migrate(path, capsys)
    assert header_of(out) == [f"# {path}: no legacy entries; nothing to migrate."]
    assert yaml.safe_load(out) == yaml.safe_load(NEW_SHAPE)


def test_empty_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Only a config that loads is migrated, and one without a model does not.
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert call_main("config", "migrate", str(path)) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [f"{path}: 1 problem(s)", f"  $.models: {NO_MODELS}"]


# --------------------------------------------------------------------------- invalid input


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_legacy_file_exits_2_with_legacy_paths(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text, expected = INVALID[case]
    path = tmp_path / f"{case}.yaml"
    path.write_text(text)
    for command in ("migrate", "check"):
        assert call_main("config", command, str(path)) == 2
        out, err = capsys.readouterr()
        assert out == ""
        lines = err.splitlines()
        assert lines[0] == f"{path}: {len(expected)} problem(s)"
        for where, words in expected.items():
            matching = [line for line in lines[1:] if line.startswith(f"  {where}: ")]
            assert len(matching) == 1, f"{where}:\n{err}"
            assert words in matching[0]


def test_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert call_main("config", "migrate", str(tmp_path / "nope.yaml")) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "cannot read" in err
    assert "Traceback" not in err


def test_migrate_needs_a_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert call_main("config", "migrate") == 2
    assert "usage: iop config migrate" in capsys.readouterr().err


# --------------------------------------------------------------------------- the console script


def test_subprocess_migrate_and_check(tmp_path: Path) -> None:
    legacy = tmp_path / "legacy.yaml"
    legacy.write_text(ROUTES_ACROSS_NODES)
    result = run_iop("config", "migrate", str(legacy))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    migrated = tmp_path / "migrated.yaml"
    migrated.write_text(result.stdout)
    assert cfg.load(migrated).config == cfg.load(legacy).config

    check = run_iop("config", "check", str(migrated))
    assert check.returncode == 0, check.stderr
    assert check.stderr == ""
    assert "OK - 4 model(s), 2 node(s), 5 provider(s)" in check.stdout


def test_subprocess_invalid_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(UNKNOWN_ADAPTER)
    result = run_iop("config", "migrate", str(path))
    assert result.returncode == 2
    assert result.stdout == ""
    for where in INVALID["unknown-adapter"][1]:
        assert f"  {where}: " in result.stderr
    assert "Traceback" not in result.stderr


def test_check_prints_deprecation_warnings_to_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "legacy.yaml"
    path.write_text(SEVERAL_ROUTES_ONE_INSTANCE)
    assert call_main("config", "check", str(path)) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"{path}: OK - 3 model(s), 1 node(s), 1 provider(s), total capacity 3")
    assert "legacy route" not in out
    lines = err.splitlines()
    assert lines[0] == f"{path}: 4 warning(s)"
    expected = [
        "$.openai.model_routes[0] (llama3): legacy route",
        "$.openai.model_routes[1] (qwen3.6:35b): legacy route",
        "$.openai.model_routes[2] (llama3-alias): legacy route",
        "$.nodes[0].adapters.ollama-local: legacy adapter instance",
    ]
    assert len(lines) == 1 + len(expected)
    for line, start in zip(lines[1:], expected, strict=True):
        assert line.startswith(f"  {start}")
        assert line.endswith("run 'iop config migrate'")


def test_check_subprocess_prints_warnings_once(tmp_path: Path) -> None:
    """``config check`` prints the warnings itself; they must not also come out of the logger."""
    path = tmp_path / "legacy.yaml"
    path.write_text(ONE_ROUTE)
    result = run_iop("config", "check", str(path))
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("legacy route") == 1
    assert result.stderr.count("legacy adapter instance") == 1
