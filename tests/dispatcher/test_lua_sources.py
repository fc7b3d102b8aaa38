"""The shape of the Lua in ``lua/`` (issue 31): no function over 120 lines, and every file
names its own includes -- resolved alone, it uses nothing that it, or what it includes, does
not define. Read with ``tests/dispatcher/lua_text.py``, whose own tests come first."""

from __future__ import annotations

from pathlib import Path

import pytest

from dispatcher import scripts
from tests.dispatcher.lua_text import Function, functions, undeclared

MAX_LINES = 120

# What Redis gives every script (its Lua 5.1 sandbox), as far as the scripts use it.
BUILTINS = frozenset({"redis", "cjson", "cmsgpack", "KEYS", "ARGV", "string", "table", "math", "tonumber",
                      "tostring", "ipairs", "pairs", "next", "unpack", "type"})

ROOT = scripts.lua_dir()
FILES = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.lua"))


# --- the reader -----------------------------------------------------------------------------

SNIPPET = """\
local function short(a)
  return a  -- end
end

local function nested(t)
  local s = ']] end'
  for _, x in ipairs(t) do
    if x then s = s .. x elseif not x then s = s else s = nil end
  end
  while false do end
  repeat local y = 1 until true
  do local z = 2 end
  local inner = function(q)
    return q
  end
  --[[ function
  end ]]
  return inner(s), [==[
end]==]
end

M = {}
function M.field(x) return x end
"""


def test_the_reader_finds_each_function_to_its_own_end() -> None:
    assert functions(SNIPPET) == [
        Function("short", 1, 3), Function("nested", 5, 20), Function("inner", 13, 15),
        Function("M.field", 23, 23),
    ]


def test_the_reader_refuses_blocks_that_do_not_close() -> None:
    with pytest.raises(ValueError, match="never closed"):
        functions("local function f()\n  if x then\nend\n")
    with pytest.raises(ValueError, match="closes nothing"):
        functions("x = 1\nend\n")


def test_the_reader_finds_names_used_before_any_declaration() -> None:
    text = """\
local A = KEYS[1]
local function f(rec, n)
  local t = {lim = rec.lim, n}
  for i, v in ipairs(t) do g(v, i, A, B) end
  return helper(n):upper(), t.lim
end
local function helper(x) return x end
"""
    assert [(t.text, t.line) for t in undeclared(text, BUILTINS)] == [("g", 4), ("B", 4), ("helper", 5)]


# --- lua/ -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FILES)
def test_no_function_is_over_120_lines(name: str) -> None:
    long = [f for f in functions((ROOT / name).read_text()) if f.lines > MAX_LINES]
    assert not long, [f"{f.name}: lines {f.first}-{f.last} ({f.lines})" for f in long]


def test_the_length_check_reads_the_files_functions() -> None:
    # Not a check that finds nothing: pump.lua has its pump(), of a plausible length.
    found = {f.name: f for f in functions((ROOT / "lib" / "pump.lua").read_text())}
    assert 10 < found["pump"].lines <= MAX_LINES


@pytest.mark.parametrize("name", FILES)
def test_a_file_resolved_alone_uses_only_what_it_defines_or_includes(name: str) -> None:
    missing = [f"{t.text} (line {t.line})" for t in undeclared(scripts.resolve(ROOT, name), BUILTINS)]
    assert not missing, f"{name} uses, without including what defines them: {', '.join(missing)}"


def test_a_forgotten_include_is_found(tmp_path: Path) -> None:
    # The same check on a copy of lua/ in which lib/pick.lua forgets lib/excluded.lua.
    for path in ROOT.rglob("*.lua"):
        copy = tmp_path / path.relative_to(ROOT)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(path.read_text())
    pick = tmp_path / "lib" / "pick.lua"
    pick.write_text(pick.read_text().replace("--!include lib/excluded.lua\n", ""))
    assert {t.text for t in undeclared(scripts.resolve(tmp_path, "lib/pick.lua"), BUILTINS)} == {"excluded"}
