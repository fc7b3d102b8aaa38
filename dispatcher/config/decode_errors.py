"""msgspec's decoding errors as :class:`ConfigProblem`, the path first like every other problem."""

from __future__ import annotations

import re

import msgspec

from dispatcher.exceptions import ConfigProblem


def problem_from_validation(exc: msgspec.ValidationError, root: type | None = None) -> ConfigProblem:
    # msgspec ends its message with " - at `$.a.b`"; split it so the path comes first like ours.
    text = str(exc)
    message, sep, where = text.rpartition(" - at `")
    if not sep or not where.startswith(("$", "key` in `$")):  # (a field name may hold " - at `")
        message, where = text, "$`"
    where = where.rstrip("`")
    if where.startswith("key` in `"):
        where = where[len("key` in `"):]
        message += " (mapping key)"
    unknown = _UNKNOWN_FIELD.fullmatch(message)
    if unknown:
        # Point at the misspelt field itself, not at the object holding it.
        return ConfigProblem(f"{where}.{unknown.group(1)}", f"unknown field `{unknown.group(1)}`")
    if root is not None and message.startswith("Invalid enum value"):
        choices, numbers = _choices_at(root, where)
        if choices:
            message += (" (expected an integer or one of: " if numbers else " (expected one of: ") \
                + ", ".join(choices) + ")"
    return ConfigProblem(where, message)


def _choices_at(root: type, where: str) -> tuple[list[str], bool]:
    """The values a Literal field at `where` ($.a[0].b) takes, following the Struct types, and
    whether it takes an integer instead (``capacity: 4 | auto``)."""
    info: msgspec.inspect.Type = msgspec.inspect.type_info(root)
    for part in re.findall(r"\.([^.\[]+)|\[\d+\]", where):
        while isinstance(info, msgspec.inspect.UnionType):
            info = next((t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)), info.types[0])
        if part == "":  # an index: the list's item
            sequences = msgspec.inspect.ListType | msgspec.inspect.TupleType | msgspec.inspect.VarTupleType
            if not isinstance(info, sequences):
                return [], False
            info = info.item_type if not isinstance(info, msgspec.inspect.TupleType) else info.item_types[0]
        elif isinstance(info, msgspec.inspect.StructType):
            field = next((f for f in info.fields if f.encode_name == part), None)
            if field is None:
                return [], False
            info = field.type
        elif isinstance(info, msgspec.inspect.DictType):
            info = info.value_type
        else:
            return [], False
    if isinstance(info, msgspec.inspect.LiteralType):
        return [str(v) for v in info.values], False
    if isinstance(info, msgspec.inspect.UnionType):
        inner = [t.type if isinstance(t, msgspec.inspect.Metadata) else t for t in info.types]
        literals = [str(v) for t in inner if isinstance(t, msgspec.inspect.LiteralType) for v in t.values]
        return literals, any(isinstance(t, msgspec.inspect.IntType) for t in inner)
    return [], False


_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `(.+)`")
