"""What the OpenAPI document says about the OpenAI endpoints.

The handlers read their bodies raw (only ``model`` and ``stream`` are looked at, the
rest goes to the provider untouched), so Litestar cannot infer a request schema. It is
added here: an object with a required ``model`` -- one of the configured ids -- and an
optional ``stream``, anything else allowed; plus the error answers each may give.
"""

from __future__ import annotations

from litestar import Litestar
from litestar.openapi.spec import OpenAPIMediaType as MediaType
from litestar.openapi.spec import OpenAPIResponse, RequestBody, Schema
from litestar.openapi.spec.enums import OpenAPIType

_ERROR = Schema(
    type=OpenAPIType.OBJECT,
    required=["error"],
    properties={"error": Schema(type=OpenAPIType.OBJECT, required=["message", "type", "param", "code"])},
)
_ERRORS = {
    "400": "Malformed JSON, not an object, or a missing or mistyped `model` / `stream`",
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
    body = RequestBody(
        required=True,
        description="An OpenAI request body; only `model` and `stream` are read, the rest reaches the provider.",
        content={"application/json": MediaType(schema=Schema(
            type=OpenAPIType.OBJECT,
            required=["model"],
            properties={
                "model": Schema(type=OpenAPIType.STRING, enum=list(model_ids) or None),
                "stream": Schema(type=OpenAPIType.BOOLEAN),
            },
        ))},
    )
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
        item = schema.paths[path] if schema.paths else None
        if item is None or item.post is None:
            continue
        item.post.request_body = body
        responses = dict(item.post.responses or {})
        for status, description in _ERRORS.items():
            responses.setdefault(status, OpenAPIResponse(
                description=description, content={"application/json": MediaType(schema=_ERROR)}))
        item.post.responses = responses
