"""Reading the config file again in a running process (``SIGHUP``, ``iop reload``).

:func:`reread` gives the config a process is to switch to, or ``None`` when the file is
invalid (every problem logged with its path; the process keeps what it runs). Sections a
running process cannot change -- its Redis, the dispatch timings its leases and loops
were started with, the HTTP limits its server was built with -- keep their running
values, with a warning naming each one: those marked ``RESTART`` in
:mod:`dispatcher.config.schema` (:func:`dispatcher.config.field_rules.restart_paths`).
Turning flow control on or off changes how waiting jobs are ordered in Redis, which every
process must agree on: such a file is refused as a whole.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import msgspec

from dispatcher.config import Config, ProviderConfig, load
from dispatcher.config.field_rules import restart_paths
from dispatcher.exceptions import ConfigError, ConfigProblem
from dispatcher.tenants import flow_control

log = logging.getLogger("iop.config")

def fixed_changes(running: Config, new: Config) -> list[str]:
    """``$.path``s that differ but only take effect at a restart."""
    return ["$." + ".".join(path) for path in restart_paths(Config) if _at(running, path) != _at(new, path)]


def keep_fixed(running: Config, new: Config) -> Config:
    """``new`` with the running values of what cannot change without a restart."""
    for path in restart_paths(Config):
        new = _replaced(new, path, _at(running, path))
    return new


def _at(config: Config, path: tuple[str, ...]) -> Any:
    value: Any = config
    for name in path:
        value = getattr(value, name)
    return value


def _replaced(struct: Any, path: tuple[str, ...], value: Any) -> Any:
    """``struct`` with the field at ``path`` (attribute names, nested) set to ``value``."""
    name, *rest = path
    inner = _replaced(getattr(struct, name), tuple(rest), value) if rest else value
    return msgspec.structs.replace(struct, **{name: inner})


def reread(path: str | Path, running: Config) -> Config | None:
    """The config in ``path`` as this process may apply it, or None (and why, logged)."""
    try:
        loaded = load(path)
    except ConfigError as exc:
        _log_refusal(path, exc.problems)
        return None
    new = loaded.config
    if flow_control(new) != flow_control(running):
        _log_refusal(path, [ConfigProblem(
            "$.api", "turning flow control on or off (tenants, bands, limits, a tenant header) "
            "needs a restart of every API and worker process",
        )])
        return None
    loaded.logged()
    for path_changed in fixed_changes(running, new):
        log.warning("reload: %s changed in %s; it takes effect at the next restart", path_changed, path)
    return keep_fixed(running, new)


def _log_refusal(path: str | Path, problems: list[ConfigProblem]) -> None:
    # One record, so a reader (or a log shipper) never sees the verdict without its reasons.
    log.error("reload: %s has %d problem(s); nothing changed%s", path, len(problems),
              "".join(f"\nreload:   {problem}" for problem in problems))


def describe_changes(old: Config, new: Config) -> str:
    """What a reload changes, in a few words (models and providers added, removed, resized)."""
    parts: list[str] = []
    old_models, new_models = {m.id: m for m in old.models}, {m.id: m for m in new.models}
    parts += [f"model +{m}" for m in new_models if m not in old_models]
    parts += [f"model -{m}" for m in old_models if m not in new_models]
    parts += [f"model ~{m}" for m in new_models if m in old_models and new_models[m] != old_models[m]]
    old_providers, new_providers = dict(_providers(old)), dict(_providers(new))
    parts += [f"provider +{p}" for p in new_providers if p not in old_providers]
    parts += [f"provider -{p}" for p in old_providers if p not in new_providers]
    for pid, prov in new_providers.items():
        before = old_providers.get(pid)
        if before is not None and before != prov:
            if before.capacity != prov.capacity:
                parts.append(f"provider ~{pid} capacity {before.capacity}->{prov.capacity}")
            else:
                parts.append(f"provider ~{pid}")
    if old.api.keys != new.api.keys or old.api.api_keys_env != new.api.api_keys_env:
        parts.append("keys")
    return ", ".join(parts) or "no change to models, providers or keys"


def _providers(config: Config) -> list[tuple[str, ProviderConfig]]:
    return [(p.id, p) for _, p in config.providers()]
