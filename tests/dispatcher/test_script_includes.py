"""How ``dispatcher/scripts.py`` resolves ``--!include`` lines: recursively, each file once,
a file's includes before its own text; a cycle or a missing file is an error that names
where it is. Against small trees of files of its own, then the real ``lua/``."""

from __future__ import annotations

from pathlib import Path

import pytest

from dispatcher import scripts
from dispatcher.scripts import IncludeError, resolve


def tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line]


def test_includes_resolve_recursively_each_before_its_includer(tmp_path: Path) -> None:
    root = tree(tmp_path, {
        "s.lua": "--!include lib/a.lua\nscript\n",
        "lib/a.lua": "-- a\n--!include lib/b.lua\na\n",
        "lib/b.lua": "--!include lib/c.lua\nb\n",
        "lib/c.lua": "c\n",
    })
    assert lines(resolve(root, "s.lua")) == ["-- a", "c", "b", "a", "script"]


def test_a_file_several_files_include_comes_once_where_it_is_first_needed(tmp_path: Path) -> None:
    root = tree(tmp_path, {
        "s.lua": "--!include lib/a.lua\n--!include lib/b.lua\n--!include lib/shared.lua\nscript\n",
        "lib/a.lua": "--!include lib/shared.lua\na\n",
        "lib/b.lua": "--!include lib/shared.lua\n--!include lib/a.lua\nb\n",
        "lib/shared.lua": "shared\n",
    })
    assert lines(resolve(root, "s.lua")) == ["shared", "a", "b", "script"]


def test_an_include_cycle_is_an_error_naming_the_chain(tmp_path: Path) -> None:
    root = tree(tmp_path, {
        "s.lua": "--!include lib/a.lua\n",
        "lib/a.lua": "--!include lib/b.lua\n",
        "lib/b.lua": "--!include lib/c.lua\n",
        "lib/c.lua": "--!include lib/a.lua\n",
    })
    with pytest.raises(IncludeError, match=r"^include cycle: s\.lua -> lib/a\.lua -> lib/b\.lua -> lib/c\.lua "
                                           r"-> lib/a\.lua$"):
        resolve(root, "s.lua")


def test_a_file_that_includes_itself_is_a_cycle(tmp_path: Path) -> None:
    root = tree(tmp_path, {"s.lua": "--!include lib/a.lua\n", "lib/a.lua": "a\n--!include lib/a.lua\n"})
    with pytest.raises(IncludeError, match=r"^include cycle: s\.lua -> lib/a\.lua -> lib/a\.lua$"):
        resolve(root, "s.lua")


def test_a_missing_include_is_an_error_naming_its_includer(tmp_path: Path) -> None:
    root = tree(tmp_path, {
        "s.lua": "--!include lib/a.lua\n",
        "lib/a.lua": "-- a\n--!include lib/b.lua\n--!include lib/nope.lua\n",
        "lib/b.lua": "b\n",
    })
    with pytest.raises(IncludeError, match=r"^lib/a\.lua:3 includes lib/nope\.lua, which is not in "):
        resolve(root, "s.lua")


def test_an_include_line_is_a_whole_line(tmp_path: Path) -> None:
    # Mentioned in a comment or indented, it is text like any other.
    root = tree(tmp_path, {"s.lua": "-- see --!include lib/a.lua\n  --!include lib/a.lua\n"})
    assert resolve(root, "s.lua") == "-- see --!include lib/a.lua\n  --!include lib/a.lua\n"


@pytest.mark.parametrize("name", scripts.NAMES)
def test_every_script_resolves_with_each_function_defined_once(name: str) -> None:
    text = scripts.source(name)
    assert "--!include" not in text
    defined = [line.split("(")[0] for line in text.splitlines() if line.startswith("local function ")]
    assert len(defined) == len(set(defined)), sorted(d for d in defined if defined.count(d) > 1)


def test_a_script_has_what_its_includes_include() -> None:
    # finish.lua names lib/pump.lua; pump names lib/dispatch.lua, which names lib/route.lua ...
    text = scripts.source("finish")
    for function in ("local function pump(", "local function dispatch(", "local function route(",
                     "local function pick(", "local function takes_work(", "local function get_record("):
        assert function in text
    assert text.index("local function takes_work(") < text.index("local function pick(") \
        < text.index("local function route(") < text.index("local function dispatch(") \
        < text.index("local function pump(")
