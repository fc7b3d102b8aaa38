"""The ways in: :func:`load` a file, or :func:`parse` a document already decoded from YAML.

Both give the validated, normalised :class:`Config` with its warnings (legacy entries,
secrets written into the file), or raise :class:`ConfigError` listing every problem.
Neither logs the warnings: ``iop config check`` prints them, while a process that loads the
file to run logs them with :meth:`Loaded.logged`, so each process says so at start-up.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from dispatcher.config import field_rules, legacy
from dispatcher.config.decode_errors import problem_from_validation
from dispatcher.config.schema import Config
from dispatcher.config.validation import secrets_in_file
from dispatcher.exceptions import ConfigError, ConfigProblem

_log = logging.getLogger("iop.config")


class Loaded(NamedTuple):
    config: Config
    warnings: list[str]

    def logged(self) -> Config:
        """The config, after logging each warning on the ``iop.config`` logger."""
        for warning in self.warnings:
            _log.warning("%s", warning)
        return self.config


def load(path: str | Path) -> Loaded:
    """The config in the YAML file at ``path``; an unreadable file is a :class:`ConfigError` too."""
    return parse(read_document(path))


def parse(data: Any) -> Loaded:
    """The config in a decoded YAML document (builtins; ``None`` is the empty document).

    The document may be in the pool shape, the legacy route shape or a mix: legacy entries are
    converted to the pool shape before validation, so the rules are written once, and problems
    found in them are reported at their legacy paths.

    Every value out of its field's range is reported, and dropped before decoding (which would
    stop at the first), so that the rest is still decoded and cross-checked: one pass lists
    all of a file's problems.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([ConfigProblem("$", "the config must be a mapping")])
    core, parts, problems = legacy.split(data)
    core, out_of_range = field_rules.out_of_range(core, Config)
    try:
        config = msgspec.convert(core, type=Config)
    except msgspec.ValidationError as exc:
        problems.insert(0, problem_from_validation(exc, Config))
    if problems:
        raise ConfigError([*out_of_range, *problems])
    conversion = legacy.convert(config, parts)
    if out_of_range or conversion.problems:
        raise ConfigError([*out_of_range, *conversion.problems])
    return Loaded(_normalised(conversion.config), [*conversion.warnings, *secrets_in_file(conversion.config)])


def read_document(path: str | Path) -> Any:
    """The YAML document at ``path`` as builtins, before any checking (what ``iop config migrate`` rewrites)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError([ConfigProblem("$", f"cannot read {path}: {exc.strerror}")]) from None
    try:
        return msgspec.yaml.decode(data)
    except msgspec.DecodeError as exc:
        raise ConfigError([ConfigProblem("$", f"not valid YAML: {exc}")]) from None


def normalise_base_url(url: str) -> str:
    """``http://h:8000/v1/`` and ``http://h:8000`` name the same server root."""
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")].rstrip("/")
    return url


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
