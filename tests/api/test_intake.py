"""``api/intake.py`` on its own: what a request becomes before it is a job -- its model
(or the fallback that serves its endpoint), its lane and band, its stream flag, its
deadline, its affinity keys -- from a config's runtime, without a server (and without
Redis, but for the stored Responses a call on one looks up)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from redis.asyncio import Redis

from api.intake import Intake, fallbacks, take, take_stored
from api.runtime import Runtime
from dispatcher import config as cfg
from dispatcher.exceptions import (
    InvalidRequest,
    ModelNotAllowed,
    ModelNotFound,
    ResponseProviderGone,
    UnsupportedEndpoint,
)
from dispatcher.scripts import Scripts

pytestmark = pytest.mark.anyio


class Request:
    """What intake reads of a request: its headers (as an ASGI scope holds them) and its body."""

    def __init__(self, body: bytes, **headers: str) -> None:
        self._body = body
        named = {"content-type": "application/json", **{k.replace("_", "-"): v for k, v in headers.items()}}
        self.scope: dict[str, Any] = {"headers": [(k.encode(), v.encode()) for k, v in named.items()]}

    async def body(self) -> bytes:
        return self._body


def runtime(**api: Any) -> Runtime:
    config = cfg.parse({
        "api": {"priorities": ["interactive", "standard", "batch"], **api},
        "models": [
            {"id": "chat", "providers": {"c": "served-chat"}, "fallbacks": ["spare", "closed", "embedder"],
             "affinity": {"mode": "prefix"}},
            {"id": "spare", "providers": {"s": "served-spare"}},
            {"id": "closed", "providers": {"s": "served-spare"}},
            {"id": "embedder", "providers": {"e": "served-embed"}},
            {"id": "embed-only", "providers": {"e": "served-embed"}, "fallbacks": ["spare"]},
        ],
        "nodes": [{"id": "n", "providers": [
            {"id": "c", "type": "vllm", "base_url": "http://h:1", "models": ["served-chat"],
             "endpoints": ["chat/completions"]},
            {"id": "s", "type": "vllm", "base_url": "http://h:2", "models": ["served-spare"],
             "endpoints": ["chat/completions"]},
            {"id": "e", "type": "vllm", "base_url": "http://h:3", "models": ["served-embed"],
             "endpoints": ["embeddings"]},
        ]}],
    }).config
    redis = Redis()  # never connected: intake asks Redis nothing for these requests
    return Runtime.build(config, Scripts(redis), redis, "rep")


async def intake_of(rt: Runtime, body: bytes, endpoint: str = "chat/completions", **headers: str) -> Intake:
    return await take(Request(body, **headers), rt, endpoint, rt.tenants.default)  # type: ignore[arg-type]


async def test_a_body_names_its_model_and_lane_and_whether_it_streams() -> None:
    rt = runtime()
    intake = await intake_of(rt, b'{"model": "chat", "stream": true, "messages": [{"role": "user", "content": "hi"}]}')
    assert intake.model.id == "chat"
    assert intake.stream
    assert not intake.pinned
    assert intake.lane == rt.plans.lane_for("chat", "chat/completions")
    assert intake.blocks  # prefix affinity: the prompt's block hashes
    assert intake.fell_back_from is None
    assert intake.deadline_ms == 0
    plain = await intake_of(rt, b'{"model": "spare", "messages": [{"role": "user", "content": "hi"}]}')
    assert not plain.stream
    assert plain.blocks == ()


async def test_unknown_and_forbidden_models_are_refused_before_anything_is_queued() -> None:
    rt = runtime()
    with pytest.raises(ModelNotFound):
        await intake_of(rt, b'{"model": "nope"}')
    rt_limited = runtime(keys=[{"name": "web", "key_sha256": "0" * 64, "models": ["spare"]}])
    with pytest.raises(ModelNotAllowed):
        await take(Request(b'{"model": "chat"}'), rt_limited, "chat/completions",  # type: ignore[arg-type]
                   rt_limited.tenants.by_name["web"])


async def test_an_endpoint_the_model_does_not_serve_goes_to_a_fallback_that_does() -> None:
    rt = runtime()
    intake = await intake_of(rt, b'{"model": "chat", "input": "x"}', "embeddings")
    assert intake.model.id == "embedder"
    assert intake.fell_back_from == "chat"
    with pytest.raises(UnsupportedEndpoint):
        await intake_of(rt, b'{"model": "spare", "input": "x"}', "embeddings")


async def test_fallbacks_come_in_order_skipping_what_the_tenant_may_not_call_or_what_cannot_serve() -> None:
    rt = runtime(keys=[{"name": "web", "key_sha256": "0" * 64, "models": ["chat", "spare", "embedder"]}])
    web = rt.tenants.by_name["web"]
    request = Request(b'{"model": "chat", "messages": [{"role": "user", "content": "hi"}]}')
    intake = await take(request, rt, "chat/completions", web)  # type: ignore[arg-type]
    tried = list(fallbacks(request, rt, intake))  # type: ignore[arg-type]
    # "closed" is not on web's list; "embedder" does not serve chat/completions.
    assert [(i.model.id, i.fell_back_from) for i in tried] == [("spare", "chat")]
    assert tried[0].lane == rt.plans.lane_for("spare", "chat/completions")
    assert tried[0].blocks == ()  # spare has no affinity: no blocks to key it by


async def test_a_request_may_ask_for_a_lower_band_and_a_deadline() -> None:
    rt = runtime()
    intake = await intake_of(rt, b'{"model": "spare"}', x_iop_priority="batch", x_iop_deadline_ms="1500")
    assert intake.lane.band == rt.tenants.bands.index("batch")
    assert intake.lane.name.endswith("#batch")
    assert intake.deadline_ms == 1500
    for bad in ("0", "-5", "soon"):
        with pytest.raises(InvalidRequest):
            await intake_of(rt, b'{"model": "spare"}', x_iop_deadline_ms=bad)


# --------------------------------------------------------------------------- stored Responses


class StoredRequest(Request):
    """A call on a stored Response (``GET /v1/responses/{id}``) as intake reads it."""

    method = "GET"
    url = SimpleNamespace(query="")


async def stored_runtime(redis: Redis) -> Runtime:
    """:func:`runtime` against a real Redis, which remembers four responses: one made by a
    provider the config no longer has, one by ``s`` for ``chat`` (whose pool is ``c`` alone
    now), one by ``s`` for ``spare``, one by ``c`` for ``chat``."""
    config = runtime().config
    rt = Runtime.build(config, Scripts(redis), redis, "rep")
    for response_id, provider, model in (("resp_gone", "old", "chat"), ("resp_moved", "s", "chat"),
                                         ("resp_spare", "s", "spare"), ("resp_ok", "c", "chat")):
        await rt.calls.remember_response(response_id, provider, model)
    return rt


async def follow_up(rt: Runtime, model: str, previous: str) -> Intake:
    body = f'{{"model": "{model}", "input": "next", "previous_response_id": "{previous}"}}'.encode()
    return await take(Request(body), rt, "responses", rt.tenants.default)  # type: ignore[arg-type]


@pytest.mark.parametrize(("model", "previous", "message"), [
    ("chat", "resp_gone", "Response 'resp_gone' lives on provider 'old', which is no longer in this gateway's "
                          "config; start a new conversation"),
    ("chat", "resp_moved", "Response 'resp_moved' lives on provider 's', which no longer serves 'chat' here; "
                           "start a new conversation"),
    # s made it for spare, and never served chat: not "no longer".
    ("chat", "resp_spare", "Response 'resp_spare' lives on provider 's', which made it for model 'spare' and "
                           "does not serve 'chat' here: continue it with model 'spare', or start a new conversation"),
    ("embedder", "resp_moved", "Response 'resp_moved' lives on provider 's', which made it for model 'chat' and "
                               "does not serve 'embedder' here: start a new conversation"),
])
async def test_a_follow_up_its_provider_cannot_take_says_why(redis: Redis, model: str, previous: str,
                                                             message: str) -> None:
    rt = await stored_runtime(redis)
    with pytest.raises(ResponseProviderGone) as info:
        await follow_up(rt, model, previous)
    assert info.value.message == message


async def test_a_follow_up_goes_to_the_provider_that_made_it(redis: Redis) -> None:
    rt = await stored_runtime(redis)
    intake = await follow_up(rt, "chat", "resp_ok")
    assert intake.pinned
    assert intake.lane == rt.plans.pinned_lane("chat", "c")
    intake = await follow_up(rt, "spare", "resp_spare")
    assert intake.lane == rt.plans.pinned_lane("spare", "s")


@pytest.mark.parametrize(("response_id", "message"), [
    ("resp_gone", "Response 'resp_gone' lives on provider 'old', which is no longer in this gateway's config; "
                  "start a new conversation"),
    ("resp_moved", "Response 'resp_moved' lives on provider 's', which no longer serves 'chat' here; "
                   "start a new conversation"),
])
async def test_a_call_on_a_stored_response_its_provider_cannot_take_says_why(redis: Redis, response_id: str,
                                                                             message: str) -> None:
    rt = await stored_runtime(redis)
    with pytest.raises(ResponseProviderGone) as info:
        await take_stored(StoredRequest(b""), rt, response_id, "", rt.tenants.default)  # type: ignore[arg-type]
    assert info.value.message == message
