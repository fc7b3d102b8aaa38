"""The configuration: YAML decoded straight into frozen structs, then cross-checked.

Decoding (``msgspec.yaml.decode``) rejects unknown fields and wrong types with a
``$.path``; it stops at the first such error. Everything that needs more than one
field to judge -- references between models and providers, duplicates, enums,
ranges -- is checked afterwards by :func:`validate`, which reports *all* problems
at once.

The older route shape (``openai.model_routes`` + ``nodes[].adapters``) is still
accepted: :mod:`dispatcher.legacy` converts it to this one before validation and
reports its problems at their legacy paths, with a deprecation warning per entry.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec

from dispatcher.exceptions import ConfigError, ConfigProblem

PROVIDER_TYPES = ("vllm", "sglang", "lemonade", "ollama", "openai_api", "cli")
HTTP_TYPES = frozenset(PROVIDER_TYPES) - {"cli"}
CATEGORIES = ("api", "cli", "local_inference")

_log = logging.getLogger("iop.config")

# The category a provider gets when the config does not name one.
DEFAULT_CATEGORY = {
    "vllm": "local_inference",
    "sglang": "local_inference",
    "lemonade": "local_inference",
    "ollama": "local_inference",
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


class ApiConfig(_Base, frozen=True):
    # Name of an env var holding comma-separated caller keys; unset = open API.
    api_keys_env: str | None = None
    # Keys for the operator surfaces (/catalog, /ui, /metrics); unset = the caller keys.
    admin_keys_env: str | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    # Request line and headers together; beyond, 431.
    max_header_bytes: int = 16 * 1024
    # A client must send its headers, and then its body, within these.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    # Streamed answers one API process relays at once; beyond, 503 server_overloaded.
    max_streams: int = 4096


class QueueConfig(_Base, frozen=True):
    max_queue: int = 100
    queue_timeout_ms: int = 30_000


class DispatchConfig(_Base, frozen=True):
    """Timings of the dispatch machinery (leases, heartbeats, reaper)."""

    # A running job's slot is held by a lease the worker renews every third of it.
    lease_ms: int = 15_000
    # A provider whose last heartbeat is older than this is not chosen.
    heartbeat_ttl_ms: int = 10_000
    heartbeat_interval_ms: int = 2_000
    probe_interval_ms: int = 5_000
    probe_timeout_ms: int = 2_000
    reap_interval_ms: int = 1_000
    # An API replica silent this long is dead: the reaper cancels what it waited on.
    replica_ttl_ms: int = 10_000
    # Dispatches of one job when its worker dies before any output reached the client.
    max_attempts: int = 2
    # SIGTERM: running jobs get this long to finish before they are cancelled.
    drain_grace_s: float = 30.0

    @property
    def observation_gap_ms(self) -> int:
        """No reaper round for longer than this means nobody was watching Redis: expiries
        that passed meanwhile are not held against their owners (``lua/reap_round.lua``).
        Short enough that no live lease or replica expires inside it."""
        return min(self.lease_ms // 3, self.replica_ttl_ms // 2)


class ModelConfig(_Base, frozen=True):
    id: str
    providers: dict[str, str]
    display_name: str | None = None
    max_queue: int | None = None
    queue_timeout_ms: int | None = None


class ProviderConfig(_Base, frozen=True):
    id: str
    type: str
    models: list[str] = []
    category: str | None = None
    capacity: int = 1
    base_url: str | None = None
    api_key_env: str | None = None
    command: list[str] | None = None
    timeout_s: float = 600.0

    @property
    def effective_category(self) -> str:
        return self.category or DEFAULT_CATEGORY.get(self.type, "api")


class NodeConfig(_Base, frozen=True):
    id: str
    providers: list[ProviderConfig] = []


class FakeProviderConfig(_Base, frozen=True):
    """A fake OpenAI-compatible upstream that ``iop up`` starts (demo configs only)."""

    port: int
    host: str = "127.0.0.1"
    delay_ms: int = 0
    tokens: int = 16
    token_interval_ms: int = 0


class DemoConfig(_Base, frozen=True):
    fake_providers: list[FakeProviderConfig] = []


class Config(_Base, frozen=True):
    models: list[ModelConfig] = []
    nodes: list[NodeConfig] = []
    redis: RedisConfig = RedisConfig()
    api: ApiConfig = ApiConfig()
    queue: QueueConfig = QueueConfig()
    dispatch: DispatchConfig = DispatchConfig()
    demo: DemoConfig = DemoConfig()

    def model(self, model_id: str) -> ModelConfig | None:
        return next((m for m in self.models if m.id == model_id), None)

    def node(self, node_id: str) -> NodeConfig | None:
        return next((n for n in self.nodes if n.id == node_id), None)

    def providers(self) -> Iterator[tuple[NodeConfig, ProviderConfig]]:
        for node in self.nodes:
            for provider in node.providers:
                yield node, provider

    def max_queue(self, model: ModelConfig) -> int:
        return self.queue.max_queue if model.max_queue is None else model.max_queue

    def queue_timeout_ms(self, model: ModelConfig) -> int:
        return self.queue.queue_timeout_ms if model.queue_timeout_ms is None else model.queue_timeout_ms


def normalise_base_url(url: str) -> str:
    """``http://h:8000/v1/`` and ``http://h:8000`` name the same server root."""
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")].rstrip("/")
    return url


def validate(config: Config) -> list[ConfigProblem]:
    """Every cross-field problem of ``config``, each with the path of the offending value."""
    problems: list[ConfigProblem] = []

    def bad(path: str, message: str) -> None:
        problems.append(ConfigProblem(path, message))

    providers: dict[str, ProviderConfig] = {}
    prov: ProviderConfig | None
    for path, pid in _duplicates((f"$.nodes[{i}].id", n.id) for i, n in enumerate(config.nodes)):
        bad(path, f"duplicate node id {pid!r}")
    for ni, node in enumerate(config.nodes):
        if not node.id:
            bad(f"$.nodes[{ni}].id", "must not be empty")
        for pi, prov in enumerate(node.providers):
            path = f"$.nodes[{ni}].providers[{pi}]"
            if prov.id in providers:
                bad(f"{path}.id", f"duplicate provider id {prov.id!r}")
            providers.setdefault(prov.id, prov)
            problems.extend(_provider_problems(path, prov))

    for path, mid in _duplicates((f"$.models[{i}].id", m.id) for i, m in enumerate(config.models)):
        bad(path, f"duplicate model id {mid!r}")
    for mi, model in enumerate(config.models):
        path = f"$.models[{mi}]"
        if not model.id:
            bad(f"{path}.id", "must not be empty")
        if not model.providers:
            bad(f"{path}.providers", "a model needs at least one provider")
        for pid, served in model.providers.items():
            prov = providers.get(pid)
            if prov is None:
                bad(f"{path}.providers.{pid}", f"no node defines provider {pid!r}")
            elif served not in prov.models:
                bad(
                    f"{path}.providers.{pid}",
                    f"served name {served!r} is not in provider {pid!r} models {prov.models}",
                )
        if model.max_queue is not None and model.max_queue < 0:
            bad(f"{path}.max_queue", f"must be >= 0, got {model.max_queue}")
        if model.queue_timeout_ms is not None and model.queue_timeout_ms <= 0:
            bad(f"{path}.queue_timeout_ms", f"must be > 0, got {model.queue_timeout_ms}")

    if config.queue.max_queue < 0:
        bad("$.queue.max_queue", f"must be >= 0, got {config.queue.max_queue}")
    if config.queue.queue_timeout_ms <= 0:
        bad("$.queue.queue_timeout_ms", f"must be > 0, got {config.queue.queue_timeout_ms}")
    for name in ("max_body_bytes", "max_header_bytes", "header_timeout_s", "body_timeout_s", "max_streams"):
        if getattr(config.api, name) <= 0:
            bad(f"$.api.{name}", f"must be > 0, got {getattr(config.api, name)}")
    d = config.dispatch
    for name in ("lease_ms", "heartbeat_ttl_ms", "heartbeat_interval_ms", "probe_interval_ms",
                 "probe_timeout_ms", "reap_interval_ms", "replica_ttl_ms", "max_attempts"):
        if getattr(d, name) <= 0:
            bad(f"$.dispatch.{name}", f"must be > 0, got {getattr(d, name)}")
    if d.heartbeat_interval_ms >= d.heartbeat_ttl_ms:
        bad("$.dispatch.heartbeat_interval_ms",
            f"must be shorter than heartbeat_ttl_ms ({d.heartbeat_interval_ms} >= {d.heartbeat_ttl_ms})")
    if d.drain_grace_s < 0:
        bad("$.dispatch.drain_grace_s", f"must be >= 0, got {d.drain_grace_s}")
    if min(d.lease_ms, d.replica_ttl_ms, d.reap_interval_ms) > 0 and 2 * d.reap_interval_ms >= d.observation_gap_ms:
        bad("$.dispatch.reap_interval_ms",
            f"must be under half of min(lease_ms / 3, replica_ttl_ms / 2) = {d.observation_gap_ms}, "
            f"got {d.reap_interval_ms}: a longer pause between rounds is taken for a Redis outage")
    problems.extend(_redis_problems(config.redis))
    return problems


def _redis_problems(redis: RedisConfig) -> Iterator[ConfigProblem]:
    url = urlsplit(redis.url) if redis.url else None
    if (redis.cluster or redis.sentinel) and url is not None and url.scheme not in ("redis", "rediss"):
        yield ConfigProblem("$.redis.url", "Redis Cluster and Sentinel are reached over TCP: use redis:// or rediss://")
    elif redis.cluster and url is not None and url.path.strip("/") not in ("", "0"):
        yield ConfigProblem("$.redis.url", f"a Redis Cluster has only database 0, got {url.path.strip('/')!r}")
    sentinel = redis.sentinel
    if sentinel is None:
        return
    if redis.cluster:
        yield ConfigProblem("$.redis.sentinel", "cannot be combined with cluster: true")
    if not sentinel.master:
        yield ConfigProblem("$.redis.sentinel.master", "must not be empty")
    if not sentinel.nodes:
        yield ConfigProblem("$.redis.sentinel.nodes", "needs at least one sentinel, as host:port")
    for i, node in enumerate(sentinel.nodes):
        try:
            host_port(node)
        except ValueError as exc:
            yield ConfigProblem(f"$.redis.sentinel.nodes[{i}]", str(exc))
    for name in ("password_env", "sentinel_password_env"):
        value = getattr(sentinel, name)
        if value is not None and not _ENV_NAME.fullmatch(value):
            yield ConfigProblem(f"$.redis.sentinel.{name}", "must be the name of an environment variable")


def host_port(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as a pair; a ValueError says what is wrong."""
    host, sep, port = text.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not host:port")
    return host, int(port)


def _provider_problems(path: str, prov: ProviderConfig) -> Iterator[ConfigProblem]:
    if not prov.id:
        yield ConfigProblem(f"{path}.id", "must not be empty")
    if prov.type not in PROVIDER_TYPES:
        yield ConfigProblem(f"{path}.type", f"unknown type {prov.type!r}; expected one of {list(PROVIDER_TYPES)}")
    if prov.category is not None and prov.category not in CATEGORIES:
        yield ConfigProblem(
            f"{path}.category", f"unknown category {prov.category!r}; expected one of {list(CATEGORIES)}"
        )
    if prov.capacity < 0:
        yield ConfigProblem(
            f"{path}.capacity", f"must be >= 0, got {prov.capacity} (0 keeps the provider out of rotation)"
        )
    if prov.timeout_s <= 0:
        yield ConfigProblem(f"{path}.timeout_s", f"must be > 0, got {prov.timeout_s}")
    if prov.type in HTTP_TYPES and not prov.base_url:
        yield ConfigProblem(f"{path}.base_url", f"required for type {prov.type!r}")
    if prov.base_url and not prov.base_url.startswith(("http://", "https://")):
        yield ConfigProblem(f"{path}.base_url", "must start with http:// or https://")
    if prov.type == "cli" and not prov.command:
        yield ConfigProblem(f"{path}.command", "required for type 'cli' (an argv list)")
    for path_, name in _duplicates((f"{path}.models[{i}]", m) for i, m in enumerate(prov.models)):
        yield ConfigProblem(path_, f"duplicate served name {name!r}")


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SECRET_ARG = re.compile(
    r"(?i)(api[_-]?key|token|secret|passw(or)?d)\s*[=:]\s*\S|\bsk-[A-Za-z0-9_-]{16,}|\bbearer\s+\S"
)


def secrets_in_file(config: Config) -> list[str]:
    """Warnings about secrets written into the file itself: they belong in the environment."""
    found: list[str] = []
    if config.redis.url and urlsplit(config.redis.url).password:
        found.append("$.redis.url: holds a password; set the URL in IOP_REDIS_URL instead of the file")
    for name in ("api_keys_env", "admin_keys_env"):
        value = getattr(config.api, name)
        if value and not _ENV_NAME.fullmatch(value):
            found.append(f"$.api.{name}: looks like a key, not the name of an environment variable holding keys")
    for ni, node in enumerate(config.nodes):
        for pi, prov in enumerate(node.providers):
            path = f"$.nodes[{ni}].providers[{pi}]"
            if prov.base_url and urlsplit(prov.base_url).password:
                found.append(f"{path}.base_url: holds a password; give the provider a key through api_key_env")
            if prov.api_key_env and not _ENV_NAME.fullmatch(prov.api_key_env):
                found.append(f"{path}.api_key_env: looks like a key, not the name of an environment variable")
            for ai, arg in enumerate(prov.command or []):
                if _SECRET_ARG.search(arg):
                    found.append(f"{path}.command[{ai}]: looks like a secret; pass it through api_key_env")
    return found


def _duplicates(items: Iterable[tuple[str, str]]) -> Iterator[tuple[str, str]]:
    seen: set[str] = set()
    for path, value in items:
        if value in seen:
            yield path, value
        seen.add(value)


def _normalised(config: Config) -> Config:
    nodes = [
        msgspec.structs.replace(
            node,
            providers=[
                msgspec.structs.replace(p, base_url=normalise_base_url(p.base_url)) if p.base_url else p
                for p in node.providers
            ],
        )
        for node in config.nodes
    ]
    # The URL only: a cluster or sentinel setting of the file still applies to it.
    redis_url = os.environ.get("IOP_REDIS_URL") or config.redis.url
    return msgspec.structs.replace(config, nodes=nodes, redis=msgspec.structs.replace(config.redis, url=redis_url))


def decode(data: bytes | str) -> Config:
    """Decode and validate YAML text; raise :class:`ConfigError` listing every problem.

    Deprecation warnings (legacy entries, see ``dispatcher.legacy``) go to the ``iop.config``
    logger, so every process that loads the file says so at start-up.
    """
    config, warnings = decode_with_warnings(data)
    _log_warnings(warnings)
    return config


def decode_with_warnings(data: bytes | str) -> tuple[Config, list[str]]:
    """:func:`decode`, handing the deprecation warnings to the caller instead of logging them."""
    return from_builtins_with_warnings(parse_yaml(data))


def from_builtins(raw: Any) -> Config:
    config, warnings = from_builtins_with_warnings(raw)
    _log_warnings(warnings)
    return config


def from_builtins_with_warnings(raw: Any) -> tuple[Config, list[str]]:
    """Convert and validate decoded YAML, in the pool shape, the legacy route shape or a mix.

    Legacy entries are converted to the pool shape before :func:`validate` runs, so the rules
    are written once; problems found in them are reported at their legacy paths.
    """
    # Imported here: dispatcher.legacy builds on the structs of this module.
    from dispatcher import legacy

    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError([ConfigProblem("$", "the config must be a mapping")])
    core, parts, problems = legacy.split(raw)
    try:
        config = msgspec.convert(core, type=Config)
    except msgspec.ValidationError as exc:
        problems.insert(0, problem_from_validation(exc))
    if problems:
        raise ConfigError(problems)
    conversion = legacy.convert(config, parts)
    if conversion.problems:
        raise ConfigError(conversion.problems)
    return _normalised(conversion.config), [*conversion.warnings, *secrets_in_file(conversion.config)]


def load(path: str | Path) -> Config:
    config, warnings = load_with_warnings(path)
    _log_warnings(warnings)
    return config


def load_with_warnings(path: str | Path) -> tuple[Config, list[str]]:
    """:func:`load`, handing the deprecation warnings to the caller instead of logging them."""
    return decode_with_warnings(read_file(path))


def read_file(path: str | Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError([ConfigProblem("$", f"cannot read {path}: {exc.strerror}")]) from None


def parse_yaml(data: bytes | str) -> Any:
    """The YAML document as builtins (``None`` for an empty one); a syntax error is a :class:`ConfigError`."""
    try:
        return msgspec.yaml.decode(data)
    except msgspec.DecodeError as exc:
        raise ConfigError([ConfigProblem("$", f"not valid YAML: {exc}")]) from None


def _log_warnings(warnings: list[str]) -> None:
    for warning in warnings:
        _log.warning("%s", warning)


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
