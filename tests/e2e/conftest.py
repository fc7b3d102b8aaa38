"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from iop.redis_server import RedisServer
from tests.e2e.system import System


@pytest.fixture
def aof_system(tmp_path: Path) -> Iterator[System]:
    """A system on a private Redis with its AOF on, so it can be killed and come back."""
    with RedisServer(appendonly=True) as redis_server:
        system = System(tmp_path, redis_server)
        try:
            yield system
        finally:
            system.close()
