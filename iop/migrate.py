"""``iop config migrate``: a config file rewritten in the pool shape, as YAML text.

The conversion is the one loading uses (:mod:`dispatcher.config.legacy`), so the migrated file
loads to the same config; this module only writes it out, keeping the file's other sections as
they were written.
"""

from __future__ import annotations

from typing import Any

import msgspec
import yaml

from dispatcher.config import Config, NodeConfig, ProviderConfig, legacy, parse, read_document


def migrate(path: str) -> str:
    """The pool-shape YAML equivalent to the (legacy, mixed or already new) config file at ``path``.

    Raises ConfigError, problems at legacy paths, unless the whole file is valid: only a
    config that loads is migrated. Sections other than the legacy ones are copied as
    written (not expanded to defaults); comments of the original are not carried over.
    """
    raw = read_document(path)
    parse(raw)  # every problem, before anything is written
    raw = raw or {}
    core, parts, _ = legacy.split(raw)
    # parse() keeps neither the sections as written nor the list of changes: split and convert again.
    conversion = legacy.convert(msgspec.convert(core, type=Config), parts)

    models = [*core.get("models", []), *({"id": r.model, "providers": {r.adapter: r.target}} for r in parts.routes)]
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key in ("openai", "models"):
            # models[] takes the place of whichever of the two came first.
            if models and "models" not in out:
                out["models"] = models
        elif key == "nodes":
            out[key] = [_migrated_node(node, conversion.config.nodes[ni]) for ni, node in enumerate(value)]
        else:
            out[key] = value

    if parts.empty:
        header = [f"# {path}: no legacy entries; nothing to migrate."]
    else:
        header = [
            f"# Migrated by 'iop config migrate' from {path}: the legacy route shape",
            "# (openai.model_routes, nodes[].adapters) is now the pool shape (models[], nodes[].providers[]).",
            "# Routing is unchanged. Comments of the original file are not carried over.",
            "# Changes (paths are those of the original file, then of this one):",
            *(f"#   {change}" for change in conversion.changes),
        ]
    header = [_comment(line) for line in header]
    body = yaml.safe_dump(out, sort_keys=False, allow_unicode=True, default_flow_style=None, width=120) if out else ""
    return "\n".join(header) + "\n" + body


def _comment(text: str) -> str:
    # Ids and keys are free text: a line break in one would end the comment and inject YAML.
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


def _migrated_node(node: dict[str, Any], converted: NodeConfig) -> dict[str, Any]:
    if "adapters" not in node:
        return node
    adapters: dict[str, Any] = node["adapters"]
    # convert() appended the instances, in mapping order, after the node's own providers.
    instances = converted.providers[len(converted.providers) - len(adapters):]
    new = [_provider_dict(key, adapter, prov) for (key, adapter), prov in zip(adapters.items(), instances, strict=True)]
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("providers", "adapters"):
            # providers[] takes the place of whichever of the two came first.
            if "providers" not in out:
                out["providers"] = [*node.get("providers", []), *new]
        else:
            out[key] = value
    return out


def _provider_dict(key: str, adapter: dict[str, Any], provider: ProviderConfig) -> dict[str, Any]:
    """The adapter's settings as written, plus what the conversion decided (id, category, models)."""
    out: dict[str, Any] = {"id": key, "type": adapter["type"], "category": provider.category}
    out.update((name, value) for name, value in adapter.items() if name not in ("type", "category", "models"))
    if provider.models:
        out["models"] = list(provider.models)
    return out
