"""The SSE relay of the API: provider chunks come out as SSE frames that any parser reads
back as the same JSON, with ``model`` set to the id the caller asked for."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from api.relay import DONE_FRAME, _frames
from workers.sse import SSEParser

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
    wire = _frames(payloads, alias) + DONE_FRAME
    parser = SSEParser()
    got: list[bytes] = []
    for start in range(0, len(wire), cut):  # however the bytes are cut on the way
        got += parser.feed(wire[start:start + cut])
    assert parser.done
    assert [msgspec.json.decode(g) for g in got] == [{**chunk, "model": alias} for chunk, _ in items]


def test_a_payload_that_is_not_json_passes_unchanged() -> None:
    assert _frames([b"not json"], "m") == b"data: not json\n\n"
