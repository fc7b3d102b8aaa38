"""A provider's error answer as the caller gets it (``api/errors.py``): in the
endpoint's error shape, byte for byte when it already is, wrapped when it is not."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.errors import QUOTED_CHARS, in_error_shape, provider_error_body, provider_said
from dispatcher.endpoints import ErrorShape
from dispatcher.exceptions import ProviderRejected

OPENAI_ERROR = b'{"error":{"message":"bad","type":"invalid_request_error","param":null,"code":null}}'
ANTHROPIC_ERROR = b'{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"},"request_id":"r"}'


@pytest.mark.parametrize("body", [
    OPENAI_ERROR,
    # Extra fields, spacing, a trailing newline, llama.cpp's integer code, no type at all.
    b'  {"error": {"code": 400, "message": "too long", "type": "invalid_request_error"}, "x": [1]}\n',
    b'{"error":{"message":"only a message"}}',
    # Anthropic's has the error.message an OpenAI client reads too.
    ANTHROPIC_ERROR,
])
def test_an_openai_error_passes_byte_for_byte(body: bytes) -> None:
    assert provider_error_body("openai", 400, body, "p") is body


def test_an_anthropic_error_passes_byte_for_byte() -> None:
    assert provider_error_body("anthropic", 529, ANTHROPIC_ERROR, "p") is ANTHROPIC_ERROR


@pytest.mark.parametrize(("status", "body", "error_type", "message"), [
    (404, b'{"detail":"Not Found"}', "invalid_request_error", 'provider p answered 404: {"detail":"Not Found"}'),
    (400, b'{"error":"no model"}', "invalid_request_error", 'provider p answered 400: {"error":"no model"}'),
    (429, b"slow down", "rate_limit_error", "provider p answered 429: slow down"),
    (503, b"", "server_error", "provider p answered 503 with an empty body"),
    (502, b"<html>\r\n<body>\r\n  <h1>502 Bad Gateway</h1>\r\n</body>\r\n</html>\r\n", "server_error",
     "provider p answered 502: <html> <body> <h1>502 Bad Gateway</h1> </body> </html>"),
    (529, b'{"error":{"type":"overloaded_error"}}', "server_error",
     'provider p answered 529: {"error":{"type":"overloaded_error"}}'),
])
def test_anything_else_is_wrapped_in_openais_shape(status: int, body: bytes, error_type: str, message: str) -> None:
    wrapped = provider_error_body("openai", status, body, "p")
    assert json.loads(wrapped) == {"error": {"message": message, "type": error_type, "param": None,
                                             "code": "upstream_error"}}


@pytest.mark.parametrize(("status", "body", "error_type"), [
    (404, b'{"detail":"Not Found"}', "not_found_error"),
    (529, OPENAI_ERROR, "overloaded_error"),
    (429, b"slow down", "rate_limit_error"),
    (500, b"", "api_error"),
    # Anthropic's shape, but without the error's type.
    (400, b'{"type":"error","error":{"message":"x"}}', "invalid_request_error"),
])
def test_anything_else_is_wrapped_in_anthropics_shape(status: int, body: bytes, error_type: str) -> None:
    wrapped = json.loads(provider_error_body("anthropic", status, body, "gpu-a"))
    assert wrapped["type"] == "error"
    assert wrapped["error"]["type"] == error_type
    assert wrapped["error"]["message"] == provider_said("gpu-a", status, body)
    assert wrapped["error"]["message"].startswith(f"provider gpu-a answered {status}")


def test_a_cut_body_is_wrapped_even_in_shape() -> None:
    wrapped = json.loads(provider_error_body("openai", 500, OPENAI_ERROR, "p", cut=True))
    assert wrapped["error"]["message"] == f"provider p answered 500: {OPENAI_ERROR.decode()}…"
    assert wrapped["error"]["code"] == "upstream_error"


def test_the_quote_is_bounded() -> None:
    message = provider_said("p", 500, b"y" * 100_000)
    assert message == "provider p answered 500: " + "y" * QUOTED_CHARS + "…"
    # Whitespace folds before the bound is applied; a short body is quoted whole.
    assert provider_said("p", 500, b"a\n\n\tb " * 10) == "provider p answered 500: " + " ".join(["a b"] * 10)


def test_bytes_that_are_not_text_still_make_json() -> None:
    wrapped = json.loads(provider_error_body("openai", 500, b"\xff\xfe\x00oops", "p"))
    assert wrapped["error"]["message"].endswith("oops")


@given(st.binary(max_size=3000), st.sampled_from(["openai", "anthropic"]), st.integers(400, 599), st.booleans())
def test_every_answer_is_in_its_shape(body: bytes, shape: ErrorShape, status: int, cut: bool) -> None:
    shaped = provider_error_body(shape, status, body, "p", cut)
    assert in_error_shape(shaped, shape)
    msgspec.json.decode(shaped)
    if shaped is not body:
        assert "provider p answered" in shaped.decode()


@pytest.mark.parametrize("status", [429, 500, 502, 503, 529])
def test_statuses_another_provider_may_not_share_are_retried_elsewhere(status: int) -> None:
    assert ProviderRejected(status, b"").retry_elsewhere


@pytest.mark.parametrize("status", [400, 401, 403, 404, 408, 413, 422, 501, 504, 505])
def test_other_statuses_are_the_callers(status: int) -> None:
    assert not ProviderRejected(status, b"").retry_elsewhere
