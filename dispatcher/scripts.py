"""The Lua scripts of ``lua/``, loaded once and called by SHA.

One script per decision; each file's header lists its KEYS, ARGV and return value.
Helpers several scripts share live in ``lua/lib/`` and are pulled in by a line
``--!include lib/NAME.lua`` -- Redis 6.2 has no function libraries, and this keeps
every script a static file rather than text assembled at run time.
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

from dispatcher.fastredis import Arg, FastRedis

NAMES = ("submit", "cancel", "emit", "finish", "renew", "heartbeat", "reap_round", "reap_lease", "replica",
         "reconcile", "remember_response", "drain", "refuse", "rehome", "wake", "plan", "abandon")

_INCLUDE = re.compile(r"^--!include (\S+)$", re.MULTILINE)


def lua_dir() -> Path:
    here = Path(__file__).resolve().parent
    # Installed wheel: dispatcher/lua; source checkout: ../lua
    for candidate in (here / "lua", here.parent / "lua"):
        if (candidate / "submit.lua").is_file():
            return candidate
    raise FileNotFoundError("cannot find the lua/ scripts next to the dispatcher package")


@cache
def source(name: str) -> str:
    root = lua_dir()
    text = (root / f"{name}.lua").read_text()
    return _INCLUDE.sub(lambda m: (root / m.group(1)).read_text(), text)


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
