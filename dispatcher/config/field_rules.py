"""Each field's type, range and reload policy, read from its annotation in :mod:`dispatcher.config.schema`.

A field says what it takes where it is declared, and nowhere else::

    lease_ms: Annotated[int, POSITIVE] = 15_000
    max_body_bytes: Annotated[int, POSITIVE, RESTART] = 16 * 1024 * 1024
    capacity: Annotated[int, NON_NEGATIVE, hint("0 keeps the provider out of rotation")] = 1
    redis: Annotated[RedisConfig, RESTART] = RedisConfig()

msgspec enforces types and bounds when it decodes, but stops at the first problem.
:meth:`Findings.check` walks a raw document along the struct types first and finds them all,
each at its ``$.path`` and in msgspec's own words: a value of the wrong type, a value out of
range, an unknown field, a required field missing. Each bad value is dropped, so that its
field's default stands in (a required field gets a placeholder of its type), and decoding and
the cross-field checks (:mod:`dispatcher.config.validation`) still run on the rest: every
problem is reported at once. :meth:`Findings.explains` tells which later problems only follow
from a value stood in for. :func:`problems_in` checks a decoded config the same way
(``validate()`` of a config built in code, and of legacy entries, converted before they are
checked). :func:`restart_paths` lists the fields a running process keeps until its next
restart (:mod:`dispatcher.reloading`).

Only numeric bounds (``gt``, ``ge``, ``lt``, ``le``) on fields of structs are supported, on fields
that have a default; a length, a pattern or a ``multiple_of``, or a range on a required field,
raises ``TypeError`` when the rules are read (``declared_ranges`` reads them all; a test calls it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Annotated, Any, Literal, NamedTuple, TypeVar, Union

import msgspec
from msgspec import inspect as mi

from dispatcher.exceptions import ConfigProblem

# A field, or a whole section, that a running process takes only at its next restart;
# unmarked, a reload (SIGHUP) applies it.
RELOAD = "reload"
RESTART = msgspec.Meta(extra={RELOAD: "restart"})
_POLICIES = frozenset({"restart"})

POSITIVE = msgspec.Meta(gt=0)
NON_NEGATIVE = msgspec.Meta(ge=0)
_HINT = "hint"


def hint(text: str) -> msgspec.Meta:
    """Words added, in parentheses, to the problem of a value out of range."""
    return msgspec.Meta(extra={_HINT: text})


class Range(NamedTuple):
    """The bounds of a numeric field; ``floats``: whether it takes floats, not only ints."""

    gt: float | None
    ge: float | None
    lt: float | None
    le: float | None
    floats: bool
    hint: str | None = None

    def applies_to(self, value: Any) -> bool:
        """Whether ``value`` is a number of the field's type (else decoding reports its type)."""
        if isinstance(value, bool):
            return False
        return isinstance(value, int) or (self.floats and isinstance(value, float))

    def problem(self, value: float) -> str | None:
        """Why ``value`` is out of range, or None. NaN is out of every range."""
        inside = ((self.gt is None or value > self.gt) and (self.ge is None or value >= self.ge)
                  and (self.lt is None or value < self.lt) and (self.le is None or value <= self.le))
        if inside:
            return None
        message = f"must be {self.describe()}, got {value}"
        return f"{message} ({self.hint})" if self.hint else message

    def describe(self) -> str:
        if self.ge is not None and self.le is not None and self.gt is None and self.lt is None:
            return f"between {_number(self.ge)} and {_number(self.le)}"
        bounds = [f"{op} {_number(bound)}" for op, bound in ((">", self.gt), (">=", self.ge), ("<", self.lt),
                                                               ("<=", self.le)) if bound is not None]
        return " and ".join(bounds)


def _number(bound: float) -> str:
    """A bound as written in a config: msgspec keeps a float field's bounds as floats (0.0)."""
    return str(int(bound)) if isinstance(bound, float) and bound.is_integer() else str(bound)


_DROPPED = object()


class Findings:
    """What checking raw documents value by value found: every problem, each at its ``$.path``,
    and where the file's value was replaced (a field's default, or a placeholder of its type).

    One object may check several documents (the pool-shape core and the legacy sections of one
    file): :meth:`explains` and :meth:`unsure` then answer for them all.
    """

    def __init__(self) -> None:
        self.problems: list[ConfigProblem] = []
        self._reported: set[str] = set()
        self._replaced: set[str] = set()  # values dropped or stood in for
        self._thinned: set[str] = set()  # mappings that lost an entry

    def check(self, document: Any, root: Any, path: str = "$") -> Any:
        """``document`` (builtins, as decoded from YAML) as ``root`` decodes without an error.

        A value of the wrong type, out of range or at an unknown field is dropped, so that its
        field's default stands in; a required field, and an item of a list, get a placeholder
        of their type instead (so that the paths of the next items stay theirs). The document
        is not modified: containers on the way to a change are copied.
        """
        checked = _walk(document, _type_info(root), path, self)
        return self._stand_in(path, _type_info(root)) if checked is _DROPPED else checked

    def unsure(self, path: str) -> bool:
        """Whether the value at ``path`` is not the file's: replaced, or a mapping that lost an
        entry. A check that reads it to claim something is missing (a reference to an id no
        entry defines) is not made (:func:`dispatcher.config.validation.validate`)."""
        return path in self._replaced or path in self._thinned

    def explains(self, path: str) -> bool:
        """Whether a later problem at ``path`` may only follow from one found here: at a path
        already reported, at or under a replaced value, or at a mapping that lost an entry."""
        if path in self._reported or path in self._thinned:
            return True
        return any(path == where or path.startswith((where + ".", where + "[")) for where in self._replaced)

    def _report(self, path: str, message: str) -> None:
        self.problems.append(ConfigProblem(path, message))
        self._reported.add(path)

    def _drop(self, path: str, message: str) -> object:
        self._report(path, message)
        self._replaced.add(path)
        return _DROPPED

    def _stand_in(self, path: str, info: mi.Type) -> Any:
        self._replaced.add(path)
        return _placeholder(info)


def problems_in(config: msgspec.Struct) -> list[ConfigProblem]:
    """A problem for each value of the wrong type or out of range in a decoded ``config``
    (its struct fields, nested): a struct built in code is not checked when it is made."""
    findings = Findings()
    findings.check(msgspec.to_builtins(config), type(config))
    return findings.problems


class Declared(NamedTuple):
    """A field with a range: its struct, name, range and default."""

    struct: type
    name: str
    range: Range
    default: Any


def declared_ranges(root: type) -> list[Declared]:
    """Every field with a range, in every struct reachable from ``root`` (each struct once)."""
    found: list[Declared] = []
    seen: set[type] = set()

    def visit(info: mi.Type) -> None:
        info = _strip(info)
        if isinstance(info, mi.StructType):
            if info.cls in seen:
                return
            seen.add(info.cls)
            for field in info.fields:
                bounds = _range(field.type)
                if bounds is not None:
                    factory = field.default_factory
                    default = factory() if factory is not msgspec.NODEFAULT else field.default
                    found.append(Declared(info.cls, field.name, bounds, default))
                visit(field.type)
        elif isinstance(info, mi.ListType | mi.VarTupleType | mi.SetType | mi.FrozenSetType):
            visit(info.item_type)
        elif isinstance(info, mi.DictType):
            visit(info.value_type)
        elif isinstance(info, mi.UnionType):
            for member in info.types:
                visit(member)

    visit(_type_info(root))
    return found


@functools.cache
def restart_paths(root: type) -> tuple[tuple[str, ...], ...]:
    """The attribute paths, from ``root``, of the fields and sections marked :data:`RESTART`,
    in schema order. Marks are looked for through fields whose type is a struct (not
    ``Struct | None``, nor lists of structs)."""
    info = _type_info(root)
    assert isinstance(info, mi.StructType), root
    return tuple(_restart_paths(info, ()))


def _restart_paths(info: mi.StructType, prefix: tuple[str, ...]) -> list[tuple[str, ...]]:
    paths: list[tuple[str, ...]] = []
    for field in info.fields:
        inner, extra = _unwrap(field.type)
        policy = extra.get(RELOAD)
        if policy is not None and policy not in _POLICIES:
            raise ValueError(f"{info.cls.__name__}.{field.name}: unknown reload policy {policy!r}")
        if policy == "restart":
            paths.append((*prefix, field.name))
        elif isinstance(inner, mi.StructType) and inner is _bare(field.type):
            # (Not into an optional struct: a running value of None has no field to keep.)
            paths.extend(_restart_paths(inner, (*prefix, field.name)))
    return paths


# --------------------------------------------------------------------------- reading the annotations


@functools.cache
def _type_info(root: type) -> mi.Type:
    return mi.type_info(root)


def _unwrap(info: mi.Type) -> tuple[mi.Type, dict[str, Any]]:
    """``info`` without its metadata, and without ``| None`` when one type remains; and the
    ``extra`` of the metadata taken off (a reload policy, a hint)."""
    extra: dict[str, Any] = {}
    while True:
        if isinstance(info, mi.Metadata):
            extra.update(info.extra or {})
            info = info.type
            continue
        if isinstance(info, mi.UnionType):
            others = [t for t in info.types if not isinstance(t, mi.NoneType)]
            if len(others) == 1:
                info = others[0]
                continue
        return info, extra


_T = TypeVar("_T")


def _per_type(derive: Callable[[mi.Type], _T]) -> Callable[[mi.Type], _T]:
    """``derive``, remembered per type object: msgspec's type objects are not hashable, and
    the walk asks the same ones again for every value (the objects of the cached
    :func:`_type_info` trees, kept alive here so that their ids stay theirs)."""
    known: dict[int, tuple[mi.Type, _T]] = {}

    def derived(info: mi.Type) -> _T:
        hit = known.get(id(info))
        if hit is None or hit[0] is not info:
            hit = known[id(info)] = (info, derive(info))
        return hit[1]

    return derived


@_per_type
def _strip(info: mi.Type) -> mi.Type:
    return _unwrap(info)[0]


def _bare(info: mi.Type) -> mi.Type:
    while isinstance(info, mi.Metadata):
        info = info.type
    return info


def _range(info: mi.Type) -> Range | None:
    """The bounds a field's type carries (``Annotated[int, Meta(ge=0)] | None`` too), or None."""
    inner, extra = _unwrap(info)
    unchecked = [name for name in ("min_length", "max_length", "pattern", "multiple_of")
                 if getattr(inner, name, None) is not None]
    if unchecked:
        # Decoding would report only the first such problem: keep to bounds, or check it in validation.py.
        raise TypeError(f"{inner}: {', '.join(unchecked)} is not checked by dispatcher.config.field_rules")
    if isinstance(inner, mi.UnionType):
        # A number or a word (``capacity: 4 | auto``): the number's bounds.
        numbers = [t for t in (_unwrap(t) for t in inner.types) if isinstance(t[0], mi.IntType | mi.FloatType)]
        if len(numbers) == 1:
            inner, more = numbers[0]
            extra = {**extra, **more}
    if not isinstance(inner, mi.IntType | mi.FloatType):
        return None
    if inner.gt is None and inner.ge is None and inner.lt is None and inner.le is None:
        return None
    return Range(inner.gt, inner.ge, inner.lt, inner.le, floats=isinstance(inner, mi.FloatType), hint=extra.get(_HINT))


class _FieldRule(NamedTuple):
    name: str
    info: mi.Type
    range: Range | None
    required: bool
    plain: frozenset[type]  # the types of the values it takes, whatever they are (:func:`_plainly_taken`)


class _StructRules(NamedTuple):
    fields: dict[str, _FieldRule]  # by the name in the document
    forbid_unknown: bool


@functools.cache
def _rules(cls: type) -> _StructRules:
    info = _type_info(cls)
    assert isinstance(info, mi.StructType)
    rules = {}
    for field in info.fields:
        bounds = _range(field.type)
        if bounds is not None and field.required:
            # Dropping its value would only trade the problem for "missing required field".
            raise TypeError(f"{cls.__name__}.{field.name}: a field with a range needs a default")
        rules[field.encode_name] = _FieldRule(field.encode_name, field.type, bounds, field.required,
                                              _plainly_taken(field.type))
    return _StructRules(rules, info.forbid_unknown_fields)


def key_path(path: str, key: object) -> str:
    """The path of ``key``'s value in the mapping at ``path`` (``[""]`` for the empty key)."""
    return f"{path}.{key}" if key != "" else f'{path}[""]'


# --------------------------------------------------------------------------- the walk


_SEQUENCES = mi.ListType | mi.VarTupleType | mi.SetType | mi.FrozenSetType


def _walk(value: Any, info: mi.Type, path: str, findings: Findings) -> Any:
    """``value`` checked against ``info``: the same object when nothing in it changed, a copy
    with its bad parts replaced, or ``_DROPPED`` when it is itself bad (reported)."""
    inner = _strip(info)
    if isinstance(inner, mi.StructType) and isinstance(value, dict):
        return _walk_struct(value, inner, path, findings)
    if isinstance(inner, _SEQUENCES) and isinstance(value, list):
        items = []
        for i, item in enumerate(value):
            where = f"{path}[{i}]"
            new = _walk(item, inner.item_type, where, findings)
            items.append(findings._stand_in(where, inner.item_type) if new is _DROPPED else new)
        return value if all(new is old for new, old in zip(items, value, strict=True)) else items
    if isinstance(inner, mi.DictType) and isinstance(value, dict):
        entries: dict[Any, Any] = {}
        for key, item in value.items():
            wrong_key = _type_problem(key, inner.key_type)
            if wrong_key is not None:
                findings._report(path, f"{wrong_key} (mapping key)")
                findings._thinned.add(path)
                continue
            new = _walk(item, inner.value_type, key_path(path, key), findings)
            if new is _DROPPED:
                findings._thinned.add(path)
            else:
                entries[key] = new
        same = len(entries) == len(value) and all(entries[key] is item for key, item in value.items())
        return value if same else entries
    problem = _type_problem(value, info)
    return value if problem is None else findings._drop(path, problem)


def _walk_struct(value: dict[Any, Any], info: mi.StructType, path: str, findings: Findings) -> Any:
    rules = _rules(info.cls)
    for name, field in rules.fields.items():
        if field.required and name not in value:
            findings._report(path, f"Object missing required field `{name}`")
    out: dict[Any, Any] | None = None
    for key, item in value.items():
        rule = rules.fields.get(key) if isinstance(key, str) else None
        if rule is None:
            if not isinstance(key, str):
                findings._report(path, f"{_type_problem(key, _STR)} (mapping key)")
            elif rules.forbid_unknown:
                findings._report(key_path(path, key), f"unknown field `{key}`")
            else:
                continue  # decoding ignores it
            new = _DROPPED
        elif type(item) in rule.plain:
            continue  # (most values: the walk's fast path)
        else:
            where = key_path(path, key)
            message = rule.range.problem(item) if rule.range is not None and rule.range.applies_to(item) else None
            new = findings._drop(where, message) if message is not None else _walk(item, rule.info, where, findings)
        if new is not item:
            out = dict(value) if out is None else out
            if new is _DROPPED:
                del out[key]
            else:
                out[key] = new
    if out is None:
        out = value
    missing = [name for name, rule in rules.fields.items() if rule.required and name not in out]
    if missing:
        out = dict(out)
        for name in missing:
            out[name] = findings._stand_in(key_path(path, name), rules.fields[name].info)
    return out


def _type_problem(value: Any, info: mi.Type) -> str | None:
    """msgspec's own words for ``value`` not being of type ``info``, or None (ranges included)."""
    if type(value) in _plainly_taken(info):
        return None
    try:
        msgspec.convert(value, type=_annotation(info))
    except msgspec.ValidationError as exc:
        message, sep, where = str(exc).rpartition(" - at `")
        if not sep:
            message, where = str(exc), "$`"
        inner = where.rstrip("`")
        if inner != "$":  # (only where the walk does not go: a union of several container types)
            message += f" (at {inner})"
        choices = _strip(info)
        if message.startswith("Invalid enum value"):
            if isinstance(choices, mi.LiteralType):
                message += " (expected one of: " + ", ".join(str(v) for v in choices.values) + ")"
            elif isinstance(choices, mi.UnionType):
                # A number or a word (``capacity: 4 | auto``).
                members = [_strip(t) for t in choices.types]
                words = [str(v) for t in members if isinstance(t, mi.LiteralType) for v in t.values]
                number = "an integer or " if any(isinstance(t, mi.IntType) for t in members) else ""
                if words:
                    message += f" (expected {number}one of: " + ", ".join(words) + ")"
        return message
    return None


_STR = mi.StrType()


@_per_type
def _plainly_taken(info: mi.Type) -> frozenset[type]:
    """The Python types of the values ``info`` takes whatever they are (no bound, no choice
    of values): those need no msgspec.convert to tell."""
    if isinstance(info, mi.Metadata):
        return _plainly_taken(info.type)
    if isinstance(info, mi.UnionType):
        return frozenset().union(*(_plainly_taken(member) for member in info.types))
    if isinstance(info, mi.IntType | mi.FloatType) and any(
            getattr(info, name) is not None for name in ("gt", "ge", "lt", "le", "multiple_of")):
        return frozenset()
    if isinstance(info, mi.StrType) and (info.min_length, info.max_length, info.pattern) != (None, None, None):
        return frozenset()
    plain: dict[type, frozenset[type]] = {
        mi.StrType: frozenset({str}), mi.BoolType: frozenset({bool}), mi.IntType: frozenset({int}),
        mi.FloatType: frozenset({float, int}), mi.NoneType: frozenset({type(None)}),
    }
    return plain.get(type(info), frozenset())


@_per_type
def _annotation(info: mi.Type) -> Any:
    """The type ``info`` describes, as msgspec.convert takes it."""
    if isinstance(info, mi.Metadata):
        return _annotation(info.type)
    if isinstance(info, mi.IntType | mi.FloatType):
        base: type = int if isinstance(info, mi.IntType) else float
        bounds = {name: getattr(info, name) for name in ("gt", "ge", "lt", "le", "multiple_of")
                  if getattr(info, name) is not None}
        return Annotated[base, msgspec.Meta(**bounds)] if bounds else base
    simple = {mi.StrType: str, mi.BoolType: bool, mi.NoneType: None, mi.AnyType: Any}
    if type(info) in simple:
        return simple[type(info)]
    if isinstance(info, mi.LiteralType):
        return Literal[info.values]
    if isinstance(info, mi.UnionType):
        return Union[tuple(_annotation(member) for member in info.types)]  # noqa: UP007
    if isinstance(info, mi.ListType):
        return list[_annotation(info.item_type)]  # type: ignore[misc]
    if isinstance(info, mi.VarTupleType):
        return tuple[_annotation(info.item_type), ...]  # type: ignore[misc]
    if isinstance(info, mi.SetType | mi.FrozenSetType):
        return (set if isinstance(info, mi.SetType) else frozenset)[_annotation(info.item_type)]
    if isinstance(info, mi.DictType):
        return dict[_annotation(info.key_type), _annotation(info.value_type)]  # type: ignore[misc]
    if isinstance(info, mi.StructType):
        return info.cls
    raise TypeError(f"{info}: not a type dispatcher.config.field_rules checks")


def _placeholder(info: mi.Type) -> Any:
    """A value of type ``info``, for a required field whose value is missing or wrong: the
    problem is reported there, and what follows from the placeholder is not (:meth:`Findings.explains`)."""
    info = _bare(info)
    if isinstance(info, mi.UnionType):
        if any(isinstance(member, mi.NoneType) for member in info.types):
            return None
        return _placeholder(info.types[0])
    if isinstance(info, mi.LiteralType):
        return info.values[0]
    if isinstance(info, mi.StructType):
        return {name: _placeholder(rule.info) for name, rule in _rules(info.cls).fields.items() if rule.required}
    if isinstance(info, _SEQUENCES):
        return []
    if isinstance(info, mi.DictType):
        return {}
    if isinstance(info, mi.IntType | mi.FloatType):  # the lowest it takes, else 0
        low = info.ge if info.ge is not None else info.gt + 1 if info.gt is not None else 0
        return int(low) if isinstance(info, mi.IntType) else float(low)
    zero = {mi.StrType: "", mi.BoolType: False, mi.NoneType: None, mi.AnyType: None}
    return zero[type(info)]
