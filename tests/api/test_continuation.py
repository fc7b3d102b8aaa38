"""A cut stream read, its continuation's request made, and the continuation's chunks spliced
into the caller's stream (api/continuation.py): the pure parts, on chunks shaped as vLLM's and
llama.cpp's servers send them. The relay through real processes is tests/e2e/test_continuation.py."""

from __future__ import annotations

import json
from typing import Any

from api.continuation import Splice, Transcript, continuation_body, request_problem
from dispatcher.endpoints import CHAT, COMPLETIONS
from dispatcher.events import Usage


def chat_chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
    return json.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 17, "model": "m",
                       "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}).encode()


def cut_chat(words: int) -> list[bytes]:
    return [chat_chunk({"role": "assistant", "content": ""}),
            *(chat_chunk({"content": ("" if i == 0 else " ") + f"tok{i}"}) for i in range(words))]


def test_a_cut_chat_stream_is_read_and_its_continuation_prefills_the_text_so_far() -> None:
    t = Transcript.read(CHAT, cut_chat(3))
    assert (t.id, t.created, t.so_far, t.tokens, t.why_not()) == ("chatcmpl-1", 17, "tok0 tok1 tok2", 3, None)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 10}
    cont = json.loads(continuation_body(body, CHAT, t) or b"")
    assert cont["messages"][-1] == {"role": "assistant", "content": "tok0 tok1 tok2"}
    assert cont["messages"][:-1] == body["messages"]
    assert (cont["max_tokens"], cont["continue_final_message"], cont["add_generation_prompt"]) == (7, True, False)
    # Cut before any text: the same request again, nothing prefilled.
    again = json.loads(continuation_body(body, CHAT, Transcript.read(CHAT, cut_chat(0))) or b"")
    assert again["messages"] == body["messages"]
    assert "continue_final_message" not in again
    # Every token used: nothing to continue.
    assert continuation_body({**body, "max_tokens": 3}, CHAT, t) is None


def test_a_completions_stream_continues_its_prompt() -> None:
    chunks = [json.dumps({"id": "cmpl-1", "created": 5, "choices": [{"index": 0, "text": w, "finish_reason": None}]})
              .encode() for w in ("a", " b")]
    t = Transcript.read(COMPLETIONS, chunks)
    cont = json.loads(continuation_body({"prompt": "say:", "max_tokens": 5}, COMPLETIONS, t) or b"")
    assert cont == {"prompt": "say:a b", "max_tokens": 3}


def test_what_is_not_continued() -> None:
    tool = [*cut_chat(1), chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{\"a"}}]})]
    assert Transcript.read(CHAT, tool).why_not() == "cut inside a tool call"
    thinking = [chat_chunk({"role": "assistant"}), chat_chunk({"reasoning_content": "hmm"})]
    assert Transcript.read(CHAT, thinking).why_not() == "cut while the model was reasoning"
    # Reasoning, then text: the text is continued.
    assert Transcript.read(CHAT, [*thinking, chat_chunk({"content": "so"})]).why_not() is None
    ended = [*cut_chat(2), chat_chunk({}, "stop")]
    assert Transcript.read(CHAT, ended).why_not() == "the answer had ended"
    two = [json.dumps({"id": "x", "choices": [{"index": 1, "delta": {"content": "b"}}]}).encode()]
    assert Transcript.read(CHAT, two).why_not() == "several choices"
    msgs = {"messages": []}
    assert request_problem(CHAT, msgs) is None
    assert request_problem(CHAT, {**msgs, "n": 2}) == "n > 1"
    assert request_problem(CHAT, {**msgs, "response_format": {"type": "json_schema"}}) == "a structured output"
    assert request_problem(COMPLETIONS, {"prompt": "x", "echo": True}) is not None
    assert request_problem(COMPLETIONS, {"prompt": [1, 2]}) is not None
    assert request_problem("embeddings", {}) is not None


def test_the_continuations_chunks_join_the_callers_stream() -> None:
    splice = Splice(CHAT, "chatcmpl-1", 17, 3, ["a", "b"])
    theirs = [json.dumps({"id": "chatcmpl-9", "created": 99, "choices": [{"index": 0, "delta": d, "finish_reason": f}]})
              .encode() for d, f in (({"role": "assistant", "content": ""}, None), ({"content": " tok3"}, None),
                                     ({}, "stop"))]
    theirs.append(json.dumps({"id": "chatcmpl-9", "created": 99, "choices": [],
                              "usage": {"prompt_tokens": 13, "completion_tokens": 2, "total_tokens": 15}}).encode())
    out = [json.loads(c) for c in splice.chunks(theirs)]
    # No second role chunk; the caller's id and created throughout.
    assert [c["choices"][0]["delta"] if c["choices"] else None for c in out] == [{"content": " tok3"}, {}, None]
    assert {(c["id"], c["created"]) for c in out} == {("chatcmpl-1", 17)}
    assert out[1]["iop"] == {"continued": 1, "providers": ["a", "b"]}
    # The original prompt once (the continuation's held the 3 tokens so far), every token generated.
    assert out[2]["usage"] == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    assert splice.end_usage(Usage(13, 2, 4)) == Usage(10, 5, 4)
