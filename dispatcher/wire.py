"""Wire formats of the Lua scripts' options: one Struct per script call, encoded as the one
JSON table the script decodes (``local opts = cjson.decode(ARGV[n])``), so Lua and Python
name every field alike and a new field is a change in two places, here and in the script.
``tests/dispatcher/test_wire.py`` checks that each script reads exactly its Struct's fields.

Fields are never None on the wire: ``cjson`` turns a JSON null into a truthy userdata.
"""

from __future__ import annotations

import msgspec


class Limits(msgspec.Struct, frozen=True):
    """A limited tenant's limits as ``lua/lib/limits.lua`` checks them (0: no such limit)."""

    tenant: str
    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    tokens_per_day: int = 0
    tokens: int = 0  # the estimate reserved (prompt + output)
    day: int = 0  # UTC days since the epoch, on the API's clock (the budget's day)
    next_day_ms: int = 0  # ms from now until the next 00:00 UTC (a refusal's retry-after)


class SubmitOptions(msgspec.Struct, frozen=True, omit_defaults=True):
    """``lua/submit.lua``'s ARGV[4] (a field at its default is left out: Lua reads nil)."""

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
    # Cache-aware dispatch (a model with affinity): the chained hashes of the prompt's blocks
    # (dispatcher/affinity.py), or the one of its conversation key; none otherwise.
    blocks: list[str] = []
    # A tenant with rate limits or a budget (lua/lib/limits.lua); absent otherwise.
    limits: Limits | None = None
    # Refuse the job at once if its predicted queue wait is over this (0: never).
    predict_ms: int = 0


encode = msgspec.json.Encoder().encode


# --- the dispatch plan (``lua/lib/pump.lua``; built by ``dispatcher/plans.py``) -------------
# Key fields (``*_key``, ``queue``, and the header's flow control keys) are positions in the
# plan's key list: the script finds the key at ``KEYS[offset + position]``.


class Candidate(msgspec.Struct, frozen=True):
    """A provider of a lane."""

    provider: str
    served: str  # the model's name on that provider (the dispatch rewrites the body to it)
    provider_key: int
    node_key: int  # the node stream its worker reads
    node: str
    endpoints: str  # ',chat/completions,rerank,': the endpoints it serves, for a job's check


class LaneSpec(msgspec.Struct, frozen=True):
    """One lane of a plan: a queue and the providers that take its jobs."""

    model: str
    name: str  # "" for the lane of all the model's providers in the default band
    queue: int
    band: int  # rank, 0 first
    hold_ms: int  # the model's hold_when_unavailable_ms
    candidates: list[Candidate]
    # Cache-aware dispatch (the model's affinity; load_bound 0: off): the bound, the keys of
    # the model's index (block -> providers that served it), of its recency (block -> last
    # use ms) and of its footprint (provider -> blocks it holds), and the index's bounds.
    load_bound: float = 0.0
    load_floor: float = 0.0
    index: int = 0
    recency: int = 0
    footprint: int = 0
    index_max: int = 0
    index_ttl_ms: int = 0
    look_ahead: int = 0
    max_wait_ms: int = 0


class Ejection(msgspec.Struct, frozen=True):
    """When 5xx answers eject a provider (the config's ``ejection``), as ``lua/lib/blame.lua``
    and ``lua/lib/eject.lua`` read it from a finish's plan."""

    consecutive: int  # 5xx in a row that count against a provider (0: no streak rule)
    rate: float  # share of its requests over the window (0: no rate rule)
    window_ms: int  # two buckets of half this
    min_requests: int
    base_ms: int
    max_ms: int
    max_percent: int  # of a lane's providers ejected at once


class PlanHeader(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a pumping script reads first (field '' of the plan hash)."""

    fair: bool = False  # flow control: tenants, weights, bands
    capped: bool = False  # some tenant has a max_in_flight (else no job's tenant is looked at)
    # Flow control's keys: tenant counters, tenant limits, each band's virtual time, each
    # tenant's finish tag; and the prefix of a tenant's parked-jobs keys.
    tenants: int = 0
    limits: int = 0
    vtime: int = 0
    ftags: int = 0
    park: str = ""
    # Cache-aware dispatch's counters: '<model>\t<hit|miss|spill>' -> decisions.
    affinity_stats: int = 0
    # Each lane's drain rate while it has a backlog (queue key -> 'block start ms|dispatches
    # since|interval ms', lua/lib/pump.lua note_drain): how long a place in its queue takes
    # (deadlines, lua/submit.lua).
    rates: int = 0
    # A plan of one lane carries it here, and has no lane fields or set: one read.
    only: LaneSpec | None = None
    # What a finish's evidence of a 5xx may do to a provider (lua/lib/blame.lua).
    ejection: Ejection | None = None


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


class CapacityReport(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a worker publishes of a provider's load (``lua/capacity.lua``'s options;
    workers/capacity_control.py)."""

    capacity: int  # the limit in force: dispatch fills at most this many slots
    mode: str  # 'auto' (learned) | 'fixed'
    external: int = 0  # what its engine runs and queues beyond iop's in_flight there
    hold_ms: int = 0  # nothing new goes there for this long (a rate limit); 0: none
    hold_reason: str = ""
    reason: str = ""  # why the limit last moved ('' for a fixed one)
    engine: str = ""  # its engine's last reading, JSON (EngineReading); '' when it has none
    service_ms: float = 0.0  # the median time of its recent calls (deadline predictions)
    moved: bool = False  # the limit moved since the last report: added to its history


class EngineReading(msgspec.Struct, frozen=True):
    """An engine's load as the worker last read it (workers/engine_metrics.py), kept as JSON
    in the provider's hash (field ``engine``); None where the engine does not say."""

    running: int | None
    waiting: int | None
    kv_usage: float | None
    age_ms: int  # how old the reading was when it was published (``engine_ms``)


# --- what the scripts write into a provider's hash (``{iop}:p:<provider>``) -------------------

EJECTION_KINDS = ("consecutive_5xx", "failure_rate", "trial")


class EjectionState(msgspec.Struct, frozen=True):
    """A provider's 5xx evidence and ejection, as ``lua/lib/eject.lua``, ``blame.lua``,
    ``answered.lua`` and ``evidence.lua`` keep them in its hash (the field names below, with
    ``ej_n:<kind>`` for ``ejections``); :func:`ejection_state` reads them."""

    until_ms: int | None  # ej_until: out until then; after it on trial while ``trial``
    trial: bool  # ej_trial == '1': ejected, or on trial once ``until_ms`` passed
    count: int  # ej_count: the repeat count its last ejection's length came from
    reason: str  # ej_reason, in words
    kind: str  # ej_kind: one of EJECTION_KINDS
    streak: int  # c5xx: 5xx counted against it since it last answered
    excused: int  # excused_5xx: 5xx another provider also answered the same request
    ejections: dict[str, int]  # ej_n:<kind>: ejections so far, by kind

    def ejected(self, now_ms: int) -> bool:
        return self.trial and (self.until_ms or 0) > now_ms

    def on_trial(self, now_ms: int) -> bool:
        return self.trial and (self.until_ms or 0) <= now_ms


def _int(raw: str | None) -> int:
    try:
        return int(raw) if raw else 0
    except ValueError:
        return 0


def ejection_state(fields: dict[str, str]) -> EjectionState:
    """The ejection fields of a provider's hash (decoded to str)."""
    until = fields.get("ej_until")
    return EjectionState(
        until_ms=_int(until) if until else None, trial=fields.get("ej_trial") == "1",
        count=_int(fields.get("ej_count")), reason=fields.get("ej_reason", ""), kind=fields.get("ej_kind", ""),
        streak=_int(fields.get("c5xx")), excused=_int(fields.get("excused_5xx")),
        ejections={kind: _int(fields.get(f"ej_n:{kind}")) for kind in EJECTION_KINDS})


# --- live figures (``{iop}:live:<model>|<provider>``, lua/lib/live_figures.lua) ---------------


class LiveBucket(msgspec.Struct, frozen=True):
    """One time bucket of a provider x model's live figures, as ``lua/lib/live_figures.lua``
    packs it (msgpack): its number (server ms // the window's bucket length), the requests that
    ended in it, their errors by kind, and histograms (log bin -> count, ``dispatcher/live.py``
    ``value_of``) of the answered ones' TTFT ms, e2e ms and output tokens/s. An empty table is
    left out by the script (cmsgpack would pack it as an array)."""

    at: int
    requests: int = 0
    errors: dict[str, int] = {}
    ttft: dict[int, int] = {}
    e2e: dict[int, int] = {}
    tps: dict[int, int] = {}


def live_bucket(raw: bytes) -> LiveBucket | None:
    try:
        return msgspec.msgpack.decode(raw, type=LiveBucket)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


class UptimeBucket(msgspec.Struct, frozen=True):
    """A provider's uptime bucket, ``up:<window>:<slot>`` of its hash: '<number>|<up ms>|<seen
    ms>' (``lua/lib/uptime.lua``)."""

    at: int
    up_ms: int
    seen_ms: int


def uptime_bucket(raw: str | None) -> UptimeBucket | None:
    parts = (raw or "").split("|")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    return UptimeBucket(int(parts[0]), int(parts[1]), int(parts[2]))
