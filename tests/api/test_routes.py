"""api/routes.py: the HTTP surface. Every endpoint of dispatcher/endpoints.py is served at
POST /v1/<endpoint> and relayed (it answers for its model, not as a missing route), the calls
on stored Responses reach the stored-response lookup, and a model card is the same on every
call. (What a relay does: tests/api/test_app.py, tests/api/test_relay.py.)"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from litestar.testing import AsyncTestClient

from api.app import create_app
from dispatcher.endpoints import ENDPOINTS
from iop.redis_server import RedisServer
from tests.api.app_config import make_config

pytestmark = pytest.mark.anyio


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[AsyncTestClient[Any]]:
    async with AsyncTestClient(create_app(make_config(redis_server.url))) as c:
        yield c


def message_of(resp: Any) -> str:
    """The error message of an OpenAI- or Anthropic-shaped error answer."""
    message: str = resp.json()["error"]["message"]
    return message


async def test_every_endpoint_is_relayed(client: AsyncTestClient[Any]) -> None:
    assert ENDPOINTS, "no endpoints to serve"
    for endpoint in ENDPOINTS:
        resp = await client.post(f"/v1/{endpoint}", json={"model": "nope"})
        # The relay's own answer: the model is unknown, or the body is not the form this
        # endpoint takes; never the router's "Not Found".
        assert resp.status_code in (400, 404), (endpoint, resp.text)
        message = message_of(resp)
        assert "'nope' does not exist" in message or "takes multipart/form-data" in message, (endpoint, message)


async def test_an_endpoint_takes_post_only(client: AsyncTestClient[Any]) -> None:
    for endpoint in ENDPOINTS:
        assert (await client.get(f"/v1/{endpoint}")).status_code == 405, endpoint


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/v1/responses/resp_unknown"),
    ("DELETE", "/v1/responses/resp_unknown"),
    ("POST", "/v1/responses/resp_unknown/cancel"),
    ("GET", "/v1/responses/resp_unknown/input_items"),
])
async def test_the_calls_on_a_stored_response_look_it_up(client: AsyncTestClient[Any], method: str, path: str) -> None:
    resp = await client.request(method, path)
    assert resp.status_code == 404
    assert "No response with id 'resp_unknown' is known to iop" in message_of(resp)


async def test_an_unknown_call_on_a_stored_response_is_a_missing_route(client: AsyncTestClient[Any]) -> None:
    resp = await client.get("/v1/responses/resp_unknown/nothing")
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "not_found"


async def test_a_model_card_is_the_same_on_every_call_and_in_the_list(client: AsyncTestClient[Any]) -> None:
    one = (await client.get("/v1/models/m")).json()
    assert one == (await client.get("/v1/models/m")).json()
    assert one["owned_by"] == "iop"
    assert isinstance(one["created"], int)
    assert one in (await client.get("/v1/models")).json()["data"]
