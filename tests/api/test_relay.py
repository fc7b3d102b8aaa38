"""``api/relay.py`` on its own: how a request that ends without an answer is counted, and
which error answers a submit that did not take its job."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from api import relay as relay_module
from api.metrics import RequestMetrics
from dispatcher.exceptions import (
    DeadlineUnmeetable,
    NoProviderAvailable,
    QueueFull,
    RequestError,
    ResponseProviderDown,
    TenantQueueFull,
)
from dispatcher.script_calls import SubmitStatus, Submitted
from dispatcher.tenants import Tenant

pytestmark = pytest.mark.anyio


class _Gateway:
    """What ``relay`` itself reads of the gateway before ``_relay`` takes over."""

    def __init__(self) -> None:
        self.metrics = RequestMetrics()
        self.runtime = None


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


@pytest.mark.parametrize(("status", "why", "error", "http"), [
    (SubmitStatus.FULL, "", QueueFull, 429),
    (SubmitStatus.TENANT_FULL, "", TenantQueueFull, 429),
    (SubmitStatus.UNAVAILABLE, "a: down", ResponseProviderDown, 503),
    (SubmitStatus.NO_PROVIDER, "a: down", NoProviderAvailable, 503),
    (SubmitStatus.DEADLINE_UNMEETABLE, "2400", DeadlineUnmeetable, 503),
])
def test_a_submit_that_did_not_take_the_job_is_answered_by_its_error(
    status: SubmitStatus, why: str, error: type[RequestError], http: int
) -> None:
    refused = relay_module._refusal(Submitted(status, 7, 0, why), "m", Tenant("t", 0, max_queued=3), "openai")
    assert isinstance(refused, error)
    assert refused.status == http
    if why == "a: down":
        assert "a: down" in refused.message  # each provider's reason reaches the caller
    if status == SubmitStatus.DEADLINE_UNMEETABLE:
        assert refused.retry_after == 3  # its predicted wait (2.4 s), rounded up


@pytest.mark.parametrize("status", [SubmitStatus.DISPATCHED, SubmitStatus.QUEUED])
def test_a_submit_that_took_the_job_is_no_refusal(status: SubmitStatus) -> None:
    assert relay_module._refusal(Submitted(status, 0, 1000), "m", Tenant("t", 0), "openai") is None
