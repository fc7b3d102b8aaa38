"""Each setting's range and reload policy, read from its annotation in :mod:`dispatcher.config.schema`.

A field says what it takes where it is declared, and nowhere else::

    lease_ms: Annotated[int, POSITIVE] = 15_000
    max_body_bytes: Annotated[int, POSITIVE, RESTART] = 16 * 1024 * 1024
    capacity: Annotated[int, NON_NEGATIVE, hint("0 keeps the provider out of rotation")] = 1
    redis: Annotated[RedisConfig, RESTART] = RedisConfig()

msgspec enforces the bounds when it decodes, but stops at the first value out of range.
:func:`out_of_range` finds them all in a raw document first, each at its ``$.path``, and drops
each such value, so that the field's default stands in and decoding and the cross-field checks
(:mod:`dispatcher.config.validation`) still run on the rest: every problem is reported at once.
:func:`problems_in` checks a decoded config the same way (``validate()`` of a config built in
code, and of legacy entries, converted before they are checked). :func:`restart_paths` lists the
fields a running process keeps until its next restart (:mod:`dispatcher.reloading`).

Only numeric bounds (``gt``, ``ge``, ``lt``, ``le``) on fields of structs are supported, on fields
that have a default; a length, a pattern or a ``multiple_of``, or a range on a required field,
raises ``TypeError`` when the rules are read (``declared_ranges`` reads them all; a test calls it).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

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


def out_of_range(document: Any, root: type) -> tuple[Any, list[ConfigProblem]]:
    """``document`` (builtins, as decoded from YAML) without its values out of range, and a
    problem for each of them.

    The document is not modified: containers on the way to a dropped value are copied. Values
    of the wrong type, and shapes that do not match the schema, are left for decoding to report.
    """
    problems: list[ConfigProblem] = []
    return _walk(document, _type_info(root), "$", problems), problems


def problems_in(config: msgspec.Struct) -> list[ConfigProblem]:
    """A problem for each value out of range in a decoded ``config`` (its struct fields, nested)."""
    return out_of_range(msgspec.to_builtins(config), type(config))[1]


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


@functools.cache
def _rules(cls: type) -> tuple[_FieldRule, ...]:
    info = _type_info(cls)
    assert isinstance(info, mi.StructType)
    rules = []
    for field in info.fields:
        bounds = _range(field.type)
        if bounds is not None and field.required:
            # Dropping its value would only trade the problem for "missing required field".
            raise TypeError(f"{cls.__name__}.{field.name}: a field with a range needs a default")
        rules.append(_FieldRule(field.encode_name, field.type, bounds))
    return tuple(rules)


# --------------------------------------------------------------------------- the walk


def _walk(value: Any, info: mi.Type, path: str, problems: list[ConfigProblem]) -> Any:
    """``value`` checked against ``info``: the same object when nothing in it was dropped."""
    info = _strip(info)
    if isinstance(info, mi.StructType) and isinstance(value, dict):
        out: dict[Any, Any] | None = None
        for rule in _rules(info.cls):
            if rule.name not in value:
                continue
            item = value[rule.name]
            where = f"{path}.{rule.name}"
            if rule.range is not None:
                message = rule.range.problem(item) if rule.range.applies_to(item) else None
                if message is not None:
                    problems.append(ConfigProblem(where, message))
                new = _DROPPED if message is not None else item
            else:
                new = _walk(item, rule.info, where, problems)
            if new is not item:
                out = dict(value) if out is None else out
                if new is _DROPPED:
                    del out[rule.name]
                else:
                    out[rule.name] = new
        return value if out is None else out
    sequences = mi.ListType | mi.VarTupleType | mi.SetType | mi.FrozenSetType
    if isinstance(info, sequences) and isinstance(value, list):
        items = [_walk(item, info.item_type, f"{path}[{i}]", problems) for i, item in enumerate(value)]
        return value if all(new is old for new, old in zip(items, value, strict=True)) else items
    if isinstance(info, mi.DictType) and isinstance(value, dict):
        entries = {key: _walk(item, info.value_type, f"{path}.{key}", problems) for key, item in value.items()}
        return value if all(entries[key] is item for key, item in value.items()) else entries
    return value
