"""A client of the fake provider under test, shared by the fake provider's tests
(tests/iop/test_fake_provider.py, tests/iop/test_fake_continuation.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from iop.fake_provider import FakeOptions, start
from iop.redis_server import free_port

HOST = "127.0.0.1"


@dataclass
class Fake:
    options: FakeOptions
    session: aiohttp.ClientSession
    url: str

    async def stats(self) -> dict[str, int]:
        async with self.session.get("/_fake/stats") as resp:
            assert resp.status == 200
            result: dict[str, int] = await resp.json()
            return result

    async def wait_stats(self, **expected: int) -> dict[str, int]:
        """The stats once they show ``expected`` (or as they are after 5 s)."""
        deadline = time.monotonic() + 5.0
        while True:
            stats = await self.stats()
            if all(stats[k] == v for k, v in expected.items()) or time.monotonic() > deadline:
                return stats
            await asyncio.sleep(0.02)

    async def requests(self) -> list[dict[str, Any]]:
        async with self.session.get("/_fake/requests") as resp:
            assert resp.status == 200
            result: list[dict[str, Any]] = await resp.json()
            return result


def sse_events(text: str) -> list[str]:
    """The data payloads of an SSE body, in order."""
    events = []
    for block in text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        events.append(block[len("data: ") :])
    return events


async def post(fake: Fake, path: str, body: Any, **kwargs: Any) -> tuple[int, Any]:
    async with fake.session.post(path, json=body, **kwargs) as resp:
        text = await resp.text()
        return resp.status, json.loads(text) if text else None


@contextlib.asynccontextmanager
async def running(options: FakeOptions) -> AsyncIterator[Fake]:
    """A fake provider with ``options`` on a free port, and a client of it, until the block ends."""
    port = free_port()
    runner = await start(HOST, port, options)
    url = f"http://{HOST}:{port}"
    try:
        async with aiohttp.ClientSession(base_url=url) as session:
            yield Fake(options, session, url)
    finally:
        await runner.cleanup()
