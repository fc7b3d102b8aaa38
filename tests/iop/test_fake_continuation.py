"""The fake provider's side of continued streams (issue 49): a chat request ending in an assistant
message, or a completions prompt ending in the answer's first words, goes on where that text
stopped; ``max_tokens`` caps the words; ``cut_after`` cuts a stream's connection mid-stream."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest

from iop.fake_provider import FakeOptions
from iop.fake_provider._common import _given
from tests.iop.fake_client import Fake, post, running, sse_events

pytestmark = pytest.mark.anyio

HOST = "127.0.0.1"
N = 8
WHOLE = " ".join(f"tok{i}" for i in range(N))


@pytest.fixture
async def fake() -> AsyncIterator[Fake]:
    async with running(FakeOptions(tokens=N)) as fake:
        yield fake


def so_far(k: int) -> str:
    """The text of a stream's first ``k`` content chunks."""
    return "".join(f"tok{i} " for i in range(k))


def continued_chat(body: dict[str, Any], text: str, used: int) -> dict[str, Any]:
    """The continuation iop makes of ``body`` (api/continuation.py): the text so far as a trailing
    assistant message, the continuation flags, max_tokens less what was used."""
    out = dict(body)
    out["messages"] = [*body["messages"], {"role": "assistant", "content": text}]
    out["continue_final_message"] = True
    out["add_generation_prompt"] = False
    for name in ("max_tokens", "max_completion_tokens"):
        if name in out:
            out[name] -= used
    return out


async def post_raw(fake: Fake, path: str, body: dict[str, Any]) -> Any:
    """POST ``body`` as compact JSON (as iop's worker sends it); the decoded answer."""
    headers = {"Content-Type": "application/json"}
    async with fake.session.post(path, data=msgspec.json.encode(body), headers=headers) as resp:
        assert resp.status == 200
        return await resp.json()


async def stream_chunks(fake: Fake, path: str, body: dict[str, Any]) -> list[Any]:
    async with fake.session.post(path, json={**body, "stream": True}) as resp:
        assert resp.status == 200
        events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


CHAT = {"model": "m", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}


# --------------------------------------------------------------------------- chat


@pytest.mark.parametrize("k", [1, 3, N - 1])
async def test_chat_continues_a_trailing_assistant_message(fake: Fake, k: int) -> None:
    whole = await post_raw(fake, "/v1/chat/completions", CHAT)
    assert whole["choices"][0]["message"]["content"] == WHOLE
    answer = await post_raw(fake, "/v1/chat/completions", continued_chat(CHAT, so_far(k), k))
    rest = answer["choices"][0]["message"]["content"]
    assert so_far(k) + rest == WHOLE
    assert answer["choices"][0]["finish_reason"] == "stop"
    usage = answer["usage"]
    assert usage["completion_tokens"] == N - k
    # The original prompt plus the k words given: less them, the uninterrupted answer's prompt.
    assert usage["prompt_tokens"] - k == whole["usage"]["prompt_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + N - k


async def test_chat_continuation_streams_the_rest(fake: Fake) -> None:
    body = {**continued_chat(CHAT, so_far(3), 3), "stream_options": {"include_usage": True}}
    chunks = await stream_chunks(fake, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    contents = [c["choices"][0]["delta"]["content"] for c in chunks[1:-2]]
    assert contents == ["tok3 ", "tok4 ", "tok5 ", "tok6 ", "tok7"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] == N - 3


async def test_text_ending_in_a_word_is_continued_after_a_space(fake: Fake) -> None:
    answer = await post_raw(fake, "/v1/chat/completions", continued_chat(CHAT, "tok0 tok1 tok2", 3))
    assert answer["choices"][0]["message"]["content"] == " tok3 tok4 tok5 tok6 tok7"
    chunks = await stream_chunks(fake, "/v1/chat/completions", continued_chat(CHAT, "tok0 tok1 tok2", 3))
    contents = [c["choices"][0]["delta"]["content"] for c in chunks[1:-1]]
    assert contents == [" tok3 ", "tok4 ", "tok5 ", "tok6 ", "tok7"]
    assert "tok0 tok1 tok2" + "".join(contents) == WHOLE


async def test_content_parts_are_read_too(fake: Fake) -> None:
    body = dict(CHAT)
    body["messages"] = [*CHAT["messages"], {"role": "assistant", "content": [
        {"type": "text", "text": "tok0 tok1 "}, {"type": "text", "text": "tok2 "}]}]
    answer = await post_raw(fake, "/v1/chat/completions", body)
    assert answer["choices"][0]["message"]["content"] == "tok3 tok4 tok5 tok6 tok7"


@pytest.mark.parametrize("text", ["Sure, ", "tok1 tok2 ", "tok0 tok2 ", "tok0  tok1 ", "tok007 ", "", "tok99 "])
async def test_an_assistant_message_not_from_the_answer_gets_the_whole_answer(fake: Fake, text: str) -> None:
    body = dict(CHAT)
    body["messages"] = [*CHAT["messages"], {"role": "assistant", "content": text}]
    answer = await post_raw(fake, "/v1/chat/completions", body)
    assert answer["choices"][0]["message"]["content"] == WHOLE
    assert answer["usage"]["completion_tokens"] == N


async def test_a_whole_answer_given_back_ends_at_once(fake: Fake) -> None:
    answer = await post_raw(fake, "/v1/chat/completions", continued_chat(CHAT, WHOLE, N))
    assert answer["choices"][0]["message"]["content"] == ""
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == 0
    chunks = await stream_chunks(fake, "/v1/chat/completions", continued_chat(CHAT, WHOLE, N))
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "stop"]


async def test_another_word_stem_continues_its_own_words(fake: Fake) -> None:
    fake.options.word = "w"
    answer = await post_raw(fake, "/v1/chat/completions", continued_chat(CHAT, "w0 w1 ", 2))
    assert answer["choices"][0]["message"]["content"] == "w2 w3 w4 w5 w6 w7"
    answer = await post_raw(fake, "/v1/chat/completions", continued_chat(CHAT, "tok0 tok1 ", 2))
    assert answer["choices"][0]["message"]["content"] == " ".join(f"w{i}" for i in range(N))


# --------------------------------------------------------------------------- max_tokens


@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens"])
async def test_max_tokens_caps_the_words(fake: Fake, name: str) -> None:
    capped = await post_raw(fake, "/v1/chat/completions", {**CHAT, name: 5})
    assert capped["choices"][0]["message"]["content"] == "tok0 tok1 tok2 tok3 tok4"
    assert capped["choices"][0]["finish_reason"] == "length"
    assert capped["usage"]["completion_tokens"] == 5
    # Continued after 2 words with max_tokens less those: the same capped answer.
    rest = await post_raw(fake, "/v1/chat/completions", continued_chat({**CHAT, name: 5}, so_far(2), 2))
    assert so_far(2) + rest["choices"][0]["message"]["content"] == "tok0 tok1 tok2 tok3 tok4"
    assert rest["choices"][0]["finish_reason"] == "length"
    assert rest["usage"]["completion_tokens"] == 3
    assert rest["usage"]["prompt_tokens"] - 2 == capped["usage"]["prompt_tokens"]
    chunks = await stream_chunks(fake, "/v1/chat/completions", {**CHAT, name: 2})
    assert [c["choices"][0]["delta"].get("content") for c in chunks] == ["", "tok0 ", "tok1", None]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("limits", [{"max_tokens": N}, {"max_tokens": 100}, {"max_tokens": 0}, {"max_tokens": -1},
                                    {"max_tokens": True}, {"max_tokens": "3"}, {"max_tokens": None}])
async def test_max_tokens_at_or_over_the_answer_or_not_a_count_changes_nothing(
    fake: Fake, limits: dict[str, Any]
) -> None:
    answer = await post_raw(fake, "/v1/chat/completions", {**CHAT, **limits})
    assert answer["choices"][0]["message"]["content"] == WHOLE
    assert answer["choices"][0]["finish_reason"] == "stop"


async def test_the_smaller_of_both_limits_counts(fake: Fake) -> None:
    answer = await post_raw(fake, "/v1/chat/completions", {**CHAT, "max_tokens": 6, "max_completion_tokens": 3})
    assert answer["choices"][0]["message"]["content"] == "tok0 tok1 tok2"


# --------------------------------------------------------------------------- completions


@pytest.mark.parametrize("prompt", ["Say", "Say ", "Say\n", "Q: what?\nA: "])
@pytest.mark.parametrize("k", [1, 4])
async def test_completions_continue_the_prompts_last_words(fake: Fake, prompt: str, k: int) -> None:
    body = {"model": "m", "prompt": prompt, "max_tokens": 50}
    whole = await post_raw(fake, "/v1/completions", body)
    assert whole["choices"][0]["text"] == WHOLE
    continued = {**body, "prompt": prompt + so_far(k), "max_tokens": 50 - k}
    answer = await post_raw(fake, "/v1/completions", continued)
    assert so_far(k) + answer["choices"][0]["text"] == WHOLE
    assert answer["usage"]["completion_tokens"] == N - k
    assert answer["usage"]["prompt_tokens"] - k == whole["usage"]["prompt_tokens"]
    async with fake.session.post("/v1/completions", json={**continued, "stream": True}) as resp:
        events = sse_events(await resp.text())
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-1]]
    assert so_far(k) + "".join(texts) == WHOLE
    assert len(texts) == N - k + 1  # and the finish chunk


@pytest.mark.parametrize("prompt", ["tok1 tok2 ", "count: tok3", "tok", "0", "tok-1 ", ""])
async def test_completions_of_other_prompts_get_the_whole_answer(fake: Fake, prompt: str) -> None:
    answer = await post_raw(fake, "/v1/completions", {"model": "m", "prompt": prompt})
    assert answer["choices"][0]["text"] == WHOLE


async def test_completions_max_tokens(fake: Fake) -> None:
    answer = await post_raw(fake, "/v1/completions", {"model": "m", "prompt": "Say tok0 ", "max_tokens": 2})
    assert answer["choices"][0]["text"] == "tok1 tok2"
    assert answer["choices"][0]["finish_reason"] == "length"


def test_given_reads_the_trailing_run() -> None:
    assert _given("tok0 tok1 tok2 ", "tok", 16) == (3, 0)
    assert _given("Saytok0 tok1", "tok", 16) == (2, 3)
    assert _given("Q\ntok0 tok1 \n", "tok", 16) == (2, 2)
    assert _given("tok0 tok1", "tok", 1) == (0, 9)  # more than the answer has
    assert _given("tok123456789012 ", "tok", 16) == (0, 16)
    assert _given("1", "tok", 16) == (0, 1)
    assert _given("", "tok", 16) == (0, 0)


# --------------------------------------------------------------------------- cut_after


async def read_cut(fake: Fake, path: str, body: dict[str, Any]) -> tuple[list[str], BaseException | None]:
    """The data payloads of a stream read until it ends or breaks, and how it broke."""
    payloads: list[str] = []
    error: BaseException | None = None
    try:
        async with fake.session.post(path, json={**body, "stream": True}) as resp:
            assert resp.status == 200
            async for line in resp.content:
                if line.startswith(b"data: "):
                    payloads.append(line.decode().strip()[len("data: "):])
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
        error = exc
    return payloads, error


@pytest.mark.parametrize("interval_ms", [0, 20])
async def test_cut_after_closes_a_chat_stream_mid_way(fake: Fake, interval_ms: int) -> None:
    status, options = await post(fake, "/_fake/control", {"cut_after": 3, "token_interval_ms": interval_ms})
    assert status == 200
    assert options["cut_after"] == 3
    payloads, error = await read_cut(fake, "/v1/chat/completions", CHAT)
    assert error is not None, payloads
    assert "[DONE]" not in payloads
    chunks = [json.loads(p) for p in payloads]
    assert [c["choices"][0]["delta"]["content"] for c in chunks] == ["", "tok0 ", "tok1 ", "tok2 "]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    stats = await fake.wait_stats(in_flight=0)
    assert (stats["total"], stats["completed"], stats["disconnected"]) == (1, 1, 0)
    # The server goes on serving, on a new connection.
    status, answer = await post(fake, "/v1/chat/completions", CHAT)
    assert status == 200
    assert answer["choices"][0]["message"]["content"] == WHOLE  # JSON answers are never cut


async def test_cut_after_closes_a_completions_stream(fake: Fake) -> None:
    fake.options.cut_after = 2
    payloads, error = await read_cut(fake, "/v1/completions", {"model": "m", "prompt": "Say"})
    assert error is not None
    assert [json.loads(p)["choices"][0]["text"] for p in payloads] == ["tok0 ", "tok1 "]


async def test_cut_after_every_word_before_the_finish_and_zero(fake: Fake) -> None:
    fake.options.cut_after = N
    payloads, error = await read_cut(fake, "/v1/chat/completions", CHAT)
    assert error is not None
    contents = [json.loads(p)["choices"][0]["delta"]["content"] for p in payloads]
    assert "".join(contents) == WHOLE
    assert all(json.loads(p)["choices"][0]["finish_reason"] is None for p in payloads)
    fake.options.cut_after = 0
    payloads, error = await read_cut(fake, "/v1/chat/completions", CHAT)
    assert error is not None
    assert [json.loads(p)["choices"][0]["delta"] for p in payloads] == [{"role": "assistant", "content": ""}]


async def test_cut_after_beyond_the_answer_cuts_nothing(fake: Fake) -> None:
    fake.options.cut_after = N + 1
    payloads, error = await read_cut(fake, "/v1/chat/completions", CHAT)
    assert error is None
    assert payloads[-1] == "[DONE]"


async def test_cut_after_counts_a_continuations_own_chunks(fake: Fake) -> None:
    fake.options.cut_after = 2
    payloads, error = await read_cut(fake, "/v1/chat/completions", continued_chat(CHAT, so_far(3), 3))
    assert error is not None
    assert [json.loads(p)["choices"][0]["delta"]["content"] for p in payloads] == ["", "tok3 ", "tok4 "]


async def test_cut_after_as_a_body_override_cuts_that_request_alone(fake: Fake) -> None:
    await post(fake, "/_fake/hooks", {"body_overrides": True, "track_executions": True})
    payloads, error = await read_cut(fake, "/v1/chat/completions", {**CHAT, "fake": {"cut_after": 1}})
    assert error is not None
    assert len(payloads) == 2
    assert fake.options.cut_after is None
    payloads, error = await read_cut(fake, "/v1/chat/completions", CHAT)
    assert error is None
    assert payloads[-1] == "[DONE]"
    async with fake.session.get("/_fake/executions") as resp:
        outcomes = [e["outcome"] for e in await resp.json()]
    assert outcomes == ["cut", "completed"]
    status, body = await post(fake, "/v1/chat/completions", {**CHAT, "fake": {"cut_after": -1}})
    assert status == 400
    assert "cut_after" in body["error"]["message"]


async def test_control_refuses_a_negative_cut_and_clears_it_with_null(fake: Fake) -> None:
    status, _ = await post(fake, "/_fake/control", {"cut_after": -1})
    assert status == 400
    status, options = await post(fake, "/_fake/control", {"cut_after": 4})
    assert options["cut_after"] == 4
    status, options = await post(fake, "/_fake/control", {"cut_after": None})
    assert status == 200
    assert options["cut_after"] is None
