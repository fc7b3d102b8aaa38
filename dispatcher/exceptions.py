"""Every error iop raises on purpose, and the OpenAI-style answer it maps to.

Hierarchy::

    IopError
    ├── ConfigError                 the config file is wrong; ``.problems`` lists every problem
    └── RequestError                a request ends with an OpenAI-style error answer
        ├── InvalidRequest          400 invalid_request_error (malformed JSON, no ``model`` …)
        │   └── UnsupportedEndpoint 400 unsupported_endpoint (no provider of the model serves it)
        ├── Unauthorized            401 invalid_api_key
        ├── ModelNotAllowed         403 model_not_allowed (outside the tenant's allow-list)
        ├── AdminKeyRequired        403 admin_key_required (runtime control, and only caller keys exist)
        ├── ModelNotFound           404 model_not_found
        ├── ControlConflict         409 control_conflict (a load or unload the provider cannot take now)
        ├── InvalidOverride         422 invalid_override (a capacity out of its bounds, a fallbacks loop…)
        ├── ResponseNotFound        404 response_not_found (a Responses id iop does not know)
        ├── UnknownProvider         404 provider_not_found (drain/resume of a provider not in the config)
        ├── ResponseProviderGone    409 response_provider_gone (its provider left the pool)
        ├── ResponseProviderDown    503 response_provider_unavailable, with Retry-After
        ├── RequestTimeout          408 request_timeout (the body came too slowly)
        ├── BodyTooLarge            413 request_too_large
        ├── QueueFull               429 queue_full, with Retry-After
        ├── TenantQueueFull         429 tenant_queue_full, with Retry-After
        ├── RateLimited             429 rate_limited (a tenant's requests or tokens per minute),
        │                           with Retry-After from the window
        ├── BudgetExhausted         429 budget_exhausted (its tokens per day), Retry-After: midnight UTC
        ├── QueueTimeout            503 queue_timeout, with Retry-After
        ├── DeadlineUnmeetable      503 deadline_unmeetable (its predicted queue wait is over its
        │                           x-iop-deadline-ms or the model's refuse_predicted_over_ms)
        ├── NoProviderAvailable     503 no_provider_available (every provider of the request is
        │                           down, drained or unheard-of; each one's reason), with Retry-After
        ├── Overloaded              503 server_overloaded, with Retry-After
        ├── RedisUnavailable        503 redis_unavailable, with Retry-After
        └── ProviderError           the provider call failed (raised in workers, relayed to the API)
            ├── ProviderUnreachable 502 provider_error (connect error, garbage, a stream cut)
            ├── ProviderTimeout     504 provider_timeout
            ├── ProviderRejected    the provider's own error status, passed through with its body
            │                       in the endpoint's error shape (``api/errors.py``)
            ├── ModelLifecycleFailed 502 model_lifecycle_failed (a runtime would not load or unload a
            │                       model, in its own words: out of memory, a file it cannot read…)
            ├── WorkerLost          502 worker_lost (the worker died after output started)
            └── JobCancelled        499 cancelled (only ever seen in logs: the client left)

A ``RequestError`` carries everything the API needs to answer: HTTP status,
``type``, ``code``, ``param`` and, for the retryable ones, ``retry_after``. How an answer
looks -- OpenAI's shape, or Anthropic's on the Anthropic paths (``/v1/messages``) -- is
``api/errors.py``'s alone. Workers send provider errors back to the API as events
(``dispatcher.events``) by their ``code`` (:func:`error_from_code`), so the same classes
describe a failure on both sides of Redis.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec


class IopError(Exception):
    """Base class of every error iop raises on purpose."""


class ConfigProblem(msgspec.Struct, frozen=True):
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class ConfigError(IopError):
    """The configuration cannot be used. ``problems`` holds all of them, each with its path."""

    def __init__(self, problems: Sequence[ConfigProblem]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


class RequestError(IopError):
    status = 500
    type = "server_error"
    code: str | None = "internal_error"
    retry_after: int | None = None

    def __init__(self, message: str, *, param: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if retry_after is not None:
            self.retry_after = retry_after
        # Response headers the answer carries besides Retry-After (where the job ran).
        self.headers: dict[str, str] = {}


class InvalidRequest(RequestError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class UnsupportedEndpoint(InvalidRequest):
    code = "unsupported_endpoint"


class ResponseNotFound(RequestError):
    status = 404
    type = "invalid_request_error"
    code = "response_not_found"


class UnknownProvider(RequestError):
    status = 404
    type = "invalid_request_error"
    code = "provider_not_found"

    def __init__(self, provider: str) -> None:
        super().__init__(f"No provider '{provider}' in the config", param="provider_id")


class ResponseProviderGone(RequestError):
    status = 409
    type = "invalid_request_error"
    code = "response_provider_gone"


class ResponseProviderDown(RequestError):
    status = 503
    type = "server_error"
    code = "response_provider_unavailable"
    retry_after = 5

    @classmethod
    def because(cls, why: str) -> ResponseProviderDown:
        """``why``: its provider's reason, as ``lua/lib/unavailable_lane.lua`` words it. The words
        are ``lua/lib/refuse_unavailable.lua``'s too (tests/dispatcher/test_refuse.py holds them equal)."""
        return cls(f"The provider holding this response is unavailable ({why}); retry later")


class Unauthorized(RequestError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class ModelNotAllowed(RequestError):
    status = 403
    type = "permission_error"
    code = "model_not_allowed"


class AdminKeyRequired(RequestError):
    status = 403
    type = "permission_error"
    code = "admin_key_required"


class ModelNotFound(RequestError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model '{model}' does not exist", param="model")


class ControlConflict(RequestError):
    """A control action the target cannot take in its state now (dispatcher/control.py)."""

    status = 409
    type = "invalid_request_error"
    code = "control_conflict"


class InvalidOverride(RequestError):
    """An override the config's own rules refuse (dispatcher/control.py): the message names
    the rule or the bound, ``param`` the value."""

    status = 422
    type = "invalid_request_error"
    code = "invalid_override"


class RequestTimeout(RequestError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class BodyTooLarge(RequestError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class QueueFull(RequestError):
    status = 429
    type = "rate_limit_error"
    code = "queue_full"
    retry_after = 1


class TenantQueueFull(RequestError):
    status = 429
    type = "rate_limit_error"
    code = "tenant_queue_full"
    retry_after = 1


class RateLimited(RequestError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limited"


class BudgetExhausted(RequestError):
    status = 429
    type = "rate_limit_error"
    code = "budget_exhausted"


class DeadlineUnmeetable(RequestError):
    status = 503
    type = "server_error"
    code = "deadline_unmeetable"
    retry_after = 1


class QueueTimeout(RequestError):
    status = 503
    type = "server_error"
    code = "queue_timeout"
    retry_after = 1


class NoProviderAvailable(RequestError):
    """No provider that could serve the request can take work: answered at once, not after
    the queue deadline (unless the model holds requests: ``hold_when_unavailable_ms``)."""

    status = 503
    type = "server_error"
    code = "no_provider_available"
    retry_after = 5

    @classmethod
    def because(cls, model_id: str, why: str) -> NoProviderAvailable:
        """``why``: each provider's reason, as ``lua/lib/unavailable_lane.lua`` words it. The words
        are ``lua/lib/refuse_unavailable.lua``'s too (tests/dispatcher/test_refuse.py holds them equal)."""
        return cls(f"No provider of '{model_id}' is available ({why}); retry later")


class Overloaded(RequestError):
    status = 503
    type = "server_error"
    code = "server_overloaded"
    retry_after = 1


class RedisUnavailable(RequestError):
    status = 503
    type = "server_error"
    code = "redis_unavailable"
    retry_after = 1


# A provider's own error status that another provider of the lane may well not share
# (rate limited, overloaded, broken): before any output the job goes to another provider
# (lua/finish.lua mode 'retry') rather than to the caller. 502 is the proxy in front of a
# runtime that is down -- the unreachable case iop retries anyway. 504 is not: the
# provider (or its proxy) ran out of time on this very request, which another provider
# would likely take as long over, and iop does not retry its own timeout either.
RETRIED_STATUSES = frozenset({429, 500, 502, 503, 529})


class ProviderError(RequestError):
    status = 502
    type = "server_error"
    code = "provider_error"
    # Before any output, another provider of the job's lane may serve it instead.
    retry_elsewhere = False


class ProviderUnreachable(ProviderError):
    retry_elsewhere = True


class ProviderTimeout(ProviderError):
    status = 504
    code = "provider_timeout"


class ModelLifecycleFailed(ProviderError):
    """A runtime would not load or unload one of its models (``workers/adapters/model_runtime.py``),
    or answered its model list in a shape iop cannot read: the message quotes the runtime's
    own words. Another provider may hold the model, or have room for it."""

    code = "model_lifecycle_failed"
    retry_elsewhere = True


class WorkerLost(ProviderError):
    code = "worker_lost"


class JobCancelled(ProviderError):
    status = 499
    code = "cancelled"


class ProviderRejected(ProviderError):
    """The provider answered an error status: the caller gets that status, the provider's
    headers that pass on, and ``body`` as it goes to the caller (already in the endpoint's
    error shape: :func:`provider_error_body`)."""

    type = "invalid_request_error"
    code = "provider_rejected"

    def __init__(
        self, status: int, body: bytes, content_type: str = "application/json", headers: dict[str, str] | None = None,
        provider: str = "",
    ) -> None:
        super().__init__(f"provider {provider} answered {status}" if provider else f"provider answered {status}")
        self.status = status
        self.raw_body = body
        self.content_type = content_type
        # The provider's own headers that pass on (Retry-After, x-ratelimit-*, ...).
        self.headers.update(headers or {})
        self.retry_elsewhere = status in RETRIED_STATUSES


def _leaves_by_code(cls: type[RequestError]) -> dict[str, type[RequestError]]:
    """Every class under ``cls`` by its code; of a class and a subclass with the same code,
    the subclass (``ProviderUnreachable`` is what a bare ``provider_error`` stands for)."""
    found: dict[str, type[RequestError]] = {}
    for sub in cls.__subclasses__():
        found.update(_leaves_by_code(sub))
    if cls.code is not None:
        found.setdefault(cls.code, cls)
    return found


# Derived, so that no class can be left off (and turn into ProviderUnreachable on the way).
_BY_CODE: dict[str, type[RequestError]] = _leaves_by_code(RequestError)


def error_from_code(code: str, message: str) -> RequestError:
    """Rebuild the error a worker (or a script) reported by its ``code`` on the API side: the
    class of that code, with ``message`` as it was worded (not reworded by the class's own
    constructor); a code iop does not know is a provider that failed."""
    cls = _BY_CODE.get(code, ProviderUnreachable)
    exc = cls.__new__(cls)
    RequestError.__init__(exc, message)
    return exc
