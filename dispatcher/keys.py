"""Every Redis key and channel iop uses, in one place.

All keys carry the hash tag ``{iop}`` so that they live in one Redis Cluster slot
and every script can be given all of its keys in KEYS.

| key                      | type   | holds                                                          |
|--------------------------|--------|----------------------------------------------------------------|
| ``{iop}:p:<provider>``   | hash   | node, type, category, capacity, models, health, hb_ms, hb_exp,  |
|                          |        | in_flight, probe reason (written by its node's worker);        |
|                          |        | ``drain``: ms an operator drained it (lua/drain.lua), absent   |
|                          |        | when open -- no heartbeat touches it; ``off``: ms an operator  |
|                          |        | disabled it, ``cap_o``/``cap_lo``/``cap_hi``: an operator's    |
|                          |        | capacity or bounds, ``cap_c``: what its worker last proposed   |
|                          |        | (lua/override.lua, lib/capacity_in_force.lua);                 |
|                          |        | ``tok_t0``, ``tok_cur``, ``tok_prev``: completion tokens of    |
|                          |        | jobs finished in two 10 s buckets (lua/finish.lua);            |
|                          |        | 5xx evidence and ejection: ``ev_b``, ``evn``, ``evf``,         |
|                          |        | ``evn0``, ``evf0``, ``c5xx``, ``ej_*`` (dispatcher/wire.py     |
|                          |        | EjectionState; lua/lib/evidence.lua);                          |
|                          |        | load: ``capacity_mode``, ``ext``, ``hold_until``, ``engine``,  |
|                          |        | ``cap_reason``, ``svc_ms`` (wire.CapacityReport, capacity.lua) |
| ``{iop}:caph:<provider>``| list   | ``<ms>:<limit>`` each time its learned limit moved (last 240) |
| ``{iop}:q:<model>``      | zset   | waiting jobs of a model group's lane: job id -> submit seq     |
|  ``[|<providers>]``      |        | (FIFO), or its fair-queuing tag with flow control; the lane of |
|  ``[#<band>]``           |        | all its providers has no suffix, a lane of some (an endpoint   |
|                          |        | only they serve, a stored response) lists them, a priority     |
|                          |        | band other than the default names it:                          |
|                          |        | ``{iop}:q:qwen|gpu1,gpu2#batch``  (dispatcher/plans.py)        |
| ``{iop}:n:<node>``       | stream | jobs dispatched to a node, with the rewritten target; group    |
|                          |        | ``workers`` is consumed by that node's worker processes        |
| ``{iop}:r:<replica>``    | stream | events for the requests one API process is waiting on         |
| ``{iop}:rj:<replica>``   | set    | job ids an API process submitted and still waits on            |
| ``{iop}:jobs``           | hash   | job id -> JSON record (state, model, provider, fence, times)   |
| ``{iop}:body``           | hash   | job id -> request body, until the job ends                     |
| ``{iop}:leases``         | zset   | job id -> lease expiry ms: the proof that a slot is held       |
| ``{iop}:deadlines``      | zset   | job id -> queue deadline ms of waiting (or expired) jobs       |
| ``{iop}:replicas``       | zset   | API replica id -> liveness expiry ms                           |
| ``{iop}:seq``            | string | submit counter (global FIFO order across groups)               |
| ``{iop}:fence``          | string | dispatch counter (fencing tokens)                              |
| ``{iop}:reaper``         | string | the reaper round lock (owner, expires after one interval)     |
| ``{iop}:tenants``        | hash   | flow control: ``q:<tenant>[:<model>]`` waiting, ``r:...``      |
|                          |        | running jobs of each tenant                                    |
| ``{iop}:tenant:limits``  | hash   | tenant -> max_in_flight (written by the API from its config)   |
| ``{iop}:vt``             | hash   | ``band:<rank>`` -> virtual time (tag of its last dispatch)     |
| ``{iop}:ft``             | hash   | tenant -> start tag of the tenant's next job                   |
| ``{iop}:park:<tenant>``  | set    | a tenant at its max_in_flight: the lanes it has parked jobs in |
| ``…:park:<tenant>|<q>``  | zset   | its parked jobs of lane queue ``<q>`` -> their tags            |
| ``{iop}:lanes:waiting``  | set    | queue keys of lanes that may hold jobs: a job put in a lane    |
|                          |        | adds it, a pump that finds it empty removes it                 |
| ``{iop}:plan:<id>``      | hash   | a dispatch plan: ``''`` -> header, queue key -> lane (JSON,    |
|                          |        | dispatcher/wire.py); ``<id>`` a digest of its content; TTL 1 d |
| ``{iop}:plan:<id>:lanes``| set    | its lanes' queue keys                                          |
| ``{iop}:aff:<model>``    | hash   | cache-aware dispatch: prompt block hash -> providers that      |
|                          |        | served it (its home first, comma-separated)                    |
| ``{iop}:afft:<model>``   | zset   | block hash -> last use ms (bounds the index: oldest go first)  |
| ``{iop}:affn:<model>``   | hash   | provider -> blocks the index lists it as holding               |
| ``{iop}:aff:stats``      | hash   | ``<model>\t<hit|miss|spill>`` -> affinity decisions           |
| ``{iop}:copies``         | hash   | models that load and unload: model id -> ``,<provider>,...,``  |
|                          |        | the managed providers whose runtime holds it loaded            |
|                          |        | (lua/lib/copies.lua; what may give up a spare copy)            |
| ``{iop}:ovr``            | hash   | operators' overrides of the config (dispatcher/overrides.py):  |
|                          |        | ``<field>|<id>`` -> its record (JSON, wire.Override; written   |
|                          |        | only by lua/override.lua)                                      |
| ``{iop}:ovr:v``          | string | counts changes of ``{iop}:ovr``: every process watches it      |
| ``{iop}:audit``          | stream | control actions, newest last (wire.AuditEntry; lib/audit.lua), |
|                          |        | the last ``AUDIT_KEEP`` kept                                    |
| ``{iop}:audit:n``        | hash   | action -> how many were audited (``/metrics``)                  |
| ``{iop}:audit:once``     | string | the last config digest a reload audited (one entry per reload  |
|                          |        | of the fleet, not one per process)                              |
| ``{iop}:limits``         | hash   | tenants' rate limits and budgets (lua/lib/limits.lua):         |
|                          |        | ``r:``/``t:<tenant>`` GCRA arrival ms ``|`` limit, ``d:<tenant>`` |
|                          |        | ``<day>:<tokens used>``, ``x:<tenant>:<limit>`` refusals        |
| ``{iop}:qrate``          | hash   | queue key -> ``<block start>|<count>|<interval ms>``: how fast  |
|                          |        | it drains while it has a backlog (deadlines, lua/submit.lua)   |
| ``{iop}:responses``      | hash   | Responses API response id -> ``provider\tmodel\texpiry ms``  |
| ``{iop}:responses:t``    | zset   | response id -> expiry ms (bounds how many are remembered)      |
| ``{iop}:reaper:seen``    | hash   | server ms and run id of the last reaper round: after a gap or |
|                          |        | on a new server, expiries are renewed before anyone is judged |
|                          |        | (and ``judge``: no heartbeat is judged before that server ms; |
|                          |        | ``quiet``: nor until a provider's heartbeat is newer than it) |
| ``{iop}:live:<model>|<p>``| hash  | live figures of provider p serving a model: ``<window>:<slot>`` |
|                          |        | -> that bucket (msgpack, wire.LiveBucket; lua/live.lua)       |
|                          |        | (uptime lives in the provider hash: ``up:<window>:<slot>``)   |
| ``{iop}:qual:<model>``   | list   | a model's qualification reports, newest first (JSON,          |
|                          |        | dispatcher/qualifications.py; the last 20 kept)               |
| ``{iop}:qual:run:<id>``  | hash   | a qualification run under way: model, expires_ms, max_tokens,  |
|                          |        | asked, cancelled (api/qualify.py); expires after its time     |
| ``{iop}:qual:cap``       | hash   | provider -> the suggested_capacity its latest finished         |
|                          |        | qualification found (JSON, qualifications.CapacitySeed): the  |
|                          |        | start of a ``capacity: auto`` limit with none learned yet      |
| ``{iop}:tel:<node>``     | hash   | device telemetry: worker id -> its last report (JSON,         |
|                          |        | wire.Telemetry; workers/telemetry.py), TTL 3 heartbeats       |

Channel ``{iop}:cancel:<node>`` tells a node's workers to abort a running job.

The separators that join ids here (``|``, ``,`` and ``#`` in queue keys, ``~`` in job ids,
``:`` in tenant counters, a tab in finish tags and stored Responses) are kept out of the ids
they could confuse by config validation (``dispatcher/config/validation.py``), so two ids
never make one key.
"""

from __future__ import annotations

PREFIX = "{iop}"

JOBS = f"{PREFIX}:jobs"
BODIES = f"{PREFIX}:body"
LEASES = f"{PREFIX}:leases"
DEADLINES = f"{PREFIX}:deadlines"
FENCE = f"{PREFIX}:fence"
SEQ = f"{PREFIX}:seq"
REPLICAS = f"{PREFIX}:replicas"
REAPER_LOCK = f"{PREFIX}:reaper"
REAPER_SEEN = f"{PREFIX}:reaper:seen"
TENANTS = f"{PREFIX}:tenants"
TENANT_LIMITS = f"{PREFIX}:tenant:limits"
VIRTUAL_TIME = f"{PREFIX}:vt"
FINISH_TAGS = f"{PREFIX}:ft"
RESPONSES = f"{PREFIX}:responses"
WAITING_LANES = f"{PREFIX}:lanes:waiting"
AFFINITY_STATS = f"{PREFIX}:aff:stats"
MODEL_COPIES = f"{PREFIX}:copies"
# Each lane's drain rate while it has a backlog (lua/lib/drain_rate.lua note_drain), and, under
# shed_field(queue), how many submits the queue refused for want of room or time.
QUEUE_RATES = f"{PREFIX}:qrate"
# Operators' overrides of the config, the count of their changes, and the audit of every
# control action (dispatcher/overrides.py, lua/override.lua, lua/lib/audit.lua).
OVERRIDES = f"{PREFIX}:ovr"
OVERRIDES_VERSION = f"{PREFIX}:ovr:v"
AUDIT = f"{PREFIX}:audit"
AUDIT_COUNTS = f"{PREFIX}:audit:n"
AUDIT_ONCE = f"{PREFIX}:audit:once"
AUDIT_KEEP = 10_000
# The tenants' rate limits and budgets (lua/lib/limits.lua: r:/t:/d:/x: fields per tenant).
LIMITS = f"{PREFIX}:limits"
RESPONSES_BY_EXPIRY = f"{PREFIX}:responses:t"

# The keys every job script takes first (lua/lib/jobs.lua), and the dispatch scripts'
# fifth (lua/lib/pump.lua).
JOB_KEYS = (JOBS, BODIES, LEASES, DEADLINES)
PUMP_KEYS = (*JOB_KEYS, FENCE)

NODE_GROUP = "workers"
CANCEL_CHANNEL_PREFIX = f"{PREFIX}:cancel:"


def provider(provider_id: str) -> str:
    return f"{PREFIX}:p:{provider_id}"


def live(provider_id: str, model_id: str) -> str:
    """The live figures of a provider serving a model (``lua/lib/live_figures.lua``); a model
    id has no ``|``, so the pair is unambiguous."""
    return f"{PREFIX}:live:{model_id}|{provider_id}"


def qualifications(model_id: str) -> str:
    """A model's qualification reports, newest first (``dispatcher/qualifications.py``)."""
    return f"{PREFIX}:qual:{model_id}"


def qualification_run(run_id: str) -> str:
    """A qualification run under way: its model, bounds and tokens asked (``api/qualify.py``)."""
    return f"{PREFIX}:qual:run:{run_id}"


# provider -> qualifications.CapacitySeed (dispatcher/qualifications.py seed_capacity).
CAPACITY_SEEDS = f"{PREFIX}:qual:cap"


def telemetry(node_id: str) -> str:
    """What each live worker of a node last said of its host and devices (``workers/telemetry.py``)."""
    return f"{PREFIX}:tel:{node_id}"


def capacity_history(provider_id: str) -> str:
    """When a provider's learned capacity moved, and to what (``lua/capacity.lua``)."""
    return f"{PREFIX}:caph:{provider_id}"


def queue(model_id: str, lane: str = "") -> str:
    """``lane``: its providers (none for all of them), then ``#band`` if not the default band."""
    if not lane or lane.startswith("#"):
        return f"{PREFIX}:q:{model_id}{lane}"
    return f"{PREFIX}:q:{model_id}|{lane}"


def shed_field(queue_key: str) -> str:
    """The field of ``QUEUE_RATES`` counting the submits ``queue_key`` refused as full or
    deadline_unmeetable (lua/submit.lua): demand a learned limit reads as a backlog."""
    return f"{queue_key}|shed"


def plan(plan_id: str) -> str:
    """A dispatch plan (``dispatcher/plans.py``, ``lua/plan.lua``)."""
    return f"{PREFIX}:plan:{plan_id}"


def plan_lanes(plan_id: str) -> str:
    return f"{plan(plan_id)}:lanes"


def affinity(model_id: str) -> str:
    """A model group's prefix index: block hash -> the providers that served it, its home first."""
    return f"{PREFIX}:aff:{model_id}"


def affinity_recency(model_id: str) -> str:
    """When each block of a model group's prefix index was last used (oldest forgotten first)."""
    return f"{PREFIX}:afft:{model_id}"


def affinity_footprint(model_id: str) -> str:
    """How many blocks of a model group's prefix index each provider holds (a new prefix
    goes where the fewest are, per unit of capacity: the servers' caches fill evenly)."""
    return f"{PREFIX}:affn:{model_id}"


def node(node_id: str) -> str:
    return f"{PREFIX}:n:{node_id}"


def parked(tenant: str) -> str:
    """The lanes a capped tenant has parked jobs in (``lua/lib/pump.lua`` park_job): a set of
    queue keys."""
    return f"{PREFIX}:park:{tenant}"


def parked_in(tenant: str, queue_key: str) -> str:
    """A capped tenant's parked jobs of one lane: job id -> its tag."""
    return f"{parked(tenant)}|{queue_key}"


def reply(replica_id: str) -> str:
    return f"{PREFIX}:r:{replica_id}"


def replica_jobs(replica_id: str) -> str:
    return f"{PREFIX}:rj:{replica_id}"


def cancel_channel(node_id: str) -> str:
    return f"{CANCEL_CHANNEL_PREFIX}{node_id}"
