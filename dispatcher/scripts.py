"""The Lua scripts of ``lua/``, loaded once and called by SHA.

One script per decision; each file's header lists its KEYS, ARGV and return value.
Helpers several scripts share live in ``lua/lib/`` and are pulled in by a line
``--!include lib/NAME.lua`` -- Redis 6.2 has no function libraries, and this keeps
every script a static file rather than text assembled at run time.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

NAMES = ("submit", "cancel", "emit", "finish", "renew", "heartbeat", "reap_lease", "replica", "reconcile")

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


class Scripts:
    """Every script registered on one client; ``load()`` puts them in the server's cache."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self.submit = redis.register_script(source("submit"))
        self.cancel = redis.register_script(source("cancel"))
        self.emit = redis.register_script(source("emit"))
        self.finish = redis.register_script(source("finish"))
        self.renew = redis.register_script(source("renew"))
        self.heartbeat = redis.register_script(source("heartbeat"))
        self.reap_lease = redis.register_script(source("reap_lease"))
        self.replica = redis.register_script(source("replica"))
        self.reconcile = redis.register_script(source("reconcile"))

    def all(self) -> list[AsyncScript]:
        return [getattr(self, name) for name in NAMES]

    async def load(self) -> None:
        for script in self.all():
            await self._redis.script_load(script.script)

    async def loaded(self) -> bool:
        shas = [script.sha for script in self.all()]
        return all(await self._redis.script_exists(*shas))
