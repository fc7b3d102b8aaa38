"""msgspec's decoding errors as :class:`ConfigProblem`, the path first like every other problem."""

from __future__ import annotations

import re

import msgspec

from dispatcher.exceptions import ConfigProblem


def problem_from_validation(exc: msgspec.ValidationError) -> ConfigProblem:
    # msgspec ends its message with " - at `$.a.b`"; split it so the path comes first like ours.
    text = str(exc)
    message, sep, where = text.rpartition(" - at `")
    if not sep:
        message, where = text, "$"
    where = where.rstrip("`")
    if where.startswith("key` in `"):
        where = where[len("key` in `"):]
        message += " (mapping key)"
    unknown = _UNKNOWN_FIELD.fullmatch(message)
    if unknown:
        # Point at the misspelt field itself, not at the object holding it.
        return ConfigProblem(f"{where}.{unknown.group(1)}", f"unknown field `{unknown.group(1)}`")
    return ConfigProblem(where, message)


_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `(.+)`")
