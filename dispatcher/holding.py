"""Holding a call through a short Redis outage instead of failing it at once.

A failover (Cluster, Sentinel) leaves no primary for the seconds it takes to notice the
death and promote a replica, and a standalone Redis that restarts is away for as long as
that takes. A request that reaches the API meanwhile would rather wait those seconds than
be answered ``503 redis_unavailable``: :func:`held` calls again what failed for want of a
connection, with short pauses, until a deadline.

Only a failure to reach Redis is held: no connection, no reply in time, no primary (the
topology refusals ``dispatcher.fastredis`` and ``dispatcher.redis_conn`` turn into
``ConnectionError``), a Redis still loading its data. Such a call did not run, or ran and
lost its reply; what is held here is safe to run twice (``submit`` answers 'duplicate' for
a job id it has seen, the rest only read or are idempotent). A script's error would be the
same again, and a refused login is a configuration problem: both are raised at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.exceptions import AuthenticationError, ConnectionError, RedisError, TimeoutError

from dispatcher.backoff import Backoff

T = TypeVar("T")

# Short pauses: a held call goes on at most CAP_S after Redis is back, and a caller's wait
# is mostly the outage itself. Concurrent callers of one client share a reconnection
# attempt (dispatcher.fastredis), so many held requests do not multiply the probes.
FIRST_S = 0.02
CAP_S = 0.2


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says Redis could not be asked (worth asking again), not what it answered."""
    return isinstance(exc, ConnectionError | TimeoutError) and not isinstance(exc, AuthenticationError)


async def held(call: Callable[[], Awaitable[T]], hold_s: float) -> T:
    """``call()``, made again while it fails because Redis is unreachable, until ``hold_s``
    seconds after the first try; then its last failure is raised. A last try is made at the
    deadline itself. ``hold_s`` 0: one try, as if nothing held it."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + hold_s
    backoff: Backoff | None = None  # made on the first failure: the common path pays nothing
    while True:
        try:
            return await call()
        except RedisError as exc:
            left = give_up - loop.time()
            if left <= 0 or not unreachable(exc):
                raise
            backoff = backoff or Backoff(FIRST_S, CAP_S)
            await asyncio.sleep(min(backoff.next(), left))
