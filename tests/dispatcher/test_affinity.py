"""Prefix block hashes of a request's prompt (dispatcher/affinity.py): a shared head gives
shared hashes and nothing else does; the next turn of a conversation extends the blocks
of the one before; every endpoint's prompt shape, tools included; the rest of a request
changes nothing; malformed bodies never raise; and the session key's sources."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dispatcher.affinity import BLOCK_CHARS, MAX_BLOCKS, blocks_of, rendering, session_of

CHAT = "chat/completions"
SYSTEM = "You are a careful assistant. Answer in full sentences and cite your sources. " * 60  # ~4.7 kB


def obj(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def chat(*turns: str, system: str = SYSTEM, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"model": "m", "messages": messages, **extra}


def shared(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def common_prefix(a: bytes, b: bytes) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# --------------------------------------------------------------------------- the prefix property


def test_a_shared_head_gives_the_same_first_hashes_and_the_tails_diverge() -> None:
    a, b = chat("What is the capital of France?"), chat("How far away is the Moon?")
    ha, hb = blocks_of(CHAT, a), blocks_of(CHAT, b)
    k = shared(ha, hb)
    assert k >= len(SYSTEM) // BLOCK_CHARS - 1 > 0
    # Exactly the blocks the two renderings share in full; from there on nothing matches.
    assert k == common_prefix(rendering(CHAT, a), rendering(CHAT, b)) // BLOCK_CHARS
    assert all(x != y for x, y in zip(ha[k:], hb[k:], strict=False))


def test_a_different_head_shares_nothing() -> None:
    a = blocks_of(CHAT, chat("Same question", system="Another system prompt. " * 200))
    b = blocks_of(CHAT, chat("Same question"))
    assert shared(a, b) == 0


def test_the_next_turn_extends_the_blocks_of_the_one_before() -> None:
    first = chat("Tell me about Paris. " * 40)
    second = chat("Tell me about Paris. " * 40, "Paris is the capital of France. " * 30, "And Lyon?")
    before, after = rendering(CHAT, first), rendering(CHAT, second)
    assert after.startswith(before)  # the rendering only grows
    old, new = blocks_of(CHAT, first), blocks_of(CHAT, second)
    assert len(new) > len(old)
    assert new[: len(old) - 1] == old[:-1]  # every full block; the old partial one grew


def test_the_same_prompt_gives_the_same_blocks_whatever_else_the_request_says() -> None:
    base = chat("Hello there")
    other = {"stream": True, "temperature": 0.2, "max_tokens": 9, "user": "u1", "n": 2, "top_p": 0.5,
             "stream_options": {"include_usage": True}, "model": "other", "seed": 7,
             "messages": [{"content": m["content"], "role": m["role"]} for m in base["messages"]]}  # key order
    assert blocks_of(CHAT, base) == blocks_of(CHAT, other) == blocks_of(CHAT, obj(other))


def test_bytes_and_decoded_bodies_agree() -> None:
    body = chat("a", "b", "c", tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert blocks_of(CHAT, body) == blocks_of(CHAT, obj(body)) == blocks_of(CHAT, bytearray(obj(body)))


def test_the_hashes_are_blake2b_chained_over_blocks_of_the_rendering() -> None:
    body = chat("hi")
    data = rendering(CHAT, body)
    expected, previous = [], b""
    for start in range(0, len(data), 100):
        digest = hashlib.blake2b(previous + data[start:start + 100], digest_size=8).hexdigest()
        expected.append(digest)
        previous = digest.encode()
    assert blocks_of(CHAT, body, block_chars=100) == expected
    assert len(data) % 100  # the last block is partial, and counted
    assert len(expected) == len(data) // 100 + 1


def test_a_short_prompt_is_one_partial_block() -> None:
    blocks = blocks_of(CHAT, {"messages": [{"role": "user", "content": "hi"}]})
    assert len(blocks) == 1
    assert len(blocks[0]) == 16  # 8 bytes, in hex


def test_max_blocks_keeps_the_first_ones() -> None:
    body = chat("x" * (BLOCK_CHARS * (MAX_BLOCKS + 20)))
    full = blocks_of(CHAT, body)
    assert len(full) == MAX_BLOCKS
    assert blocks_of(CHAT, body, max_blocks=3) == full[:3]
    assert len(rendering(CHAT, body)) == BLOCK_CHARS * MAX_BLOCKS
    # A longer tail changes none of them.
    assert blocks_of(CHAT, chat("x" * (BLOCK_CHARS * (MAX_BLOCKS + 40)))) == full


def test_block_size_is_a_parameter() -> None:
    body = chat("hello")
    small = blocks_of(CHAT, body, block_chars=256)
    assert len(small) == -(-len(rendering(CHAT, body)) // 256)
    assert blocks_of(CHAT, body, block_chars=0) == []
    assert blocks_of(CHAT, body, max_blocks=0) == []


# --------------------------------------------------------------------------- chat


def test_tools_come_first_and_count() -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    plain, with_tool = chat("hi"), chat("hi", tools=[tool])
    other_tool = chat("hi", tools=[{**tool, "function": {**tool["function"], "name": "get_time"}}])
    a, b, c = blocks_of(CHAT, plain), blocks_of(CHAT, with_tool), blocks_of(CHAT, other_tool)
    assert a[0] != b[0] != c[0]  # tools are rendered before everything else
    assert b"get_weather" in rendering(CHAT, with_tool).split(b"\n")[1]
    assert blocks_of(CHAT, chat("hi", tools=[])) == blocks_of(CHAT, chat("hi", tools=None)) == a


def test_content_parts_and_images_count_as_they_appear() -> None:
    def with_image(url: str) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": url}},
        ]}]}

    a, b = with_image("data:image/png;base64,AAAA"), with_image("data:image/png;base64,BBBB")
    assert blocks_of(CHAT, a) != blocks_of(CHAT, b)
    assert b"data:image/png;base64,AAAA" in rendering(CHAT, a)


def test_tool_calls_and_their_results_count_client_metadata_does_not() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"x\":1}"}}
    conversation = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]
    decorated = [
        {"role": "user", "content": "hi", "name": None},
        {"role": "assistant", "tool_calls": [call], "refusal": None, "annotations": [], "reasoning_content": "hm"},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]
    assert blocks_of(CHAT, {"messages": conversation}) == blocks_of(CHAT, {"messages": decorated})
    other = [*conversation[:2], {"role": "tool", "tool_call_id": "call_1", "content": "43"}]
    assert blocks_of(CHAT, {"messages": conversation}) != blocks_of(CHAT, {"messages": other})
    assert b'"arguments":"{\\"x\\":1}"' in rendering(CHAT, {"messages": conversation})


# --------------------------------------------------------------------------- completions


@pytest.mark.parametrize(("prompt", "same_as"), [
    ("Once upon a time", "Once upon a time"),
    (["Once upon a time", "Another prompt"], "Once upon a time"),  # a batch: its first prompt
    ([1, 2, 3], [1, 2, 3]),  # a token list
    ([[1, 2, 3], [4, 5]], [1, 2, 3]),  # a batch of token lists
])
def test_completions_prompts(prompt: Any, same_as: Any) -> None:
    blocks = blocks_of("completions", {"model": "m", "prompt": prompt, "max_tokens": 5})
    assert blocks
    assert blocks == blocks_of("completions", obj({"prompt": same_as}))


def test_a_completions_prompt_is_not_a_chat_or_responses_prompt() -> None:
    text = "You are a helpful assistant."
    assert blocks_of("completions", {"prompt": text}) != blocks_of("responses", {"instructions": text, "input": ""})


# --------------------------------------------------------------------------- responses


def test_responses_instructions_input_and_tools() -> None:
    base = {"model": "m", "instructions": "Be brief.", "input": "Hello"}
    as_items = {**base, "input": [{"role": "user", "content": "Hello"}]}
    typed = {**base, "input": [{"type": "message", "role": "user", "content": "Hello"}]}
    assert blocks_of("responses", base) == blocks_of("responses", as_items) == blocks_of("responses", typed)
    assert blocks_of("responses", base) != blocks_of("responses", {**base, "instructions": "Be long."})
    tool = {"type": "function", "name": "f", "parameters": {}}
    assert blocks_of("responses", base)[0] != blocks_of("responses", {**base, "tools": [tool]})[0]
    assert blocks_of("responses", {"input": "Hello"}) != blocks_of("responses", base)


def test_responses_earlier_output_fed_back_counts_without_its_ids() -> None:
    turn = [{"role": "user", "content": "What is 2+2?"}]
    output = [
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "add", "arguments": "{}",
         "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "4"},
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "4", "annotations": []}]},
    ]
    again = [{k: v for k, v in item.items() if k not in ("id", "status")} for item in output]
    first = blocks_of("responses", {"input": turn + output})
    assert first == blocks_of("responses", {"input": turn + again})
    assert rendering("responses", {"input": turn + output}).startswith(rendering("responses", {"input": turn}))


# --------------------------------------------------------------------------- Anthropic messages


def test_anthropic_system_string_or_blocks_and_messages() -> None:
    body = {"model": "claude", "max_tokens": 100, "system": SYSTEM,
            "messages": [{"role": "user", "content": "Hi"}]}
    blocks = blocks_of("messages", body)
    assert len(blocks) > 1
    assert blocks != blocks_of("messages", {**body, "system": "short"})
    as_blocks = {**body, "system": [{"type": "text", "text": SYSTEM}]}
    assert blocks_of("messages", as_blocks)  # a list of blocks renders too
    assert blocks_of("messages", {**body, "messages": [{"role": "user", "content": "Bye"}]})[:3] == blocks[:3]


def test_anthropic_cache_control_breakpoints_change_nothing() -> None:
    tool = {"name": "f", "description": "d", "input_schema": {"type": "object"}}
    turn1 = [{"role": "user", "content": [{"type": "text", "text": "Q1 " * 400}]}]
    marked = {"tools": [{**tool, "cache_control": {"type": "ephemeral"}}],
              "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
              "messages": [{"role": "user", "content": [{"type": "text", "text": "Q1 " * 400,
                                                          "cache_control": {"type": "ephemeral"}}]}]}
    plain = {"tools": [tool], "system": [{"type": "text", "text": SYSTEM}], "messages": turn1}
    assert blocks_of("messages", marked) == blocks_of("messages", plain) == blocks_of("messages", obj(marked))


def test_anthropic_tool_use_and_results_count() -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"c": "P"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
    ]
    other = [*messages[:2], {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                          "content": "rain"}]}]
    assert blocks_of("messages", {"messages": messages}) != blocks_of("messages", {"messages": other})


# --------------------------------------------------------------------------- no prompt, or a broken one


@pytest.mark.parametrize("endpoint", [
    "embeddings", "rerank", "score", "tokenize", "detokenize", "audio/transcriptions", "audio/translations",
    "audio/speech", "images/generations", "messages/count_tokens", "nonsense",
])
def test_endpoints_without_a_prompt_give_no_blocks(endpoint: str) -> None:
    body = {"model": "m", "input": "hello", "messages": [{"role": "user", "content": "hi"}], "prompt": "p",
            "query": "q", "documents": ["d"]}
    assert blocks_of(endpoint, body) == []
    assert blocks_of(endpoint, obj(body)) == []


@pytest.mark.parametrize(("endpoint", "body"), [
    (CHAT, b"not json"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}'),
    (CHAT, b"[1, 2, 3]"),
    (CHAT, b'"a string"'),
    (CHAT, b""),
    (CHAT, {}),
    (CHAT, {"messages": "hi"}),
    (CHAT, {"messages": None}),
    (CHAT, {"messages": []}),
    (CHAT, {"messages": [{"role": 1, "content": "hi"}]}),
    (CHAT, {"messages": [{"content": "hi"}]}),
    (CHAT, {"messages": [{"role": "user", "content": 7}]}),
    (CHAT, {"messages": ["hi"]}),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "tools": "all of them"}),
    ("completions", {"prompt": {"text": "hi"}}),
    ("completions", {"prompt": [{"text": "hi"}]}),
    ("completions", {"prompt": [True, False]}),
    ("completions", {"prompt": []}),
    ("completions", {"prompt": 3}),
    ("responses", {"input": 3}),
    ("responses", {"instructions": "only instructions"}),
    ("responses", {"instructions": 5, "input": "hi"}),
    ("responses", {"input": ["hi"]}),
    ("messages", {"system": "s"}),
    ("messages", {"system": 5, "messages": [{"role": "user", "content": "hi"}]}),
    ("messages", {"messages": {"role": "user"}}),
])
def test_malformed_bodies_give_no_blocks(endpoint: str, body: Any) -> None:
    assert blocks_of(endpoint, body) == []
    if isinstance(body, dict):
        assert blocks_of(endpoint, obj(body)) == []


def test_a_malformed_message_keeps_the_head_before_it() -> None:
    good = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    whole = blocks_of(CHAT, {"messages": good})
    for bad in (5, "text", {"role": None}, {"role": "user", "content": {"a": 1}}):
        broken = {"messages": [*good, bad, {"role": "user", "content": "more " * 500}]}
        assert blocks_of(CHAT, broken) == whole
        assert blocks_of(CHAT, obj(broken)) == whole
    items = [{"role": "user", "content": "hi"}]
    assert blocks_of("responses", {"input": [*items, 7]}) == blocks_of("responses", {"input": items})
    anthropic = [{"role": "user", "content": "hi"}]
    assert blocks_of("messages", {"messages": [*anthropic, [1]]}) == blocks_of("messages", {"messages": anthropic})


def test_values_no_json_holds_end_the_rendering_there() -> None:
    good = [{"role": "user", "content": "hi"}]
    whole = blocks_of(CHAT, {"messages": good})
    assert blocks_of(CHAT, {"messages": [*good, {"role": "user", "content": [object()]}]}) == whole
    assert blocks_of(CHAT, {"messages": [*good, {"role": "user", "content": "x", "name": object()}]}) == whole
    assert blocks_of(CHAT, {"messages": good, "tools": [object()]}) == []
    assert blocks_of(CHAT, "a str is no body") == []  # type: ignore[arg-type]
    assert blocks_of(CHAT, None) == []  # type: ignore[arg-type]


def test_deep_nesting_does_not_raise() -> None:
    deep: Any = "x"
    for _ in range(5000):
        deep = [deep]
    assert blocks_of(CHAT, {"messages": [{"role": "user", "content": "hi", "tool_calls": deep}]}) == []
    assert blocks_of(CHAT, b'{"messages": [{"role": "user", "content": ' + b"[" * 5000 + b"]" * 5000 + b"}]}") == []


_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                  "content": st.text(max_size=30)})
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20) | _message,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["role", "content", "type", "text", "name", "tool_calls", "id", "x"]), inner, max_size=4),
    max_leaves=20,
)
_bodies = st.fixed_dictionaries({}, optional={
    key: st.lists(_message, max_size=3) | st.lists(_message | _json, max_size=4) | _json
    for key in ("messages", "tools", "prompt", "system", "instructions", "input", "user", "metadata")
})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(endpoint=st.sampled_from([CHAT, "completions", "responses", "messages"]), body=_bodies)
def test_any_json_body_gives_blocks_or_none_and_never_raises(endpoint: str, body: dict[str, Any]) -> None:
    from_dict = blocks_of(endpoint, body)
    assert from_dict == blocks_of(endpoint, obj(body))
    assert all(isinstance(h, str) and len(h) == 16 for h in from_dict)
    session_of(endpoint, body, {})


# --------------------------------------------------------------------------- sessions


def test_the_header_comes_first() -> None:
    body = {"user": "u1", "metadata": {"user_id": "a1"}, "previous_response_id": "resp_1"}
    for endpoint in (CHAT, "completions", "responses", "messages"):
        assert session_of(endpoint, body, {"x-session-id": "s1"}) == "h:s1"
    assert session_of(CHAT, body, {"X-Session-Id": "s2"}) == "h:s2"  # header names are not case-sensitive


def test_the_body_sources_by_endpoint() -> None:
    body = {"user": "u1", "metadata": {"user_id": "a1"}, "previous_response_id": "resp_1"}
    assert session_of(CHAT, body, {}) == "u:u1"
    assert session_of("completions", body, {}) == "u:u1"
    assert session_of("responses", body, {}) == "u:u1"
    assert session_of("responses", {"previous_response_id": "resp_1"}, {}) == "r:resp_1"
    assert session_of("messages", body, {}) == "a:a1"  # Anthropic has no ``user``
    assert session_of(CHAT, {"metadata": {"user_id": "a1"}, "previous_response_id": "resp_1"}, {}) is None
    assert session_of("embeddings", body, {}) is None


def test_sources_never_collide() -> None:
    keys = {session_of(CHAT, {}, {"x-session-id": "same"}), session_of(CHAT, {"user": "same"}, {}),
            session_of("messages", {"metadata": {"user_id": "same"}}, {}),
            session_of("responses", {"previous_response_id": "same"}, {})}
    assert len(keys) == 4


@pytest.mark.parametrize("bad", ["", None, 5, True, ["u"], {"id": "u"}])
def test_values_that_are_not_non_empty_strings_are_passed_over(bad: Any) -> None:
    assert session_of(CHAT, {"user": bad}, {"x-session-id": ""}) is None
    assert session_of(CHAT, {"user": "u1"}, {"x-session-id": bad}) == "u:u1"
    assert session_of("messages", {"metadata": {"user_id": bad}}, {}) is None
    assert session_of("messages", {"metadata": bad}, {}) is None
    assert session_of("responses", {"user": bad, "previous_response_id": "r1"}, {}) == "r:r1"
    assert session_of(CHAT, bad, {}) is None
