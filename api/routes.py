"""The HTTP surface: the model-bearing endpoints (OpenAI's, Anthropic's Messages, rerank,
audio...: ``dispatcher/endpoints.py``), the calls on stored Responses, model listing,
health."""

from __future__ import annotations

import time
from typing import Any

from litestar import Request, Response, Router, delete, get, post
from litestar.datastructures import State
from litestar.handlers import HTTPRouteHandler
from litestar.params import FromPath

from api.gateway import Gateway
from api.relay import relay
from dispatcher.endpoints import ENDPOINTS, RESPONSES
from dispatcher.exceptions import ModelNotAllowed, ModelNotFound

_CREATED = int(time.time())


def _gw(state: State) -> Gateway:
    gw: Gateway = state.gateway
    return gw


def _endpoint_handler(endpoint: str) -> HTTPRouteHandler:
    async def handler(request: Request[Any, Any, State]) -> Response[Any]:
        return await relay(request, _gw(request.app.state), endpoint)

    name = endpoint.replace("/", "_")
    handler.__name__ = name
    return post(f"/{endpoint}", status_code=200, name=name, operation_id=name,
                summary=f"/v1/{endpoint}, relayed to a provider of the model that serves it")(handler)


ENDPOINT_HANDLERS = [_endpoint_handler(name) for name in ENDPOINTS]


async def _stored(request: Request[Any, Any, State], response_id: str, rest: str = "") -> Response[Any]:
    return await relay(request, _gw(request.app.state), RESPONSES, response_id, rest)


@get("/responses/{response_id:str}", summary="A stored response, from the provider that made it")
async def get_response(request: Request[Any, Any, State], response_id: FromPath[str]) -> Response[Any]:
    return await _stored(request, response_id)


@delete("/responses/{response_id:str}", status_code=200, summary="Delete a stored response")
async def delete_response(request: Request[Any, Any, State], response_id: FromPath[str]) -> Response[Any]:
    return await _stored(request, response_id)


@post("/responses/{response_id:str}/cancel", status_code=200, summary="Cancel a background response")
async def cancel_response(request: Request[Any, Any, State], response_id: FromPath[str]) -> Response[Any]:
    return await _stored(request, response_id, "/cancel")


@get("/responses/{response_id:str}/input_items", summary="The input items of a stored response")
async def response_input_items(request: Request[Any, Any, State], response_id: FromPath[str]) -> Response[Any]:
    return await _stored(request, response_id, "/input_items")


def _model_card(gw: Gateway, model_id: str) -> dict[str, object]:
    model = gw.models[model_id]
    return {
        "id": model.id,
        "object": "model",
        "created": _CREATED,
        "owned_by": "iop",
        "display_name": model.display_name or model.id,
    }


@get("/models", summary="Models callable through this gateway")
async def list_models(request: Request[Any, Any, State], state: State) -> dict[str, object]:
    gw = _gw(state)
    tenant = gw.tenants.of(request.headers)
    return {"object": "list", "data": [_model_card(gw, m) for m in gw.models if tenant.allows(m)]}


@get("/models/{model_id:path}", summary="One model")
async def get_model(request: Request[Any, Any, State], state: State, model_id: FromPath[str]) -> dict[str, object]:
    gw = _gw(state)
    tenant = gw.tenants.of(request.headers)
    model_id = model_id.lstrip("/")
    if model_id not in gw.models:
        raise ModelNotFound(model_id)
    if not tenant.allows(model_id):
        raise ModelNotAllowed(f"Your key may not call '{model_id}'")
    return _model_card(gw, model_id)


@get("/healthz", summary="The process is alive")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@get("/readyz", summary="Redis is reachable and the scripts are loaded")
async def readyz(state: State) -> Response[dict[str, str]]:
    ok, detail = await _gw(state).ready()
    return Response({"status": "ready" if ok else "unavailable", "detail": detail}, status_code=200 if ok else 503)


def v1_router() -> Router:
    # Caller keys are checked inside each handler (Gateway.tenants), not by a guard.
    return Router(
        path="/v1",
        route_handlers=[*ENDPOINT_HANDLERS, get_response, delete_response, cancel_response, response_input_items,
                        list_models, get_model],
    )
