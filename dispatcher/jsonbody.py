"""The little JSON surgery iop does: read ``model``/``stream``, swap ``model``.

Bodies are decoded only one level deep (values stay ``msgspec.Raw``), so everything
but ``model`` goes out byte for byte as it came in, and a large body (embedding
inputs, long conversations) costs one scan, not a full parse and re-encode.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from dispatcher.exceptions import InvalidRequest

_object = msgspec.json.Decoder(dict[str, msgspec.Raw])
_str = msgspec.json.Decoder(str)
_opt_bool = msgspec.json.Decoder(bool | None)
_opt_str = msgspec.json.Decoder(str | None)
_encode = msgspec.json.encode


class Parsed(NamedTuple):
    model: str
    stream: bool
    # Responses API: the stored response this one continues.
    previous_response_id: str | None = None


def read_request(body: bytes) -> Parsed:
    """What iop reads of a JSON request body, or InvalidRequest saying what is wrong."""
    try:
        obj = _object.decode(body)
    except msgspec.ValidationError:
        raise InvalidRequest("The request body must be a JSON object") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from None
    except RecursionError:
        # msgspec stops at a fixed depth (about a thousand levels) instead of blowing the stack.
        raise InvalidRequest("The request body is nested too deeply") from None
    raw_model = obj.get("model")
    if raw_model is None:
        raise InvalidRequest("You must provide a model parameter", param="model")
    try:
        model = _str.decode(raw_model)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"Invalid type for 'model': {exc}", param="model") from None
    raw_stream = obj.get("stream")
    try:
        stream = bool(_opt_bool.decode(raw_stream)) if raw_stream is not None else False
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"Invalid type for 'stream': {exc}", param="stream") from None
    if not model:
        raise InvalidRequest("You must provide a model parameter", param="model")
    raw_previous = obj.get("previous_response_id")
    previous = None
    if raw_previous is not None:
        try:
            previous = _opt_str.decode(raw_previous)
        except msgspec.ValidationError as exc:
            raise InvalidRequest(f"Invalid type for 'previous_response_id': {exc}",
                                 param="previous_response_id") from None
    return Parsed(model, stream, previous)


def with_model(body: bytes, model: str) -> bytes:
    """``body`` (a JSON object) with its top-level ``model`` set to ``model``."""
    obj = _object.decode(body)
    obj["model"] = msgspec.Raw(_encode(model))
    return _encode(obj)


_ASK_USAGE = msgspec.Raw(b'{"include_usage":true}')
_TRUE = b"true"
_NULL = b"null"


def with_model_asking_usage(body: bytes, model: str) -> tuple[bytes, bool]:
    """``body`` with its ``model`` set, and ``stream_options.include_usage`` set unless the
    caller asked for it; whether iop asked (then the caller must not get the usage-only
    chunk). One decode, one encode, as ``with_model``.

    The caller's own ``stream_options`` are kept: ``include_usage`` joins them, except
    beside vLLM's ``continuous_usage_stats`` (which would then put usage in every chunk),
    and an ill-typed value is left for the provider to refuse."""
    obj = _object.decode(body)
    obj["model"] = msgspec.Raw(_encode(model))
    asked = False
    raw = obj.get("stream_options")
    if raw is None or bytes(raw) == _NULL:
        obj["stream_options"] = _ASK_USAGE
        asked = True
    elif bytes(raw).lstrip().startswith(b"{"):
        options = _object.decode(raw)
        given = options.get("include_usage")
        if (given is None or bytes(given) != _TRUE) and "continuous_usage_stats" not in options:
            options["include_usage"] = msgspec.Raw(_TRUE)
            obj["stream_options"] = msgspec.Raw(_encode(options))
            asked = True
    return _encode(obj), asked


def renamed(payload: bytes, model: str) -> bytes:
    """``payload`` with its ``model`` -- top-level, or in the ``response`` (Responses events)
    or ``message`` (Messages ``message_start``) object it carries -- set to ``model``
    wherever it is present; anything that is not such a JSON object as it was."""
    try:
        obj = _object.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        return payload
    changed = False
    if "model" in obj:
        obj["model"] = msgspec.Raw(_encode(model))
        changed = True
    for holder in ("response", "message"):
        inner = obj.get(holder)
        if inner is not None and b'"model"' in bytes(inner):
            try:
                nested = _object.decode(inner)
            except (msgspec.DecodeError, RecursionError):
                continue
            if "model" in nested:
                nested["model"] = msgspec.Raw(_encode(model))
                obj[holder] = msgspec.Raw(_encode(nested))
                changed = True
    return _encode(obj) if changed else payload


class _Typed(msgspec.Struct):
    type: str | None = None


_typed = msgspec.json.Decoder(_Typed)


def event_type(data: bytes) -> str | None:
    """The ``type`` of a JSON event object, if it has a string one."""
    try:
        return _typed.decode(data).type
    except (msgspec.DecodeError, RecursionError):
        return None


def is_json_object(data: bytes) -> bool:
    try:
        _object.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return False
    return True
