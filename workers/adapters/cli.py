"""Providers of type ``cli``: a local command that reads a prompt on stdin and answers on stdout.

The command comes from the config as an argv list and is started the way
``create_subprocess_exec`` starts one (exec, never a shell), so nothing a caller sends can
become a shell word or an extra argument: ``{model}`` is replaced inside the one
argv element that holds it. The child runs in its own session (process group) so
that a timeout or a cancellation kills whatever it spawned too, and it sees only a
minimal environment: caller data never reaches it, and neither do the worker's
other secrets.

The answer is shaped like OpenAI's: a ``chat.completion`` / ``text_completion``
object, or for streamed calls the matching chunk objects, sent as soon as the
child writes.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import os
import secrets
import signal
import subprocess
import time
from typing import Any

import anyio
import msgspec

from dispatcher.exceptions import (
    ProviderRejected,
    ProviderTimeout,
    ProviderUnreachable,
)
from workers.adapters.base import Adapter, ProbeResult, ProviderCall, Sink
from workers.probes import probe_command

# Beyond this the command is runaway (or not a chat tool at all): kill it rather than
# buffer without bound in the worker.
MAX_OUTPUT_BYTES = 8 * 1024 * 1024
# Only the end of stderr is reported; a chatty tool must not grow the worker's memory.
STDERR_TAIL_BYTES = 64 * 1024
# How much of that tail goes into the error message the caller sees.
ERROR_TAIL_CHARS = 500
# Streamed reads return whatever the child has written so far, up to this much.
STREAM_READ_BYTES = 4096
# Non-streamed reads can take bigger bites: nobody waits for the pieces.
COLLECT_READ_BYTES = 64 * 1024
# Buffer limit of the pipe readers (asyncio's default): reading from the child pauses
# when this much (times two) is waiting, so a fast tool is held back, not buffered.
PIPE_LIMIT = 64 * 1024

# Variables a command line tool legitimately needs to find itself, its config and a
# locale; everything else in the worker's environment stays out.
ENV_PASSTHROUGH = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")

MODEL_PLACEHOLDER = "{model}"


class CliAdapter(Adapter):
    """Runs ``provider.command`` once per call."""

    async def call(self, call: ProviderCall, sink: Sink) -> None:
        prompt, options = _parse_request(call)
        child = await _Child.spawn(self._argv(call.target), _child_env(self.provider.api_key_env))
        answer = _Answer(call, prompt, options)
        stderr_tail = bytearray()
        # stdin is fed and stderr drained beside the stdout reader: a child that writes
        # before it has read all its input (or fills stderr) must not deadlock us.
        helpers = [
            asyncio.create_task(_feed(child.stdin, prompt.encode("utf-8", errors="replace"))),
            asyncio.create_task(_drain_tail(child.stderr, stderr_tail)),
        ]
        timeout = self.provider.timeout_s
        returncode: int | None = None
        ended = False
        try:
            with anyio.move_on_after(timeout) as scope:
                if call.stream:
                    await _stream_stdout(child.stdout, answer, sink)
                else:
                    await _collect_stdout(child.stdout, answer)
                returncode = await child.wait()
                # The tail must be complete before it is quoted in an error.
                await helpers[1]
                ended = True
            if scope.cancelled_caught:
                raise ProviderTimeout(f"command did not finish within {timeout:g}s")
        finally:
            await child.settle(helpers, kill=not ended)

        assert returncode is not None
        if returncode != 0:
            tail = stderr_tail.decode("utf-8", errors="replace").strip()[-ERROR_TAIL_CHARS:]
            message = f"command exited with status {returncode}"
            raise ProviderUnreachable(f"{message}: {tail}" if tail else message)

        if call.stream:
            await answer.finish_stream(sink)
        else:
            await sink.done(200, answer.whole_body(), "application/json")

    async def probe(self, timeout_s: float) -> ProbeResult:
        command = self.provider.command
        if not command:
            return ProbeResult(False, "no command configured")
        # The executable must resolve and start; a command reports no models of its own.
        return await probe_command(command[0], _child_env(self.provider.api_key_env), timeout_s)

    def _argv(self, target: str) -> list[str]:
        command = self.provider.command
        if not command:
            raise ProviderUnreachable(f"provider {self.provider.id!r} has no command")
        # str.replace inside each element: the target never splits into more argv words.
        return [part.replace(MODEL_PLACEHOLDER, target) for part in command]


class _ChildProtocol(asyncio.subprocess.SubprocessStreamProtocol):
    """The stream protocol of ``create_subprocess_exec``, plus a future for the exit alone.

    ``Process.wait()`` (3.11) resolves only once the child has exited *and* all its
    pipes are closed. Something the tool started in a session of its own can hold a
    pipe open indefinitely, and then a shielded ``wait()`` on the way out of a
    cancellation would hang the worker. The exit itself -- the moment the child is
    reaped -- is what we need to know.
    """

    def __init__(self, limit: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=limit, loop=loop)
        self.exited: asyncio.Future[None] = loop.create_future()

    def process_exited(self) -> None:
        super().process_exited()
        if not self.exited.done():
            self.exited.set_result(None)


class _Child:
    """One running command: its transport (to kill and close) and its three pipes."""

    def __init__(self, transport: asyncio.SubprocessTransport, protocol: _ChildProtocol) -> None:
        self.transport = transport
        self.protocol = protocol
        self.pid = transport.get_pid()
        # All three are pipes (see spawn); the asserts only tell the type checker.
        assert protocol.stdin is not None
        assert protocol.stdout is not None
        assert protocol.stderr is not None
        self.stdin = protocol.stdin
        self.stdout = protocol.stdout
        self.stderr = protocol.stderr

    @classmethod
    async def spawn(cls, argv: list[str], env: dict[str, str]) -> _Child:
        loop = asyncio.get_running_loop()
        # What create_subprocess_exec does, one level down, so that the transport can be
        # closed and the exit awaited on their own (see _ChildProtocol).
        try:
            transport, protocol = await loop.subprocess_exec(
                lambda: _ChildProtocol(limit=PIPE_LIMIT, loop=loop),
                *argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                # A group of its own: killing it reaches the tool's own children too.
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            # Not found, not executable, not a file: the provider cannot take work.
            reason = exc.strerror or str(exc)
            raise ProviderUnreachable(f"cannot start {argv[0]!r}: {reason}") from None
        return cls(transport, protocol)

    async def wait(self) -> int:
        await self.protocol.exited
        returncode = self.transport.get_returncode()
        assert returncode is not None
        return returncode

    async def settle(self, helpers: list[asyncio.Task[None]], *, kill: bool) -> None:
        """Kill the child's group unless the call ended normally; always reap and close."""
        # Shielded: this runs on the way out of a cancellation or a timeout too, and an
        # unreaped child (or one left running) is exactly what must not happen then.
        with anyio.CancelScope(shield=True):
            if kill or not self.protocol.exited.done():
                # Also when the child itself has exited: whatever it left behind in its
                # group (holding our pipes open, say) goes with it.
                self._kill_group()
            # The watcher has reaped the child once this resolves: no zombie remains.
            await self.protocol.exited
            # Closes our ends of the pipes even if some escaped process still holds
            # theirs; nothing more is read from them.
            self.transport.close()
            for task in helpers:
                task.cancel()
            for task in helpers:
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await task

    def _kill_group(self) -> None:
        try:
            # The child leads its own session (start_new_session), so its pid is the group id.
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            # The group is already gone; make sure about the child itself.
            if self.transport.get_returncode() is None:
                with contextlib.suppress(ProcessLookupError):
                    self.transport.kill()


class _Answer:
    """Builds the OpenAI-shaped objects of one call, JSON or streamed."""

    def __init__(self, call: ProviderCall, prompt: str, options: dict[str, Any]) -> None:
        self.chat = call.endpoint == "chat/completions"
        self.target = call.target
        self.prompt = prompt
        self.include_usage = bool(options.get("include_usage"))
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.output = bytearray()  # non-streamed: the raw stdout
        self.streamed: list[str] = []  # streamed: kept only when usage must be reported
        self.sent_first = False

    def usage(self, text: str) -> dict[str, int]:
        # Whitespace words: a CLI tool reports no token counts, and a rough figure is
        # still useful for dashboards.
        prompt_tokens = len(self.prompt.split())
        completion_tokens = len(text.split())
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def whole_body(self) -> bytes:
        text = self.output.decode("utf-8", errors="replace")
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = None
        choice["finish_reason"] = "stop"
        return msgspec.json.encode(
            {
                "id": self.id,
                "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created,
                "model": self.target,
                "choices": [choice],
                "usage": self.usage(text),
            }
        )

    def chunk(self, text: str | None, finish_reason: str | None) -> bytes:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            delta: dict[str, str] = {}
            if not self.sent_first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        self.sent_first = True
        return self._envelope([choice])

    def _envelope(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        obj: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.target,
            "choices": choices,
        }
        if usage is not None:
            obj["usage"] = usage
        return msgspec.json.encode(obj)

    async def emit(self, sink: Sink, text: str) -> None:
        if not self.sent_first:
            # Started only once there is output: a command that fails before writing
            # anything still gets a proper error status instead of a broken stream.
            await sink.start(200)
        if self.include_usage:
            self.streamed.append(text)
        await sink.chunks([self.chunk(text, None)])

    async def finish_stream(self, sink: Sink) -> None:
        if not self.sent_first:
            # Empty output: the stream still opens with the assistant role.
            await self.emit(sink, "")
        payloads = [self.chunk(None if self.chat else "", "stop")]
        if self.include_usage:
            # OpenAI's stream_options.include_usage: one last chunk, no choices, the usage.
            payloads.append(self._envelope([], self.usage("".join(self.streamed))))
        await sink.chunks(payloads)


async def _stream_stdout(stdout: asyncio.StreamReader, answer: _Answer, sink: Sink) -> None:
    # Incremental decoding: a multibyte character split across two writes of the child
    # is held back until complete rather than turned into two replacement characters.
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    total = 0
    while data := await stdout.read(STREAM_READ_BYTES):
        total += len(data)
        if total > MAX_OUTPUT_BYTES:
            raise ProviderUnreachable("output too large")
        text = decoder.decode(data)
        if text:
            await answer.emit(sink, text)
    rest = decoder.decode(b"", final=True)
    if rest:
        await answer.emit(sink, rest)


async def _collect_stdout(stdout: asyncio.StreamReader, answer: _Answer) -> None:
    while data := await stdout.read(COLLECT_READ_BYTES):
        answer.output += data
        if len(answer.output) > MAX_OUTPUT_BYTES:
            raise ProviderUnreachable("output too large")


async def _feed(stdin: asyncio.StreamWriter, data: bytes) -> None:
    try:
        stdin.write(data)
        await stdin.drain()
        stdin.close()
        await stdin.wait_closed()
    except (BrokenPipeError, ConnectionResetError):
        # The tool may exit (or close stdin) without reading everything; its exit
        # status and output tell what happened, not this.
        pass
    finally:
        stdin.close()


async def _drain_tail(stream: asyncio.StreamReader, tail: bytearray) -> None:
    while data := await stream.read(STDERR_TAIL_BYTES):
        tail += data
        if len(tail) > STDERR_TAIL_BYTES:
            del tail[:-STDERR_TAIL_BYTES]


def _child_env(api_key_env: str | None) -> dict[str, str]:
    env = {name: os.environ[name] for name in ENV_PASSTHROUGH if name in os.environ}
    if api_key_env and api_key_env in os.environ:
        env[api_key_env] = os.environ[api_key_env]
    return env


# --- request parsing -------------------------------------------------------------------


def _rejected(message: str, code: str, param: str | None = None) -> ProviderRejected:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}
    return ProviderRejected(400, msgspec.json.encode(body))


def _parse_request(call: ProviderCall) -> tuple[str, dict[str, Any]]:
    """The text for the command's stdin, and the stream options, or ProviderRejected."""
    if call.endpoint not in ("chat/completions", "completions"):
        raise _rejected(f"a command line provider does not serve /{call.endpoint}", "unsupported_endpoint")
    try:
        body: Any = msgspec.json.decode(call.body)
    except msgspec.DecodeError:
        raise _rejected("the request body is not valid JSON", "invalid_request") from None
    if not isinstance(body, dict):
        raise _rejected("the request body must be a JSON object", "invalid_request")
    options = body.get("stream_options")
    if not isinstance(options, dict):
        options = {}
    if call.endpoint == "chat/completions":
        return _chat_prompt(body.get("messages")), options
    return _completion_prompt(body.get("prompt")), options


def _chat_prompt(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise _rejected("'messages' must be a non-empty list", "invalid_request", "messages")
    turns: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _rejected(f"{where} must be an object", "invalid_request", where)
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise _rejected(f"{where}.role must be a non-empty string", "invalid_request", f"{where}.role")
        turns.append((role, _content_text(message.get("content"), f"{where}.content")))
    if len(turns) == 1 and turns[0][0] == "user":
        # A plain question goes to the tool as is, without a "User:" label it would echo.
        return turns[0][1]
    return "\n\n".join(f"{role.capitalize()}: {text}" for role, text in turns)


def _content_text(content: Any, where: str) -> str:
    if content is None:
        # An assistant turn that only made tool calls has no content.
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _rejected(f"{where} must be a string or a list of content parts", "invalid_request", where)
    texts: list[str] = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            # Images, audio, files cannot be put on a text stdin; answering as if they
            # were not there would mislead the caller.
            raise _rejected(
                f"{where}[{j}]: a command line provider only takes text content parts",
                "unsupported_content",
                f"{where}[{j}]",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _completion_prompt(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return "\n".join(prompt)
    raise _rejected("'prompt' must be a string or a non-empty list of strings", "invalid_request", "prompt")
