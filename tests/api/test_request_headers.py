"""api/request_headers.py: a request's headers as iop reads them."""

from __future__ import annotations

from typing import Any

from api.request_headers import headers_of


class Request:
    def __init__(self, *headers: tuple[bytes, bytes]) -> None:
        self.scope: dict[str, Any] = {"headers": list(headers)}


def test_names_are_lower_case_and_a_repeated_header_keeps_its_first_value() -> None:
    request = Request((b"x-api-key", b"first"), (b"X-Tenant", b"t1"), (b"x-api-key", b"second"))
    assert headers_of(request) == {"x-api-key": "first", "x-tenant": "t1"}  # type: ignore[arg-type]


def test_values_are_latin_1_and_read_once_per_request() -> None:
    request = Request((b"x-note", "café".encode("latin-1")))
    first = headers_of(request)  # type: ignore[arg-type]
    assert first == {"x-note": "café"}
    request.scope["headers"].append((b"x-late", b"1"))
    assert headers_of(request) is first  # type: ignore[arg-type]
