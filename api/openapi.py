"""What the OpenAPI document says about the relayed endpoints (``dispatcher/endpoints.py``).

The handlers read their bodies raw (only ``model`` and ``stream`` are looked at, the
rest goes to the provider untouched), so Litestar cannot infer a request schema. It is
added here: an object (a multipart form for the audio uploads) with a required ``model``
-- one of the configured ids -- and an optional ``stream``, anything else allowed; plus
the error answers each may give.
"""

from __future__ import annotations

from litestar import Litestar
from litestar.openapi.spec import OpenAPIMediaType as MediaType
from litestar.openapi.spec import OpenAPIResponse, RequestBody, Schema
from litestar.openapi.spec.enums import OpenAPIFormat, OpenAPIType

from dispatcher.endpoints import ENDPOINTS

_ERROR = Schema(
    type=OpenAPIType.OBJECT,
    required=["error"],
    properties={"error": Schema(type=OpenAPIType.OBJECT, required=["message", "type", "param", "code"])},
)
_ERRORS = {
    "400": "Malformed JSON, not an object, a missing or mistyped `model` / `stream`, or no provider of the "
           "model serves the endpoint",
    "401": "Missing or wrong API key",
    "404": "Unknown model",
    "408": "The body did not arrive in time",
    "413": "Body too large",
    "429": "The model's queue is full",
    "502": "The provider failed, or its worker was lost after output started",
    "503": "Queue deadline passed, Redis unavailable, or too many streams",
    "504": "The provider timed out",
}


def document_requests(app: Litestar, model_ids: list[str]) -> None:
    schema = app.openapi_schema
    fields = Schema(
        type=OpenAPIType.OBJECT,
        required=["model"],
        properties={
            "model": Schema(type=OpenAPIType.STRING, enum=list(model_ids) or None),
            "stream": Schema(type=OpenAPIType.BOOLEAN),
        },
    )
    json_body = RequestBody(
        required=True,
        description="The endpoint's own request body; only `model` and `stream` are read, the rest reaches "
                    "the provider.",
        content={"application/json": MediaType(schema=fields)},
    )
    form_body = RequestBody(
        required=True,
        description="A multipart form; only its `model` and `stream` fields are read, the file goes on as it is.",
        content={"multipart/form-data": MediaType(schema=Schema(
            type=OpenAPIType.OBJECT,
            required=["model", "file"],
            properties={**(fields.properties or {}),
                        "file": Schema(type=OpenAPIType.STRING, format=OpenAPIFormat.BINARY)},
        ))},
    )
    for endpoint in ENDPOINTS.values():
        item = schema.paths.get(f"/v1/{endpoint.name}") if schema.paths else None
        if item is None or item.post is None:
            continue
        item.post.request_body = form_body if endpoint.body == "multipart" else json_body
        responses = dict(item.post.responses or {})
        for status, description in _ERRORS.items():
            responses.setdefault(status, OpenAPIResponse(
                description=description, content={"application/json": MediaType(schema=_ERROR)}))
        item.post.responses = responses
