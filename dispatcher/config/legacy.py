"""The legacy route shape: still loaded, converted to the pool shape (which ``iop config migrate`` writes out).

Older configs route each model id to exactly one adapter instance and target::

    openai:
      model_routes:
        - {model: llama3, adapter: ollama-local, target: "llama3:8b"}
    nodes:
      - id: n1
        adapters:
          ollama-local: {type: ollama, base_url: "http://127.0.0.1:11434", capacity: 2}

Each route becomes a one-provider model group (``models[]``); each adapter instance becomes
a provider of its node, whose id is the instance key, whose ``models`` gain the routes'
targets it does not list, and whose category is derived from its type when not given.
Both shapes may be mixed in one file.

The converted config is checked by the ordinary :func:`dispatcher.config.validation.validate`,
so the rules exist once; a map from converted paths back to legacy paths puts each problem
where the operator wrote the value. Only what needs the legacy view is checked here: routes naming
no adapter, model ids defined twice, adapter keys that collide with other providers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec

from dispatcher.config.field_rules import Findings, key_path
from dispatcher.config.schema import DEFAULT_CATEGORY, Config, ModelConfig, ProviderConfig
from dispatcher.config.validation import validate
from dispatcher.exceptions import ConfigProblem

MIGRATE_HINT = "run 'iop config migrate'"


class _Legacy(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class LegacyRoute(_Legacy, frozen=True):
    model: str
    """The external model id."""
    adapter: str
    """The adapter instance key (a provider id also works, for half-migrated files)."""
    target: str
    """The served model name on that instance."""


class LegacyOpenAI(_Legacy, frozen=True):
    model_routes: list[LegacyRoute] = []


class LegacyAdapter(_Legacy, frozen=True):
    """An adapter instance's settings: a provider without ``id`` (its key is the id).

    Unset fields stay ``UNSET`` so the provider gets :class:`ProviderConfig`'s own defaults
    (no second copy of them to drift), while an explicit ``null`` is still a type error.
    """

    type: str
    category: str | msgspec.UnsetType | None = msgspec.UNSET
    capacity: int | msgspec.UnsetType = msgspec.UNSET
    base_url: str | msgspec.UnsetType | None = msgspec.UNSET
    api_key_env: str | msgspec.UnsetType | None = msgspec.UNSET
    command: list[str] | msgspec.UnsetType | None = msgspec.UNSET
    timeout_s: float | msgspec.UnsetType = msgspec.UNSET
    models: list[str] | msgspec.UnsetType = msgspec.UNSET


class LegacyParts(msgspec.Struct, frozen=True, kw_only=True):
    """The legacy entries of one file, decoded; ``adapters`` is keyed by node index, then instance key."""

    routes: list[LegacyRoute] = []
    adapters: dict[int, dict[str, LegacyAdapter]] = {}

    @property
    def empty(self) -> bool:
        return not self.routes and not any(self.adapters.values())


class Conversion(msgspec.Struct, frozen=True, kw_only=True):
    """A config with its legacy entries converted to the pool shape."""

    config: Config
    problems: list[ConfigProblem]
    """Every problem of the whole config, legacy entries at their legacy paths."""
    warnings: list[str]
    """One deprecation warning per legacy entry."""
    changes: list[str]
    """What the conversion did, one line each (the header of ``iop config migrate``)."""


# --------------------------------------------------------------------------- decoding


def split(raw: dict[str, Any]) -> tuple[dict[str, Any], LegacyParts, Findings]:
    """``raw`` without its legacy sections, those sections decoded, and what checking them found.

    The legacy sections are checked against their own structs so that wrong types and unknown
    fields come out at legacy paths, every one of them (:class:`Findings`); the same findings
    go on to check the rest of the file. ``raw`` itself is not modified.
    """
    core = dict(raw)
    findings = Findings()
    routes: list[LegacyRoute] = []
    if "openai" in core:
        section = findings.check(core.pop("openai"), LegacyOpenAI, "$.openai")
        routes = msgspec.convert(section, type=LegacyOpenAI).model_routes
    adapters: dict[int, dict[str, LegacyAdapter]] = {}
    nodes = core.get("nodes")
    if isinstance(nodes, list):
        core_nodes: list[Any] = []
        for ni, node in enumerate(nodes):
            if isinstance(node, dict) and "adapters" in node:
                node = dict(node)
                section = findings.check(node.pop("adapters"), dict[str, LegacyAdapter], f"$.nodes[{ni}].adapters")
                adapters[ni] = msgspec.convert(section, type=dict[str, LegacyAdapter])
            core_nodes.append(node)
        core["nodes"] = core_nodes
    return core, LegacyParts(routes=routes, adapters=adapters), findings


def adapter_path(adapters_path: str, key: str) -> str:
    return key_path(adapters_path, key)


def provider_of(key: str, adapter: LegacyAdapter) -> ProviderConfig:
    """The provider an adapter instance becomes (before the routes' targets are added)."""
    fields = {name: getattr(adapter, name) for name in adapter.__struct_fields__}
    settings = {name: value for name, value in fields.items() if value is not msgspec.UNSET}
    provider = ProviderConfig(id=key, **settings)
    if provider.category is None:
        # Explicit, so the migrated file and the catalog show it; same value effective_category derives.
        provider = msgspec.structs.replace(provider, category=DEFAULT_CATEGORY.get(provider.type))
    return provider


# --------------------------------------------------------------------------- conversion


class _PathMap:
    """Paths in the converted config -> paths in the file: exact entries first, then longest prefix."""

    def __init__(self) -> None:
        self.exact: dict[str, str] = {}
        self.prefixes: dict[str, str] = {}

    def translate(self, path: str) -> str:
        if path in self.exact:
            return self.exact[path]
        best = ""
        for prefix in self.prefixes:
            if len(prefix) > len(best) and path.startswith(prefix) and path[len(prefix):][:1] in ("", ".", "["):
                best = prefix
        return self.prefixes[best] + path[len(best):] if best else path


class _Instance(msgspec.Struct, kw_only=True):
    node: int
    key: str
    path: str
    view_path: str
    adapter: LegacyAdapter
    provider: ProviderConfig
    added: list[str]


def convert(config: Config, parts: LegacyParts, findings: Findings | None = None) -> Conversion:
    """Convert the legacy entries of a decoded file and check the whole result.

    Order is fixed so that loading a migrated file gives an equal :class:`Config`: routes
    become models after ``models[]``, in route order; adapter instances become providers
    after each node's ``providers[]``, in mapping order. ``findings``: what checking the
    file found (:func:`split`), whose replaced values the checks do not hold against it.
    """
    unsure = findings.unsure if findings is not None else (lambda path: False)
    paths = _PathMap()
    # Converted paths where validate() would report what a legacy check below reports better.
    owned: set[str] = set()
    problems: list[ConfigProblem] = []
    warnings: list[str] = []
    changes: list[str] = []
    targets: list[str] = []

    instances: list[_Instance] = []
    for ni, node in enumerate(config.nodes):
        for j, (key, adapter) in enumerate(parts.adapters.get(ni, {}).items()):
            path = adapter_path(f"$.nodes[{ni}].adapters", key)
            view_path = f"$.nodes[{ni}].providers[{len(node.providers) + j}]"
            instances.append(_Instance(node=ni, key=key, path=path, view_path=view_path, adapter=adapter,
                                       provider=provider_of(key, adapter), added=[]))
            paths.prefixes[view_path] = path
            paths.exact[f"{view_path}.id"] = path
    by_key: dict[str, _Instance] = {}
    for inst in instances:
        by_key.setdefault(inst.key, inst)
    new_providers = {p.id: f"$.nodes[{ni}].providers[{pi}]"
                     for ni, node in enumerate(config.nodes) for pi, p in enumerate(node.providers)}

    model_paths = {m.id: f"$.models[{mi}].id" for mi, m in reversed(list(enumerate(config.models)))}
    routes: list[ModelConfig] = []
    for ri, route in enumerate(parts.routes):
        path = f"$.openai.model_routes[{ri}]"
        view_path = f"$.models[{len(config.models) + ri}]"
        routes.append(ModelConfig(id=route.model, providers={route.adapter: route.target}))
        paths.prefixes[view_path] = path
        paths.exact[f"{view_path}.id"] = f"{path}.model"
        paths.exact[f"{view_path}.providers.{route.adapter}"] = f"{path}.target"
        warnings.append(f"{path} ({route.model}): legacy route; use models[] (id {route.model!r}, providers "
                        f"{{{route.adapter}: {route.target}}}) — {MIGRATE_HINT}")
        changes.append(f"route {path} -> model group {route.model!r} ({view_path}) with providers "
                       f"{{{route.adapter!r}: {route.target!r}}}")

        if route.model in model_paths:
            problems.append(ConfigProblem(f"{path}.model", f"duplicate model id {route.model!r} "
                                                            f"(also defined at {model_paths[route.model]})"))
            owned.add(f"{view_path}.id")
        model_paths.setdefault(route.model, f"{path}.model")

        owner = by_key.get(route.adapter)
        if owner is not None:
            if route.target not in owner.provider.models and route.target not in owner.added:
                owner.added.append(route.target)
                targets.append(f"target {route.target!r} added to the models of provider {owner.key!r} "
                               f"(for route {path})")
        elif route.adapter not in new_providers:
            owned.add(f"{view_path}.providers.{route.adapter}")
            # Not when an adapter section or a provider the file got wrong may have defined it.
            if not any(unsure(p) for p in _definitions(config, parts)):
                known = ", ".join(sorted(by_key)) or "none"
                problems.append(ConfigProblem(f"{path}.adapter", f"no node defines adapter {route.adapter!r} "
                                                                  f"(adapter instances: {known})"))

    for inst in instances:
        inst.provider = msgspec.structs.replace(inst.provider, models=[*inst.provider.models, *inst.added])
        warnings.append(f"{inst.path}: legacy adapter instance; use nodes[{inst.node}].providers[] "
                        f"(id {inst.key!r}) — {MIGRATE_HINT}")
        how = "derived from the type" if inst.adapter.category in (None, msgspec.UNSET) else "as configured"
        changes.append(f"adapter instance {inst.path} -> provider {inst.key!r} ({inst.view_path}), "
                       f"type {inst.provider.type!r}, category {inst.provider.category!r} ({how})")
    changes.extend(targets)
    collisions, collided = _collisions(config, instances, owned)
    problems.extend(collisions)
    for ri, route in enumerate(parts.routes):
        if route.adapter in collided:
            # Which of the colliding definitions the route means is ambiguous: the collision says it all.
            owned.add(f"$.models[{len(config.models) + ri}].providers.{route.adapter}")

    nodes = [
        msgspec.structs.replace(node, providers=[*node.providers, *(i.provider for i in instances if i.node == ni)])
        if ni in parts.adapters else node
        for ni, node in enumerate(config.nodes)
    ]
    converted = msgspec.structs.replace(config, models=[*config.models, *routes], nodes=nodes)
    if unsure("$.openai") or unsure("$.openai.model_routes"):
        owned.add("$.models")  # no model: the routes the file got wrong may have been its models
    checked = validate(converted, unsure=lambda path: unsure(paths.translate(path)))
    generic = [ConfigProblem(paths.translate(p.path), p.message) for p in checked if p.path not in owned]
    return Conversion(config=converted, problems=generic + problems, warnings=warnings, changes=changes)


def _definitions(config: Config, parts: LegacyParts) -> Iterator[str]:
    """The paths whose values say which adapter instances and providers exist."""
    yield "$.nodes"
    for ni, node in enumerate(config.nodes):
        yield from (f"$.nodes[{ni}]", f"$.nodes[{ni}].providers", f"$.nodes[{ni}].adapters")
        for pi in range(len(node.providers)):
            yield from (f"$.nodes[{ni}].providers[{pi}]", f"$.nodes[{ni}].providers[{pi}].id")
        yield from (adapter_path(f"$.nodes[{ni}].adapters", key) for key in parts.adapters.get(ni, {}))


def _collisions(config: Config, instances: list[_Instance], owned: set[str]) -> tuple[list[ConfigProblem], set[str]]:
    """Provider ids shared by an adapter instance and another provider or instance, reported at the
    instance's path; and the set of those ids.

    validate() walks providers in converted order (each node's ``providers[]``, then its
    instances) and reports every occurrence after the first; those it would report only
    because of an instance are reported here instead, once, at the instance.
    """
    occurrences: dict[str, list[tuple[str, _Instance | None]]] = {}
    for ni, node in enumerate(config.nodes):
        for pi, prov in enumerate(node.providers):
            occurrences.setdefault(prov.id, []).append((f"$.nodes[{ni}].providers[{pi}]", None))
        for instance in instances:
            if instance.node == ni:
                occurrences.setdefault(instance.key, []).append((instance.view_path, instance))
    problems: list[ConfigProblem] = []
    collided: set[str] = set()
    for pid, occs in occurrences.items():
        if len(occs) < 2 or all(inst is None for _, inst in occs):
            continue
        collided.add(pid)
        providers = [path for path, inst in occs if inst is None]
        for n, (view_path, inst) in enumerate(occs):
            if inst is None:
                # A second provider[] entry is a plain duplicate that validate() still reports.
                if view_path == providers[0] and n > 0:
                    owned.add(f"{view_path}.id")
                continue
            owned.add(f"{view_path}.id")
            if providers:
                problems.append(ConfigProblem(inst.path, f"adapter instance {pid!r} has the id of the provider "
                                                         f"at {providers[0]}; provider ids must be unique"))
            elif n > 0:
                first = occs[0][1]
                assert first is not None
                problems.append(ConfigProblem(inst.path, f"adapter instance {pid!r} is also defined at {first.path}; "
                                                         "provider ids must be unique"))
    return problems, collided
