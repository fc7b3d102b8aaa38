"""The configuration's shape: frozen structs that reject unknown fields, and their defaults.

Checking a document against :class:`Config` catches wrong types and misspelt fields, each with
its ``$.path`` (all of them: :mod:`dispatcher.config.field_rules`); what needs more than one
field to judge is :mod:`dispatcher.config.validation`'s.

A setting is declared once, here: its type, its default, its range (``POSITIVE``,
``NON_NEGATIVE``, any ``msgspec.Meta`` bounds) and, when a reload cannot apply it, ``RESTART``.
The range checks (every value out of range reported at once) and the restart-only set of
:mod:`dispatcher.reloading` are derived from these annotations (:mod:`dispatcher.config.field_rules`).
A default must be in its range.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Annotated, Literal

import msgspec

from dispatcher.config.field_rules import NON_NEGATIVE, POSITIVE, RESTART, hint
from dispatcher.endpoints import DEFAULT_ENDPOINTS

PROVIDER_TYPES = ("vllm", "sglang", "lemonade", "ollama", "llamacpp", "openai_api", "cli")
HTTP_TYPES = frozenset(PROVIDER_TYPES) - {"cli"}
# The default of a provider's ``stream_usage``: the runtimes that take
# stream_options.include_usage. Not openai_api: some hosted APIs refuse the field (Mistral
# answers 422), and a stream that worked must not start failing.
# Not llamacpp: llama-server ends every stream with its counts unasked (``timings``), and
# asked, moves them into the usage-only chunk, which iop keeps from a caller who did not ask;
# llama-cpp-python ignores the field.
STREAM_USAGE_TYPES = frozenset({"vllm", "sglang", "lemonade", "ollama"})
CATEGORIES = ("api", "cli", "local_inference")

# The category a provider gets when the config does not name one.
DEFAULT_CATEGORY = {
    "vllm": "local_inference",
    "sglang": "local_inference",
    "lemonade": "local_inference",
    "ollama": "local_inference",
    "llamacpp": "local_inference",
    "openai_api": "api",
    "cli": "cli",
}


class _Base(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class SentinelConfig(_Base, frozen=True):
    """Redis Sentinel names the master; ``url`` then gives only TLS, db and credentials."""

    master: str
    # "host:port" of each sentinel; asked in turn.
    nodes: list[str]
    # The ACL user and the env var holding the password of the data connections.
    username: str | None = None
    password_env: str | None = None
    # The env var holding the sentinels' own password (none when unset).
    sentinel_password_env: str | None = None


class RedisConfig(_Base, frozen=True):
    url: str | None = None
    # The url is any one node of a Redis Cluster: iop finds the master serving {iop}.
    cluster: bool = False
    sentinel: SentinelConfig | None = None
    # While Redis is unreachable (a failover, a restart), a new request waits this long for
    # it before it is answered 503 redis_unavailable; 0 answers at once.
    failover_hold_ms: Annotated[int, NON_NEGATIVE, hint("0: no holding")] = 5_000


DEFAULT_TENANT = "default"
# The tenant, and the band, of qualification runs (``iop qualify``; dispatcher/tenants.py).
QUALIFY_TENANT = "iop-qualify"


class KeyLimits(_Base, frozen=True):
    """A tenant's rate limits and budget, across the fleet (``lua/lib/limits.lua``). Unset:
    no limit of that kind."""

    # Sliding one-minute windows (GCRA): a steady rate, and at most a minute's worth at once.
    requests_per_minute: Annotated[int, msgspec.Meta(ge=1)] | None = None
    # Prompt + completion tokens: an estimate reserved at submit (the body's bytes / 4, plus
    # the request's max_tokens / max_output_tokens or output_tokens_if_unset), settled to the
    # usage its provider reports when the job ends.
    tokens_per_minute: Annotated[int, msgspec.Meta(ge=1)] | None = None
    # A budget: tokens per UTC day, reset at 00:00 UTC.
    tokens_per_day: Annotated[int, msgspec.Meta(ge=1)] | None = None
    output_tokens_if_unset: Annotated[int, msgspec.Meta(ge=0)] = 1024


class KeyConfig(_Base, frozen=True):
    """A named caller key: its name is the request's tenant (flow control, limits, metrics)."""

    name: str
    # The env var holding the key, or the key's SHA-256 (hex): never the key itself.
    key_env: str | None = None
    key_sha256: str | None = None
    # A band of api.priorities (unset: api.default_priority).
    priority: str | None = None
    # Share of slots within its band, relative to the other tenants there.
    weight: Annotated[float, POSITIVE] = 1.0
    # Model ids it may call (globs); unset = all.
    models: list[str] | None = None
    # Across the fleet: waiting at once (beyond, 429 tenant_queue_full), running at once
    # (beyond, its requests wait without holding anyone else up).
    max_queued: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_in_flight: Annotated[int, msgspec.Meta(ge=1)] | None = None
    limits: KeyLimits | None = None


class ApiConfig(_Base, frozen=True):
    # Name of an env var holding comma-separated caller keys; unset = open API.
    api_keys_env: str | None = None
    # Named caller keys (tenants); the keys of api_keys_env keep working as tenant "default".
    keys: list[KeyConfig] = []
    # Priority bands, highest first; a request waits behind every job of a higher band.
    priorities: list[str] = []
    default_priority: str = "standard"
    # Trust this request header for the tenant's name (only behind a load balancer that sets it).
    tenant_header: str | None = None
    # Keys for the operator surfaces (/catalog, /ui, /metrics); unset = the caller keys.
    admin_keys_env: str | None = None
    # The HTTP server is built with the fields marked RESTART: a reload keeps them until a restart.
    max_body_bytes: Annotated[int, POSITIVE, RESTART] = 16 * 1024 * 1024
    # Request line and headers together; beyond, 431.
    max_header_bytes: Annotated[int, POSITIVE, RESTART] = 16 * 1024
    # A client must send its headers, and then its body, within these.
    header_timeout_s: Annotated[float, POSITIVE, RESTART] = 10.0
    body_timeout_s: Annotated[float, POSITIVE] = 30.0
    # How long an idle kept-alive connection stays open. Longer than the idle limit of any
    # client or proxy in front (httpx 5 s, aiohttp 15 s, nginx and cloud load balancers
    # 60 s), so the client always closes first: a server that closes in the instant a
    # client reuses the connection fails that request, and a POST cannot be retried.
    keep_alive_s: Annotated[float, POSITIVE, RESTART] = 75.0
    # Streamed answers one API process relays at once; beyond, 503 server_overloaded.
    max_streams: Annotated[int, POSITIVE] = 4096


class QueueConfig(_Base, frozen=True):
    max_queue: Annotated[int, NON_NEGATIVE] = 100
    queue_timeout_ms: Annotated[int, POSITIVE] = 30_000
    # 0: a request none of whose providers can take work is answered 503
    # no_provider_available at once (and so are waiting ones when the last goes down); N:
    # it waits up to N ms for one to come back (a provider restarting) before that answer.
    hold_when_unavailable_ms: Annotated[int, NON_NEGATIVE] = 0
    # Load shedding: a request that would wait is refused at once (503 deadline_unmeetable)
    # when its place in the queue and the queue's recent drain rate predict a longer wait
    # than this one time in twenty. Unset: only a caller's x-iop-deadline-ms asks for that.
    refuse_predicted_over_ms: Annotated[int, msgspec.Meta(ge=1)] | None = None


# busy_probe_interval_ms unset: this many probe intervals.
BUSY_PROBE_FACTOR = 12


class DispatchConfig(_Base, frozen=True):
    """Timings of the dispatch machinery (leases, heartbeats, reaper)."""

    # A running job's slot is held by a lease the worker renews every third of it.
    lease_ms: Annotated[int, POSITIVE] = 15_000
    # A provider whose last heartbeat is older than this is not chosen.
    heartbeat_ttl_ms: Annotated[int, POSITIVE] = 10_000
    heartbeat_interval_ms: Annotated[int, POSITIVE] = 2_000
    # A provider that runs nothing is probed this often; a busy one only this seldom, and
    # only with a check that cannot disturb its requests (workers/adapters/probes.py): its
    # traffic tells meanwhile. Unset: BUSY_PROBE_FACTOR probe intervals (60 s by default).
    probe_interval_ms: Annotated[int, POSITIVE] = 5_000
    busy_probe_interval_ms: int | None = None
    probe_timeout_ms: Annotated[int, POSITIVE] = 2_000
    # How often the reaper runs (reap_period_ms). Unset: 1 s, or less where the leases or
    # the replica TTL are short enough to need it; set: it must stay under half of
    # observation_gap_ms (validation.py).
    reap_interval_ms: Annotated[int, POSITIVE] | None = None
    # An API replica silent this long is dead: the reaper cancels what it waited on.
    replica_ttl_ms: Annotated[int, POSITIVE] = 10_000
    # Dispatches of one job when its worker dies before any output reached the client.
    max_attempts: Annotated[int, POSITIVE] = 2
    # SIGTERM: running jobs get this long to finish before they are cancelled.
    drain_grace_s: Annotated[float, NON_NEGATIVE] = 30.0

    @property
    def busy_probe_period_ms(self) -> int:
        """How seldom a busy provider is probed: ``busy_probe_interval_ms``, else a multiple
        of ``probe_interval_ms`` (so that a config with long probe intervals stays valid)."""
        if self.busy_probe_interval_ms is not None:
            return self.busy_probe_interval_ms
        return BUSY_PROBE_FACTOR * self.probe_interval_ms

    @property
    def reap_period_ms(self) -> int:
        """``reap_interval_ms``, else 1 s, shortened to stay under half of the observation
        gap: a default never fails validation, whatever the leases and TTLs."""
        if self.reap_interval_ms is not None:
            return self.reap_interval_ms
        return max(min(1_000, (self.observation_gap_ms - 1) // 2), 1)

    @property
    def observation_gap_ms(self) -> int:
        """No reaper round for longer than this means nobody was watching Redis: expiries
        that passed meanwhile are not held against their owners (``lua/reap_round.lua``).
        Short enough that no live lease or replica expires inside it."""
        return min(self.lease_ms // 3, self.replica_ttl_ms // 2)


class QualifyConfig(_Base, frozen=True):
    """Qualification runs (``iop qualify``, docs/QUALIFY.md): present, they are allowed, as the
    tenant ``iop-qualify`` in a band of its own below every other (which turns flow control on);
    absent, iop refuses them and dispatch is as it was."""

    # The most of a model's slots (the sum of its providers' capacities) a run may hold at
    # once: its concurrency sweep stops there.
    share: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.25
    # How long a run may last, and how many completion tokens it may ask for, before iop
    # refuses its requests.
    max_seconds: Annotated[int, POSITIVE] = 900
    max_tokens: Annotated[int, POSITIVE] = 200_000
    # Reports kept per model (the newest first; older ones are dropped).
    keep_reports: Annotated[int, POSITIVE] = 20


class EjectionConfig(_Base, frozen=True):
    """When a provider leaves rotation for its 5xx answers, and how it comes back
    (``lua/lib/blame.lua``, ``lua/lib/eject.lua``; docs/PROVIDERS.md "Leaving rotation and coming back").

    A provider that refuses or resets connections, times out, cuts a stream or fails its probe
    leaves at once, whatever this says. A 5xx counts against it only when it is the
    provider's fault, not the request's: when another provider served the same request, or
    when none other could try it. One that another provider of the request also answered 5xx
    counts against neither. A 4xx never counts."""

    # 5xx in a row that count against it (each on a different request; an answered request
    # ends the streak) eject it; 0: never on a streak.
    consecutive_5xx: Annotated[int, NON_NEGATIVE, hint("0: never on a streak")] = 5
    # ... or at least this share of its finished requests over the last window_s (two halves)
    # with at least min_requests of them, while the other providers of its lanes together
    # fail less than half as often; 0: never on a rate.
    failure_rate: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.5
    window_s: Annotated[int, msgspec.Meta(ge=2, le=3600)] = 60
    min_requests: Annotated[int, POSITIVE] = 20
    # The first ejection lasts base_s, each repeat twice as long as the one before, at most
    # max_s (a repeat count falls by one for each max_s the provider then stays in). When it
    # ends the provider is on trial: one request at a time until one is answered; a 5xx
    # that counts against it then ejects it again at once.
    base_s: Annotated[float, POSITIVE] = 30.0
    max_s: Annotated[float, POSITIVE] = 300.0
    # At most this share of a lane's providers are ejected at once (at least one of two or
    # more may be); and a lane none of whose other providers can take work keeps using an
    # ejected one: a 5xx alone never leaves a request with no provider.
    max_ejected_percent: Annotated[int, msgspec.Meta(ge=0, le=100)] = 50


# affinity.load_floor when the config sets none, by the provider's capacity mode.
FIXED_LOAD_FLOOR = 0.5
AUTO_LOAD_FLOOR = 1.0


class AffinityConfig(_Base, frozen=True):
    """Cache-aware dispatch of a model group (``lua/lib/pump.lua`` affine; docs/DESIGN.md).

    ``prefix``: a request goes, within the load bound, to a provider that served the
    longest head of its prompt (``dispatcher/affinity.py`` blocks_of), whose KV cache likely
    holds it. ``session``: a conversation (``x-session-id``, ``user``, Anthropic
    ``metadata.user_id``) stays on one provider within the bound. ``off``: the lowest
    ``in_flight / capacity`` always (S04)."""

    mode: Literal["off", "prefix", "session"] = "off"
    # Affinity may choose a provider only while its load ratio, with this request, stays at
    # most load_bound x the mean of the lane's (consistent hashing with bounded loads).
    load_bound: Annotated[float, msgspec.Meta(ge=1.0, le=100.0)] = 1.25
    # ... except that a provider at most this loaded (in_flight / capacity with the request)
    # is never over the bound: at low load the mean is a request or two, and a home that
    # is half idle has room for its own prompts (a miss costs the whole prefill elsewhere).
    # Unset: FIXED_LOAD_FLOOR for a provider of fixed capacity, which may be set above what
    # its server runs at once (then the bound must act before it is full), and
    # AUTO_LOAD_FLOOR for `capacity: auto`, whose limit is where its engine starts to queue:
    # a free slot under it is one the engine runs at once, and a hit belongs there.
    load_floor: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    # The index of which provider served which prompt blocks (per model group): at most this
    # many blocks, and none unused for longer than index_ttl_s (oldest forgotten first).
    index_max_blocks: Annotated[int, msgspec.Meta(ge=16, le=10_000_000)] = 200_000
    index_ttl_s: Annotated[int, msgspec.Meta(ge=1)] = 3600
    # Under saturation: a job whose home is busy (within the bound, no free slot) waits for
    # it rather than run uncached elsewhere, and a slot that frees on a provider that is
    # not the first waiting job's home may go to one of the next look_ahead jobs whose home
    # it is; either way a job waits so for at most max_wait_ms (then it takes the next free
    # slot: a second home if one is free, else wherever).
    look_ahead: Annotated[int, msgspec.Meta(ge=0, le=64)] = 8
    max_wait_ms: Annotated[int, msgspec.Meta(ge=0, le=60_000)] = 500
    # A home's own queue: a job whose prompt's head a provider holds may go there while its
    # in_flight is under capacity x (1 + home_queue), to wait in its engine's queue with its
    # prefix cached, rather than be prefilled whole on another provider (which then caches
    # it too, and evicts what it held). Anything else still stops at capacity, so the limit
    # keeps meaning where requests run, and what waits without a home waits in iop.
    home_queue: Annotated[float, msgspec.Meta(ge=0.0, le=8.0)] = 1.0


class ModelConfig(_Base, frozen=True):
    id: str
    providers: dict[str, str]
    display_name: str | None = None
    # Unset: the queue section's.
    max_queue: Annotated[int, NON_NEGATIVE] | None = None
    queue_timeout_ms: Annotated[int, POSITIVE] | None = None
    hold_when_unavailable_ms: Annotated[int, NON_NEGATIVE] | None = None
    refuse_predicted_over_ms: Annotated[int, msgspec.Meta(ge=1)] | None = None
    # Other model ids tried in order when this one cannot take a request at once (no
    # provider of its endpoint available, its queue or its tenant's share full, its
    # deadline unmeetable); the first that can takes it.
    fallbacks: list[str] = []
    # Providers of this model whose free slots are filled first, in this order; the others
    # after them, by load (lua/lib/pick.lua). Unset: by load alone (S04). A cheaper or nearer
    # provider first, the rest as overflow.
    preference: list[str] = []
    affinity: AffinityConfig = AffinityConfig()
    # A streamed answer cut after output began (its provider died, its worker was lost) goes
    # on on another provider of the model that can continue it (api/continuation.py), at most
    # max_continuations times per request; false: the stream ends with the error.
    continue_streams: bool = True
    max_continuations: Annotated[int, msgspec.Meta(ge=0, le=8)] = 2


# The provider types whose runtimes can load and unload models at run time, which iop then
# manages where the config says ``lifecycle: managed`` (docs/PROVIDERS.md "Models that load
# and unload"): Ollama, Lemonade, llama.cpp's llama-server in router mode (``--models-dir``),
# vLLM in sleep mode (``/sleep``, ``/wake_up``).
LIFECYCLE_TYPES = frozenset({"ollama", "lemonade", "llamacpp", "vllm"})

# The bounds of ``capacity: auto`` when the config names none.
AUTO_MIN_CAPACITY = 1
AUTO_MAX_CAPACITY = 64


class ProviderConfig(_Base, frozen=True):
    id: str
    type: str
    models: list[str] = []
    category: str | None = None
    # Requests it runs at once: a number, or "auto" -- iop learns it from the engine's own
    # metrics, the provider's latency and rate-limit headers (workers/capacity.py), within
    # min_capacity and max_capacity.
    capacity: Annotated[int, NON_NEGATIVE, hint("0 keeps the provider out of rotation")] | Literal["auto"] = 1
    min_capacity: Annotated[int, POSITIVE] | None = None
    max_capacity: Annotated[int, POSITIVE] | None = None
    base_url: str | None = None
    api_key_env: str | None = None
    command: list[str] | None = None
    timeout_s: Annotated[float, POSITIVE] = 600.0
    # Endpoint names (dispatcher/endpoints.py) this provider serves; unset = its type's default.
    endpoints: list[str] | None = None
    # Ask streamed chat/completions for their usage (stream_options.include_usage) when the
    # caller did not, to count their tokens; the caller still gets what it asked for.
    # Unset = on for the local runtimes (STREAM_USAGE_TYPES).
    stream_usage: bool | None = None
    # Models that load and unload (docs/PROVIDERS.md): ``managed``, iop reads which of its
    # models the runtime holds, sends a request only where its model is loaded (warm first)
    # and loads and unloads models through the runtime's API as demand moves (lua/lib/place.lua);
    # ``static`` (the default), every model of ``models`` is always ready. Not the default for
    # any type: a runtime left to hold several models by itself (Ollama's
    # OLLAMA_MAX_LOADED_MODELS) would be held to max_loaded, and one that does not list a
    # served name would never be sent it.
    lifecycle: Literal["managed", "static"] = "static"
    # Models it holds at once; unset: what its runtime says (llama.cpp's --models-max), else 1.
    max_loaded: Annotated[int, POSITIVE] | None = None
    # The expected time to load one of its models, until iop has timed one there.
    load_s: Annotated[float, POSITIVE] = 30.0
    # A load that takes longer has failed.
    load_timeout_s: Annotated[float, POSITIVE] = 600.0
    # A model unused for less than this is never unloaded to make room for another (nor is a
    # spare copy, one that another provider also holds, loaded for less). Unset: load_s: a
    # model used within one load's time is likely wanted again before a load could pay off.
    unload_idle_s: Annotated[float, NON_NEGATIVE] | None = None

    @property
    def idle_floor_s(self) -> float:
        """``unload_idle_s``, else ``load_s``."""
        return self.load_s if self.unload_idle_s is None else self.unload_idle_s

    @property
    def manages_models(self) -> bool:
        """Whether iop manages which of its models are loaded (``lifecycle``)."""
        return self.lifecycle == "managed"

    @property
    def auto(self) -> bool:
        """Whether iop learns its capacity (``capacity: auto``)."""
        return self.capacity == "auto"

    @property
    def capacity_bounds(self) -> tuple[int, int]:
        """The floor and ceiling of a learned capacity (``min_capacity``, ``max_capacity``)."""
        floor = self.min_capacity if self.min_capacity is not None else AUTO_MIN_CAPACITY
        return floor, max(self.max_capacity if self.max_capacity is not None else AUTO_MAX_CAPACITY, floor)

    @property
    def fixed_capacity(self) -> int:
        """A fixed capacity as configured; with ``auto``, the most it may learn."""
        return self.capacity_bounds[1] if self.capacity == "auto" else self.capacity

    @property
    def asks_stream_usage(self) -> bool:
        if self.stream_usage is not None:
            return self.stream_usage
        return self.type in STREAM_USAGE_TYPES

    @property
    def effective_category(self) -> str:
        return self.category or DEFAULT_CATEGORY.get(self.type, "api")

    @property
    def served_endpoints(self) -> tuple[str, ...]:
        if self.endpoints is not None:
            return tuple(self.endpoints)
        return DEFAULT_ENDPOINTS.get(self.type, ())


class NodeConfig(_Base, frozen=True):
    id: str
    providers: list[ProviderConfig] = []


class ResponsesConfig(_Base, frozen=True):
    """Where stored Responses live: iop remembers which provider made each response id."""

    # How long an id is remembered (a provider that forgets sooner answers 404 itself).
    id_ttl_s: Annotated[int, POSITIVE] = 7 * 24 * 3600
    # At most this many ids are remembered; the oldest are forgotten first.
    max_ids: Annotated[int, POSITIVE] = 100_000


class FakeProviderConfig(_Base, frozen=True):
    """A fake OpenAI-compatible upstream that ``iop up`` starts (demo configs only)."""

    port: int
    host: str = "127.0.0.1"
    delay_ms: int = 0
    tokens: int = 16
    token_interval_ms: int = 0
    # Ollama's model lifecycle (``iop fake-provider --max-loaded/--load-ms/--keep-alive-s``); all
    # None: off, every model always loaded.
    max_loaded: Annotated[int, POSITIVE] | None = None
    load_ms: Annotated[int, NON_NEGATIVE] | None = None
    keep_alive_s: Annotated[float, NON_NEGATIVE] | None = None


class DemoConfig(_Base, frozen=True):
    fake_providers: list[FakeProviderConfig] = []


class TracingConfig(_Base, frozen=True):
    """OpenTelemetry traces (dispatcher/tracing.py); off unless an endpoint is set here or in
    OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT."""

    # The OTLP/HTTP collector's base URL, as OTEL_EXPORTER_OTLP_ENDPOINT (/v1/traces is added).
    endpoint: str | None = None
    service_name: str = "iop"
    # Of new traces; a caller's traceparent keeps its own sampling decision.
    sample_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] = 1.0


class Config(_Base, frozen=True):
    models: list[ModelConfig] = []
    nodes: list[NodeConfig] = []
    # RESTART: a running process keeps its Redis, the timings its leases and loops were
    # started with, and its tracing (set up once per process) until it restarts.
    redis: Annotated[RedisConfig, RESTART] = RedisConfig()
    api: ApiConfig = ApiConfig()
    queue: QueueConfig = QueueConfig()
    dispatch: Annotated[DispatchConfig, RESTART] = DispatchConfig()
    responses: ResponsesConfig = ResponsesConfig()
    demo: DemoConfig = DemoConfig()
    tracing: Annotated[TracingConfig, RESTART] = TracingConfig()
    ejection: EjectionConfig = EjectionConfig()
    qualify: QualifyConfig | None = None

    def model(self, model_id: str) -> ModelConfig | None:
        return next((m for m in self.models if m.id == model_id), None)

    def node(self, node_id: str) -> NodeConfig | None:
        return next((n for n in self.nodes if n.id == node_id), None)

    def provider(self, provider_id: str) -> ProviderConfig | None:
        return next((p for _, p in self.providers() if p.id == provider_id), None)

    def providers(self) -> Iterator[tuple[NodeConfig, ProviderConfig]]:
        for node in self.nodes:
            for provider in node.providers:
                yield node, provider

    def max_queue(self, model: ModelConfig) -> int:
        return self.queue.max_queue if model.max_queue is None else model.max_queue

    def queue_timeout_ms(self, model: ModelConfig) -> int:
        return self.queue.queue_timeout_ms if model.queue_timeout_ms is None else model.queue_timeout_ms

    def refuse_predicted_over_ms(self, model: ModelConfig) -> int | None:
        if model.refuse_predicted_over_ms is None:
            return self.queue.refuse_predicted_over_ms
        return model.refuse_predicted_over_ms

    def hold_when_unavailable_ms(self, model: ModelConfig) -> int:
        if model.hold_when_unavailable_ms is None:
            return self.queue.hold_when_unavailable_ms
        return model.hold_when_unavailable_ms


def host_port(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as a pair; a ValueError says what is wrong."""
    host, sep, port = text.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not host:port")
    return host, int(port)


def config_digest(config: Config) -> str:
    """A short digest of a config's content: what a reload's audit entry names it by."""
    return hashlib.blake2b(msgspec.json.encode(config), digest_size=8).hexdigest()
