"""A small reader of the Lua in ``lua/`` for tests of its shape: tokens (comments and strings
set apart), each function's extent, and the names a file uses before anything declares
them. Not a Lua parser: enough for the 5.1 dialect the scripts are written in, and tested
on snippets of its own (``tests/dispatcher/test_lua_sources.py``)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

KEYWORDS = frozenset({"and", "break", "do", "else", "elseif", "end", "false", "for", "function", "if", "in",
                      "local", "nil", "not", "or", "repeat", "return", "then", "true", "until", "while"})

_TOKEN = re.compile(r"""
    (?P<space>[ \t\r\n]+)
  | (?P<comment>--\[(?P<ceq>=*)\[.*?\](?P=ceq)\]|--[^\n]*)
  | (?P<string>\[(?P<seq>=*)\[.*?\](?P=seq)\]|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*')
  | (?P<number>0[xX][0-9a-fA-F]+|\d+(?:\.(?!\.)\d*)?(?:[eE][+-]?\d+)?)
  | (?P<name>[A-Za-z_]\w*)
  | (?P<op>\.\.\.|\.\.|==|~=|<=|>=|[-+*/%^\#<>=(){}\[\];:,.])
""", re.X | re.S)


@dataclass(frozen=True, slots=True)
class Token:
    kind: str  # 'name', 'keyword', 'op', 'string' or 'number'
    text: str
    line: int


def tokens(text: str) -> list[Token]:
    """The tokens of ``text``, without spaces and comments, each with its first line."""
    out: list[Token] = []
    pos, line = 0, 1
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ValueError(f"line {line}: cannot read {text[pos:pos + 20]!r}")
        kind = m.lastgroup
        assert kind is not None
        if kind == "name" and m.group() in KEYWORDS:
            kind = "keyword"
        if kind not in ("space", "comment"):
            out.append(Token(kind, m.group(), line))
        line += m.group().count("\n")
        pos = m.end()
    return out


@dataclass(frozen=True, slots=True)
class Function:
    name: str  # '(anonymous)' for a function expression not assigned to a name
    first: int  # the line of its `function`
    last: int  # the line of its `end`

    @property
    def lines(self) -> int:
        return self.last - self.first + 1


def functions(text: str) -> list[Function]:
    """Every function of ``text``, from its ``function`` keyword to its matching ``end``."""
    toks = tokens(text)
    found: list[Function] = []
    # Open blocks: (keyword, name, line); a `while` or `for` takes the next `do` as its own.
    stack: list[tuple[str, str, int]] = []
    for i, tok in enumerate(toks):
        if tok.kind != "keyword":
            continue
        word = tok.text
        if word == "function":
            stack.append(("function", _function_name(toks, i), tok.line))
        elif word in ("if", "repeat", "while", "for"):
            stack.append((word, "", tok.line))
        elif word == "do":
            if stack and stack[-1][0] in ("while", "for") and not stack[-1][1]:
                stack[-1] = (stack[-1][0], "do", stack[-1][2])  # the loop's own `do`
            else:
                stack.append(("do", "", tok.line))
        elif word in ("end", "until"):
            if not stack:
                raise ValueError(f"line {tok.line}: `{word}` closes nothing")
            kind, name, first = stack.pop()
            if (word == "until") != (kind == "repeat"):
                raise ValueError(f"line {tok.line}: `{word}` closes the `{kind}` of line {first}")
            if kind == "function":
                found.append(Function(name, first, tok.line))
    if stack:
        raise ValueError(f"line {stack[-1][2]}: `{stack[-1][0]}` is never closed")
    return sorted(found, key=lambda f: f.first)


def _function_name(toks: list[Token], i: int) -> str:
    """The name a function is defined under: `function NAME(`, `local function NAME(`, `NAME =
    function(` or `local NAME = function(`."""
    after = toks[i + 1] if i + 1 < len(toks) else None
    if after is not None and after.kind == "name":
        name, j = after.text, i + 2
        while j + 1 < len(toks) and toks[j].text in (".", ":") and toks[j + 1].kind == "name":
            name, j = f"{name}{toks[j].text}{toks[j + 1].text}", j + 2
        return name
    if i >= 2 and toks[i - 1].text == "=" and toks[i - 2].kind == "name":
        return toks[i - 2].text
    return "(anonymous)"


def undeclared(text: str, builtins: frozenset[str]) -> Iterator[Token]:
    """The names ``text`` uses where nothing before them declared that name (a local, a local
    function, a parameter, a loop variable) and that are not ``builtins``: in a file whose
    includes go before its own text, a name one of its includes should have brought. Scopes
    are not followed (a name declared anywhere before counts), so this finds what is missing
    everywhere, which is what a forgotten include is."""
    toks = tokens(text)
    declared: set[str] = set()
    declaring = False  # in the names of `local a, b` or `for a, b`
    params = False  # in a function's parameter list
    for i, tok in enumerate(toks):
        prev = toks[i - 1].text if i else ""
        nxt = toks[i + 1].text if i + 1 < len(toks) else ""
        if tok.kind == "keyword":
            declaring = tok.text in ("local", "for") or (tok.text == "function" and prev == "local")
            continue
        if tok.kind == "op":
            if tok.text == "(" and (prev == "function" or _names_function(toks, i)):
                params = True
            elif tok.text == ")":
                params = False
            if tok.text != ",":
                declaring = False
            continue
        if tok.kind != "name" or prev in (".", ":"):
            continue  # a literal, a field or a method
        if (declaring and prev in ("local", ",", "for")) or prev == "function" or params:
            declared.add(tok.text)
            continue
        declaring = False
        if prev in ("{", ",") and nxt == "=":
            continue  # a table constructor's key (or a target of a multiple assignment)
        if tok.text not in declared and tok.text not in builtins:
            yield tok


def _names_function(toks: list[Token], i: int) -> bool:
    """Is the `(` at ``i`` the one of `function NAME(` (NAME possibly dotted)?"""
    j = i - 1
    while j >= 1 and toks[j].kind == "name":
        if toks[j - 1].text == "function":
            return True
        if toks[j - 1].text not in (".", ":"):
            return False
        j -= 2
    return False
