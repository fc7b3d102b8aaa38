"""CliAdapter against real child processes (``python -c`` scripts), no mocks of asyncio."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import stat
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import pytest

from dispatcher.config import ProviderConfig
from dispatcher.exceptions import ProviderRejected, ProviderTimeout, ProviderUnreachable
from tests.workers.adapters.recording import RecordingSink
from workers.adapters import cli
from workers.adapters.base import ProbeResult, ProviderCall
from workers.adapters.cli import CliAdapter

pytestmark = pytest.mark.anyio

PY = sys.executable


def script(source: str, *args: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(source), *args]


ECHO = script("import sys; sys.stdout.write(sys.stdin.read())")
UPPER = script("import sys; sys.stdout.write(sys.stdin.read().upper())")

# Writes its pid (atomically, so a reader never sees half a number) to argv[1], then
# hangs: the tests use it to check that the adapter kills and reaps.
SLEEP_FOREVER = script(
    """
    import os, sys, time
    tmp = sys.argv[1] + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, sys.argv[1])
    time.sleep(1000)
    """
)


def provider(command: list[str], timeout_s: float = 30.0, **extra: Any) -> ProviderConfig:
    return ProviderConfig(id="c", type="cli", command=command, models=["m"], timeout_s=timeout_s, **extra)


def chat(
    messages: list[dict[str, Any]], *, target: str = "m", stream: bool = False, **extra: Any
) -> ProviderCall:
    body = json.dumps({"model": target, "messages": messages, "stream": stream, **extra}).encode()
    return ProviderCall(endpoint="chat/completions", body=body, target=target, stream=stream)


def ask(text: str, **kw: Any) -> ProviderCall:
    return chat([{"role": "user", "content": text}], **kw)


async def run(command: list[str], call: ProviderCall, **kw: Any) -> RecordingSink:
    sink = RecordingSink()
    await CliAdapter(provider(command, **kw)).call(call, sink)
    return sink


def alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie waiting for some other parent counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


async def read_pid(path: Path) -> int:
    """The pid a child wrote to ``path`` once it got going (polled, up to 20 s)."""
    apath = anyio.Path(path)
    for _ in range(2000):
        if await apath.exists():
            return int(await apath.read_text())
        await anyio.sleep(0.01)
    raise AssertionError(f"the child never wrote {path}")


async def gone(pid: int) -> bool:
    # Not our child (a grandchild): its new parent reaps it whenever it gets round to it.
    for _ in range(500):
        if not alive(pid):
            return True
        await anyio.sleep(0.02)
    return False


async def first_chunk(sink: RecordingSink) -> None:
    with anyio.fail_after(20):
        await sink.got_chunk.wait()


# --- input --------------------------------------------------------------------------------


async def test_single_user_message_goes_to_stdin_as_is() -> None:
    sink = await run(UPPER, ask("hello wörld", target="served-name"))
    assert sink.events == ["done"]
    assert sink.answer is not None
    status, _, content_type = sink.answer
    assert (status, content_type) == (200, "application/json")
    answer = sink.json()
    assert answer["object"] == "chat.completion"
    assert answer["model"] == "served-name"
    assert answer["id"].startswith("chatcmpl-")
    assert isinstance(answer["created"], int)
    [choice] = answer["choices"]
    assert choice["index"] == 0
    assert choice["message"] == {"role": "assistant", "content": "HELLO WÖRLD"}
    assert choice["finish_reason"] == "stop"
    assert answer["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


async def test_conversation_becomes_a_transcript() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    sink = await run(ECHO, chat(messages))
    content = sink.json()["choices"][0]["message"]["content"]
    assert content == "System: Be brief.\n\nUser: Hi\nthere\n\nAssistant: Hello.\n\nUser: Bye"


async def test_single_system_message_is_a_transcript_too() -> None:
    sink = await run(ECHO, chat([{"role": "system", "content": "x"}]))
    assert sink.json()["choices"][0]["message"]["content"] == "System: x"


@pytest.mark.parametrize(("prompt", "expected"), [("one two", "one two"), (["a", "b c"], "a\nb c")])
async def test_completions_prompt(prompt: str | list[str], expected: str) -> None:
    body = json.dumps({"model": "m", "prompt": prompt}).encode()
    sink = await run(ECHO, ProviderCall(endpoint="completions", body=body, target="t", stream=False))
    answer = sink.json()
    assert answer["object"] == "text_completion"
    assert answer["model"] == "t"
    assert answer["id"].startswith("cmpl-")
    assert answer["choices"][0]["text"] == expected
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert "message" not in answer["choices"][0]


async def test_embeddings_rejected_without_starting_a_process(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    command = [*script("import sys; open(sys.argv[1], 'w').close()"), str(marker)]
    call = ProviderCall(endpoint="embeddings", body=b'{"model":"m","input":"x"}', target="m", stream=False)
    with pytest.raises(ProviderRejected) as info:
        await run(command, call)
    assert info.value.status == 400
    assert json.loads(info.value.raw_body)["error"]["code"] == "unsupported_endpoint"
    assert not marker.exists()


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        ("chat/completions", b"not json", None),
        ("chat/completions", b"[1, 2]", None),
        ("chat/completions", b'{"model": "m"}', "messages"),
        ("chat/completions", b'{"messages": []}', "messages"),
        ("chat/completions", b'{"messages": [{"content": "no role"}]}', "messages[0].role"),
        ("chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
        ("completions", b'{"model": "m"}', "prompt"),
        ("completions", b'{"prompt": [1, 2, 3]}', "prompt"),
    ],
)
async def test_malformed_bodies_rejected(endpoint: str, body: bytes, param: str | None) -> None:
    with pytest.raises(ProviderRejected) as info:
        await run(ECHO, ProviderCall(endpoint=endpoint, body=body, target="m", stream=False))
    assert info.value.status == 400
    error = json.loads(info.value.raw_body)["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


async def test_non_text_content_parts_rejected() -> None:
    parts = [{"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "x"}}]
    with pytest.raises(ProviderRejected) as info:
        await run(ECHO, chat([{"role": "user", "content": parts}]))
    assert info.value.status == 400
    assert json.loads(info.value.raw_body)["error"]["code"] == "unsupported_content"


async def test_model_substitution_keeps_argv_elements_whole() -> None:
    command = [
        *script("import json, sys; print(json.dumps(sys.argv[1:]), end='')"),
        "{model}",
        "--model={model}",
        "{model}/{model}",
        "plain",
    ]
    sink = await run(command, ask("hi", target="my model --x"))
    argv = json.loads(sink.json()["choices"][0]["message"]["content"])
    assert argv == ["my model --x", "--model=my model --x", "my model --x/my model --x", "plain"]


async def test_child_gets_a_minimal_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IOP_TEST_SECRET", "s3cret")
    monkeypatch.setenv("IOP_TEST_CLI_KEY", "k-123")
    command = script("import json, os; print(json.dumps(dict(os.environ)), end='')")
    sink = await run(command, ask("hi"), api_key_env="IOP_TEST_CLI_KEY")
    env = json.loads(sink.json()["choices"][0]["message"]["content"])
    assert "IOP_TEST_SECRET" not in env
    assert env["IOP_TEST_CLI_KEY"] == "k-123"
    # LC_CTYPE: Python itself sets it in the child under a C locale (PEP 538).
    assert set(env) <= {*cli.ENV_PASSTHROUGH, "IOP_TEST_CLI_KEY", "LC_CTYPE"}
    if "PATH" in os.environ:
        assert env["PATH"] == os.environ["PATH"]


async def test_unset_api_key_env_is_simply_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("IOP_TEST_UNSET_KEY", raising=False)
    command = script("import json, os; print(json.dumps(dict(os.environ)), end='')")
    sink = await run(command, ask("hi"), api_key_env="IOP_TEST_UNSET_KEY")
    assert "IOP_TEST_UNSET_KEY" not in json.loads(sink.json()["choices"][0]["message"]["content"])


async def test_large_input_and_output_do_not_deadlock() -> None:
    # Reads a line, answers a lot, then reads the rest: both pipes fill up at once.
    command = script(
        """
        import sys
        first = sys.stdin.readline()
        sys.stdout.write("y" * 1_000_000)
        sys.stdout.write(str(len(first) + len(sys.stdin.read())))
        """
    )
    text = "word " * 200_000 + "\nmore" * 100_000
    sink = await run(command, ask(text))
    content = sink.json()["choices"][0]["message"]["content"]
    assert content == "y" * 1_000_000 + str(len(text))


# --- streaming --------------------------------------------------------------------------


async def test_streaming_chunks_in_order() -> None:
    command = script(
        """
        import sys, time
        for word in ["one ", "two ", "three"]:
            sys.stdout.write(word)
            sys.stdout.flush()
            time.sleep(0.05)
        """
    )
    sink = await run(command, ask("go", stream=True, target="tgt"))
    assert sink.started == [200]
    assert sink.events[0] == "start"
    assert "done" not in sink.events
    assert sink.streamed_text() == "one two three"
    objects = sink.objects
    assert len(objects) >= 2
    assert all(not p.startswith(b"data:") for p in sink.payloads)
    assert {o["object"] for o in objects} == {"chat.completion.chunk"}
    assert {o["model"] for o in objects} == {"tgt"}
    assert len({o["id"] for o in objects}) == 1
    assert objects[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in o["choices"][0]["delta"] for o in objects[1:])
    assert all(o["choices"][0]["finish_reason"] is None for o in objects[:-1])
    assert objects[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}


async def test_streamed_completions() -> None:
    body = json.dumps({"model": "m", "prompt": "abc", "stream": True}).encode()
    sink = await run(UPPER, ProviderCall(endpoint="completions", body=body, target="t", stream=True))
    objects = sink.objects
    assert {o["object"] for o in objects} == {"text_completion"}
    assert sink.streamed_text() == "ABC"
    assert objects[-1]["choices"][0]["finish_reason"] == "stop"
    assert objects[-1]["choices"][0]["text"] == ""


async def test_stream_include_usage() -> None:
    sink = await run(ECHO, ask("a b c", stream=True, stream_options={"include_usage": True}))
    last = sink.objects[-1]
    assert last["choices"] == []
    assert last["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert sink.objects[-2]["choices"][0]["finish_reason"] == "stop"


async def test_empty_stream_still_opens_and_finishes() -> None:
    sink = await run(script("pass"), ask("x", stream=True))
    assert sink.started == [200]
    objects = sink.objects
    assert objects[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert objects[-1]["choices"][0]["finish_reason"] == "stop"


async def test_first_chunk_reaches_the_sink_while_the_child_runs(tmp_path: Path) -> None:
    pid_file, release = tmp_path / "pid", tmp_path / "release"
    command = script(
        """
        import os, sys, time
        with open(sys.argv[1] + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(sys.argv[1] + ".tmp", sys.argv[1])
        sys.stdout.write("hello ")
        sys.stdout.flush()
        while not os.path.exists(sys.argv[2]):
            time.sleep(0.01)
        sys.stdout.write("world")
        """,
        str(pid_file),
        str(release),
    )
    sink = RecordingSink()
    task = asyncio.create_task(CliAdapter(provider(command)).call(ask("x", stream=True), sink))
    pid = await read_pid(pid_file)
    await first_chunk(sink)
    # The child cannot exit before ``release`` exists, so this chunk came while it ran.
    assert sink.streamed_text() == "hello "
    assert not task.done()
    assert alive(pid)
    await anyio.Path(release).touch()
    await task
    assert sink.streamed_text() == "hello world"
    assert not alive(pid)


async def test_multibyte_characters_split_across_writes(tmp_path: Path) -> None:
    release = tmp_path / "release"
    command = script(
        """
        import os, sys, time
        out = sys.stdout.buffer
        out.write(b"a\\xc3")  # first byte of "é"
        out.flush()
        while not os.path.exists(sys.argv[1]):
            time.sleep(0.01)
        out.write(b"\\xa9\\xe2\\x82")  # rest of "é", two bytes of "€"
        out.flush()
        time.sleep(0.05)
        out.write(b"\\xac!")
        """,
        str(release),
    )
    sink = RecordingSink()
    task = asyncio.create_task(CliAdapter(provider(command)).call(ask("x", stream=True), sink))
    await first_chunk(sink)
    # The lone lead byte is held back, not sent as a replacement character.
    assert sink.streamed_text() == "a"
    await anyio.Path(release).touch()
    await task
    assert sink.streamed_text() == "aé€!"
    texts = [c["delta"].get("content", "") for o in sink.objects for c in o["choices"]]
    assert all("\ufffd" not in t for t in texts)


@pytest.mark.parametrize("stream", [False, True])
async def test_invalid_utf8_is_replaced(stream: bool) -> None:
    command = script("import sys; sys.stdout.buffer.write(b'ok\\xff then \\xc3')")
    sink = await run(command, ask("x", stream=stream))
    text = sink.streamed_text() if stream else sink.json()["choices"][0]["message"]["content"]
    assert text == "ok\ufffd then \ufffd"


# --- failures ---------------------------------------------------------------------------


async def test_non_zero_exit_reports_the_stderr_tail() -> None:
    command = script("import sys; sys.stderr.write('x' * 200_000 + 'the end\\n'); sys.exit(3)")
    with pytest.raises(ProviderUnreachable) as info:
        await run(command, ask("x"))
    message = str(info.value)
    prefix = "command exited with status 3: "
    assert message.startswith(prefix)
    assert message.endswith("the end")
    assert len(message) == len(prefix) + cli.ERROR_TAIL_CHARS


async def test_non_zero_exit_without_stderr() -> None:
    with pytest.raises(ProviderUnreachable, match=r"^command exited with status 2$"):
        await run(script("raise SystemExit(2)"), ask("x"))


async def test_non_zero_exit_before_output_does_not_start_a_stream() -> None:
    sink = RecordingSink()
    with pytest.raises(ProviderUnreachable, match="status 4"):
        await CliAdapter(provider(script("raise SystemExit(4)"))).call(ask("x", stream=True), sink)
    assert sink.events == []


async def test_non_zero_exit_after_streamed_output() -> None:
    command = script(
        """
        import sys
        sys.stdout.write("partial")
        sys.stdout.flush()
        sys.stderr.write("crashed")
        sys.exit(5)
        """
    )
    sink = RecordingSink()
    with pytest.raises(ProviderUnreachable, match=r"^command exited with status 5: crashed$"):
        await CliAdapter(provider(command)).call(ask("x", stream=True), sink)
    assert sink.started == [200]
    assert sink.streamed_text() == "partial"
    assert all(o["choices"][0]["finish_reason"] is None for o in sink.objects)


async def test_timeout_kills_the_child_and_its_children(tmp_path: Path) -> None:
    pid_file, grandchild_file = tmp_path / "pid", tmp_path / "grandchild"
    command = script(
        """
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"])
        with open(sys.argv[2], "w") as f:
            f.write(str(child.pid))
        with open(sys.argv[1] + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(sys.argv[1] + ".tmp", sys.argv[1])
        time.sleep(1000)
        """,
        str(pid_file),
        str(grandchild_file),
    )
    with pytest.raises(ProviderTimeout, match="did not finish within 2s"):
        await run(command, ask("x"), timeout_s=2)
    # Reaped as well as killed: a zombie would still answer kill(pid, 0).
    with pytest.raises(ProcessLookupError):
        os.kill(await read_pid(pid_file), 0)
    assert await gone(await read_pid(grandchild_file))


async def test_timeout_after_streamed_output() -> None:
    command = script(
        """
        import sys, time
        sys.stdout.write("some")
        sys.stdout.flush()
        time.sleep(1000)
        """
    )
    sink = RecordingSink()
    with pytest.raises(ProviderTimeout):
        await CliAdapter(provider(command, timeout_s=1)).call(ask("x", stream=True), sink)
    assert sink.streamed_text() == "some"


async def test_cancelling_the_task_kills_and_reaps_the_child(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    task = asyncio.create_task(
            CliAdapter(provider([*SLEEP_FOREVER, str(pid_file)])).call(ask("x"), RecordingSink())
    )
    pid = await read_pid(pid_file)
    assert alive(pid)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
            await task
    # Reaped as well as killed: a zombie would still answer kill(pid, 0).
    with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def test_anyio_cancellation_kills_and_reaps_the_child(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    adapter = CliAdapter(provider([*SLEEP_FOREVER, str(pid_file)]))
    async with anyio.create_task_group() as tg:
            tg.start_soon(adapter.call, ask("x", stream=True), RecordingSink())
            pid = await read_pid(pid_file)
            tg.cancel_scope.cancel()
    with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def test_missing_executable() -> None:
    with pytest.raises(ProviderUnreachable, match="cannot start"):
            await run(["/nonexistent/iop-no-such-tool"], ask("x"))
    with pytest.raises(ProviderUnreachable, match="cannot start"):
            await run(["iop-no-such-tool-on-path"], ask("x"))


async def test_file_that_is_not_executable(tmp_path: Path) -> None:
    tool = tmp_path / "tool"
    tool.write_text("#!/bin/sh\necho hi\n")
    tool.chmod(0o644)
    with pytest.raises(ProviderUnreachable, match="cannot start"):
            await run([str(tool)], ask("x"))


@pytest.mark.parametrize("stream", [False, True])
async def test_output_cap_kills_the_child(tmp_path: Path, stream: bool) -> None:
    pid_file = tmp_path / "pid"
    command = script(
        """
        import os, sys, time
        with open(sys.argv[1] + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(sys.argv[1] + ".tmp", sys.argv[1])
        sys.stdout.write("x" * (9 * 1024 * 1024))
        sys.stdout.flush()
        time.sleep(1000)
        """,
        str(pid_file),
    )
    assert cli.MAX_OUTPUT_BYTES == 8 * 1024 * 1024
    with pytest.raises(ProviderUnreachable, match=r"^output too large$"):
        await run(command, ask("x", stream=stream), timeout_s=120)
    assert not alive(await read_pid(pid_file))


async def test_output_just_under_the_cap_is_fine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "MAX_OUTPUT_BYTES", 10)
    sink = await run(script("print('x' * 9, end='')"), ask("x"))
    assert sink.json()["choices"][0]["message"]["content"] == "x" * 9
    with pytest.raises(ProviderUnreachable, match="output too large"):
        await run(script("print('x' * 11, end='')"), ask("x"))


# --- probe ------------------------------------------------------------------------------


async def test_probe_found() -> None:
    result = await CliAdapter(provider([PY, "-c", "pass"])).probe(1.0)
    assert result == ProbeResult(True, "")


@pytest.mark.skipif(shutil.which("sh") is None, reason="no sh on PATH")
async def test_probe_found_on_path() -> None:
    assert (await CliAdapter(provider(["sh"])).probe(1.0)).healthy


async def test_probe_relative_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tool = tmp_path / "tool"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    monkeypatch.chdir(tmp_path)
    assert (await CliAdapter(provider(["./tool"])).probe(1.0)).healthy
    tool.chmod(0o644)
    assert not (await CliAdapter(provider(["./tool"])).probe(1.0)).healthy


async def test_probe_not_found() -> None:
    result = await CliAdapter(provider(["iop-no-such-tool-on-path", "--x"])).probe(1.0)
    assert result == ProbeResult(False, "executable 'iop-no-such-tool-on-path' not found")
    assert result.models is None


async def test_child_that_ignores_stdin() -> None:
    # Exits without reading a large prompt: the broken pipe is not an error.
    sink = await run(script("print('ok', end='')"), ask("word " * 500_000))
    assert sink.json()["choices"][0]["message"]["content"] == "ok"


async def test_escaped_grandchild_holding_stdout_does_not_hang_the_call(tmp_path: Path) -> None:
    # The grandchild leaves the process group (new session) and keeps stdout open, so
    # stdout never ends: the call times out instead of hanging, even while it reaps.
    grandchild_file = tmp_path / "grandchild"
    command = script(
        """
        import subprocess, sys
        child = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(1000)"], start_new_session=True
        )
        with open(sys.argv[1], "w") as f:
            f.write(str(child.pid))
        print("bye", flush=True)
        """,
        str(grandchild_file),
    )
    try:
        with anyio.fail_after(30):
            with pytest.raises(ProviderTimeout):
                await run(command, ask("x"), timeout_s=1)
    finally:
        with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
            os.kill(int(grandchild_file.read_text()), signal.SIGKILL)


async def test_probe_of_a_command_that_hangs_is_unhealthy(tmp_path: Path) -> None:
    tool = tmp_path / "tool"
    tool.write_text("#!/bin/sh\nsleep 30\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    result = await CliAdapter(provider([str(tool)])).probe(0.3)
    assert not result.healthy
    assert "did not finish" in result.reason
