"""A request's headers as a plain dict, read from the ASGI scope once per request.

Litestar's ``request.headers`` builds a case-insensitive multidict, through ABC
``isinstance`` checks, the first time a request's headers are read: about 3% of the API's
CPU per JSON request (py-spy on ``bench.throughput``). ASGI servers give header names in
lower case and iop asks only for lower-case names, so a dict answers every question iop
asks of them; a repeated header keeps its first value, as the multidict's ``get`` does."""

from __future__ import annotations

from typing import Any

from litestar import Request

_SCOPE_KEY = "iop.headers"


def headers_of(request: Request[Any, Any, Any]) -> dict[str, str]:
    """``request``'s headers, name (lower case) -> first value."""
    scope: Any = request.scope
    found: dict[str, str] | None = scope.get(_SCOPE_KEY)
    if found is None:
        found = {}
        for name, value in scope["headers"]:
            found.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
        scope[_SCOPE_KEY] = found
    return found
