"""Each script reads exactly the fields of its options Struct (``dispatcher/wire.py``): a field
added on one side only, or misspelt, fails here rather than as a nil in Lua."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from dispatcher import events, scripts, wire

# (script, the Lua name its options table has there, the Struct)
TABLES = [
    ("submit", "opts", wire.SubmitOptions),
    ("heartbeat", "refusal", wire.Refusal),
    ("refuse", "refusal", wire.Refusal),
    ("drain", "refusal", wire.Refusal),
    # The dispatch plan: heartbeat both pumps (lib/pump.lua) and refuses (lib/refuse_plan.lua),
    # which between them read the lanes; its header is read by all of the scripts together
    # ("*": finish reads its ejection rules).
    ("*", "PLAN", wire.PlanHeader),
    ("heartbeat", "lane", wire.LaneSpec),
    ("heartbeat", "cand", wire.Candidate),
    # The plan's ejection rules, as lib/blame.lua and lib/eject.lua read them.
    ("finish", "rules", wire.Ejection),
    ("capacity", "report", wire.CapacityReport),
]


def fields_read(source: str, table: str) -> set[str]:
    return set(re.findall(rf"\b{table}\.([a-z][a-z0-9_]*)", source))


@pytest.mark.parametrize(("script", "table", "struct"), TABLES, ids=[f"{s}:{t}" for s, t, _ in TABLES])
def test_a_script_reads_exactly_its_structs_fields(script: str, table: str, struct: type[msgspec.Struct]) -> None:
    source = lua_sources() if script == "*" else scripts.source(script)
    assert fields_read(source, table) == set(struct.__struct_fields__)


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


def lua_sources() -> str:
    """Every script as Redis runs it (its libraries included)."""
    return "\n".join(scripts.source(name) for name in scripts.NAMES)


def test_the_scripts_use_exactly_the_job_records_fields() -> None:
    # Read or written as rec.<field>, or set when submit.lua creates the record.
    used = fields_read(lua_sources(), "rec")
    created = re.search(r"local rec = \{(.*?)\n\}", scripts.source("submit"), re.S)
    assert created is not None
    used |= set(re.findall(r"\b([a-z_]+) = ", created.group(1)))
    assert used == set(events.JobRecord.__struct_fields__)


def test_the_node_stream_entry_is_the_assignment() -> None:
    xadd = re.search(r"redis\.call\('XADD', nkey, '\*',(.*?)\)\n", scripts.source("finish"), re.S)
    assert xadd is not None
    written = re.findall(r"'([a-z_]+)', ", xadd.group(1))
    assert set(written) == set(events.Assignment.__struct_fields__) - {"entry_id"}
    assert len(written) == len(set(written))


def test_every_reply_stream_entry_is_job_then_event() -> None:
    # api/waiting.py reads a reply entry's fields by position: [b"job", job, b"event", event].
    source = lua_sources() + (Path(__file__).parents[2] / "dispatcher" / "worker_side.py").read_text()
    writes = re.findall(r"XADD[\"']?,\s*([\w.()]+),\s*[\"']\*[\"'],\s*([^\n]*)", source)
    replies = [fields for key, fields in writes if key != "nkey"]
    assert len(replies) >= 7, writes
    for fields in replies:
        assert re.match(r"[\"']job[\"'], job(\.job)?, [\"']event[\"'], ", fields), fields
