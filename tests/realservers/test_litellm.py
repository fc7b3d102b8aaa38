"""LiteLLM's proxy (1.77.7, every model mocked) directly and through iop.

The clients are the official ``openai`` SDK (chat, Responses) and ``anthropic`` SDK
(Messages); the comparisons send the same raw request both ways and compare status,
body, SSE framing and relayed headers (tests/realservers/compare.py).
"""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest

from tests.e2e.system import System
from tests.realservers.compare import Answer, assert_same, send, usage_chunks
from tests.realservers.conftest import CLAUDE, EMBED, GPT, IOP_KEY, LOOP
from tests.realservers.servers import (
    LITELLM_CLAUDE,
    LITELLM_EMBED,
    LITELLM_GPT,
    LITELLM_LOOP,
    MOCK_CLAUDE_TEXT,
    MOCK_TEXT,
    RealServer,
)

pytestmark = pytest.mark.realservers

ANTHROPIC_HEADERS = {"anthropic-version": "2023-06-01"}
CHAT: Any = [{"role": "user", "content": "say hello"}]


def openai_client(base: str, key: str = "sk-direct") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)


def anthropic_client(base: str, key: str = "sk-direct") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key=key, max_retries=0, timeout=60)


# --- the server alone, with the official SDKs -----------------------------------------------


def test_direct_chat(litellm: RealServer) -> None:
    client = openai_client(litellm.url)
    answer = client.chat.completions.create(model=LITELLM_GPT, messages=CHAT)
    assert answer.choices[0].message.content == MOCK_TEXT
    stream = client.chat.completions.create(model=LITELLM_GPT, messages=CHAT, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == MOCK_TEXT
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens > 0


def test_direct_responses(litellm: RealServer) -> None:
    client = openai_client(litellm.url)
    answer = client.responses.create(model=LITELLM_GPT, input="say hello")
    assert answer.output_text == MOCK_TEXT
    events = list(client.responses.create(model=LITELLM_LOOP, input="say hello", stream=True))
    types = [e.type for e in events]
    assert types[-1] == "response.completed", types
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == MOCK_TEXT


def test_direct_messages(litellm: RealServer) -> None:
    client = anthropic_client(litellm.url)
    message = client.messages.create(model=LITELLM_CLAUDE, max_tokens=64, messages=CHAT)
    assert message.content[0].type == "text"
    assert message.content[0].text == MOCK_CLAUDE_TEXT
    with client.messages.stream(model=LITELLM_LOOP, max_tokens=64, messages=CHAT) as stream:
        assert stream.get_final_text() == MOCK_TEXT
    counted = client.messages.count_tokens(model=LITELLM_CLAUDE, messages=CHAT)
    assert counted.input_tokens > 0


# --- the same raw request directly and through iop ------------------------------------------

CASES: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    # id: (path, iop alias, served name, body without model)
    "chat": ("/v1/chat/completions", GPT, LITELLM_GPT, {"messages": CHAT}),
    "chat-stream-usage": ("/v1/chat/completions", GPT, LITELLM_GPT,
                          {"messages": CHAT, "stream": True, "stream_options": {"include_usage": True}}),
    "embeddings": ("/v1/embeddings", EMBED, LITELLM_EMBED, {"input": "hello"}),
    "responses": ("/v1/responses", GPT, LITELLM_GPT, {"input": "say hello"}),
    "responses-stream": ("/v1/responses", LOOP, LITELLM_LOOP, {"input": "say hello", "stream": True}),
    "messages": ("/v1/messages", CLAUDE, LITELLM_CLAUDE, {"messages": CHAT, "max_tokens": 64}),
    "messages-stream": ("/v1/messages", LOOP, LITELLM_LOOP, {"messages": CHAT, "max_tokens": 64, "stream": True}),
    "messages-count-tokens": ("/v1/messages/count_tokens", CLAUDE, LITELLM_CLAUDE, {"messages": CHAT}),
}


def _both(litellm: RealServer, iop: System, case: str) -> tuple[Answer, Answer, str]:
    path, alias, served, body = CASES[case]
    anthropic_style = path.startswith("/v1/messages")
    headers = ANTHROPIC_HEADERS if anthropic_style else {}
    direct = send(litellm.url, path, {"model": served, **body},
                  {**headers, "x-api-key": "sk-direct"} if anthropic_style else {"authorization": "Bearer sk-direct"})
    via = send(iop.api_url, path, {"model": alias, **body},
               {**headers, "x-api-key": IOP_KEY} if anthropic_style else {"authorization": f"Bearer {IOP_KEY}"})
    assert direct.status == 200, f"LiteLLM itself: {direct.describe()}"
    return direct, via, alias


@pytest.mark.parametrize("case", list(CASES))
def test_same_answer_through_iop(litellm: RealServer, iop_litellm: System, case: str) -> None:
    direct, via, alias = _both(litellm, iop_litellm, case)
    assert_same(direct, via, alias)


def test_usage_chunk_and_ratelimit_headers_through_iop(litellm: RealServer, iop_litellm: System) -> None:
    """The checks above are not vacuous here: LiteLLM sends a usage chunk and x-ratelimit-*."""
    direct, via, _ = _both(litellm, iop_litellm, "chat-stream-usage")
    assert via.status == 200, via.describe()
    assert len(usage_chunks(direct)) == 1
    assert [c["usage"] for c in usage_chunks(via)] == [c["usage"] for c in usage_chunks(direct)]
    direct, via, _ = _both(litellm, iop_litellm, "chat")
    assert "x-ratelimit-limit-requests" in direct.headers
    assert via.headers.get("x-ratelimit-limit-requests") == direct.headers["x-ratelimit-limit-requests"], (
        dict(via.headers))


def test_sse_framing_of_typed_streams(litellm: RealServer, iop_litellm: System) -> None:
    """LiteLLM's Messages stream has ``event:`` lines and no [DONE]; its Responses stream
    has no ``event:`` lines and ends with [DONE]: both come through iop as they were sent."""
    direct, via, _ = _both(litellm, iop_litellm, "messages-stream")
    assert direct.names[0] == "message_start"
    assert direct.names[-1] == "message_stop"
    assert not direct.done
    assert via.names == direct.names, via.describe()
    assert via.done is False, via.describe()
    direct, via, _ = _both(litellm, iop_litellm, "responses-stream")
    assert set(direct.names) == {None}
    assert direct.done
    assert via.names == direct.names, via.describe()
    assert via.done is True, via.describe()


# --- the official SDKs through iop get what they get directly ------------------------------


def test_openai_sdk_through_iop(litellm: RealServer, iop_litellm: System) -> None:
    direct, via = openai_client(litellm.url), openai_client(iop_litellm.api_url, IOP_KEY)
    a = direct.chat.completions.create(model=LITELLM_GPT, messages=CHAT)
    b = via.chat.completions.create(model=GPT, messages=CHAT)
    assert b.model == GPT
    assert b.choices[0].message.content == a.choices[0].message.content == MOCK_TEXT
    chunks = list(via.chat.completions.create(model=GPT, messages=CHAT, stream=True,
                                              stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == MOCK_TEXT
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens > 0
    embedded = via.embeddings.create(model=EMBED, input="hello")
    assert embedded.model == EMBED
    assert embedded.data[0].embedding == [0.25, -0.5, 0.125, 1.0]


def test_openai_sdk_responses_through_iop(litellm: RealServer, iop_litellm: System) -> None:
    direct, via = openai_client(litellm.url), openai_client(iop_litellm.api_url, IOP_KEY)
    a = direct.responses.create(model=LITELLM_GPT, input="say hello")
    b = via.responses.create(model=GPT, input="say hello")
    assert b.output_text == a.output_text == MOCK_TEXT
    assert b.model == GPT
    assert b.usage == a.usage
    a_events = list(direct.responses.create(model=LITELLM_LOOP, input="say hello", stream=True))
    b_events = list(via.responses.create(model=LOOP, input="say hello", stream=True))
    assert [e.type for e in b_events] == [e.type for e in a_events]
    assert "".join(e.delta for e in b_events if e.type == "response.output_text.delta") == MOCK_TEXT
    final = b_events[-1]
    assert final.type == "response.completed"
    assert final.response.model == LOOP


def test_anthropic_sdk_through_iop(litellm: RealServer, iop_litellm: System) -> None:
    direct, via = anthropic_client(litellm.url), anthropic_client(iop_litellm.api_url, IOP_KEY)
    a = direct.messages.create(model=LITELLM_CLAUDE, max_tokens=64, messages=CHAT)
    b = via.messages.create(model=CLAUDE, max_tokens=64, messages=CHAT)
    assert b.model == CLAUDE
    assert b.content == a.content
    assert b.usage == a.usage
    assert b.stop_reason == a.stop_reason
    with direct.messages.stream(model=LITELLM_LOOP, max_tokens=64, messages=CHAT) as stream:
        a_events = [e.type for e in stream]
        a_final = stream.get_final_message()
    with via.messages.stream(model=LOOP, max_tokens=64, messages=CHAT) as stream:
        b_events = [e.type for e in stream]
        b_final = stream.get_final_message()
    assert b_events == a_events
    assert b_final.content == a_final.content
    assert b_final.model == LOOP
    assert b_final.usage == a_final.usage
    a_count = direct.messages.count_tokens(model=LITELLM_CLAUDE, messages=CHAT)
    b_count = via.messages.count_tokens(model=CLAUDE, messages=CHAT)
    assert b_count.input_tokens == a_count.input_tokens


def test_anthropic_sdk_wrong_key_through_iop(iop_litellm: System) -> None:
    with pytest.raises(anthropic.AuthenticationError):
        anthropic_client(iop_litellm.api_url, "not-the-key").messages.create(
            model=CLAUDE, max_tokens=64, messages=CHAT)
