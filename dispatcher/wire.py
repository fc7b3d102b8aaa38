"""Wire formats between the Lua scripts and Python, each in one place.

What Python sends: one Struct per script call, encoded as the one JSON table the script
decodes (``local opts = cjson.decode(ARGV[n])``), so Lua and Python name every field alike
and a new field is a change in two places, here and in the script. Fields are never None on
the wire: ``cjson`` turns a JSON null into a truthy userdata.

What the scripts write and Python reads back (the catalog, the reaper): a Struct each, and
the function that reads it from a hash's fields, with the rule the scripts apply to it where
Python needs the same answer (whether a provider can take work).

``tests/dispatcher/test_wire.py`` holds both to the Lua: each script reads exactly its
Struct's fields, and each reader and rule here answers what its script answers.
"""

from __future__ import annotations

import math
import re
from typing import Any

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
    # A continuation of a cut stream (api/continuation.py): never to these providers (their
    # type cannot continue), and ahead of the lane's new work.
    excluded: list[str] = []
    first: bool = False


encode = msgspec.json.Encoder().encode


# --- the dispatch plan (``lua/lib/pump.lua``; built by ``dispatcher/plans.py``) -------------
# Key fields (``*_key``, ``queue``, and the header's flow control keys) are positions in the
# plan's key list: the script finds the key at ``KEYS[offset + position]``.


class Candidate(msgspec.Struct, frozen=True, omit_defaults=True):
    """A provider of a lane (``managed`` is left out when false: most plans have none)."""

    provider: str
    served: str  # the model's name on that provider (the dispatch rewrites the body to it)
    provider_key: int
    node_key: int  # the node stream its worker reads
    node: str
    endpoints: str  # ',chat/completions,rerank,': the endpoints it serves, for a job's check
    # iop manages which models its runtime holds (lifecycle: managed): a job goes there only
    # while the model is loaded (lua/lib/warm.lua).
    managed: bool = False
    # Where it stands in the model's preference (models[].preference, or an operator's
    # override of it): the first named has the highest; 0, the others. lua/lib/pick.lua fills
    # a higher one's free slots first, then compares load.
    rank: int = 0


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
    load_floor: float = 0.0  # for a provider of fixed capacity
    load_floor_auto: float = 0.0  # for one whose capacity is learned (`capacity_mode` auto)
    index: int = 0
    recency: int = 0
    footprint: int = 0
    index_max: int = 0
    index_ttl_ms: int = 0
    look_ahead: int = 0
    max_wait_ms: int = 0
    home_queue: float = 0.0  # a home takes its prompts up to capacity x (1 + this)


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
    # since|interval ms', lua/lib/drain_rate.lua note_drain): how long a place in its queue takes
    # (deadlines, lua/submit.lua); and keys.shed_field(queue) -> its submits refused as full
    # or deadline_unmeetable.
    rates: int = 0
    # A plan of one lane carries it here, and has no lane fields or set: one read.
    only: LaneSpec | None = None
    # What a finish's evidence of a 5xx may do to a provider (lua/lib/blame.lua).
    ejection: Ejection | None = None
    # Models that load and unload (some lane has a managed candidate): model id -> the providers
    # whose runtime holds it loaded, ',a,b,' (lua/lib/copies.lua). Set: a lane head none of
    # whose candidates can take it may place a load (lua/lib/place.lua).
    copies: int = 0


class Refusal(msgspec.Struct, frozen=True):
    """How ``lib/pump.lua`` ``refuse_unavailable`` answers the jobs of a lane with no provider
    that can take work (``heartbeat.lua``, ``drain.lua``, ``refuse.lua``)."""

    reply: str  # reply stream key prefix: + the job's replica id
    replica_jobs: str  # replica job set key prefix: + the job's replica id
    ttl_ms: int  # of a reply stream, refreshed by the answer
    limit: int  # most jobs refused per lane per call (the rest at the next call)
    # A provider whose worker is silent (never heard of, heartbeat past its TTL) counts as down
    # until this server ms (0: never): only in a reaper round, which knows that Redis was
    # reachable until it opened, and for an observation gap after that. A round whose call
    # was retried across a failover would otherwise judge on the new server, seconds later,
    # heartbeats that could not land there meanwhile (or were lost with its writes).
    silent_down_until_ms: int = 0


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


class ModelsReport(msgspec.Struct, frozen=True):
    """What a worker publishes of the models one provider's runtime holds (``lua/models.lua``'s
    options; workers/model_lifecycle.py), with the provider's lifecycle settings."""

    provider: str
    states: dict[str, str]  # every model the runtime reports -> 'loaded' | 'loading' | 'unloaded'
    # Each served name of the config -> the queue keys of the model ids served as it, one a
    # line (dispatcher/keys.py queue): a model with jobs waiting in one is never unloaded.
    queues: dict[str, str]
    # ... and those model ids, comma-separated: whose copies it holds (lua/lib/copies.lua).
    models: dict[str, str]
    max_loaded: int  # models it holds at once (the runtime's word, else the config's, else 1)
    load_ms: int  # the config's load_s: the expected load of a model never timed there
    idle_ms: int  # unload_idle_s
    timeout_ms: int  # load_timeout_s: an order no worker finished by then lapses


class Override(msgspec.Struct, frozen=True):
    """An operator's override of one config value, as ``lua/override.lua`` keeps it (the
    overrides hash's field ``<field>|<id>``; dispatcher/overrides.py)."""

    value: Any
    config: Any
    by: str
    at: int  # server ms it was set
    until: int | None  # server ms it lapses; None: never
    via: str


class AuditEntry(msgspec.Struct, frozen=True):
    """One control action of the audit stream (``lua/lib/audit.lua``): before and after are
    JSON values, decoded here."""

    id: str  # the stream entry's id
    at: int  # server ms
    by: str  # an admin key's name (never the key), "loopback", or "iop" for what iop did itself
    action: str
    target: str  # "provider/<id>", "model/<id>", "config"
    before: Any
    after: Any
    via: str  # "http", "cli", "ui", "reload", "expiry", "qualify"


class LoadOutcome(msgspec.Struct, frozen=True):
    """The end of a load iop ordered (``lua/load_done.lua``'s options)."""

    provider: str
    served: str
    ok: bool
    load_ms: int = 0  # how long the load took (ok)
    reason: str = ""  # the runtime's words (failed)
    evict: str = ""  # the model unloaded first ('' none)
    evicted: bool = False  # ... and its unload was done


class ModelState(msgspec.Struct, frozen=True):
    """One served model on a provider whose models iop manages, as ``lua/lib/model_state.lua``
    reads the provider hash (the catalog's ``providers[].models_state``)."""

    state: str  # 'loaded' | 'loading' | 'unloading' | 'unloaded' | 'unknown'
    since: int | None  # ms it entered that state
    last_used: int | None  # ms of its last dispatch
    load_s: float | None  # what its loads there took (None: none timed yet)
    running: int = 0
    # Its last load failed: no load of it ordered there before this ms, and why.
    failed_until: int | None = None
    failure: str = ""
    loads: dict[str, int] = {}  # reason ('demand', 'runtime') -> loads counted
    unloads: dict[str, int] = {}  # reason ('evict', 'runtime') -> unloads counted
    load_failures: int = 0


def models_state(fields: dict[str, str]) -> dict[str, ModelState]:
    """The models of a provider hash (decoded fields) by served name, as the scripts keep
    them (lua/lib/model_state.lua, lua/models.lua, lua/load_done.lua); {} for a provider whose
    models iop does not manage."""
    names = sorted(f[3:] for f in fields if f.startswith("ms:"))
    out: dict[str, ModelState] = {}
    for name in names:
        def num(prefix: str, name: str = name) -> int | None:
            raw = fields.get(prefix + name)
            try:
                return int(float(raw)) if raw not in (None, "") else None
            except ValueError:
                return None

        def counted(prefix: str, name: str = name) -> dict[str, int]:
            head = f"{prefix}{name}\t"
            return {f[len(head):]: int(v) for f, v in fields.items() if f.startswith(head) and v.lstrip("-").isdigit()}

        load_ms = num("ml:")
        fail_until = num("mf:")
        out[name] = ModelState(
            state=fields["ms:" + name], since=num("mt:"), last_used=num("mu:"),
            load_s=None if load_ms is None else load_ms / 1000, running=max(num("mr:") or 0, 0),
            failed_until=fail_until or None, failure=fields.get("mfr:" + name, ""),
            loads=counted("mn:"), unloads=counted("mx:"), load_failures=num("mfc:") or 0)
    return out


def capacity_history(raw: list[bytes]) -> list[list[int]]:
    """A provider's learned limit over time, ``keys.capacity_history`` as
    ``lua/capacity.lua`` appends it ('<server ms>:<limit>' each time it moved): [ms, limit],
    oldest first; an entry that does not read so is left out."""
    out = []
    for entry in raw:
        at, _, limit = entry.decode().partition(":")
        if at.isdigit() and limit.isdigit():
            out.append([int(at), int(limit)])
    return out


class EngineReading(msgspec.Struct, frozen=True):
    """An engine's load as the worker last read it (workers/engine_metrics.py), kept as JSON
    in the provider's hash (field ``engine``); None where the engine does not say."""

    running: int | None
    waiting: int | None
    kv_usage: float | None
    age_ms: int  # how old the reading was when it was published (``engine_ms``)


# --- what the scripts write into a provider's hash (``{iop}:p:<provider>``) -------------------


class ProviderLoad(msgspec.Struct, frozen=True):
    """A provider's load as its hash holds it: what ``lua/capacity.lua`` writes of a worker's
    :class:`CapacityReport` (capacity, capacity_mode, ext, hold_until, hold_reason,
    cap_reason, engine, engine_ms, svc_ms), in_flight (moved by dispatch and release only) and
    the prompt and cached token totals ``lua/finish.lua`` adds to. :func:`provider_load`
    reads it."""

    capacity: int | None  # the limit in force; None before the first report or heartbeat
    capacity_mode: str
    in_flight: int
    external: int  # ext
    hold_until_ms: int  # hold_until: nothing new goes there until then (0: none)
    hold_reason: str
    capacity_reason: str  # cap_reason: why the learned limit last moved
    engine: EngineReading | None
    engine_ms: int | None  # when ``engine`` was published (server ms)
    service_ms: float  # svc_ms (0: not known)
    prompt_tokens: int
    cached_tokens: int

    def engine_age_ms(self, now_ms: int) -> int | None:
        """How old the engine's reading is now (None: no reading)."""
        if self.engine is None:
            return None
        return self.engine.age_ms + max(now_ms - (self.engine_ms or now_ms), 0)


def provider_load(fields: dict[str, str]) -> ProviderLoad:
    """The load fields of a provider's hash (decoded to str)."""
    engine = None
    if fields.get("engine"):
        try:
            engine = msgspec.json.decode(fields["engine"], type=EngineReading)
        except msgspec.DecodeError:
            engine = None
    return ProviderLoad(
        capacity=int(fields["capacity"]) if "capacity" in fields else None,
        capacity_mode=fields.get("capacity_mode", ""), in_flight=int(fields.get("in_flight", 0)),
        external=int(fields.get("ext") or 0), hold_until_ms=int(fields.get("hold_until") or 0),
        hold_reason=fields.get("hold_reason", ""), capacity_reason=fields.get("cap_reason", ""), engine=engine,
        engine_ms=int(fields["engine_ms"]) if fields.get("engine_ms") else None,
        service_ms=float(fields.get("svc_ms") or 0), prompt_tokens=int(fields.get("prompt_tokens", 0)),
        cached_tokens=int(fields.get("cached_tokens", 0)))


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


def _num(raw: str | None) -> float | None:
    """Lua's ``tonumber`` of a field: None where it gives nil."""
    try:
        return float(raw) if raw else None
    except ValueError:
        return None


class ProviderHealth(msgspec.Struct, frozen=True):
    """Whether a provider can take work, as its hash holds it: its worker's heartbeat
    (``lua/heartbeat.lua``: health, reason, hb_ms, hb_exp; ``removed`` when a reload took
    it out of the config; ``leaving`` while its worker drains after a SIGTERM), its limit in
    force (``lua/capacity.lua``), an operator's drain mark (``lua/drain.lua``) and an
    operator's disable override (``off``, ``lua/override.lua``). :func:`provider_health`
    reads it; :meth:`reasons` is ``lua/lib/unavailable_reason.lua``'s rule."""

    health: str | None
    reason: str
    hb_ms: float | None  # None: never heard of
    hb_exp: float | None
    capacity: float | None
    drain: str
    removed: bool
    leaving: bool
    off: str = ""

    def silent(self, now_ms: int) -> bool:
        """Its worker says nothing: never heard of, or its heartbeat is past its TTL."""
        return self.hb_ms is None or (self.hb_exp or 0) < now_ms

    def reasons(self, now_ms: int) -> list[tuple[str, str]]:
        """Every reason it cannot take work, as (kind, words), in the order
        ``unavailable_reason`` tries them: ``removed``, then ``never_seen``, ``leaving`` or
        ``stale`` (its worker is silent, or leaving), ``unavailable`` (the probe's word),
        ``drained``, ``disabled``, ``capacity``. Empty: it can."""
        found: list[tuple[str, str]] = []
        if self.removed:
            found.append(("removed", "removed from the config by a reload"))
        if self.hb_ms is None:
            found.append(("never_seen", "never seen: no heartbeat from its worker yet"))
        elif self.leaving:
            ago = (now_ms - (self.hb_ms or 0)) / 1000
            found.append(("leaving", f"its worker left {ago:.1f}s ago and no other worker of its node took it over"
                          if self.silent(now_ms) else
                          f"its worker is leaving (since {ago:.1f}s): another worker of its node takes it over "
                          "with its next heartbeat"))
        elif self.silent(now_ms):
            found.append(("stale", f"stale heartbeat: last one {(now_ms - (self.hb_ms or 0)) / 1000:.1f}s ago"))
        if self.health != "available":
            found.append(("unavailable", self.reason or "reported unavailable"))
        if self.drain:
            found.append(("drained", "drained by an operator"))
        if self.off:
            found.append(("disabled", "disabled by an operator"))
        if (self.capacity or 0) <= 0:
            found.append(("capacity", "capacity 0"))
        return found

    def unavailable_reason(self, now_ms: int, silent_is_down: bool) -> str | None:
        """``lua/lib/unavailable_reason.lua``: why it cannot take work ('' when it can; None
        when it cannot but may be about to: removed by a reload, silent while
        ``silent_is_down`` is False, or its worker leaving within its heartbeat's TTL)."""
        found = self.reasons(now_ms)
        if not found:
            return ""
        kind, words = found[0]
        if kind == "removed" or (kind in ("never_seen", "stale", "leaving") and not silent_is_down):
            return None
        if kind == "leaving" and not self.silent(now_ms):
            return None
        return words


PROVIDER_HEALTH_FIELDS = ("health", "reason", "hb_ms", "hb_exp", "capacity", "drain", "removed", "leaving", "off")


def provider_health(fields: dict[str, str]) -> ProviderHealth:
    """The health fields of a provider's hash (decoded to str)."""
    hb_ms = fields.get("hb_ms")
    return ProviderHealth(
        health=fields.get("health"), reason=fields.get("reason", ""),
        hb_ms=None if hb_ms is None else _num(hb_ms) or 0.0, hb_exp=_num(fields.get("hb_exp")),
        capacity=_num(fields.get("capacity")), drain=fields.get("drain", ""), removed=bool(fields.get("removed")),
        leaving=bool(fields.get("leaving")), off=fields.get("off", ""))


TOKEN_BUCKET_MS = 10_000  # lua/finish.lua's bucket


class TokenWindow(msgspec.Struct, frozen=True):
    """A provider's completion tokens over two 10 s buckets, as ``lua/finish.lua`` keeps them
    in its hash: tok_t0 (the current bucket's start, server ms), tok_cur (its tokens),
    tok_prev (the bucket before's)."""

    t0_ms: int
    cur: float
    prev: float

    def per_s(self, now_ms: int) -> float:
        """Tokens per second over the last bucket's length: the current bucket whole, the one
        before weighted by how much of it the window still covers. Buckets the script has
        not rolled over yet (no job finished since) are rolled here, so an idle provider
        falls to 0 within two buckets. A job's tokens count when it finishes, so a long
        stream lands all at once."""
        prev, cur = self.prev, self.cur
        elapsed = max(now_ms - self.t0_ms, 0)
        if elapsed >= 2 * TOKEN_BUCKET_MS:
            return 0.0
        if elapsed >= TOKEN_BUCKET_MS:
            prev, cur, elapsed = cur, 0.0, elapsed - TOKEN_BUCKET_MS
        covered = 1 - elapsed / TOKEN_BUCKET_MS
        return round((prev * covered + cur) / (TOKEN_BUCKET_MS / 1000), 3)


def token_window(fields: dict[str, str]) -> TokenWindow | None:
    """The token window of a provider's hash; None before its first tokens."""
    try:
        return TokenWindow(int(fields["tok_t0"]), float(fields.get("tok_cur") or 0),
                           float(fields.get("tok_prev") or 0))
    except (KeyError, ValueError):
        return None


# --- rate limits and budgets (``{iop}:limits``, lua/lib/limits.lua) ------------------------

LIMIT_WINDOW_MS = 60_000  # lib/limits.lua WINDOW_MS
REFUSAL_KINDS = ("requests", "tokens", "budget")
_TAT = re.compile(r"^([\d.\-]+)\|?(\d*)$")  # lib/limits.lua read_tat's pattern
_DAY = re.compile(r"^(\d+):(-?\d+)$")  # lib/limits.lua budget_used's


class LimitWindow(msgspec.Struct, frozen=True):
    """A tenant's requests (``r:<tenant>``) or tokens (``t:<tenant>``) per minute: GCRA's
    theoretical arrival time (server ms) and the limit per minute it was computed under
    (None: not written)."""

    tat_ms: float
    per_minute: int | None

    def tat_under(self, now_ms: float, per_minute: int) -> float:
        """``read_tat``: the arrival time under the limit ``per_minute`` now in force (a
        reload that changed the limit rescales what is ahead of now: the units in the
        window stay the same)."""
        pm = self.per_minute
        if pm and pm != per_minute and self.tat_ms > now_ms:
            return now_ms + (self.tat_ms - now_ms) * pm / per_minute
        return self.tat_ms

    def used(self, now_ms: int, per_minute: int) -> int:
        """The units in the sliding minute now, under ``per_minute`` in force."""
        ahead = max(self.tat_under(now_ms, per_minute) - now_ms, 0)
        return math.ceil(ahead * per_minute / LIMIT_WINDOW_MS - 1e-9)


def limit_window(raw: str | None) -> LimitWindow | None:
    m = _TAT.match(raw or "")
    if m is None:
        return None
    try:
        tat = float(m.group(1))
    except ValueError:
        return None
    return LimitWindow(tat, int(m.group(2)) if m.group(2) else None)


class DayBudget(msgspec.Struct, frozen=True):
    """A tenant's day budget (``d:<tenant>``): the day (UTC days since the epoch) and the
    tokens used in it."""

    day: int
    used: int

    def used_on(self, day: int) -> int:
        """Tokens used on ``day`` (none before it began)."""
        return max(self.used, 0) if self.day == day else 0


def day_budget(raw: str | None) -> DayBudget | None:
    m = _DAY.match(raw or "")
    return DayBudget(int(m.group(1)), int(m.group(2))) if m else None


class TenantLimitState(msgspec.Struct, frozen=True):
    """What ``lua/lib/limits.lua`` keeps of one tenant in ``{iop}:limits``."""

    requests: LimitWindow | None
    tokens: LimitWindow | None
    budget: DayBudget | None
    refused: dict[str, int]  # x:<tenant>:<kind>: refusals so far, by REFUSAL_KINDS

    @classmethod
    def fields(cls, tenant: str) -> list[str]:
        """The hash fields it is read from, in :func:`tenant_limit_state`'s order."""
        return [f"r:{tenant}", f"t:{tenant}", f"d:{tenant}", *(f"x:{tenant}:{k}" for k in REFUSAL_KINDS)]


def tenant_limit_state(values: list[str | None]) -> TenantLimitState:
    """A tenant's state from the values of :meth:`TenantLimitState.fields`, in that order."""
    r, t, d, *refused = values
    return TenantLimitState(limit_window(r), limit_window(t), day_budget(d),
                            {kind: _int(raw) for kind, raw in zip(REFUSAL_KINDS, refused, strict=True)})


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


class LiveTally(msgspec.Struct, frozen=True, omit_defaults=True):
    """A worker's tally of one provider x model's calls since its last flush, as ``lua/live.lua``
    reads it (msgpack; ``dispatcher/live.py`` Tallies): what ``LiveBucket`` holds but its
    number, added to the current bucket of each window. Empty maps are left out."""

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
