"""A node's cancel channel: the API publishes a job's id there when its client left, and
the worker aborts the job's run (or remembers the cancel until the job comes)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio
from redis.asyncio import Redis
from redis.exceptions import RedisError

from dispatcher import keys
from dispatcher.backoff import Backoff
from workers.leases import Runs

log = logging.getLogger("iop.worker")


class CancelListener:
    """Listens on ``node_id``'s cancel channel for as long as it runs, through outages.

    Cancels published while it was not subscribed were missed: each (re)subscription
    calls ``renew_now``, whose renewal reports them (a job's state 'c') at once instead of
    a third of a lease later.
    """

    def __init__(self, redis: Redis, node_id: str, runs: Runs, renew_now: Callable[[], None]) -> None:
        self._redis = redis
        self._channel = keys.cancel_channel(node_id)
        self._runs = runs
        self._renew_now = renew_now

    async def run(self) -> None:
        backoff = Backoff(0.1, 0.5)
        while True:
            pubsub = self._redis.pubsub()
            try:
                await pubsub.subscribe(self._channel)
                backoff.reset()
                self._renew_now()
                async for message in pubsub.listen():
                    if message["type"] == "message":
                        self._runs.cancel(message["data"].decode())
            except (RedisError, OSError, RuntimeError) as exc:
                # RuntimeError too: redis-py's pubsub reconnects inside listen(), and when the
                # server dies at that moment uvloop refuses the write on the closed transport
                # ("the handler is closed") with a RuntimeError, not a ConnectionError. Seen
                # in the chaos soak: uncaught, it ended the worker.
                log.warning("cancel channel lost: %s", exc)
            finally:
                with anyio.CancelScope(shield=True):
                    await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # untyped in older redis-py
            await backoff.sleep()
