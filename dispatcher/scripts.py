"""The Lua scripts of ``lua/``, loaded once and called by SHA.

One script per decision; each file's header lists its KEYS, ARGV and return value.
Helpers several scripts share live in ``lua/lib/``, one function (or one tightly bound
group) per file, and are pulled in by a line ``--!include lib/NAME.lua`` (a path under
``lua/``) -- Redis 6.2 has no function libraries, and this keeps every script static
files rather than text assembled at run time. A file names what it uses itself, at its
top; includes resolve recursively, as BullMQ's script loader does: each file's line is
replaced by that file, its own includes already in its place, and a file already in the
script is not included again. So a file's includes come before its own text, as Lua's
locals must be defined before use.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from dispatcher.exceptions import IopError
from dispatcher.fastredis import Arg, FastRedis

NAMES = ("submit", "cancel", "emit", "finish", "renew", "heartbeat", "reap_round", "reap_lease", "replica",
         "reconcile", "remember_response", "drain", "refuse", "rehome", "wake", "plan", "abandon", "capacity",
         "live", "models", "load_done", "override", "audit", "model_order")

_INCLUDE = re.compile(r"^--!include (\S+)$", re.MULTILINE)


def lua_dir() -> Path:
    here = Path(__file__).resolve().parent
    # Installed wheel: dispatcher/lua; source checkout: ../lua
    for candidate in (here / "lua", here.parent / "lua"):
        if (candidate / "submit.lua").is_file():
            return candidate
    raise FileNotFoundError("cannot find the lua/ scripts next to the dispatcher package")


class IncludeError(IopError):
    """A script's includes cannot be resolved: a cycle, or a file that is not there."""


def resolve(root: Path, path: str) -> str:
    """The text of ``root / path`` as Redis runs it: every include resolved, each file once."""
    done: set[str] = set()

    def expand(path: str, chain: tuple[str, ...]) -> str:
        text = (root / path).read_text()

        def include(m: re.Match[str]) -> str:
            name = m.group(1)
            if name in chain:
                raise IncludeError(f"include cycle: {' -> '.join((*chain, name))}")
            if name in done:
                return ""
            if not (root / name).is_file():
                line = text.count("\n", 0, m.start()) + 1
                raise IncludeError(f"{path}:{line} includes {name}, which is not in {root}")
            resolved = expand(name, (*chain, name))
            done.add(name)
            return resolved

        return _INCLUDE.sub(include, text)

    return expand(path, (path,))


@cache
def source(name: str) -> str:
    return resolve(lua_dir(), f"{name}.lua")


class Script:
    """One script, called by SHA through the lean client when there is one (the request
    path), else through redis-py; either way its source is sent once if Redis lost it."""

    def __init__(self, redis: Redis, fast: FastRedis | None, name: str) -> None:
        self.name = name
        self._registered: AsyncScript = redis.register_script(source(name))
        self._fast = fast

    @property
    def sha(self) -> str:
        return str(self._registered.sha)

    @property
    def source(self) -> str:
        return str(self._registered.script)

    async def __call__(self, keys: Sequence[Arg], args: Sequence[Arg], reply_within: float | None = None) -> Any:
        """``reply_within``: seconds to wait for the reply instead of the client's command timeout."""
        if self._fast is not None:
            return await self._fast.evalsha(self.sha, self.source, keys, args, reply_within=reply_within)
        if reply_within is None:
            return await self._registered(keys, args)  # type: ignore[arg-type]  # ints are fine
        async with asyncio.timeout(reply_within):
            return await self._registered(keys, args)  # type: ignore[arg-type]


class Scripts:
    """Every script registered on one client; ``load()`` puts them in the server's cache."""

    def __init__(self, redis: Redis, fast: FastRedis | None = None) -> None:
        self._redis = redis
        self.submit = Script(redis, fast, "submit")
        self.cancel = Script(redis, fast, "cancel")
        self.emit = Script(redis, fast, "emit")
        self.finish = Script(redis, fast, "finish")
        self.renew = Script(redis, fast, "renew")
        self.heartbeat = Script(redis, fast, "heartbeat")
        self.reap_round = Script(redis, fast, "reap_round")
        self.reap_lease = Script(redis, fast, "reap_lease")
        self.replica = Script(redis, fast, "replica")
        self.reconcile = Script(redis, fast, "reconcile")
        self.remember_response = Script(redis, fast, "remember_response")
        self.drain = Script(redis, fast, "drain")
        self.refuse = Script(redis, fast, "refuse")
        self.rehome = Script(redis, fast, "rehome")
        self.wake = Script(redis, fast, "wake")
        self.plan = Script(redis, fast, "plan")
        self.abandon = Script(redis, fast, "abandon")
        self.capacity = Script(redis, fast, "capacity")
        self.live = Script(redis, fast, "live")
        self.models = Script(redis, fast, "models")
        self.load_done = Script(redis, fast, "load_done")
        self.override = Script(redis, fast, "override")
        self.audit = Script(redis, fast, "audit")
        self.model_order = Script(redis, fast, "model_order")

    @property
    def redis(self) -> Redis:
        """The client the scripts were registered on (for the plain reads around them)."""
        return self._redis

    def all(self) -> list[Script]:
        return [getattr(self, name) for name in NAMES]

    async def load(self) -> None:
        for script in self.all():
            await self._redis.script_load(script.source)

    async def loaded(self) -> bool:
        shas = [script.sha for script in self.all()]
        return all(await self._redis.script_exists(*shas))
