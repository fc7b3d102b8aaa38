"""Token usage read from answers as real providers shape them (vLLM, Ollama, OpenAI,
Anthropic, llama.cpp), JSON and streamed; the usage chunk iop asked for kept from the
caller, and only that one; the request rewrite that asks for it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from dispatcher.config import ProviderConfig, parse
from dispatcher.endpoints import ENDPOINTS
from dispatcher.envelope import RequestEnvelope
from dispatcher.events import Assignment, Done, End, Failed, Meta, Usage
from dispatcher.exceptions import ConfigError
from dispatcher.jsonbody import with_model_asking_usage
from iop.fake_provider import FakeOptions, start
from iop.redis_server import free_port
from tests.workers.adapters.recording import RecordingSink
from workers.adapters.base import ProviderCall
from workers.adapters.openai_http import OpenAIHttpAdapter, new_session
from workers.job_run import provider_call
from workers.sink import RedisSink
from workers.usage import StreamUsage, completion_tokens, json_usage

JSON = "application/json"


def call(endpoint: str = "chat/completions", stream: bool = False, asked: bool = False, method: str = "POST",
         path: str = "") -> ProviderCall:
    return ProviderCall(endpoint, b"{}", "m", stream, method, path, usage_asked=asked)


def obj(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


# --------------------------------------------------------------------------- JSON answers

VLLM_CHAT = obj({
    "id": "chatcmpl-8f1", "object": "chat.completion", "created": 1718000000, "model": "Qwen/Qwen2.5-0.5B",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!", "tool_calls": []},
                 "logprobs": None, "finish_reason": "stop", "stop_reason": None}],
    "usage": {"prompt_tokens": 12, "total_tokens": 20, "completion_tokens": 8, "prompt_tokens_details": None},
    "prompt_logprobs": None,
})
OLLAMA_CHAT = obj({
    "id": "chatcmpl-123", "object": "chat.completion", "created": 1718000000, "model": "llama3.2",
    "system_fingerprint": "fp_ollama",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 26, "completion_tokens": 10, "total_tokens": 36},
})
OPENAI_COMPLETION = obj({
    "id": "cmpl-1", "object": "text_completion", "created": 1, "model": "gpt-3.5-turbo-instruct",
    "choices": [{"text": "Hi", "index": 0, "logprobs": None, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12},
})
OPENAI_EMBEDDINGS = obj({
    "object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.1, -0.2]}],
    "model": "text-embedding-3-small", "usage": {"prompt_tokens": 5, "total_tokens": 5},
})
OPENAI_RESPONSE = obj({
    "id": "resp_1", "object": "response", "created_at": 1, "status": "completed", "model": "gpt-4.1",
    "output": [{"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": "Hi", "annotations": []}]}],
    "usage": {"input_tokens": 36, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 87,
              "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 123},
})
ANTHROPIC_MESSAGE = obj({
    "id": "msg_01", "type": "message", "role": "assistant", "model": "claude-sonnet-4",
    "content": [{"type": "text", "text": "Hi"}], "stop_reason": "end_turn", "stop_sequence": None,
    "usage": {"input_tokens": 2095, "cache_creation_input_tokens": 5, "cache_read_input_tokens": 100,
              "output_tokens": 503},
})
VLLM_RERANK = obj({
    "id": "rerank-1", "model": "BAAI/bge-reranker-base", "usage": {"total_tokens": 28},
    "results": [{"index": 0, "document": {"text": "a"}, "relevance_score": 0.9}],
})
VLLM_SCORE = obj({
    "id": "score-1", "object": "list", "created": 1, "model": "BAAI/bge-reranker-base",
    "data": [{"index": 0, "object": "score", "score": 0.9}],
    "usage": {"prompt_tokens": 10, "total_tokens": 10, "completion_tokens": 0, "prompt_tokens_details": None},
})
OPENAI_TRANSCRIPTION = obj({
    "text": "hello", "usage": {"type": "tokens", "input_tokens": 14,
                               "input_token_details": {"text_tokens": 0, "audio_tokens": 14},
                               "output_tokens": 45, "total_tokens": 59},
})
WHISPER_TRANSCRIPTION = obj({"text": "hello", "usage": {"type": "duration", "seconds": 9}})
OPENAI_IMAGE = obj({
    "created": 1, "data": [{"b64_json": "AAAA"}],
    "usage": {"total_tokens": 100, "input_tokens": 50, "output_tokens": 50,
              "input_tokens_details": {"text_tokens": 10, "image_tokens": 40}},
})


@pytest.mark.parametrize(("endpoint", "body", "expected"), [
    ("chat/completions", VLLM_CHAT, Usage(12, 8)),
    ("chat/completions", OLLAMA_CHAT, Usage(26, 10)),
    ("completions", OPENAI_COMPLETION, Usage(5, 7)),
    ("embeddings", OPENAI_EMBEDDINGS, Usage(5, 0)),
    ("responses", OPENAI_RESPONSE, Usage(36, 87)),
    ("messages", ANTHROPIC_MESSAGE, Usage(2095 + 5 + 100, 503, 100)),
    ("rerank", VLLM_RERANK, Usage(28, 0)),
    ("score", VLLM_SCORE, Usage(10, 0)),
    ("audio/transcriptions", OPENAI_TRANSCRIPTION, Usage(14, 45)),
    ("audio/transcriptions", WHISPER_TRANSCRIPTION, None),
    ("images/generations", OPENAI_IMAGE, Usage(50, 50)),
])
def test_json_answers(endpoint: str, body: bytes, expected: Usage | None) -> None:
    assert json_usage(call(endpoint), 200, JSON, body) == expected


@pytest.mark.parametrize(("why", "the_call", "status", "content_type", "body"), [
    ("an error", call(), 400, JSON, VLLM_CHAT),
    ("not JSON", call(), 200, "text/plain", VLLM_CHAT),
    ("a retrieve of a stored response", call("responses", method="GET", path="responses/resp_1"), 200, JSON,
     OPENAI_RESPONSE),
    ("count_tokens", call("messages/count_tokens"), 200, JSON, obj({"input_tokens": 12})),
    ("tokenize", call("tokenize"), 200, JSON, obj({"count": 3, "tokens": [1, 2, 3], "usage": {"total_tokens": 3}})),
    ("no usage", call(), 200, JSON, obj({"id": "x", "choices": []})),
    ("usage null", call(), 200, JSON, obj({"id": "x", "usage": None})),
    ("usage of another shape", call(), 200, JSON, obj({"usage": "lots"})),
    ("token counts that are not integers", call(), 200, JSON, obj({"usage": {"prompt_tokens": "12"}})),
    ("broken JSON", call(), 200, JSON, b'{"usage": {"prompt_tokens": 1'),
])
def test_what_counts_nothing(why: str, the_call: ProviderCall, status: int, content_type: str, body: bytes) -> None:
    assert json_usage(the_call, status, content_type, body) is None, why


def test_json_content_type_with_parameters_counts() -> None:
    assert json_usage(call(), 200, "application/json; charset=utf-8", VLLM_CHAT) == Usage(12, 8)


# --------------------------------------------------------------------------- streams


def chunk(choices: list[Any], **extra: Any) -> bytes:
    return obj({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                "choices": choices, **extra})


def delta(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}


USAGE = {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20}
# vLLM / Ollama / SGLang: the usage-only chunk after the finish chunk.
VLLM_STREAM = [chunk([delta("Hi")]), chunk([delta("", "stop")]), chunk([], usage=USAGE)]
# OpenAI: ``"usage": null`` in every chunk once include_usage is set.
OPENAI_STREAM = [chunk([delta("Hi")], usage=None), chunk([delta("", "stop")], usage=None),
                 chunk([], usage={**USAGE, "prompt_tokens_details": {"cached_tokens": 0}})]
# llama.cpp: usage (and timings) in the finish chunk itself, asked for or not.
LLAMACPP_STREAM = [chunk([delta("Hi")]), chunk([delta("", "stop")], usage=USAGE, timings={"predicted_n": 8})]
# llama-server (llama.cpp b11434, captured): a chat stream that does not ask has no usage,
# only ``timings`` in its finish chunk; one that asks gets a usage-only chunk, and the
# ``timings`` move there.
LLAMA_SERVER_TIMINGS = {"cache_n": 22, "prompt_n": 1, "prompt_ms": 0.553, "prompt_per_token_ms": 0.553,
                        "prompt_per_second": 1808.3, "predicted_n": 3, "predicted_ms": 0.676,
                        "predicted_per_token_ms": 0.338, "predicted_per_second": 2958.6}
LLAMA_SERVER_USAGE = {"completion_tokens": 3, "prompt_tokens": 23, "total_tokens": 26,
                      "prompt_tokens_details": {"cached_tokens": 22}}
LLAMA_SERVER_STREAM = [chunk([{"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}]),
                       chunk([{"finish_reason": None, "index": 0, "delta": {"content": " M"}}]),
                       chunk([{"finish_reason": "length", "index": 0, "delta": {}}], timings=LLAMA_SERVER_TIMINGS)]
LLAMA_SERVER_STREAM_ASKED = [*LLAMA_SERVER_STREAM[:2], chunk([{"finish_reason": "length", "index": 0, "delta": {}}]),
                             chunk([], usage=LLAMA_SERVER_USAGE, timings=LLAMA_SERVER_TIMINGS)]
# vLLM's continuous_usage_stats: cumulative usage in every chunk.
VLLM_CONTINUOUS = [chunk([delta("Hi")], usage={"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13}),
                   chunk([delta(" there")], usage={"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14}),
                   chunk([], usage={"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14})]


def typed(name: str, data: dict[str, Any]) -> bytes:
    return name.encode() + b"\n" + obj({"type": name, **data})


RESPONSE_USAGE = {"input_tokens": 36, "output_tokens": 87, "total_tokens": 123,
                  "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
RESPONSES_STREAM = [
    typed("response.created", {"sequence_number": 0, "response": {"id": "resp_1", "usage": None,
                                                                  "max_output_tokens": None}}),
    typed("response.output_text.delta", {"sequence_number": 1, "delta": "Hi"}),
    typed("response.completed", {"sequence_number": 2, "response": {"id": "resp_1", "status": "completed",
                                                                    "usage": RESPONSE_USAGE}}),
]
ANTHROPIC_STREAM = [
    typed("message_start", {"message": {"id": "msg_1", "type": "message", "role": "assistant", "content": [],
                                        "model": "claude", "stop_reason": None, "stop_sequence": None,
                                        "usage": {"input_tokens": 25, "cache_read_input_tokens": 5,
                                                  "output_tokens": 1}}}),
    typed("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "usage"}}),
    typed("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None},
                            "usage": {"output_tokens": 15}}),
    typed("message_stop", {}),
]
TRANSCRIPT_STREAM = [
    typed("transcript.text.delta", {"delta": "hello"}),
    typed("transcript.text.done", {"text": "hello", "usage": {"type": "tokens", "input_tokens": 14,
                                                              "output_tokens": 45, "total_tokens": 59}}),
]


def metered(endpoint: str, payloads: list[bytes], asked: bool = False, stream: bool = True) -> tuple[list[bytes],
                                                                                                     Usage | None]:
    meter = StreamUsage(call(endpoint, stream, asked), ENDPOINTS[endpoint])
    out: list[bytes] = []
    for payload in payloads:  # one at a time, as they may arrive
        out += meter.feed([payload])
    return out, meter.usage


@pytest.mark.parametrize(("endpoint", "payloads", "expected"), [
    ("chat/completions", VLLM_STREAM, Usage(12, 8)),
    ("chat/completions", OPENAI_STREAM, Usage(12, 8)),
    ("chat/completions", LLAMACPP_STREAM, Usage(12, 8)),
    ("chat/completions", VLLM_CONTINUOUS, Usage(12, 2)),
    ("chat/completions", LLAMA_SERVER_STREAM, Usage(23, 3, 22)),
    ("chat/completions", LLAMA_SERVER_STREAM_ASKED, Usage(23, 3, 22)),
    ("completions", [chunk([{"index": 0, "text": "Hi", "finish_reason": None}]), chunk([], usage=USAGE)],
     Usage(12, 8)),
    ("responses", RESPONSES_STREAM, Usage(36, 87)),
    ("messages", ANTHROPIC_STREAM, Usage(30, 15, 5)),
    ("audio/transcriptions", TRANSCRIPT_STREAM, Usage(14, 45)),
    ("chat/completions", [chunk([delta("Hi")]), chunk([delta("", "stop")])], None),
])
def test_streams(endpoint: str, payloads: list[bytes], expected: Usage | None) -> None:
    out, usage = metered(endpoint, payloads)
    assert usage == expected
    assert out == payloads  # the caller asked (or nobody did): everything goes on


def test_the_usage_chunk_iop_asked_for_is_kept_from_the_caller() -> None:
    out, usage = metered("chat/completions", VLLM_STREAM, asked=True)
    assert usage == Usage(12, 8)
    assert out == VLLM_STREAM[:2]


def test_llama_servers_usage_chunk_goes_when_iop_asked_it() -> None:
    out, usage = metered("chat/completions", LLAMA_SERVER_STREAM_ASKED, asked=True)
    assert usage == Usage(23, 3, 22)
    assert out == LLAMA_SERVER_STREAM_ASKED[:3]


@pytest.mark.parametrize(("why", "timings", "expected"), [
    ("no prompt count: the completion alone", {"cache_n": 4, "predicted_n": 3}, Usage(0, 3, 4)),
    ("a negative count", {"cache_n": -1, "prompt_n": 5, "predicted_n": 3}, None),
    ("not a count", {"prompt_n": "5", "predicted_n": 3}, None),
    ("not an object", [5, 3], None),
])
def test_odd_timings_count_only_what_they_say(why: str, timings: Any, expected: Usage | None) -> None:
    _, usage = metered("chat/completions", [chunk([delta("", "length")], timings=timings)])
    assert usage == expected, why


def test_usage_wins_over_timings() -> None:
    _, usage = metered("completions", [chunk([], usage=USAGE, timings=LLAMA_SERVER_TIMINGS)])
    assert usage == Usage(12, 8, 22)


def test_openais_null_usage_goes_too_when_iop_asked() -> None:
    out, usage = metered("chat/completions", OPENAI_STREAM, asked=True)
    assert usage == Usage(12, 8)
    assert [json.loads(p) for p in out] == [json.loads(chunk([delta("Hi")])), json.loads(chunk([delta("", "stop")]))]


def test_usage_in_a_chunk_with_choices_stays_even_when_iop_asked() -> None:
    # llama.cpp sends it whether asked or not: the caller would have had it anyway.
    out, usage = metered("chat/completions", LLAMACPP_STREAM, asked=True)
    assert usage == Usage(12, 8)
    assert out == LLAMACPP_STREAM


def test_a_batch_keeps_its_order_around_the_dropped_chunk() -> None:
    meter = StreamUsage(call(stream=True, asked=True), ENDPOINTS["chat/completions"])
    batch = [VLLM_STREAM[0], VLLM_STREAM[2], VLLM_STREAM[1]]
    assert meter.feed(batch) == [VLLM_STREAM[0], VLLM_STREAM[1]]
    assert meter.feed([VLLM_STREAM[2]]) == []


def test_content_that_mentions_usage_is_untouched() -> None:
    payloads = [chunk([delta('the "usage" of it')]), chunk([delta("", "stop")])]
    out, usage = metered("chat/completions", payloads, asked=True)
    assert out == payloads
    assert usage is None


def test_a_chunk_iop_cannot_read_goes_on_as_it_is() -> None:
    odd = [b'{"usage": "lots", "choices": []}', b'{"usage": {"prompt_tokens": 3}, "choices": 7}', b"not json usage"]
    out, usage = metered("chat/completions", odd, asked=True)
    assert out == odd
    assert usage is None


def test_bytes_streams_are_not_read() -> None:
    meter = StreamUsage(call("audio/speech", True), ENDPOINTS["audio/speech"])
    data = b'\x00\x01"usage":{"prompt_tokens":1}'
    assert meter.feed([data]) == [data]
    assert meter.usage is None


def test_completion_tokens_of_the_final_event() -> None:
    meta = Meta("p", "n", "t", 0)
    assert completion_tokens(Done(meta, 200, b"{}", usage=Usage(3, 9))) == 9
    assert completion_tokens(End(None, True, Usage(3, 4))) == 4
    assert completion_tokens(End()) == 0
    assert completion_tokens(Failed(500, "x", "y")) == 0
    assert completion_tokens(None) == 0


# --------------------------------------------------------------------------- asking for it


def asked(body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    out, added = with_model_asking_usage(obj(body), "served")
    return json.loads(out), added


def test_a_stream_without_stream_options_asks_for_usage() -> None:
    body, added = asked({"model": "m", "stream": True, "messages": []})
    assert added
    assert body == {"model": "served", "stream": True, "messages": [], "stream_options": {"include_usage": True}}


def test_null_or_false_include_usage_asks_too() -> None:
    assert asked({"model": "m", "stream_options": None}) == (
        {"model": "served", "stream_options": {"include_usage": True}}, True)
    assert asked({"model": "m", "stream_options": {"include_usage": False, "include_obfuscation": False}}) == (
        {"model": "served", "stream_options": {"include_usage": True, "include_obfuscation": False}}, True)


def test_a_caller_that_asked_is_left_as_it_is() -> None:
    body = {"model": "m", "stream": True, "stream_options": {"include_usage": True}}
    assert asked(body) == ({**body, "model": "served"}, False)


@pytest.mark.parametrize("options", [
    {"include_usage": False, "continuous_usage_stats": True},  # vLLM would then send usage in every chunk
    "yes",  # the provider refuses it as it would without iop
    [True],
])
def test_stream_options_iop_does_not_touch(options: Any) -> None:
    body = {"model": "m", "stream_options": options}
    assert asked(body) == ({**body, "model": "served"}, False)


def test_the_rest_of_the_body_goes_out_byte_for_byte() -> None:
    raw = b'{"model":"m","messages":[{"role":"user","content":"h\\u00e9 1.50"}],"temperature":1.50,"stream":true}'
    out, added = with_model_asking_usage(raw, "s")
    assert added
    assert out == (b'{"model":"s","messages":[{"role":"user","content":"h\\u00e9 1.50"}],"temperature":1.50,'
                   b'"stream":true,"stream_options":{"include_usage":true}}')


def assignment(endpoint: str, stream: bool) -> Assignment:
    return Assignment("1-0", "j", 1, "p", "served", "m", "", "rep", endpoint, stream, 1, 0, 0, b"")


@pytest.mark.parametrize(("endpoint", "stream", "ask", "path", "expected"), [
    ("chat/completions", True, True, "", True),
    ("completions", True, True, "", True),
    ("chat/completions", True, False, "", False),  # the provider's stream_usage is off
    ("chat/completions", False, True, "", False),  # a JSON answer carries usage anyway
    ("responses", True, True, "", False),  # its stream always ends with its usage
    ("messages", True, True, "", False),
])
def test_provider_call_asks_only_streamed_chat_and_completions(
    endpoint: str, stream: bool, ask: bool, path: str, expected: bool
) -> None:
    body = obj({"model": "m", "stream": stream})
    made = provider_call(assignment(endpoint, stream), RequestEnvelope(body), ask)
    sent = json.loads(made.body)
    assert made.usage_asked is expected
    assert sent["model"] == "served"
    assert ("stream_options" in sent) is expected


def test_stream_usage_defaults_by_type() -> None:
    def of(ptype: str, **extra: Any) -> bool:
        return ProviderConfig(id="p", type=ptype, **extra).asks_stream_usage

    assert all(of(t) for t in ("vllm", "sglang", "lemonade", "ollama"))
    assert not of("llamacpp")  # llama-server would move its timings into a chunk the caller does not get
    assert not of("openai_api")  # some hosted APIs refuse stream_options
    assert of("openai_api", stream_usage=True)
    assert not of("cli")
    assert not of("vllm", stream_usage=False)


def test_stream_usage_on_a_cli_provider_is_a_config_problem() -> None:
    cli = {"id": "c", "type": "cli", "command": ["tool"], "models": ["t"], "stream_usage": True}
    with pytest.raises(ConfigError) as info:
        parse({"models": [{"id": "m", "providers": {"c": "t"}}], "nodes": [{"id": "n", "providers": [cli]}]})
    assert [p.path for p in info.value.problems] == ["$.nodes[0].providers[0].stream_usage"]


# --------------------------------------------------------------------------- through the adapter and the sink


@pytest.fixture
async def fake_url() -> AsyncIterator[str]:
    port = free_port()
    runner = await start("127.0.0.1", port, FakeOptions(models=["served"], tokens=3))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def run(url: str, endpoint: str, body: dict[str, Any], stream: bool, ask: bool = True) -> RecordingSink:
    session = new_session(1)
    try:
        made = provider_call(assignment(endpoint, stream), RequestEnvelope(obj(body)), ask)
        sink = RecordingSink()
        await OpenAIHttpAdapter(ProviderConfig(id="p", type="vllm", base_url=url, models=["served"]), session).call(
            made, sink)
        return sink
    finally:
        await session.close()


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.anyio
async def test_the_adapter_reports_a_json_answers_usage(fake_url: str) -> None:
    sink = await run(fake_url, "chat/completions", CHAT, False)
    reported = sink.json()["usage"]
    assert sink.reported_usage == Usage(reported["prompt_tokens"], 3)


@pytest.mark.anyio
async def test_the_adapter_hides_the_usage_chunk_it_asked_for(fake_url: str) -> None:
    sink = await run(fake_url, "chat/completions", {**CHAT, "stream": True}, True)
    assert all(o["choices"] for o in sink.objects)
    assert not any("usage" in o for o in sink.objects)
    assert sink.reported_usage is not None
    assert sink.reported_usage.completion == 3
    assert sink.events[-1] == "ended"


@pytest.mark.anyio
async def test_the_adapter_passes_the_usage_chunk_the_caller_asked_for(fake_url: str) -> None:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    sink = await run(fake_url, "chat/completions", body, True)
    last = sink.objects[-1]
    assert last["choices"] == []
    assert last["usage"]["completion_tokens"] == 3
    assert sink.reported_usage == Usage(last["usage"]["prompt_tokens"], 3)


@pytest.mark.anyio
async def test_without_stream_usage_a_stream_reports_none(fake_url: str) -> None:
    sink = await run(fake_url, "chat/completions", {**CHAT, "stream": True}, True, ask=False)
    assert sink.reported_usage is None
    assert not any("usage" in o for o in sink.objects)


@pytest.mark.anyio
async def test_the_adapter_reads_typed_streams(fake_url: str) -> None:
    sink = await run(fake_url, "messages", {**CHAT, "max_tokens": 10, "stream": True}, True)
    assert sink.reported_usage == Usage(1, 3)
    sink = await run(fake_url, "responses", {"model": "m", "input": "hi", "stream": True}, True)
    completed = json.loads(sink.payloads[-1].partition(b"\n")[2])
    assert sink.reported_usage == Usage(completed["response"]["usage"]["input_tokens"], 3)


def test_the_sink_puts_the_usage_in_the_final_event() -> None:
    job = assignment("chat/completions", True)
    sink = RedisSink(None, job, "n1")  # type: ignore[arg-type]  # final_event writes nothing
    assert sink.final_event() == End(Meta("p", "n1", "served", 0), True)
    sink.usage(Usage(4, 5))
    end = sink.final_event()
    assert isinstance(end, End)
    assert end.usage == Usage(4, 5)


@pytest.mark.anyio
async def test_the_sink_puts_the_usage_in_a_done_event() -> None:
    sink = RedisSink(None, assignment("chat/completions", False), "n1")  # type: ignore[arg-type]
    sink.usage(Usage(4, 5))
    await sink.done(200, b"{}", JSON)
    done = sink.final_event()
    assert isinstance(done, Done)
    assert done.usage == Usage(4, 5)


def test_old_events_still_decode_and_new_ones_still_decode_for_old_readers() -> None:
    class OldEnd(msgspec.Struct, tag="end", array_like=True):
        meta: Meta | None = None
        done: bool = True

    old = msgspec.msgpack.encode(OldEnd(None, False))
    assert msgspec.msgpack.decode(old, type=End) == End(None, False)
    new = msgspec.msgpack.encode(End(None, False, Usage(1, 2)))
    assert msgspec.msgpack.decode(new, type=OldEnd) == OldEnd(None, False)


# --------------------------------------------------------------------------- cached prompt tokens

LLAMACPP_TIMINGS = {"cache_n": 236, "prompt_n": 1, "prompt_ms": 30.9, "prompt_per_token_ms": 30.9,
                    "prompt_per_second": 32.3, "predicted_n": 35, "predicted_ms": 661.1,
                    "predicted_per_token_ms": 18.9, "predicted_per_second": 52.9}


def cached_in_stream(payload: Any) -> int | None:
    """The cached prompt tokens a stream reader notes from ``payload`` as one event of a chat
    stream (its usage, a Responses event's ``response``, a Messages event's ``message``, or
    llama.cpp's ``timings``: every place the worker reads them); None when it notes no usage."""
    reader = StreamUsage(call("chat/completions", stream=True), ENDPOINTS["chat/completions"])
    reader.feed([json.dumps(payload).encode()])
    return None if reader.usage is None else reader.usage.cached


@pytest.mark.parametrize(("why", "payload", "expected"), [
    ("OpenAI / vLLM / SGLang chat", {**json.loads(VLLM_CHAT), "usage": {
        "prompt_tokens": 2006, "completion_tokens": 300, "total_tokens": 2306,
        "prompt_tokens_details": {"cached_tokens": 1920, "audio_tokens": 0}}}, 1920),
    ("a stream's usage chunk", json.loads(chunk([], usage={**USAGE, "prompt_tokens_details": {"cached_tokens": 0}})),
     0),
    ("the Responses API", json.loads(OPENAI_RESPONSE), 0),
    ("a Responses stream's response.completed", {"type": "response.completed", "response": {
        "id": "resp_1", "usage": {**RESPONSE_USAGE, "input_tokens_details": {"cached_tokens": 30}}}}, 30),
    ("Anthropic", json.loads(ANTHROPIC_MESSAGE), 100),
    ("Anthropic's message_start", json.loads(ANTHROPIC_STREAM[0].partition(b"\n")[2]), 5),
    ("Anthropic's message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                                   "usage": {"output_tokens": 15, "cache_read_input_tokens": 7}}, 7),
    ("DeepSeek", {"usage": {"prompt_tokens": 50, "completion_tokens": 2, "prompt_cache_hit_tokens": 48,
                            "prompt_cache_miss_tokens": 2}}, 48),
    ("llama.cpp's OpenAI chat, usage and timings", {
        "object": "chat.completion", "choices": [],
        "usage": {"completion_tokens": 35, "prompt_tokens": 237, "total_tokens": 272,
                  "prompt_tokens_details": {"cached_tokens": 236}},
        "timings": LLAMACPP_TIMINGS}, 236),
    ("an older llama.cpp: timings alone", {"choices": [], "usage": {"prompt_tokens": 237, "completion_tokens": 35},
                                           "timings": LLAMACPP_TIMINGS}, 236),
    ("llama.cpp's /completion", {"content": "Hi", "tokens_predicted": 35, "tokens_evaluated": 237,
                                 "tokens_cached": 271, "timings": LLAMACPP_TIMINGS}, 236),
])
def test_cached_tokens_as_providers_report_them(why: str, payload: dict[str, Any], expected: int) -> None:
    assert cached_in_stream(payload) == expected, why


@pytest.mark.parametrize(("why", "payload"), [
    ("vLLM without --enable-prompt-tokens-details", json.loads(VLLM_CHAT)),
    ("Ollama", json.loads(OLLAMA_CHAT)),
    ("a chunk without usage", json.loads(chunk([delta("Hi")], usage=None))),
    ("response.created", json.loads(RESPONSES_STREAM[0].partition(b"\n")[2])),
    # tokens_cached is every token the slot holds after the answer, generated ones included.
    ("llama.cpp's tokens_cached alone", {"content": "Hi", "tokens_evaluated": 6, "tokens_predicted": 20,
                                         "tokens_cached": 25, "timings": {"prompt_n": 6, "predicted_n": 20}}),
    ("details null", {"usage": {"prompt_tokens": 3, "prompt_tokens_details": None}}),
    ("not a count", {"usage": {"prompt_tokens_details": {"cached_tokens": "12"}}}),
    ("a bool", {"usage": {"cache_read_input_tokens": True}}),
    ("negative", {"usage": {"prompt_tokens_details": {"cached_tokens": -1}}, "timings": {"cache_n": -1}}),
    ("a float", {"timings": {"cache_n": 3.5}}),
    ("usage of another shape", {"usage": [1, 2], "response": "r", "message": None, "timings": [0]}),
    ("nothing", {}),
])
def test_cached_tokens_not_reported(why: str, payload: dict[str, Any]) -> None:
    # No usage noted at all, or a usage that counts no cached token: never one invented.
    assert cached_in_stream(payload) in (None, 0), why


def test_a_bad_count_in_one_place_does_not_hide_a_good_one_in_another() -> None:
    payload = {"usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": None},
                         "cache_read_input_tokens": 4}, "timings": {"cache_n": 9}}
    assert cached_in_stream(payload) == 4
    payload = {"usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": None}},
               "timings": {"cache_n": 9}}
    assert cached_in_stream(payload) == 9


@pytest.mark.parametrize(("body", "cached"), [
    (b'{"usage":{"prompt_tokens":100,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":64}}}', 64),
    (b'{"usage":{"prompt_tokens":100,"completion_tokens":5,"prompt_tokens_details":null}}', 0),
    (b'{"usage":{"prompt_tokens":100,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":"x"}}}', 0),
    (b'{"usage":{"prompt_tokens":100,"completion_tokens":5},"timings":{"cache_n":80,"prompt_n":20}}', 80),
    (b'{"usage":{"prompt_tokens":100,"completion_tokens":5,"prompt_cache_hit_tokens":30}}', 30),
])
def test_the_cached_prompt_tokens_travel_with_the_usage(body: bytes, cached: int) -> None:
    # An odd details object loses the cached count, never the prompt and completion counts.
    assert json_usage(call("chat/completions"), 200, "application/json", body) == Usage(100, 5, cached)


def test_a_stream_reports_the_cached_tokens_of_its_usage_chunk() -> None:
    reader = StreamUsage(call("chat/completions", stream=True), ENDPOINTS["chat/completions"])
    reader.feed([b'{"choices":[{"delta":{"content":"a"}}]}',
                 b'{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":1,'
                 b'"prompt_tokens_details":{"cached_tokens":8}},"timings":{"cache_n":8}}'])
    assert reader.usage == Usage(9, 1, 8)
