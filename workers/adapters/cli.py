"""Providers of type ``cli``: a local command that reads a prompt on stdin and answers on stdout.

The command comes from the config as an argv list, and ``{model}`` is replaced inside the
one argv element that holds it, so the target never becomes an extra argument. The child
sees only a minimal environment: caller data never reaches it, and neither do the
worker's other secrets.

The pieces: ``cli_prompt`` renders the request as the tool's stdin, ``cli_process`` runs
the tool, ``cli_answer`` shapes its output like OpenAI's answer; this module reads the
output within the provider's limits and timeout.
"""

from __future__ import annotations

import asyncio
import codecs
import os

import anyio

from dispatcher.exceptions import ProviderTimeout, ProviderUnreachable
from workers.adapters.base import Adapter, ProbeResult, ProviderCall, Sink
from workers.adapters.cli_answer import Answer
from workers.adapters.cli_process import Child, drain_tail, feed
from workers.adapters.cli_prompt import parse_request
from workers.adapters.probes import probe_command

# Beyond this the command is runaway (or not a chat tool at all): kill it rather than
# buffer without bound in the worker.
MAX_OUTPUT_BYTES = 8 * 1024 * 1024
# How much of the stderr tail goes into the error message the caller sees.
ERROR_TAIL_CHARS = 500
# Streamed reads return whatever the child has written so far, up to this much.
STREAM_READ_BYTES = 4096
# Non-streamed reads can take bigger bites: nobody waits for the pieces.
COLLECT_READ_BYTES = 64 * 1024

# Variables a command line tool legitimately needs to find itself, its config and a
# locale; everything else in the worker's environment stays out.
ENV_PASSTHROUGH = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")

MODEL_PLACEHOLDER = "{model}"


class CliAdapter(Adapter):
    """Runs ``provider.command`` once per call."""

    async def call(self, call: ProviderCall, sink: Sink) -> None:
        prompt, options = parse_request(call)
        child = await Child.spawn(self._argv(call.target), _child_env(self.provider.api_key_env))
        answer = Answer(call, prompt, options)
        stderr_tail = bytearray()
        # stdin is fed and stderr drained beside the stdout reader: a child that writes
        # before it has read all its input (or fills stderr) must not deadlock us.
        helpers = [
            asyncio.create_task(feed(child.stdin, prompt.encode("utf-8", errors="replace"))),
            asyncio.create_task(drain_tail(child.stderr, stderr_tail)),
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

    async def probe_while_busy(self, timeout_s: float) -> ProbeResult | None:
        # ``--version`` runs in a process of its own: the running calls never see it.
        return await self.probe(timeout_s)

    def _argv(self, target: str) -> list[str]:
        command = self.provider.command
        if not command:
            raise ProviderUnreachable(f"provider {self.provider.id!r} has no command")
        # str.replace inside each element: the target never splits into more argv words.
        return [part.replace(MODEL_PLACEHOLDER, target) for part in command]


async def _stream_stdout(stdout: asyncio.StreamReader, answer: Answer, sink: Sink) -> None:
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


async def _collect_stdout(stdout: asyncio.StreamReader, answer: Answer) -> None:
    while data := await stdout.read(COLLECT_READ_BYTES):
        answer.output += data
        if len(answer.output) > MAX_OUTPUT_BYTES:
            raise ProviderUnreachable("output too large")


def _child_env(api_key_env: str | None) -> dict[str, str]:
    env = {name: os.environ[name] for name in ENV_PASSTHROUGH if name in os.environ}
    if api_key_env and api_key_env in os.environ:
        env[api_key_env] = os.environ[api_key_env]
    return env
