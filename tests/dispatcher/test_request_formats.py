"""The request formats iop reads without parsing whole bodies: multipart forms (audio
uploads), the envelope a non-plain request waits in, and the model in answers."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatcher import multipart
from dispatcher.envelope import RequestEnvelope, unwrap, wrap
from dispatcher.exceptions import InvalidRequest
from dispatcher.jsonbody import event_type, read_request, renamed

CT = "multipart/form-data; boundary=----iopBoundary42"


def form(*parts: tuple[str, bytes, str | None]) -> bytes:
    out = b""
    for name, value, filename in parts:
        out += b"------iopBoundary42\r\n"
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"Content-Disposition: {disposition}\r\n".encode()
        if filename:
            out += b"Content-Type: application/octet-stream\r\n"
        out += b"\r\n" + value + b"\r\n"
    return out + b"------iopBoundary42--\r\n"


@given(st.binary(max_size=2000), st.text(min_size=1, max_size=40).filter(lambda t: "\r" not in t))
@settings(max_examples=200, deadline=None)
def test_the_model_field_is_read_and_set_and_the_file_is_untouched(audio: bytes, served: str) -> None:
    # A file may hold anything -- even bytes that look like a boundary but are not one.
    body = form(("file", audio, "a.wav"), ("model", b"whisper", None), ("stream", b"true", None))
    assert multipart.fields(body, CT, ("model", "stream")) == {"model": "whisper", "stream": "true"}
    out = multipart.with_field(body, CT, "model", served)
    assert out == form(("file", audio, "a.wav"), ("model", served.encode(), None), ("stream", b"true", None))


def test_a_quoted_boundary_and_filename_that_contains_name_are_understood() -> None:
    body = form(("file", b"x", 'name="model"'), ("model", b"m", None))
    ct = 'multipart/form-data; boundary="----iopBoundary42"'
    assert multipart.fields(body, ct, ("model",)) == {"model": "m"}


@pytest.mark.parametrize(("content_type", "body"), [
    ("multipart/form-data", form(("model", b"m", None))),  # no boundary
    (CT, b"no parts here"),
    (CT, b"------iopBoundary42\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm"),  # cut off
])
def test_malformed_forms_are_a_clear_400(content_type: str, body: bytes) -> None:
    with pytest.raises(InvalidRequest):
        multipart.fields(body, content_type, ("model",))


def test_a_plain_request_is_stored_as_its_body_and_others_in_an_envelope() -> None:
    plain = RequestEnvelope(b'{"model":"m"}')
    assert wrap(plain) == b'{"model":"m"}'
    assert unwrap(wrap(plain)) == plain
    for other in (
        RequestEnvelope(b"", "GET", "responses/r1/input_items?limit=2"),
        RequestEnvelope(b'{"model":"m"}', headers={"anthropic-version": "2023-06-01"}),
        RequestEnvelope(form(("model", b"m", None)), content_type=CT),
    ):
        stored = wrap(other)
        assert stored[:1] == b"\x00"
        assert unwrap(stored) == other


def test_the_callers_model_replaces_the_served_name_where_answers_carry_it() -> None:
    def model_of(payload: bytes, *path: str) -> object:
        obj = msgspec.json.decode(renamed(payload, "alias"))
        for key in path:
            obj = obj[key]
        return obj

    assert model_of(b'{"id":"r","model":"served"}', "model") == "alias"
    assert model_of(b'{"type":"response.completed","response":{"model":"served"}}', "response", "model") == "alias"
    assert model_of(b'{"type":"message_start","message":{"model":"served","content":[]}}',
                    "message", "model") == "alias"
    # Nothing added where there was no model, and a payload that is not JSON passes as it is.
    assert renamed(b'{"results":[{"index":0}]}', "alias") == b'{"results":[{"index":0}]}'
    assert renamed(b"not json", "alias") == b"not json"
    assert renamed(b'{"message":"a string"}', "alias") == b'{"message":"a string"}'


def test_previous_response_id_is_read_and_checked() -> None:
    assert read_request(b'{"model":"m","previous_response_id":"resp_1"}').previous_response_id == "resp_1"
    assert read_request(b'{"model":"m"}').previous_response_id is None
    with pytest.raises(InvalidRequest) as info:
        read_request(b'{"model":"m","previous_response_id":5}')
    assert info.value.param == "previous_response_id"


def test_event_type() -> None:
    assert event_type(b'{"type":"transcript.text.done","text":"x"}') == "transcript.text.done"
    assert event_type(b'{"delta":"x"}') is None
    assert event_type(b"[]") is None
