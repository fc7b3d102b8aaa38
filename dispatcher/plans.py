"""Which keys a dispatch script needs, worked out once from the config.

A script may only touch keys it is given. Pumping a set of model groups touches each
group's queue and, for every candidate, the provider hash and the node stream. A
:class:`Plan` holds those keys and the JSON that tells the script where they are
(``lua/lib/pump.lua``). Plans are built once at start-up: the request path only
concatenates lists.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from dispatcher import keys
from dispatcher.config import Config, ModelConfig


@dataclass(frozen=True, slots=True)
class Plan:
    keys: tuple[str, ...]
    spec: bytes

    def args(self, fixed_keys: Iterable[str], lease_ms: int) -> tuple[list[str], list[bytes | str | int]]:
        """KEYS and the first three ARGV of a pumping script whose own keys are ``fixed_keys``."""
        ks = list(fixed_keys)
        offset = len(ks)
        ks.extend(self.keys)
        return ks, [self.spec, offset, lease_ms]


def build(config: Config, models: Iterable[ModelConfig]) -> Plan:
    node_of = {prov.id: node.id for node, prov in config.providers()}
    index: dict[str, int] = {}

    def pos(key: str) -> int:
        if key not in index:
            index[key] = len(index) + 1
        return index[key]

    groups = []
    for model in models:
        cands = [
            [pid, served, pos(keys.provider(pid)), pos(keys.node(node_of[pid])), node_of[pid]]
            for pid, served in sorted(model.providers.items())
            if pid in node_of
        ]
        groups.append({"m": model.id, "q": pos(keys.queue(model.id)), "c": cands})
    return Plan(keys=tuple(index), spec=msgspec.json.encode(groups))


class Plans:
    """The plan of every model group and of every provider (the groups it serves)."""

    def __init__(self, config: Config) -> None:
        self.empty = build(config, [])
        self.by_model = {m.id: build(config, [m]) for m in config.models}
        self.by_provider = {
            prov.id: build(config, [m for m in config.models if prov.id in m.providers])
            for _, prov in config.providers()
        }
