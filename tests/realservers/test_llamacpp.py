"""llama-cpp-python's server (llama.cpp inside) on a tiny random-weight GGUF, directly and
through iop.

Greedy decoding (temperature 0) makes the gibberish the same for the same prompt, so the
answers can be compared field by field, text included. The server sends
``openai-processing-ms``, ends streams with ``data: [DONE]``, ignores ``stream_options``
(no usage chunk) and answers a prompt over its context with an OpenAI-style 400.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.e2e.system import System
from tests.realservers.compare import Answer, assert_same, send, usage_chunks
from tests.realservers.conftest import TINY, TINY_EMBED
from tests.realservers.servers import LLAMA_CHAT, LLAMA_EMBED, RealServer
from tests.realservers.tiny_gguf import N_EMBD

pytestmark = pytest.mark.realservers

CHAT: Any = [{"role": "user", "content": "hello world"}]
GREEDY: dict[str, Any] = {"max_tokens": 8, "temperature": 0, "seed": 7}


def client_of(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


# --- the server alone, with the official SDK ------------------------------------------------


def test_direct_models_and_chat(llamacpp: RealServer) -> None:
    client = client_of(llamacpp.url)
    assert {m.id for m in client.models.list().data} == {LLAMA_CHAT, LLAMA_EMBED}
    answer = client.chat.completions.create(model=LLAMA_CHAT, messages=CHAT, **GREEDY)
    text = answer.choices[0].message.content
    assert text, answer
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None
    assert answer.usage.completion_tokens == GREEDY["max_tokens"]
    chunks = list(client.chat.completions.create(model=LLAMA_CHAT, messages=CHAT, stream=True, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_direct_completions_and_embeddings(llamacpp: RealServer) -> None:
    client = client_of(llamacpp.url)
    done = client.completions.create(model=LLAMA_CHAT, prompt="hello world", **GREEDY)
    assert done.choices[0].text
    assert done.choices[0].finish_reason == "length"
    pieces = list(client.completions.create(model=LLAMA_CHAT, prompt="hello world", stream=True, **GREEDY))
    assert "".join(p.choices[0].text for p in pieces if p.choices) == done.choices[0].text
    embedded = client.embeddings.create(model=LLAMA_EMBED, input=["hello", "world"])
    assert [len(e.embedding) for e in embedded.data] == [N_EMBD, N_EMBD]
    assert embedded.data[0].embedding != embedded.data[1].embedding


# --- the same raw request directly and through iop ------------------------------------------

CASES: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    # id: (path, iop alias, served name, body without model)
    "chat": ("/v1/chat/completions", TINY, LLAMA_CHAT, {"messages": CHAT, **GREEDY}),
    "chat-stream-usage": ("/v1/chat/completions", TINY, LLAMA_CHAT,
                          {"messages": CHAT, "stream": True, "stream_options": {"include_usage": True}, **GREEDY}),
    "completions": ("/v1/completions", TINY, LLAMA_CHAT, {"prompt": "hello world", **GREEDY}),
    "completions-stream": ("/v1/completions", TINY, LLAMA_CHAT, {"prompt": "hello world", "stream": True, **GREEDY}),
    "embeddings": ("/v1/embeddings", TINY_EMBED, LLAMA_EMBED, {"input": ["hello", "world"]}),
    # The server's own 4xx (a prompt longer than its 512-token context) comes back as it was.
    "chat-too-long-400": ("/v1/chat/completions", TINY, LLAMA_CHAT,
                          {"messages": [{"role": "user", "content": "hello " * 1000}], **GREEDY}),
}


def _both(llamacpp: RealServer, iop: System, case: str) -> tuple[Answer, Answer, str]:
    path, alias, served, body = CASES[case]
    direct = send(llamacpp.url, path, {"model": served, **body})
    via = send(iop.api_url, path, {"model": alias, **body})
    return direct, via, alias


@pytest.mark.parametrize("case", list(CASES))
def test_same_answer_through_iop(llamacpp: RealServer, iop_llamacpp: System, case: str) -> None:
    direct, via, alias = _both(llamacpp, iop_llamacpp, case)
    assert direct.status == (400 if "400" in case else 200), f"llama-cpp-python itself: {direct.describe()}"
    assert_same(direct, via, alias)


def test_stream_framing_through_iop(llamacpp: RealServer, iop_llamacpp: System) -> None:
    """Chunks and [DONE] in, the same events and [DONE] out; no usage chunk is made up
    where the server sends none; its ``openai-processing-ms`` header comes back."""
    direct, via, _ = _both(llamacpp, iop_llamacpp, "chat-stream-usage")
    assert direct.done
    assert not usage_chunks(direct)
    assert via.status == 200, via.describe()
    assert via.done
    assert not usage_chunks(via)
    assert len(via.events) == len(direct.events) == GREEDY["max_tokens"] + 3  # role, tokens, finish, [DONE]
    assert "openai-processing-ms" in direct.headers
    assert "openai-processing-ms" in via.headers, dict(via.headers)


def test_openai_sdk_through_iop(llamacpp: RealServer, iop_llamacpp: System) -> None:
    direct, via = client_of(llamacpp.url), client_of(iop_llamacpp.api_url)
    a = direct.chat.completions.create(model=LLAMA_CHAT, messages=CHAT, **GREEDY)
    b = via.chat.completions.create(model=TINY, messages=CHAT, **GREEDY)
    assert b.model == TINY
    assert b.choices[0].message.content == a.choices[0].message.content
    assert b.usage == a.usage
    chunks = list(via.chat.completions.create(model=TINY, messages=CHAT, stream=True, **GREEDY))
    assert {c.model for c in chunks} == {TINY}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == a.choices[0].message.content
    e_direct = direct.embeddings.create(model=LLAMA_EMBED, input="hello")
    e_via = via.embeddings.create(model=TINY_EMBED, input="hello")
    assert e_via.model == TINY_EMBED
    assert e_via.data[0].embedding == pytest.approx(e_direct.data[0].embedding)
