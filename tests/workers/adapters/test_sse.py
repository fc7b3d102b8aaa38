"""SSEParser: the incremental parser of a provider's ``text/event-stream`` answer."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dispatcher.exceptions import ProviderUnreachable
from workers.adapters.sse import DONE, MAX_EVENT_BYTES, SSEParser


def parse_all(chunks: list[bytes], max_event_bytes: int = MAX_EVENT_BYTES) -> list[bytes]:
    """Feed every chunk, then close: every payload the parser produced, in order."""
    parser = SSEParser(max_event_bytes)
    out: list[bytes] = []
    for chunk in chunks:
        out.extend(parser.feed(chunk))
    out.extend(parser.close())
    return out


def splits(data: bytes, *cuts: int) -> list[bytes]:
    bounds = [0, *sorted(cuts), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


OPENAI_STREAM = (
    b'data: {"id":"c1","choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
    b'data: {"id":"c1","choices":[{"delta":{"content":"Hel"}}]}\n\n'
    b": keep-alive\n\n"
    b'data: {"id":"c1","choices":[{"delta":{"content":"lo"}}]}\n\n'
    b'data: {"id":"c1","choices":[{"delta":{},"finish_reason":"stop"}]}\n\n'
    b"data: [DONE]\n\n"
)
OPENAI_PAYLOADS = [
    b'{"id":"c1","choices":[{"delta":{"role":"assistant","content":""}}]}',
    b'{"id":"c1","choices":[{"delta":{"content":"Hel"}}]}',
    b'{"id":"c1","choices":[{"delta":{"content":"lo"}}]}',
    b'{"id":"c1","choices":[{"delta":{},"finish_reason":"stop"}]}',
]


# --------------------------------------------------------------------------- basics


def test_single_event() -> None:
    parser = SSEParser()
    assert parser.feed(b'data: {"a":1}\n\n') == [b'{"a":1}']
    assert not parser.done
    assert parser.close() == []


def test_nothing_until_the_blank_line() -> None:
    parser = SSEParser()
    assert parser.feed(b'data: {"a":1}\n') == []
    assert parser.feed(b"\n") == [b'{"a":1}']


def test_several_events_in_one_feed() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: 1\n\ndata: 2\n\ndata: 3\n\n") == [b"1", b"2", b"3"]


def test_openai_stream_in_one_feed() -> None:
    parser = SSEParser()
    assert parser.feed(OPENAI_STREAM) == OPENAI_PAYLOADS
    assert parser.done
    assert parser.close() == []


def test_every_single_split_gives_the_same_payloads() -> None:
    for cut in range(len(OPENAI_STREAM) + 1):
        assert parse_all(splits(OPENAI_STREAM, cut)) == OPENAI_PAYLOADS, cut


def test_every_double_split_gives_the_same_payloads() -> None:
    data = b"data: ab\r\n\r\ndata: c\ndata: d\n\n: x\nevent: e\ndata:f\n\ndata: [DONE]\n\ndata: late\n\n"
    expected = [b"ab", b"c\nd", b"f"]
    for i in range(len(data) + 1):
        for j in range(i, len(data) + 1):
            assert parse_all(splits(data, i, j)) == expected, (i, j)


def test_byte_by_byte() -> None:
    assert parse_all([bytes([b]) for b in OPENAI_STREAM]) == OPENAI_PAYLOADS


def test_crlf_line_endings() -> None:
    data = OPENAI_STREAM.replace(b"\n", b"\r\n")
    assert parse_all([data]) == OPENAI_PAYLOADS
    # The \r and the \n arriving in different chunks.
    assert parse_all([b"data: x\r", b"\n\r", b"\ndata: y\r\n\r\n"]) == [b"x", b"y"]


def test_mixed_line_endings() -> None:
    assert parse_all([b"data: a\r\ndata: b\n\r\ndata: c\n\n"]) == [b"a\nb", b"c"]


def test_multi_line_data_joined_with_newlines() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: line1\ndata: line2\ndata:line3\n\n") == [b"line1\nline2\nline3"]


def test_data_with_and_without_the_space() -> None:
    parser = SSEParser()
    assert parser.feed(b"data:{}\n\ndata: {}\n\n") == [b"{}", b"{}"]


def test_only_one_leading_space_is_stripped() -> None:
    parser = SSEParser()
    assert parser.feed(b"data:  two\n\ndata:\tx\n\ndata:trailing \n\n") == [b" two", b"\tx", b"trailing "]


def test_empty_data_field_gives_an_empty_payload() -> None:
    # SSE spec: "data:" alone dispatches an event whose data is the empty string.
    parser = SSEParser()
    assert parser.feed(b"data:\n\n") == [b""]


def test_comments_event_id_retry_are_ignored() -> None:
    data = (
        b": a comment\n"
        b"event: message\n"
        b"id: 42\n"
        b"retry: 1000\n"
        b"data: payload\n"
        b":another comment\n"
        b"\n"
        b"event: ping\n\n"
        b": only a comment\n\n"
        b"id: 7\n\n"
    )
    assert parse_all([data]) == [b"payload"]


def test_blank_lines_without_data_produce_nothing() -> None:
    parser = SSEParser()
    assert parser.feed(b"\n\n\n\r\n\r\n") == []
    assert parser.feed(b"data: x\n\n\n\n") == [b"x"]


def test_unknown_fields_and_lookalikes_are_not_data() -> None:
    # "data" needs its colon; "database:" and " data:" are other fields.
    parser = SSEParser()
    assert parser.feed(b"database: no\n data: no\nDATA: no\ndata: yes\n\n") == [b"yes"]


def test_payload_is_returned_as_bytes() -> None:
    payloads = SSEParser().feed(b"data: x\n\n")
    assert all(type(p) is bytes for p in payloads)


# --------------------------------------------------------------------------- [DONE]


def test_done_stops_and_later_data_is_ignored() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: 1\n\ndata: [DONE]\n\ndata: 2\n\n") == [b"1"]
    assert parser.done
    assert parser.feed(b"data: 3\n\n") == []
    assert parser.close() == []


def test_done_split_across_feeds() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: 1\n\ndata: [DO") == [b"1"]
    assert not parser.done
    assert parser.feed(b"NE]\n") == []
    assert not parser.done
    assert parser.feed(b"\ndata: 2\n\n") == []
    assert parser.done


def test_done_without_space_and_with_crlf() -> None:
    parser = SSEParser()
    assert parser.feed(b"data:[DONE]\r\n\r\n") == []
    assert parser.done


def test_done_only_as_the_whole_payload() -> None:
    # "[DONE]" as one line of a multi-line event, or with extra text, is ordinary data.
    parser = SSEParser()
    assert parser.feed(b"data: [DONE]\ndata: x\n\ndata: [DONE] \n\n") == [b"[DONE]\nx", b"[DONE] "]
    assert not parser.done


def test_done_unterminated_is_seen_by_close() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: 1\n\ndata: [DONE]") == [b"1"]
    assert parser.close() == []
    assert parser.done


def test_oversize_after_done_is_ignored() -> None:
    parser = SSEParser(max_event_bytes=8)
    assert parser.feed(b"data: [DONE]\n\n") == []
    assert parser.feed(b"x" * 100) == []


# --------------------------------------------------------------------------- close()


def test_close_flushes_an_unterminated_event() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: 1\n\ndata: 2") == [b"1"]
    assert parser.close() == [b"2"]


def test_close_flushes_an_event_missing_only_its_blank_line() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: a\ndata: b\n") == []
    assert parser.close() == [b"a\nb"]


def test_close_flushes_a_crlf_event_cut_after_the_cr() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: a\r") == []
    assert parser.close() == [b"a"]


def test_close_with_nothing_pending() -> None:
    parser = SSEParser()
    assert parser.close() == []
    parser = SSEParser()
    parser.feed(b"data: 1\n\n")
    assert parser.close() == []
    parser = SSEParser()
    parser.feed(b": comment without newline")
    assert parser.close() == []


# --------------------------------------------------------------------------- limits


def test_one_long_line_without_newline_is_refused() -> None:
    parser = SSEParser(max_event_bytes=64)
    with pytest.raises(ProviderUnreachable):
        parser.feed(b"data: " + b"x" * 100)


def test_one_long_line_arriving_in_pieces_is_refused() -> None:
    parser = SSEParser(max_event_bytes=64)
    with pytest.raises(ProviderUnreachable):  # noqa: PT012 - the raise comes from one of the feeds
        for _ in range(100):
            parser.feed(b"xxxxxxxx")


def test_long_comment_line_without_newline_is_refused() -> None:
    # A line is buffered until its newline whatever its field: it is bounded too.
    parser = SSEParser(max_event_bytes=64)
    with pytest.raises(ProviderUnreachable):
        parser.feed(b": " + b"x" * 100)


def test_many_data_lines_are_refused() -> None:
    parser = SSEParser(max_event_bytes=64)
    with pytest.raises(ProviderUnreachable):
        parser.feed(b"data: 0123456789\n" * 10)


def test_many_data_lines_in_separate_feeds_are_refused() -> None:
    parser = SSEParser(max_event_bytes=64)
    with pytest.raises(ProviderUnreachable):  # noqa: PT012 - the raise comes from one of the feeds
        for _ in range(10):
            parser.feed(b"data: 0123456789\n")


def test_long_line_with_its_newline_in_the_same_feed_is_refused() -> None:
    parser = SSEParser(max_event_bytes=64)
    with pytest.raises(ProviderUnreachable):
        parser.feed(b"data: " + b"x" * 100 + b"\n\n")


def test_events_under_the_limit_pass_one_after_another() -> None:
    # The limit is per event: many small events add up to far more than it.
    parser = SSEParser(max_event_bytes=64)
    out: list[bytes] = []
    for i in range(100):
        out.extend(parser.feed(b"data: %032d\n\n" % i))
    assert out == [b"%032d" % i for i in range(100)]


def test_oversize_message_is_a_provider_error() -> None:
    parser = SSEParser(max_event_bytes=4)
    with pytest.raises(ProviderUnreachable, match="oversized"):
        parser.feed(b"data: 0123456789\n\n")


def test_limit_does_not_depend_on_chunking() -> None:
    # The limit counts an event's data bytes, however its line is cut.
    data = b"data: " + b"x" * 16 + b"\n\n"
    for limit, fits in ((16, True), (15, False)):
        for chunks in ([data], [data[:-2], data[-2:]], [data[:-1], data[-1:]], [bytes([b]) for b in data]):
            if fits:
                assert parse_all(chunks, max_event_bytes=limit) == [b"x" * 16]
            else:
                with pytest.raises(ProviderUnreachable):
                    parse_all(chunks, max_event_bytes=limit)


# --------------------------------------------------------------------------- spec corners


def test_bare_cr_line_endings() -> None:
    assert parse_all([b"data: a\rdata: b\r\r"]) == [b"a\nb"]


def test_leading_bom_is_ignored() -> None:
    assert parse_all([b"\xef\xbb\xbfdata: a\n\n"]) == [b"a"]


# --------------------------------------------------------------------------- properties

# A payload as an OpenAI-style server sends it: one line, never "[DONE]".
payload_st = st.binary(min_size=1, max_size=40).filter(lambda b: b"\n" not in b and b"\r" not in b and b != DONE)


@st.composite
def encoded_streams(draw: st.DrawFn) -> tuple[list[bytes], list[bytes]]:
    """(payloads, chunks): the payloads encoded as SSE, cut into arbitrary chunks."""
    payloads = draw(st.lists(payload_st, max_size=12))
    parts: list[bytes] = []
    for payload in payloads:
        # "data:" without the space only when that cannot eat a space of the payload.
        space = draw(st.booleans()) or payload.startswith(b" ")
        eol = draw(st.sampled_from([b"\n", b"\r\n"]))
        if draw(st.booleans()):
            parts.append(draw(st.sampled_from([b": comment", b"event: x", b"id: 1", b"retry: 5"])) + eol)
        parts.append(b"data:" + (b" " if space else b"") + payload + eol + eol)
    ending = draw(st.sampled_from(["done", "done+junk", "blank", "unterminated", "no-final-blank"]))
    if ending == "done":
        parts.append(b"data: [DONE]\n\n")
    elif ending == "done+junk":
        parts.append(b"data: [DONE]\n\ndata: after\n\n")
    elif ending in ("unterminated", "no-final-blank") and parts:
        # Drop the final blank line (and maybe the newline too): close() must flush.
        last = parts.pop()
        eol_len = 2 if last.endswith(b"\r\n\r\n") else 1
        last = last[:-eol_len]
        if ending == "unterminated":
            last = last[:-eol_len]
        parts.append(last)
    data = b"".join(parts)
    cuts = draw(st.lists(st.integers(min_value=0, max_value=len(data)), max_size=10))
    return payloads, splits(data, *cuts)


@given(encoded_streams())
@settings(database=None, max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_property_any_chunking_yields_the_payloads(stream: tuple[list[bytes], list[bytes]]) -> None:
    payloads, chunks = stream
    assert parse_all(chunks) == payloads


@given(st.lists(payload_st, max_size=12), st.data())
@settings(database=None, max_examples=200, deadline=None)
def test_property_byte_by_byte_and_whole_agree(payloads: list[bytes], data: st.DataObject) -> None:
    encoded = b"".join(b"data: " + p + b"\n\n" for p in payloads) + b"data: [DONE]\n\n"
    assert parse_all([encoded]) == payloads
    assert parse_all([bytes([b]) for b in encoded]) == payloads
    cut = data.draw(st.integers(min_value=0, max_value=len(encoded)))
    assert parse_all(splits(encoded, cut)) == payloads


sse_alphabet = st.sampled_from([b"\n", b"\r", b"\r\n", b"data:", b"data: ", b":", b" ", b"[DONE]", b"x", b"\x00"])
sse_like = st.lists(st.one_of(sse_alphabet, st.binary(max_size=8)), max_size=60).map(b"".join)


@given(st.lists(st.one_of(st.binary(max_size=64), sse_like), max_size=8), st.integers(min_value=1, max_value=64))
@settings(database=None, max_examples=500, deadline=None)
def test_property_arbitrary_bytes_raise_only_provider_unreachable(chunks: list[bytes], limit: int) -> None:
    # Any other exception fails the test; a hang would trip pytest-timeout.
    parser = SSEParser(max_event_bytes=limit)
    try:
        for chunk in chunks:
            for payload in parser.feed(chunk):
                assert isinstance(payload, bytes)
                assert payload != DONE
        for payload in parser.close():
            assert isinstance(payload, bytes)
    except ProviderUnreachable:
        return


@given(st.lists(st.one_of(st.binary(max_size=64), sse_like), max_size=8))
@settings(database=None, max_examples=300, deadline=None)
def test_property_arbitrary_bytes_with_the_default_limit(chunks: list[bytes]) -> None:
    # Under the default limit nothing this small can be refused: no exception at all.
    parser = SSEParser()
    for chunk in chunks:
        parser.feed(chunk)
    parser.close()
    if parser.done:
        assert parser.feed(b"data: more\n\n") == []
