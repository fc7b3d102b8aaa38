"""The little JSON surgery iop does: read ``model``/``stream``, swap ``model``.

Bodies are decoded only one level deep (values stay ``msgspec.Raw``), so everything
but ``model`` goes out byte for byte as it came in, and a large body (embedding
inputs, long conversations) costs one scan, not a full parse and re-encode.
"""

from __future__ import annotations

import msgspec

from dispatcher.exceptions import InvalidRequest

_object = msgspec.json.Decoder(dict[str, msgspec.Raw])
_str = msgspec.json.Decoder(str)
_opt_bool = msgspec.json.Decoder(bool | None)
_encode = msgspec.json.encode


def parse_request(body: bytes) -> tuple[str, bool]:
    """The ``model`` and ``stream`` of a request body, or InvalidRequest saying what is wrong."""
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
    return model, stream


def with_model(body: bytes, model: str) -> bytes:
    """``body`` (a JSON object) with its top-level ``model`` set to ``model``."""
    obj = _object.decode(body)
    obj["model"] = msgspec.Raw(_encode(model))
    return _encode(obj)


def is_json_object(data: bytes) -> bool:
    try:
        _object.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return False
    return True
