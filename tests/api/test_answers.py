"""The API's streamed answers: provider chunks come out as SSE frames that any parser
reads back as the same JSON, with ``model`` set to the id the caller asked for."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.answers import DONE_FRAME, Framing, StreamBroken, _broken, sse_frames
from dispatcher.endpoints import ENDPOINTS
from dispatcher.events import Chunks, End, Meta, Start
from dispatcher.exceptions import WorkerLost
from workers.adapters.sse import SSEParser

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)
chunks = st.dictionaries(st.text(max_size=10), json_values, max_size=5).map(
    lambda d: {k: v for k, v in d.items() if k != "model"})
served_names = st.text(min_size=1, max_size=30)


@given(st.lists(st.tuples(chunks, served_names | st.none()), min_size=1, max_size=6), served_names,
       st.integers(1, 64))
@settings(max_examples=300, deadline=None)
def test_frames_read_back_as_the_same_json_with_the_callers_model(
    items: list[tuple[dict[str, Any], str | None]], alias: str, cut: int
) -> None:
    payloads = [msgspec.json.encode({**chunk, "model": served} if served is not None else chunk)
                for chunk, served in items]
    wire = sse_frames(payloads, alias) + DONE_FRAME
    parser = SSEParser()
    got: list[bytes] = []
    for start in range(0, len(wire), cut):  # however the bytes are cut on the way
        got += parser.feed(wire[start:start + cut])
    assert parser.done
    assert [msgspec.json.decode(g) for g in got] == [{**chunk, "model": alias} for chunk, _ in items]


def test_a_payload_that_is_not_json_passes_unchanged() -> None:
    assert sse_frames([b"not json"], "m") == b"data: not json\n\n"


def test_a_second_run_or_a_gap_is_never_spliced_into_a_stream() -> None:
    meta = Meta("p", "n1", "served", 0)
    first = Start(meta, 200, [b"{}"])
    assert _broken(first, first, 0) is None
    assert _broken(Chunks([b"{}"], 1), first, 0) is None
    assert _broken(Chunks([b"{}"], 1), first, 1) is None  # a batch written twice: dropped, not broken
    assert _broken(End(), first, 3) is None
    # Only a failover that lost writes does these: a new run starts, or a batch is missing.
    assert isinstance(_broken(Start(meta, 200, [b"{}"]), first, 2), WorkerLost)
    assert isinstance(_broken(Chunks([b"{}"], 3), first, 1), WorkerLost)


# --- the other stream kinds (dispatcher/endpoints.py) -------------------------------------------------


def test_typed_events_keep_their_names_and_carry_the_callers_model() -> None:
    framing = Framing(ENDPOINTS["responses"], "alias")
    created = b'response.created\n{"type":"response.created","response":{"id":"r1","model":"served"}}'
    delta = b'response.output_text.delta\n{"type":"response.output_text.delta","delta":"hi"}'
    wire = framing.chunks([created, delta])
    parser = SSEParser(typed=True)
    got = parser.feed(wire)
    assert [g.partition(b"\n")[0] for g in got] == [b"response.created", b"response.output_text.delta"]
    assert msgspec.json.decode(got[0].partition(b"\n")[2])["response"]["model"] == "alias"
    assert got[1].partition(b"\n")[2] == delta.partition(b"\n")[2]
    # A typed stream ends with its own last event: [DONE] only when the provider sent one.
    assert framing.end(End(done=False)) == b""
    assert framing.end(End(done=True)) == DONE_FRAME


def test_an_event_without_a_name_is_written_without_one() -> None:
    framing = Framing(ENDPOINTS["audio/transcriptions"], "alias")
    assert framing.chunks([b'\n{"type":"transcript.text.delta","delta":"a"}']) == (
        b'data: {"type":"transcript.text.delta","delta":"a"}\n\n')


def test_errors_in_a_stream_take_the_endpoints_shape() -> None:
    exc = WorkerLost("lost")
    chat = Framing(ENDPOINTS["chat/completions"], "m").error(exc)
    assert chat.startswith(b"data: ")
    assert msgspec.json.decode(chat[6:])["error"]["code"] == "worker_lost"
    messages = Framing(ENDPOINTS["messages"], "m").error(exc)
    assert messages.startswith(b"event: error\ndata: ")
    assert msgspec.json.decode(messages.split(b"data: ", 1)[1]) == {
        "type": "error", "error": {"type": "api_error", "message": "lost"}}
    responses = Framing(ENDPOINTS["responses"], "m").error(exc)
    assert msgspec.json.decode(responses.split(b"data: ", 1)[1])["type"] == "error"


def test_binary_streams_pass_bytes_as_they_are_and_are_cut_on_error() -> None:
    framing = Framing(ENDPOINTS["audio/speech"], "m")
    assert framing.chunks([b"RIFF\x00", b"\x01\x02"]) == b"RIFF\x00\x01\x02"
    assert framing.end(End(done=False)) == b""
    with pytest.raises(StreamBroken):
        framing.error(WorkerLost("lost"))
