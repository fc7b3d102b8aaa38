"""The ways in: :func:`load` a file, or :func:`parse` a document already decoded from YAML.

Both give the validated, normalised :class:`Config` with its warnings (legacy entries,
secrets written into the file), or raise :class:`ConfigError` listing every problem.
Neither logs the warnings: ``iop config check`` prints them, while a process that loads the
file to run logs them with :meth:`Loaded.logged`, so each process says so at start-up.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from dispatcher.config import legacy
from dispatcher.config.decode_errors import problem_from_validation
from dispatcher.config.field_rules import key_path
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

    Every problem of the file is reported at once, in the order of the document: each value of
    the wrong type, out of range or at an unknown field, each required field missing
    (:class:`~dispatcher.config.field_rules.Findings`, which drops such values, so that the rest
    is still decoded), then every cross-field problem of the rest, but those that only follow
    from a value dropped.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([ConfigProblem("$", "the config must be a mapping")])
    core, parts, findings = legacy.split(data)
    core = findings.check(core, Config)
    try:
        config = msgspec.convert(core, type=Config)
    except msgspec.ValidationError as exc:  # what the walk let through: say so rather than crash
        problems = [*findings.problems, problem_from_validation(exc, Config)]
        raise ConfigError(_in_document_order(problems, data)) from None
    conversion = legacy.convert(config, parts, findings)
    problems = [*findings.problems, *(p for p in conversion.problems if not findings.explains(p.path))]
    if problems:
        raise ConfigError(_in_document_order(problems, data))
    return Loaded(_normalised(conversion.config), [*conversion.warnings, *secrets_in_file(conversion.config)])


def _in_document_order(problems: list[ConfigProblem], document: Any) -> list[ConfigProblem]:
    """``problems`` in the order of the values they are about in ``document``; one about a value
    the file does not hold (a field missing) comes after what the file holds of its parent.
    Problems at the same place keep their order."""
    places: dict[str, tuple[int, int]] = {}  # path -> (its place, the place after its contents)

    def visit(value: Any, path: str) -> None:
        start = len(places)
        places[path] = (start, start)
        if isinstance(value, dict):
            for key, item in value.items():
                visit(item, key_path(path, key))
                if key == "":
                    places.setdefault(f"{path}.", places[key_path(path, key)])
        elif isinstance(value, list):
            for i, item in enumerate(value):
                visit(item, f"{path}[{i}]")
        places[path] = (start, len(places))

    visit(document, "$")

    def place(problem: ConfigProblem) -> tuple[int, int]:
        path = problem.path
        if path in places:
            return places[path][0], 0
        while path != "$":
            path = _PARENT.sub("", path) or "$"
            if path in places:
                return places[path][1] - 1, 1
        return places["$"][1], 1

    return sorted(problems, key=place)


# The last step of a path: ".name", "[3]" or '[""]'.
_PARENT = re.compile(r'(\.[^.\[]*|\[[^\]]*\])$')


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
