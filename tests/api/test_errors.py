"""``api/errors.py``: the error shape of an answer comes from the endpoint table."""

from __future__ import annotations

import pytest
from litestar import Request

from api.errors import anthropic


def request_to(path: str) -> Request:  # type: ignore[type-arg]
    return Request(scope={"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
                          "query_string": b"", "headers": [], "app": None})  # type: ignore[typeddict-item]


@pytest.mark.parametrize(("path", "shape"), [
    ("/v1/messages", True), ("/v1/messages/count_tokens", True), ("/v1/chat/completions", False),
    ("/v1/responses", False), ("/v1/responses/resp_1/cancel", False), ("/v1/messages-old", False),
    ("/catalog", False),
])
def test_the_anthropic_shape_is_the_endpoint_tables(path: str, shape: bool) -> None:
    assert anthropic(request_to(path)) is shape
