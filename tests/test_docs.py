"""The documentation, checked by reading it against the tree: ``README.md`` and ``docs/*.md``.

Each ``check_*`` function holds one rule and fails with an ``AssertionError`` saying what is
wrong. The ``test_*`` functions run them on the real files; the ``test_*_catches_*`` ones run
them on broken copies, so every rule is shown to be able to fail.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from typing import Any

import pytest
import yaml

import api.qualify  # noqa: F401  (defines the qualification errors the table lists)
from dispatcher import config as cfg
from dispatcher import exceptions
from dispatcher.endpoints import ENDPOINTS
from iop.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
DESIGN = DOCS / "DESIGN.md"
API_DOC = DOCS / "API.md"
CONFIG_DOC = DOCS / "CONFIG.md"
CI_RUN = ROOT / ".ci" / "run"
MARKDOWN = [README, *sorted(DOCS.glob("*.md"))]

README_MAX_LINES = 400
TEST_COMMAND = "./dev test"
# The heading of DESIGN.md's table of the scripts, one row per lua/*.lua.
SCRIPTS_HEADING = "### The scripts"
# Error codes no caller reads in an iop error body: the base class's, a request whose caller
# left (nobody gets an answer), and a provider's own error, relayed with the provider's body
# (the table's "(the provider's)" row); a failed model load, which its worker reports to Redis
# (lua/load_done.lua) while the requests that wait for the model go on waiting.
UNANSWERED_CODES = {"internal_error", "cancelled", "provider_rejected", "model_lifecycle_failed"}

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_HEADING = re.compile(r"^(#{1,6}) (.+?)\s*$", re.M)


def without_code(text: str) -> str:
    """``text`` with its fenced blocks blanked, line count kept (a ``#`` there is no heading)."""
    return _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


# --------------------------------------------------------------------------- links


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, markup and punctuation dropped, spaces to
    hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(text: str) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for match in _HEADING.finditer(without_code(text)):
        base = slug(match.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def check_links(path: Path, text: str, root: Path = ROOT) -> None:
    """Every relative link names a file of the repo that exists, and an anchor a heading of
    the page it names."""
    for target in _LINK.findall(without_code(text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path.resolve()
        assert dest.is_relative_to(root.resolve()), f"{path.name}: link {target!r} points outside the repo"
        assert dest.exists(), f"{path.name}: link {target!r}: {dest.relative_to(root.resolve())} does not exist"
        if anchor and dest.suffix == ".md":
            page = text if dest == path.resolve() else dest.read_text()
            assert anchor in anchors(page), f"{path.name}: link {target!r}: no heading of {dest.name} has that anchor"


def check_inside_repo(path: Path, text: str) -> None:
    """No path in the text leaves the repo (a ``../shared/...`` of a sibling checkout)."""
    for match in re.finditer(r"(?<![\w.])(\.\./[\w./-]+)", text):
        dest = (path.parent / match.group(1)).resolve()
        assert dest.is_relative_to(ROOT.resolve()), f"{path.name}: {match.group(1)!r} points outside the repo"


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: p.name)
def test_links_point_at_files_that_exist(path: Path) -> None:
    check_links(path, path.read_text())


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: p.name)
def test_no_path_leaves_the_repo(path: Path) -> None:
    check_inside_repo(path, path.read_text())


@pytest.mark.parametrize(("text", "message"), [
    ("see [x](docs/NOPE.md)", "docs/NOPE.md does not exist"),
    ("see [x](docs/DESIGN.md#no-such-heading)", "no heading of DESIGN.md"),
    ("see [x](#nowhere)\n\n## Somewhere", "no heading of README.md"),
    ("see [x](../shared/notes.md)", "points outside the repo"),
])
def test_links_catch(text: str, message: str) -> None:
    with pytest.raises(AssertionError, match=re.escape(message)):
        check_links(README, text)


def test_links_accept_what_exists() -> None:
    check_links(README, "[a](docs/DESIGN.md#design-notes), [b](#here), [c](https://example.com)\n\n## Here\n"
                        "```sh\n# not a heading\n```\n[d](lua/submit.lua)")


def test_inside_repo_catches() -> None:
    with pytest.raises(AssertionError, match="outside the repo"):
        check_inside_repo(DESIGN, "the contract in ../../shared/contract.md")
    check_inside_repo(DESIGN, "the README, ../README.md")


def test_slugs_are_githubs() -> None:
    assert slug("Drain and resume a provider") == "drain-and-resume-a-provider"
    assert slug("Capacity that iop learns (`capacity: auto`)") == "capacity-that-iop-learns-capacity-auto"
    assert slug("Redis failover (Cluster, Sentinel)") == "redis-failover-cluster-sentinel"
    assert anchors("## A\n## A\n") == {"a", "a-1"}


# --------------------------------------------------------------------------- DESIGN's scripts


def design_scripts(text: str) -> list[str]:
    """The scripts DESIGN.md's table under SCRIPTS_HEADING names, in its order."""
    assert SCRIPTS_HEADING in text, f"DESIGN.md has no {SCRIPTS_HEADING!r} section"
    section = text.split(SCRIPTS_HEADING, 1)[1]
    section = re.split(r"^#{1,3} ", section, maxsplit=1, flags=re.M)[0]
    return re.findall(r"^\| `lua/(\w+)\.lua` \|", section, re.M)


def check_design_scripts(text: str, lua: Path = ROOT / "lua") -> None:
    listed = design_scripts(text)
    present = sorted(p.stem for p in lua.glob("*.lua"))
    assert len(listed) == len(set(listed)), f"DESIGN.md lists a script twice: {listed}"
    missing, stale = sorted(set(present) - set(listed)), sorted(set(listed) - set(present))
    assert not missing, f"DESIGN.md's scripts differ from lua/*.lua: not listed {missing}"
    assert not stale, f"DESIGN.md's scripts differ from lua/*.lua: listed but gone {stale}"


def test_design_lists_every_script() -> None:
    check_design_scripts(DESIGN.read_text())


def test_design_scripts_catch() -> None:
    text = DESIGN.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `lua/submit.lua` |"))
    with pytest.raises(AssertionError, match=re.escape("not listed ['submit']")):
        check_design_scripts(text.replace(row + "\n", ""))
    with pytest.raises(AssertionError, match=re.escape("listed but gone ['gone']")):
        check_design_scripts(text.replace(row, row + "\n| `lua/gone.lua` | a script since removed |"))
    with pytest.raises(AssertionError, match="twice"):
        check_design_scripts(text.replace(row, row + "\n" + row))


# --------------------------------------------------------------------------- the README


def test_readme_is_a_front_page() -> None:
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; the reference belongs in docs/"


def test_readme_shows_the_command_ci_runs() -> None:
    assert TEST_COMMAND in CI_RUN.read_text(), f".ci/run no longer calls {TEST_COMMAND!r}: update the README"
    blocks = [body for _, body in _FENCE.findall(README.read_text())]
    assert f"{TEST_COMMAND}\n" in blocks, f"the README shows no block of exactly {TEST_COMMAND!r}"


def table_after(text: str, heading: str) -> str:
    """The first table of the section under ``heading``."""
    section = text.split(heading + "\n", 1)[1]
    rows = re.search(r"(?:^\|.*(?:\n|$))+", section, re.M)
    assert rows is not None, f"no table under {heading!r}"
    return rows.group(0)


def cli_commands() -> list[str]:
    """Every command of ``iop``, a group's as ``group sub``."""
    import argparse

    def walk(parser: argparse.ArgumentParser, prefix: str) -> list[str]:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return [prefix.strip()]
        return [name for action in subs for sub_name, sub in action.choices.items()
                for name in walk(sub, f"{prefix} {sub_name}")]

    return walk(build_parser(), "")


def check_cli_table(table: str) -> None:
    for command in cli_commands():
        words = command.split()
        # A group's commands may share a row: `iop provider drain ID` / `iop provider resume ID`.
        pattern = r"`iop " + re.escape(words[0]) + r"\b[^`]*" + r"".join(rf"\b{re.escape(w)}\b" for w in words[1:])
        rows = [row for row in table.splitlines() if re.search(pattern, row)
                or (len(words) > 1 and f"`iop {command}" in row)]
        assert rows, f"the README's command table leaves out `iop {command}`"


def test_readme_lists_every_command() -> None:
    check_cli_table(table_after(README.read_text(), "## The `iop` command"))


def test_cli_table_catches() -> None:
    table = table_after(README.read_text(), "## The `iop` command")
    without = "\n".join(row for row in table.splitlines() if "`iop qualify" not in row)
    with pytest.raises(AssertionError, match="leaves out `iop qualify`"):
        check_cli_table(without)


def check_endpoint_table(table: str) -> None:
    named = set(re.findall(r"`(?:POST |GET |DELETE )?([a-z/_{}]+)`", table))
    for endpoint in ENDPOINTS:
        assert endpoint in named, f"the README's endpoint table leaves out {endpoint}"


def test_readme_lists_every_endpoint() -> None:
    check_endpoint_table(table_after(README.read_text(), "## API"))


def test_endpoint_table_catches() -> None:
    table = table_after(README.read_text(), "## API")
    with pytest.raises(AssertionError, match="leaves out embeddings"):
        check_endpoint_table(table.replace("`POST embeddings`", "`POST embedding`"))


# --------------------------------------------------------------------------- the error table


def error_classes() -> dict[str, type[exceptions.RequestError]]:
    found: dict[str, type[exceptions.RequestError]] = {}
    todo: list[type[exceptions.RequestError]] = [exceptions.RequestError]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        # iop's own (a test module may define its own subclasses for its checks)
        if cls.code is not None and "code" in vars(cls) and cls.__module__.split(".")[0] in ("dispatcher", "api"):
            found[cls.code] = cls
    return found


def check_error_table(table: str) -> None:
    """Each row's status and code are an error of iop's, and every error a caller can get
    has its row."""
    classes = error_classes()
    rows = re.findall(r"^\| (\d{3}) \| `(\w+)` \|", table, re.M)
    assert rows, "the error table has no rows"
    for status, code in rows:
        assert code in classes, f"the error table names {code}, which iop never answers"
        assert classes[code].status == int(status), (
            f"the error table says {code} is {status}; iop answers {classes[code].status}")
    missing = sorted(set(classes) - {code for _, code in rows} - UNANSWERED_CODES)
    assert not missing, f"the error table leaves out {missing}"


def test_the_error_table_is_iops() -> None:
    check_error_table(table_after(API_DOC.read_text(), "## Errors"))


def test_error_table_catches() -> None:
    table = table_after(API_DOC.read_text(), "## Errors")
    with pytest.raises(AssertionError, match="never answers"):
        check_error_table(table + "| 418 | `teapot` | never |\n")
    with pytest.raises(AssertionError, match="queue_full is 503"):
        check_error_table(table.replace("| 429 | `queue_full` |", "| 503 | `queue_full` |"))
    with pytest.raises(AssertionError, match=re.escape("leaves out ['queue_timeout']")):
        check_error_table("\n".join(row for row in table.splitlines() if "`queue_timeout`" not in row))


# --------------------------------------------------------------------------- config examples


def config_examples(text: str) -> list[dict[str, Any]]:
    """The YAML blocks of a page that are whole configs (they name models)."""
    docs = [yaml.safe_load(body) for lang, body in _FENCE.findall(text) if lang == "yaml"]
    return [d for d in docs if isinstance(d, dict) and "models" in d and "nodes" in d]


@pytest.mark.parametrize("path", [README, CONFIG_DOC], ids=lambda p: p.name)
def test_the_config_examples_load(path: Path) -> None:
    examples = config_examples(path.read_text())
    assert examples, f"{path.name} shows no whole config"
    for example in examples:
        cfg.parse(example)  # raises ConfigError listing every problem


def test_the_readme_example_is_minimal() -> None:
    (example,) = config_examples(README.read_text())
    loaded = cfg.parse(example).config
    assert len(loaded.models) == 1
    assert len(loaded.models[0].providers) == 2


# --------------------------------------------------------------------------- provider types


PROVIDERS_DOC = DOCS / "PROVIDERS.md"
TYPES_HEADING = "## Types and the endpoints they serve"


def documented_endpoints(table: str) -> dict[str, set[str]]:
    """Each type's default endpoints as the table names them: ``chat`` is chat/completions,
    ``audio/*`` every audio endpoint, a note in parentheses or before a colon is no name."""
    found: dict[str, set[str]] = {}
    for kind, listed in re.findall(r"^\| `(\w+)` \| (.+?) \|$", table, re.M):
        listed = re.sub(r"\(.*?\)", "", listed.split(": ", 1)[-1])
        names: set[str] = set()
        for word in (w.strip() for w in listed.split(",")):
            if word == "chat":
                names.add("chat/completions")
            elif word.endswith("/*"):
                names |= {e for e in ENDPOINTS if e.startswith(word[:-1])}
            elif word:
                names.add(word)
        found[kind] = names
    return found


def check_default_endpoints(table: str) -> None:
    from dispatcher.endpoints import DEFAULT_ENDPOINTS

    documented = documented_endpoints(table)
    assert set(documented) == set(DEFAULT_ENDPOINTS), (
        f"the types table lists {sorted(documented)}; iop has {sorted(DEFAULT_ENDPOINTS)}")
    for kind, served in DEFAULT_ENDPOINTS.items():
        assert documented[kind] == set(served), (
            f"{kind}: the table says {sorted(documented[kind])}, DEFAULT_ENDPOINTS {sorted(served)}")


def check_default_categories(text: str) -> None:
    from dispatcher.config.schema import DEFAULT_CATEGORY

    line = re.search(r"Default categories: (.+?)\.\n\n", text, re.S)
    assert line is not None, "PROVIDERS.md says no default categories"
    documented: dict[str, str] = {}
    for part in line.group(1).split(";"):
        types, category = part.split("→")
        for kind in re.findall(r"`(\w+)`", types):
            documented[kind] = category.strip().strip("`")
    assert documented == DEFAULT_CATEGORY, f"PROVIDERS.md's default categories {documented} are not {DEFAULT_CATEGORY}"


def test_the_types_table_is_iops() -> None:
    check_default_endpoints(table_after(PROVIDERS_DOC.read_text(), TYPES_HEADING))
    check_default_categories(PROVIDERS_DOC.read_text())


def test_types_table_catches() -> None:
    table = table_after(PROVIDERS_DOC.read_text(), TYPES_HEADING)
    with pytest.raises(AssertionError, match="ollama: the table says"):
        check_default_endpoints(table.replace("| `ollama` | chat, completions, embeddings, responses, messages |",
                                              "| `ollama` | chat, completions, embeddings, responses |"))
    with pytest.raises(AssertionError, match="the types table lists"):
        check_default_endpoints("\n".join(row for row in table.splitlines() if not row.startswith("| `cli`")))
    text = PROVIDERS_DOC.read_text()
    with pytest.raises(AssertionError, match="default categories"):
        check_default_categories(text.replace("`ollama`, `llamacpp` →", "`ollama` →"))


# --------------------------------------------------------------------------- defaults shown


# The sections whose values CONFIG.md's example shows as the defaults; `*_env` and `url` are
# examples of names, not defaults.
DEFAULTS_SHOWN = ("redis", "api", "queue", "dispatch", "responses")


def check_defaults_shown(example: dict[str, Any], sections: tuple[str, ...] = DEFAULTS_SHOWN) -> None:
    import msgspec

    config = cfg.parse(example).config
    for section in sections:
        default = msgspec.to_builtins(type(getattr(config, section))())
        for key, value in example.get(section, {}).items():
            if isinstance(value, dict | list) or key.endswith("_env") or key == "url":
                continue
            assert default.get(key) == value, (
                f"{section}.{key}: the example shows {value!r}, the default is {default.get(key)!r}")


def test_the_config_reference_shows_the_defaults() -> None:
    example = config_examples(CONFIG_DOC.read_text())[0]
    check_defaults_shown(example)


def test_defaults_shown_catches() -> None:
    example = config_examples(CONFIG_DOC.read_text())[0]
    example["dispatch"]["lease_ms"] = 20_000
    with pytest.raises(AssertionError, match=re.escape("dispatch.lease_ms: the example shows 20000")):
        check_defaults_shown(example)


def ejection_example() -> dict[str, Any]:
    blocks = [yaml.safe_load(body) for lang, body in _FENCE.findall(PROVIDERS_DOC.read_text()) if lang == "yaml"]
    (found,) = [b for b in blocks if isinstance(b, dict) and set(b) == {"ejection"}]
    return found


def test_the_ejection_example_is_the_defaults() -> None:
    import msgspec

    from dispatcher.config.schema import EjectionConfig

    shown = ejection_example()["ejection"]
    default = msgspec.to_builtins(EjectionConfig())
    assert shown == default, f"PROVIDERS.md says its ejection block is the defaults: {shown} != {default}"


# --------------------------------------------------------------------------- examples of drain


def provider_ids() -> set[str]:
    """The provider ids of the configs the pages use: the demo's, compose's, the examples'."""
    docs = [yaml.safe_load((ROOT / "iop" / "demo.yaml").read_text()),
            yaml.safe_load((ROOT / "deploy" / "iop.yaml").read_text()),
            *config_examples(README.read_text()), *config_examples(CONFIG_DOC.read_text())]
    return {p["id"] for d in docs for node in d["nodes"] for p in node.get("providers", [])}


def check_drain_examples(path: Path, text: str, known: set[str]) -> None:
    for target in re.findall(r"iop provider (?:drain|resume) ([\w.:-]+)", text):
        if target in ("ID", "drain", "resume") or target.startswith("-"):
            continue
        assert target in known, f"{path.name}: `iop provider drain|resume {target}`: no provider has that id"


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: p.name)
def test_drain_examples_name_providers(path: Path) -> None:
    check_drain_examples(path, path.read_text(), provider_ids())


def test_drain_examples_catch() -> None:
    with pytest.raises(AssertionError, match="no provider has that id"):
        check_drain_examples(README, "`iop provider drain gpu-a --wait`", provider_ids())
