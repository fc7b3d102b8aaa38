"""Each script reads exactly the fields of its options Struct (``dispatcher/wire.py``): a field
added on one side only, or misspelt, fails here rather than as a nil in Lua. And what the
scripts write that Python reads back is read as the Lua reads it: each reader and rule of
``dispatcher/wire.py`` run beside its Lua, on every available Redis version."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
from redis.asyncio import Redis

from dispatcher import events, scripts, wire

pytestmark = pytest.mark.anyio

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
    # A worker's tally of calls, as lib/live_figures.lua adds it to a bucket.
    ("live", "tally", wire.LiveTally),
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


# --- what the scripts write, read back in Python: each reader answers what its Lua does ------


async def run_lib(redis: Redis, lib: str, body: str, keys_: list[str], args: list[str | int]) -> Any:
    """``body`` run after ``lua/lib/<lib>.lua`` (its includes resolved), as a script."""
    return await redis.eval(scripts.resolve(scripts.lua_dir(), f"lib/{lib}.lua") + "\n" + body, len(keys_),
                            *keys_, *args)


NOW = 1_700_000_000_000
PROVIDER_HASHES = {
    "never seen": {},
    "never seen, reported": {"health": "available", "capacity": "2"},
    "available": {"health": "available", "hb_ms": str(NOW - 500), "hb_exp": str(NOW + 1500), "capacity": "2"},
    "fresh to the ms": {"health": "available", "hb_ms": str(NOW - 500), "hb_exp": str(NOW), "capacity": "1"},
    "stale": {"health": "available", "hb_ms": str(NOW - 12_345), "hb_exp": str(NOW - 1), "capacity": "2"},
    "stale and down": {"health": "unavailable", "reason": "probe failed", "hb_ms": str(NOW - 9_000),
                       "hb_exp": str(NOW - 7_000), "capacity": "2"},
    "down": {"health": "unavailable", "reason": "GET /v1/models answered 503", "hb_ms": str(NOW),
             "hb_exp": str(NOW + 2000), "capacity": "2"},
    "down, no reason": {"health": "unavailable", "reason": "", "hb_ms": str(NOW), "hb_exp": str(NOW + 2000),
                        "capacity": "2"},
    "drained": {"health": "available", "hb_ms": str(NOW), "hb_exp": str(NOW + 2000), "capacity": "2",
                "drain": str(NOW - 5)},
    "drained at capacity 0": {"health": "available", "hb_ms": str(NOW), "hb_exp": str(NOW + 2000),
                              "capacity": "0", "drain": "1"},
    "capacity 0": {"health": "available", "hb_ms": str(NOW), "hb_exp": str(NOW + 2000), "capacity": "0"},
    "no capacity field": {"health": "available", "hb_ms": str(NOW), "hb_exp": str(NOW + 2000)},
    "removed": {"health": "unavailable", "reason": "removed from the config", "removed": "1", "hb_ms": str(NOW),
                "hb_exp": str(NOW + 2000), "capacity": "2"},
    "removed, stale": {"health": "unavailable", "removed": "1", "hb_ms": str(NOW - 60_000),
                       "hb_exp": str(NOW - 58_000), "capacity": "2"},
    "removed mark cleared": {"health": "available", "removed": "", "hb_ms": str(NOW), "hb_exp": str(NOW + 2000),
                             "capacity": "2"},
    "leaving": {"health": "unavailable", "reason": "worker draining", "leaving": "1", "hb_ms": str(NOW - 300),
                "hb_exp": str(NOW + 700), "capacity": "2"},
    "leaving, past its TTL": {"health": "unavailable", "reason": "worker draining", "leaving": "1",
                              "hb_ms": str(NOW - 9_000), "hb_exp": str(NOW - 1), "capacity": "2"},
    "leaving mark cleared": {"health": "available", "leaving": "", "hb_ms": str(NOW), "hb_exp": str(NOW + 2000),
                             "capacity": "2"},
    "ejected": {"health": "available", "hb_ms": str(NOW), "hb_exp": str(NOW + 2000), "capacity": "2",
                "ej_until": str(NOW + 30_000), "ej_trial": "1"},
}


@pytest.mark.parametrize("silent_is_down", [True, False], ids=["silent is down", "silent may be about to"])
@pytest.mark.parametrize("state", list(PROVIDER_HASHES))
async def test_provider_health_is_unavailable_reasons_rule(any_redis: Redis, state: str, silent_is_down: bool) -> None:
    pkey = "{iop}:test:p"
    await any_redis.delete(pkey)
    if PROVIDER_HASHES[state]:
        fields: dict[Any, Any] = dict(PROVIDER_HASHES[state])
        await any_redis.hset(pkey, mapping=fields)
    lua = await run_lib(any_redis, "unavailable_reason", """
local r = unavailable_reason(KEYS[1], tonumber(ARGV[1]), ARGV[2] == '1')
if r == nil then return {0} end
return {1, r}""", [pkey], [NOW, int(silent_is_down)])
    python = wire.provider_health(PROVIDER_HASHES[state]).unavailable_reason(NOW, silent_is_down)
    assert python == (None if lua == [0] else lua[1].decode())


def test_every_field_unavailable_reason_reads_is_in_provider_health() -> None:
    source = (scripts.lua_dir() / "lib" / "unavailable_reason.lua").read_text()
    hmget = re.search(r"HMGET', pkey, (.*?)\)\n", source)
    assert hmget is not None
    assert set(re.findall(r"'([a-z_]+)'", hmget.group(1))) == set(wire.ProviderHealth.__struct_fields__)
    assert set(wire.PROVIDER_HEALTH_FIELDS) == set(wire.ProviderHealth.__struct_fields__)


LIMIT_WINDOWS = ["", "garbage", "1700000012000.500|60", "1700000012000|", "1700000012000", "1699999990000|30",
                 "-5|10", "1700000030000|120", "1700000030000|600"]


@pytest.mark.parametrize("per_minute", [60, 120, 600])
@pytest.mark.parametrize("raw", LIMIT_WINDOWS)
async def test_a_limit_window_is_read_as_read_tat_reads_it(any_redis: Redis, raw: str, per_minute: int) -> None:
    lua = await run_lib(any_redis, "limits", """
local tat = read_tat(ARGV[1] ~= '' and ARGV[1] or nil, tonumber(ARGV[2]), tonumber(ARGV[3]))
return tat and string.format('%.3f', tat) or false""", ["{iop}:test:limits"], [raw, NOW, per_minute])
    window = wire.limit_window(raw)
    if lua is None:
        assert window is None
    else:
        assert window is not None
        assert window.tat_under(NOW, per_minute) == pytest.approx(float(lua), abs=1e-3)


@pytest.mark.parametrize("day", [19_000, 19_001, 19_002])
@pytest.mark.parametrize("raw", ["", "x", "19001:250", "19001:-3", "19001", "19001:2.5"])
async def test_a_day_budget_is_read_as_budget_used_reads_it(any_redis: Redis, raw: str, day: int) -> None:
    lua = await run_lib(any_redis, "limits", """
local d, used = budget_used(ARGV[1] ~= '' and ARGV[1] or nil, tonumber(ARGV[2]))
return {d, used}""", ["{iop}:test:limits"], [raw, day])
    budget = wire.day_budget(raw)
    python = [day, 0] if budget is None or day > budget.day else [budget.day, budget.used]
    assert python == lua
    # What the catalog shows as used today: that day's, never below zero.
    assert (budget.used_on(day) if budget is not None else 0) == (max(lua[1], 0) if lua[0] == day else 0)


def test_the_limit_state_fields_are_those_limits_lua_writes() -> None:
    source = (scripts.lua_dir() / "lib" / "limits.lua").read_text()
    written = set(re.findall(r"'([a-z]):' \.\. t\b", source))
    assert written == {"r", "t", "d", "x"}
    assert [f.split(":")[0] for f in wire.TenantLimitState.fields("acme")] == ["r", "t", "d", "x", "x", "x"]
    assert set(re.findall(r"refused(?:, wait)? = '(\w+)'", source)) == set(wire.REFUSAL_KINDS)


def test_the_token_window_fields_are_those_finish_writes() -> None:
    written = set(re.findall(r"set_field\(counters, '(tok_\w+)'", scripts.source("finish")))
    assert written == {"tok_t0", "tok_cur", "tok_prev"}
    assert re.search(rf"now - t0 >= {wire.TOKEN_BUCKET_MS}\b", scripts.source("finish"))
    assert re.search(rf"t0 \+ {wire.TOKEN_BUCKET_MS}\b", scripts.source("finish"))


def test_the_capacity_history_is_read_as_capacity_lua_writes_it() -> None:
    assert "redis.call('RPUSH', HISTORY, now .. ':' .. cap)" in scripts.source("capacity")
    assert wire.capacity_history([b"1700000000000:4", b"1700000000500:12", b"x:1", b"5:", b"7:-1"]) == [
        [1_700_000_000_000, 4], [1_700_000_000_500, 12]]


def test_provider_load_reads_what_capacity_lua_writes() -> None:
    hset = re.search(r"redis\.call\('HSET', PROVIDER, (.*?)\)\nif report\.moved", scripts.source("capacity"), re.S)
    assert hset is not None
    written = set(re.findall(r"'([a-z_]+)', ", hset.group(1)))
    # The capacity itself as an operator's override lets it (lib/capacity_in_force.lua).
    assert "local cap = capacity_in_force(PROVIDER, report.capacity)" in scripts.source("capacity")
    written.add("capacity")
    assert written == {"capacity", "capacity_mode", "ext", "hold_until", "hold_reason", "cap_reason", "engine",
                       "engine_ms", "svc_ms"}
    report = wire.CapacityReport(capacity=6, mode="auto", external=2, hold_ms=0, reason="latency rose",
                                 engine=wire.encode(wire.EngineReading(3, 1, 0.5, 40)).decode(), service_ms=812.5)
    fields = {"capacity": "6", "capacity_mode": report.mode, "ext": "2", "hold_until": "0", "hold_reason": "",
              "cap_reason": report.reason, "engine": report.engine, "engine_ms": str(NOW - 60), "svc_ms": "812.5",
              "in_flight": "4", "prompt_tokens": "100", "cached_tokens": "25"}
    load = wire.provider_load(fields)
    assert (load.capacity, load.capacity_mode, load.in_flight, load.external) == (6, "auto", 4, 2)
    assert (load.hold_until_ms, load.capacity_reason, load.service_ms) == (0, "latency rose", 812.5)
    assert load.engine == wire.EngineReading(3, 1, 0.5, 40)
    assert load.engine_age_ms(NOW) == 100
    assert (load.prompt_tokens, load.cached_tokens) == (100, 25)
    empty = wire.provider_load({})
    assert (empty.capacity, empty.engine, empty.engine_age_ms(NOW), empty.in_flight) == (None, None, None, 0)
    assert wire.provider_load({"engine": "not json"}).engine is None
