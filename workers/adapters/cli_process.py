"""A command line tool run as a child process: in a session of its own, fed on stdin,
read on stdout, and killed with everything it started.

Started the way ``create_subprocess_exec`` starts one (exec, never a shell), so nothing
a caller sends can become a shell word.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess

import anyio

from dispatcher.exceptions import ProviderUnreachable

# Only the end of stderr is kept; a chatty tool must not grow the worker's memory.
STDERR_TAIL_BYTES = 64 * 1024
# Buffer limit of the pipe readers (asyncio's default): reading from the child pauses
# when this much (times two) is waiting, so a fast tool is held back, not buffered.
PIPE_LIMIT = 64 * 1024


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


class Child:
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
    async def spawn(cls, argv: list[str], env: dict[str, str]) -> Child:
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


async def feed(stdin: asyncio.StreamWriter, data: bytes) -> None:
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


async def drain_tail(stream: asyncio.StreamReader, tail: bytearray) -> None:
    while data := await stream.read(STDERR_TAIL_BYTES):
        tail += data
        if len(tail) > STDERR_TAIL_BYTES:
            del tail[:-STDERR_TAIL_BYTES]
