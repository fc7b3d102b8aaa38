"""Wire formats of the Lua scripts' options: one Struct per script call, encoded as the one
JSON table the script decodes (``local opts = cjson.decode(ARGV[n])``), so Lua and Python
name every field alike and a new field is a change in two places, here and in the script.
``tests/dispatcher/test_wire.py`` checks that each script reads exactly its Struct's fields.

Fields are never None on the wire: ``cjson`` turns a JSON null into a truthy userdata.
"""

from __future__ import annotations

import msgspec


class SubmitOptions(msgspec.Struct, frozen=True):
    """``lua/submit.lua``'s ARGV[4]."""

    job: str
    model: str
    replica: str
    endpoint: str
    stream: int  # 0 / 1: written as is into the node stream entry
    lane: str  # '' for the lane of all the model's providers
    timeout_ms: int
    max_queue: int
    # The job must go to the lane's one provider (a stored Response lives there).
    pinned: bool = False
    # Flow control only ('' / 1 / 0 otherwise).
    tenant: str = ""
    weight: float = 1.0
    max_queued: int = 0


encode = msgspec.json.Encoder().encode


class Refusal(msgspec.Struct, frozen=True):
    """How ``lib/pump.lua`` ``refuse_unavailable`` answers the jobs of a lane with no provider
    that can take work (``heartbeat.lua``, ``drain.lua``, ``refuse.lua``)."""

    reply: str  # reply stream key prefix: + the job's replica id
    replica_jobs: str  # replica job set key prefix: + the job's replica id
    ttl_ms: int  # of a reply stream, refreshed by the answer
    limit: int  # most jobs refused per lane per call (the rest at the next call)
    # A provider whose worker is silent (never heard of, heartbeat past its TTL) counts as down:
    # only in a reaper round, which knows that Redis was reachable meanwhile.
    silent_is_down: bool = False
