"""The HTTP surface: the model-bearing endpoints (OpenAI's, Anthropic's Messages, rerank,
audio...: ``dispatcher/endpoints.py``), the calls on stored Responses, model listing,
health."""

from __future__ import annotations

import time
from typing import Any

import msgspec
from litestar import Request, Response, Router, delete, get, post, route
from litestar.datastructures import State
from litestar.di import NamedDependency
from litestar.handlers import HTTPRouteHandler
from litestar.params import FromPath

from api.gateway import Gateway
from api.head import GET_AND_HEAD, page
from api.relay import relay
from api.runtime import Runtime
from dispatcher.endpoints import ENDPOINTS, RESPONSES
from dispatcher.exceptions import ModelNotAllowed, ModelNotFound

_CREATED = int(time.time())

# What handlers take (api/app.py provides them): the process's gateway, the current runtime.
Gw = NamedDependency[Gateway]
Rt = NamedDependency[Runtime]
CallerRequest = Request[Any, Any, State]


def _gateway(request: CallerRequest) -> Gateway:
    # The relayed endpoints read the gateway from the app's state rather than through
    # Provide: Litestar enters an AsyncExitStack per request for a dependency (py-spy: ~2%
    # of the API's CPU per JSON request; the other handlers take it as `gw`).
    gw: Gateway = request.app.state.gateway
    return gw


def _endpoint_handler(endpoint: str) -> HTTPRouteHandler:
    async def handler(request: CallerRequest) -> Response[Any]:
        return await relay(request, _gateway(request), endpoint)

    name = endpoint.replace("/", "_")
    handler.__name__ = name
    return post(f"/{endpoint}", status_code=200, name=name, operation_id=name,
                summary=f"/v1/{endpoint}, relayed to a provider of the model that serves it")(handler)


ENDPOINT_HANDLERS = [_endpoint_handler(name) for name in ENDPOINTS]


async def _stored(request: CallerRequest, response_id: str, rest: str = "") -> Response[Any]:
    return await relay(request, _gateway(request), RESPONSES, response_id, rest)


@get("/responses/{response_id:str}", summary="A stored response, from the provider that made it")
async def get_response(request: CallerRequest, response_id: FromPath[str]) -> Response[Any]:
    return await _stored(request, response_id)


@delete("/responses/{response_id:str}", status_code=200, summary="Delete a stored response")
async def delete_response(request: CallerRequest, response_id: FromPath[str]) -> Response[Any]:
    return await _stored(request, response_id)


@post("/responses/{response_id:str}/cancel", status_code=200, summary="Cancel a background response")
async def cancel_response(request: CallerRequest, response_id: FromPath[str]) -> Response[Any]:
    return await _stored(request, response_id, "/cancel")


@get("/responses/{response_id:str}/input_items", summary="The input items of a stored response")
async def response_input_items(request: CallerRequest, response_id: FromPath[str]) -> Response[Any]:
    return await _stored(request, response_id, "/input_items")


def _model_card(rt: Runtime, model_id: str) -> dict[str, object]:
    model = rt.models[model_id]
    return {
        "id": model.id,
        "object": "model",
        "created": _CREATED,
        "owned_by": "iop",
        "display_name": model.display_name or model.id,
    }


@get("/models", summary="Models callable through this gateway")
async def list_models(request: CallerRequest, rt: Rt) -> dict[str, object]:
    tenant = rt.callers.tenant_of(request.headers)
    return {"object": "list", "data": [_model_card(rt, m) for m in rt.models if tenant.allows(m)]}


@get("/models/{model_id:path}", summary="One model")
async def get_model(request: CallerRequest, rt: Rt, model_id: FromPath[str]) -> dict[str, object]:
    tenant = rt.callers.tenant_of(request.headers)
    model_id = model_id.lstrip("/")
    if model_id not in rt.models:
        raise ModelNotFound(model_id)
    if not tenant.allows(model_id):
        raise ModelNotAllowed(f"Your key may not call '{model_id}'")
    return _model_card(rt, model_id)


_HEALTHY = msgspec.json.encode({"status": "ok"})


@route("/healthz", http_method=GET_AND_HEAD, summary="The process is alive")
async def healthz(request: CallerRequest) -> Response[bytes]:
    return page(request, _HEALTHY, "application/json")


@route("/readyz", http_method=GET_AND_HEAD, summary="Redis is reachable and the scripts are loaded")
async def readyz(request: CallerRequest, gw: Gw) -> Response[bytes]:
    ok, detail = await gw.ready()
    body = msgspec.json.encode({"status": "ready" if ok else "unavailable", "detail": detail})
    return page(request, body, "application/json", 200 if ok else 503)


def v1_router() -> Router:
    # Caller keys are checked inside each handler (api/auth.py CallerKeys): the tenant they
    # name is the request's, which a guard could not hand on.
    return Router(
        path="/v1",
        route_handlers=[*ENDPOINT_HANDLERS, get_response, delete_response, cancel_response, response_input_items,
                        list_models, get_model],
    )
