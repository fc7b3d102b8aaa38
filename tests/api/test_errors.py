"""``api/errors.py``: the error shape of an answer comes from the endpoint table."""

from __future__ import annotations

import json

import pytest

from api.errors import body_of, shape_of, stream_error
from dispatcher.endpoints import ENDPOINTS
from dispatcher.exceptions import ModelNotFound, QueueFull


@pytest.mark.parametrize(("path", "shape"), [
    ("/v1/messages", "anthropic"), ("/v1/messages/count_tokens", "anthropic"), ("/v1/chat/completions", "openai"),
    ("/v1/responses", "openai"), ("/v1/responses/resp_1/cancel", "openai"), ("/v1/messages-old", "openai"),
    ("/catalog", "openai"),
])
def test_the_shape_is_the_endpoint_tables(path: str, shape: str) -> None:
    assert shape_of(path) == shape


def test_an_error_in_each_shape() -> None:
    exc = ModelNotFound("m")
    assert body_of(exc, "openai") == {"error": {"message": "The model 'm' does not exist",
                                                "type": "invalid_request_error", "param": "model",
                                                "code": "model_not_found"}}
    assert body_of(exc, "anthropic") == {"type": "error", "error": {"type": "not_found_error",
                                                                    "message": "The model 'm' does not exist"}}


@pytest.mark.parametrize(("endpoint", "expected"), [
    ("chat/completions", {"error": {"message": "full", "type": "rate_limit_error", "param": None,
                                    "code": "queue_full"}}),
    ("responses", {"type": "error", "code": "queue_full", "message": "full", "param": None}),
    ("messages", {"type": "error", "error": {"type": "rate_limit_error", "message": "full"}}),
])
def test_a_streams_error_event_is_in_its_endpoints_shape(endpoint: str, expected: dict[str, object]) -> None:
    frame = stream_error(QueueFull("full"), ENDPOINTS[endpoint])
    event = b"event: error\n" if ENDPOINTS[endpoint].stream == "typed_sse" else b""
    assert frame.startswith(event + b"data: ")
    assert frame.endswith(b"\n\n")
    assert json.loads(frame.removeprefix(event + b"data: ")) == expected


def test_a_providers_body_goes_into_the_event_as_it_is() -> None:
    body = b'{"error":{"message":"no"}}'
    assert stream_error(QueueFull("full"), ENDPOINTS["chat/completions"], body) == b"data: " + body + b"\n\n"
