"""``api/relay.py`` on its own: how a request that ends without an answer is counted."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from api import relay as relay_module
from api.metrics import RequestMetrics

pytestmark = pytest.mark.anyio


class _Gateway:
    """The one thing ``relay`` itself reads of the gateway before ``_relay`` takes over."""

    def __init__(self) -> None:
        self.metrics = RequestMetrics()


@pytest.mark.parametrize(("raised", "counted"), [(asyncio.CancelledError, "499"), (RuntimeError, "500")])
async def test_a_request_that_ends_without_an_answer_is_counted_once(
    monkeypatch: pytest.MonkeyPatch, raised: type[BaseException], counted: str
) -> None:
    async def ends(*args: Any) -> Any:
        raise raised()

    monkeypatch.setattr(relay_module, "_relay", ends)
    gw = _Gateway()
    with pytest.raises(raised):
        await relay_module.relay(None, gw, "chat/completions")  # type: ignore[arg-type]
    text = gw.metrics.render(None).decode()
    statuses = {line.split('status="')[1].split('"')[0] for line in text.splitlines()
                if line.startswith("iop_requests_total{")}
    # A cancelled request (its caller gone, the server stopping) is not a server error.
    assert statuses == {counted}
