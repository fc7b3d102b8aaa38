"""The checks decoding cannot make: each needs more than one field, or a rule beyond a type.

:func:`validate` reports every problem at once, each at the path of the offending value;
:func:`secrets_in_file` finds secrets written into the file, which belong in the environment.
A single field's range is not written here but on the field (:mod:`dispatcher.config.schema`),
and checked from there (:mod:`dispatcher.config.field_rules`).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Iterable, Iterator
from fnmatch import fnmatchcase
from urllib.parse import urlsplit

from dispatcher.config.field_rules import problems_in
from dispatcher.config.schema import (
    CATEGORIES,
    HTTP_TYPES,
    LIFECYCLE_TYPES,
    PROVIDER_TYPES,
    QUALIFY_TENANT,
    Config,
    ProviderConfig,
    RedisConfig,
    host_port,
)
from dispatcher.endpoints import DEFAULT_ENDPOINTS, ENDPOINTS
from dispatcher.exceptions import ConfigProblem

# What a config without models is told: the least it needs.
NO_MODELS = ("no model is configured: a config needs at least one model (models[], each with "
             "providers: {provider id: served name}) and the nodes[] whose providers serve it; "
             "iop/demo.yaml, which `iop up` runs without --config, is an example")


def _never(path: str) -> bool:
    return False


def validate(config: Config, *, unsure: Callable[[str], bool] = _never) -> list[ConfigProblem]:
    """Every problem of ``config``, each with the path of the offending value: values out of
    the range their field declares, then the rules that need more than one field.

    ``unsure(path)``: whether the value at ``path`` stands in for one the file got wrong
    (:meth:`dispatcher.config.field_rules.Findings.unsure`), already reported. A rule that
    reads such a value is not applied: a reference to an id that entry may have defined, or a
    timing compared with a default, would only be a consequence of that problem.
    """
    problems: list[ConfigProblem] = problems_in(config)

    def bad(path: str, message: str) -> None:
        problems.append(ConfigProblem(path, message))

    def known(*paths: str) -> bool:
        return not any(unsure(path) for path in paths)

    providers: dict[str, ProviderConfig] = {}
    prov: ProviderConfig | None
    for path, pid in _duplicates((f"$.nodes[{i}].id", n.id) for i, n in enumerate(config.nodes)):
        bad(path, f"duplicate node id {pid!r}")
    for ni, node in enumerate(config.nodes):
        if not node.id:
            bad(f"$.nodes[{ni}].id", "must not be empty")
        problems.extend(_id_problems(f"$.nodes[{ni}].id", "node id", node.id))
        for pi, prov in enumerate(node.providers):
            path = f"$.nodes[{ni}].providers[{pi}]"
            if prov.id in providers:
                bad(f"{path}.id", f"duplicate provider id {prov.id!r}")
            providers.setdefault(prov.id, prov)
            problems.extend(_provider_problems(path, prov))

    for path, mid in _duplicates((f"$.models[{i}].id", m.id) for i, m in enumerate(config.models)):
        bad(path, f"duplicate model id {mid!r}")
    all_providers_known = known("$.nodes", *(
        where for ni, node in enumerate(config.nodes)
        for where in (f"$.nodes[{ni}]", f"$.nodes[{ni}].providers", *(
            f"$.nodes[{ni}].providers[{pi}]{field}" for pi in range(len(node.providers)) for field in ("", ".id")))))
    provider_paths = {p.id: f"$.nodes[{ni}].providers[{pi}]"
                      for ni, node in reversed(list(enumerate(config.nodes)))
                      for pi, p in reversed(list(enumerate(node.providers)))}
    for mi, model in enumerate(config.models):
        path = f"$.models[{mi}]"
        if not model.id:
            bad(f"{path}.id", "must not be empty")
        problems.extend(_id_problems(f"{path}.id", "model id", model.id))
        if not model.providers and known(f"{path}.providers"):
            bad(f"{path}.providers", "a model needs at least one provider")
        for pid, served in model.providers.items():
            prov = providers.get(pid)
            if prov is None:
                if all_providers_known:
                    bad(f"{path}.providers.{pid}", f"no node defines provider {pid!r}")
            elif served not in prov.models and known(f"{provider_paths[pid]}.models", *(
                    f"{provider_paths[pid]}.models[{i}]" for i in range(len(prov.models)))):
                bad(
                    f"{path}.providers.{pid}",
                    f"served name {served!r} is not in provider {pid!r} models {prov.models}",
                )
        seen: set[str] = set()
        for qi, pid in enumerate(model.preference):
            if pid not in model.providers:
                bad(f"{path}.preference[{qi}]", f"{pid!r} is not a provider of model {model.id!r}"
                    f" ({', '.join(sorted(model.providers)) or 'none'})")
            elif pid in seen:
                bad(f"{path}.preference[{qi}]", f"{pid!r} is listed twice")
            seen.add(pid)
    if not config.models:
        bad("$.models", NO_MODELS)

    all_models_known = known("$.models", *(
        f"$.models[{mi}]{field}" for mi in range(len(config.models)) for field in ("", ".id")))
    problems.extend(_fallback_problems(config, all_models_known))

    d = config.dispatch
    busy = d.busy_probe_interval_ms
    if (busy is not None and busy < max(d.probe_interval_ms, 1)
            and known("$.dispatch.busy_probe_interval_ms", "$.dispatch.probe_interval_ms")):
        bad("$.dispatch.busy_probe_interval_ms",
            f"must not be shorter than probe_interval_ms ({d.probe_interval_ms}), got {busy}: a busy provider is "
            "probed less often than an idle one")
    if (d.heartbeat_interval_ms >= d.heartbeat_ttl_ms
            and known("$.dispatch.heartbeat_interval_ms", "$.dispatch.heartbeat_ttl_ms")):
        bad("$.dispatch.heartbeat_interval_ms",
            f"must be shorter than heartbeat_ttl_ms ({d.heartbeat_interval_ms} >= {d.heartbeat_ttl_ms})")
    problems.extend(_tenant_problems(config, known, all_models_known))
    if (d.reap_interval_ms is not None and min(d.lease_ms, d.replica_ttl_ms, d.reap_interval_ms) > 0
            and 2 * d.reap_interval_ms >= d.observation_gap_ms
            and known("$.dispatch.reap_interval_ms", "$.dispatch.lease_ms", "$.dispatch.replica_ttl_ms")):
        bad("$.dispatch.reap_interval_ms",
            f"must be under half of min(lease_ms / 3, replica_ttl_ms / 2) = {d.observation_gap_ms}, "
            f"got {d.reap_interval_ms}: a longer pause between rounds is taken for a Redis outage")
    problems.extend(_redis_problems(config.redis))
    ej = config.ejection
    if ej.max_s < ej.base_s:
        bad("$.ejection.max_s", f"must not be shorter than base_s ({ej.base_s:g}), got {ej.max_s:g}")
    tracing = config.tracing
    if tracing.endpoint is not None and urlsplit(tracing.endpoint).scheme not in ("http", "https"):
        bad("$.tracing.endpoint", f"must be an http(s) URL (OTLP/HTTP), got {tracing.endpoint!r}")
    if not tracing.service_name:
        bad("$.tracing.service_name", "must not be empty")
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


_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")


def _tenant_problems(config: Config, known: Callable[..., bool], all_models_known: bool) -> Iterator[ConfigProblem]:
    api = config.api
    bands_known = known("$.api.priorities", *(f"$.api.priorities[{i}]" for i in range(len(api.priorities))))
    for path, name in _duplicates((f"$.api.priorities[{i}]", b) for i, b in enumerate(api.priorities)):
        yield ConfigProblem(path, f"duplicate priority band {name!r}")
    for i, band in enumerate(api.priorities):
        yield from _id_problems(f"$.api.priorities[{i}]", "band name", band)
    if not api.priorities:
        yield from _id_problems("$.api.default_priority", "band name", api.default_priority)
    if api.priorities and api.default_priority not in api.priorities and bands_known:
        yield ConfigProblem("$.api.default_priority",
                            f"{api.default_priority!r} is not one of api.priorities {api.priorities}")
    for path, name in _duplicates((f"$.api.keys[{i}].name", k.name) for i, k in enumerate(api.keys)):
        yield ConfigProblem(path, f"duplicate key name {name!r}")
    for i, band in enumerate(api.priorities):
        if band == QUALIFY_TENANT:
            yield ConfigProblem(f"$.api.priorities[{i}]", f"{band!r} is the qualification runs' own band")
    for ki, key in enumerate(api.keys):
        path = f"$.api.keys[{ki}]"
        if key.name == QUALIFY_TENANT:
            yield ConfigProblem(f"{path}.name", f"{key.name!r} is the qualification runs' own tenant (iop qualify)")
        if not _TENANT_NAME.fullmatch(key.name):
            why = next((f"{sep!r} is not allowed in a tenant name: {reason}; "
                        for sep, reason in _SEPARATORS["tenant name"].items() if sep in key.name), "")
            yield ConfigProblem(f"{path}.name", f"{key.name!r}: {why}use letters, digits, '.', '_' and '-'")
        if (key.key_env is None) == (key.key_sha256 is None) and known(f"{path}.key_env", f"{path}.key_sha256"):
            yield ConfigProblem(path, "give exactly one of key_env (an env var holding the key) and key_sha256")
        if key.key_env is not None and not _ENV_NAME.fullmatch(key.key_env):
            yield ConfigProblem(f"{path}.key_env", "must name an environment variable, not hold the key")
        if key.key_sha256 is not None and not _SHA256.fullmatch(key.key_sha256):
            yield ConfigProblem(f"{path}.key_sha256", "must be 64 hex digits (sha256 of the key)")
        if key.priority is not None and key.priority not in api.priorities and bands_known:
            yield ConfigProblem(f"{path}.priority", f"{key.priority!r} is not one of api.priorities {api.priorities}")
        for mi, pattern in enumerate(key.models or ()):
            if not any(fnmatchcase(m.id, pattern) for m in config.models) and all_models_known:
                yield ConfigProblem(f"{path}.models[{mi}]", f"{pattern!r} matches no model id")


def _provider_problems(path: str, prov: ProviderConfig) -> Iterator[ConfigProblem]:
    if not prov.id:
        yield ConfigProblem(f"{path}.id", "must not be empty")
    yield from _id_problems(f"{path}.id", "provider id", prov.id)
    if prov.type not in PROVIDER_TYPES:
        yield ConfigProblem(f"{path}.type", f"unknown type {prov.type!r}; expected one of {list(PROVIDER_TYPES)}")
    if prov.category is not None and prov.category not in CATEGORIES:
        yield ConfigProblem(
            f"{path}.category", f"unknown category {prov.category!r}; expected one of {list(CATEGORIES)}"
        )
    for ei, name in enumerate(prov.endpoints or ()):
        if name not in ENDPOINTS:
            yield ConfigProblem(f"{path}.endpoints[{ei}]",
                                f"unknown endpoint {name!r}; expected some of {list(ENDPOINTS)}")
        elif prov.type == "cli" and name not in DEFAULT_ENDPOINTS["cli"]:
            yield ConfigProblem(f"{path}.endpoints[{ei}]",
                                f"a cli provider serves only {list(DEFAULT_ENDPOINTS['cli'])}")
    if prov.type in HTTP_TYPES and not prov.base_url:
        yield ConfigProblem(f"{path}.base_url", f"required for type {prov.type!r}")
    if prov.base_url and not prov.base_url.startswith(("http://", "https://")):
        yield ConfigProblem(f"{path}.base_url", "must start with http:// or https://")
    if prov.type == "cli" and not prov.command:
        yield ConfigProblem(f"{path}.command", "required for type 'cli' (an argv list)")
    if prov.type == "cli" and prov.stream_usage:
        yield ConfigProblem(f"{path}.stream_usage", "a cli provider reports no token usage")
    if not prov.auto:
        for name in ("min_capacity", "max_capacity"):
            if getattr(prov, name) is not None:
                yield ConfigProblem(f"{path}.{name}", "only with capacity: auto (a fixed capacity is its own bound)")
    elif prov.min_capacity is not None and prov.max_capacity is not None and prov.min_capacity > prov.max_capacity:
        yield ConfigProblem(f"{path}.max_capacity",
                            f"must not be below min_capacity ({prov.min_capacity}), got {prov.max_capacity}")
    if prov.lifecycle == "managed" and prov.type not in LIFECYCLE_TYPES:
        yield ConfigProblem(f"{path}.lifecycle", f"type {prov.type!r} cannot load or unload models; "
                            f"managed needs one of {sorted(LIFECYCLE_TYPES)}")
    for path_, name in _duplicates((f"{path}.models[{i}]", m) for i, m in enumerate(prov.models)):
        yield ConfigProblem(path_, f"duplicate served name {name!r}")


# The characters that join ids into Redis keys and fields (dispatcher/keys.py): an id that
# held one could make the same key as other ids (model 'x|y', and model 'x' in its lane of
# provider 'y', would share the queue {iop}:q:x|y). Only where a collision is possible: a
# model id may hold ',' and ':' (ollama's 'qwen3:8b'), a band name any of them, since it
# ends its key. The tab that joins finish tags ({iop}:ft <queue key>\t<tenant>) and stored
# Responses' records is a control character, which no id may hold (_INTACT). Tenant names
# are held to _TENANT_NAME, which leaves all of these out; a name that holds one is told why.
_SEPARATORS: dict[str, dict[str, str]] = {
    "model id": {
        "|": "it separates the model from its lane in queue keys ({iop}:q:<model>|<providers>)",
        "#": "it separates the model from its priority band in queue keys ({iop}:q:<model>#<band>)",
    },
    "provider id": {
        ",": "it separates the providers of a lane in queue keys ({iop}:q:<model>|<provider>,<provider>)",
        "#": "it separates a lane from its priority band in queue keys ({iop}:q:<model>|<providers>#<band>)",
    },
    "tenant name": {
        "~": "it separates the tenant from the request in a flow-controlled job id (<tenant>~<id>)",
        ":": "it separates the tenant from the model in its counters ({iop}:tenants q:<tenant>:<model>)",
    },
}
# Why an id may hold no control character, and no whitespace at either end: where it travels
# that would not carry it intact (HTTP header values and multipart fields are read stripped).
_INTACT: dict[str, tuple[str, str]] = {
    "model id": ("a tab would split its stored Responses' record ({iop}:responses: provider, model, expiry), "
                 "and the others garble log lines",
                 "a multipart request's model field is read stripped, so the id could not be asked for there"),
    "provider id": ("it is sent in the x-iop-provider header, which cannot carry them, and a tab would split its "
                    "stored Responses' record ({iop}:responses: provider, model, expiry)",
                    "it is sent in the x-iop-provider header, which drops it"),
    "node id": ("it is sent in the x-iop-node header, which cannot carry them",
                "it is sent in the x-iop-node header, which drops it"),
    "band name": ("a request names its band in the x-iop-priority header, which cannot carry them",
                  "a request names its band in the x-iop-priority header, which drops it"),
}


def _id_problems(path: str, what: str, value: str) -> Iterator[ConfigProblem]:
    """``value`` as a ``what`` (a key of _INTACT): the characters it must not hold, each with why."""
    for sep, why in _SEPARATORS.get(what, {}).items():
        if sep in value:
            yield ConfigProblem(path, f"{value!r}: {sep!r} is not allowed in a {what}: {why}")
    control = next((ch for ch in value if unicodedata.category(ch) == "Cc"), None)
    if control is not None:
        yield ConfigProblem(path, f"{value!r}: control characters ({control!r}) are not allowed in a {what}: "
                                  f"{_INTACT[what][0]}")
    elif value != value.strip():
        yield ConfigProblem(path, f"{value!r}: leading or trailing whitespace is not allowed in a {what}: "
                                  f"{_INTACT[what][1]}")


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


def _fallback_problems(config: Config, all_models_known: bool) -> list[ConfigProblem]:
    """``models[].fallbacks``: known ids, not the model itself, none twice, and no chain that
    comes back to where it started (a -> b -> a); an unknown id only when every model id is
    the file's own."""
    problems: list[ConfigProblem] = []
    ids = {m.id for m in config.models}
    edges = {m.id: [f for f in m.fallbacks if f in ids] for m in config.models}
    for mi, model in enumerate(config.models):
        seen: set[str] = set()
        for fi, fb in enumerate(model.fallbacks):
            path = f"$.models[{mi}].fallbacks[{fi}]"
            if fb not in ids:
                if all_models_known:
                    problems.append(ConfigProblem(path, f"unknown model {fb!r}"))
            elif fb == model.id:
                problems.append(ConfigProblem(path, "a model cannot be its own fallback"))
            elif fb in seen:
                problems.append(ConfigProblem(path, f"{fb!r} is listed twice"))
            elif (loop := _path_back(edges, fb, model.id)) is not None:
                chain = " -> ".join([model.id, *loop])
                problems.append(ConfigProblem(path, f"fallbacks loop: {chain}"))
            seen.add(fb)
    return problems


def _path_back(edges: dict[str, list[str]], start: str, target: str) -> list[str] | None:
    """A chain of fallbacks from ``start`` to ``target`` (both included), or None."""
    stack, came_from = [start], {start: ""}
    while stack:
        node = stack.pop()
        if node == target:
            chain = [node]
            while came_from[chain[-1]]:
                chain.append(came_from[chain[-1]])
            return chain[::-1]
        for nxt in edges.get(node, []):
            if nxt not in came_from:
                came_from[nxt] = node
                stack.append(nxt)
    return None
