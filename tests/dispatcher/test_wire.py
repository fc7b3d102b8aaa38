"""Each script reads exactly the fields of its options Struct (``dispatcher/wire.py``): a field
added on one side only, or misspelt, fails here rather than as a nil in Lua."""

from __future__ import annotations

import re

import msgspec
import pytest

from dispatcher import scripts, wire

# (script, the Lua name its options table has there, the Struct)
TABLES = [
    ("submit", "opts", wire.SubmitOptions),
    ("heartbeat", "refusal", wire.Refusal),
    ("refuse", "refusal", wire.Refusal),
    ("drain", "refusal", wire.Refusal),
    # The dispatch plan: every pumping script includes lib/pump.lua, which reads it.
    ("finish", "PLAN", wire.PlanHeader),
    ("finish", "lane", wire.LaneSpec),
    ("finish", "cand", wire.Candidate),
]


def fields_read(source: str, table: str) -> set[str]:
    return set(re.findall(rf"\b{table}\.([a-z_]+)", source))


@pytest.mark.parametrize(("script", "table", "struct"), TABLES, ids=[f"{s}:{t}" for s, t, _ in TABLES])
def test_a_script_reads_exactly_its_structs_fields(script: str, table: str, struct: type[msgspec.Struct]) -> None:
    assert fields_read(scripts.source(script), table) == set(struct.__struct_fields__)


def test_no_field_is_null_on_the_wire() -> None:
    # cjson turns null into a truthy userdata: `if opts.pinned` would hold for a None.
    # (A Struct that omits defaults never writes a None default: the field is left out.)
    for _, _, struct in TABLES:
        omitted = struct.__struct_config__.omit_defaults
        defaults = dict(zip(reversed(struct.__struct_fields__), reversed(struct.__struct_defaults__), strict=False))
        for name, annotation in struct.__annotations__.items():
            if omitted and name in defaults and defaults[name] is None:
                continue
            assert "None" not in str(annotation), f"{struct.__name__}.{name} may be None"
