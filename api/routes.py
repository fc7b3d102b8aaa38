"""The HTTP surface: OpenAI-compatible endpoints, model listing, health."""

from __future__ import annotations

import time
from typing import Any

from litestar import Request, Response, Router, get, post
from litestar.datastructures import State
from litestar.params import FromPath

from api.gateway import Gateway
from api.relay import relay
from dispatcher.exceptions import ModelNotFound

_CREATED = int(time.time())


def _gw(state: State) -> Gateway:
    gw: Gateway = state.gateway
    return gw


@post("/chat/completions", status_code=200, summary="Chat completion (JSON or SSE stream)")
async def chat_completions(request: Request[Any, Any, State]) -> Response[Any]:
    return await relay(request, _gw(request.app.state), "chat/completions")


@post("/completions", status_code=200, summary="Text completion (JSON or SSE stream)")
async def completions(request: Request[Any, Any, State]) -> Response[Any]:
    return await relay(request, _gw(request.app.state), "completions")


@post("/embeddings", status_code=200, summary="Embeddings")
async def embeddings(request: Request[Any, Any, State]) -> Response[Any]:
    return await relay(request, _gw(request.app.state), "embeddings")


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
    gw.caller_keys.check(request.headers)
    return {"object": "list", "data": [_model_card(gw, m) for m in gw.models]}


@get("/models/{model_id:path}", summary="One model")
async def get_model(request: Request[Any, Any, State], state: State, model_id: FromPath[str]) -> dict[str, object]:
    gw = _gw(state)
    gw.caller_keys.check(request.headers)
    model_id = model_id.lstrip("/")
    if model_id not in gw.models:
        raise ModelNotFound(model_id)
    return _model_card(gw, model_id)


@get("/healthz", summary="The process is alive")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@get("/readyz", summary="Redis is reachable and the scripts are loaded")
async def readyz(state: State) -> Response[dict[str, str]]:
    ok, detail = await _gw(state).ready()
    return Response({"status": "ready" if ok else "unavailable", "detail": detail}, status_code=200 if ok else 503)


def v1_router() -> Router:
    # Caller keys are checked inside each handler (Gateway.caller_keys), not by a guard.
    return Router(path="/v1", route_handlers=[chat_completions, completions, embeddings, list_models, get_model])
