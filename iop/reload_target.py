"""Which process ``iop reload`` may send ``SIGHUP``: one that reads its config file again on it.

Those are ``iop up``, ``iop api`` and ``iop worker``, however they were started (the ``iop``
console script, ``python -m iop``), and the server processes of ``iop api --workers N``,
which uvicorn starts with multiprocessing's spawn under the ``iop api`` process. Any other
process would most likely end on ``SIGHUP`` (its default action), so it is not sent one.
Read from ``/proc`` (Linux).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

# The iop commands that reload on SIGHUP (dispatcher/reloading.py).
RELOADING = ("up", "api", "worker")
# Options of the interpreter that take the next argument.
_WITH_VALUE = frozenset({"-X", "-W", "-Q"})


class Target(NamedTuple):
    """What a pid is: its command line, and the iop command it runs (None: not one that reloads)."""

    argv: list[str]
    command: str | None

    def __str__(self) -> str:
        return shlex.join(self.argv) if self.argv else "(no command line: a zombie or a kernel thread)"


def iop_command(argv: Sequence[str]) -> str | None:
    """The iop command (``up``, ``fake-provider``...) that ``argv`` runs, or None when it does
    not run iop's entry point: ``iop CMD``, ``python [options] /path/to/iop CMD`` (the
    console script, as its shebang runs it), ``python [options] -m iop CMD``."""
    if not argv:
        return None
    if os.path.basename(argv[0]) == "iop":
        return argv[1] if len(argv) > 1 else None
    if not os.path.basename(argv[0]).startswith(("python", "pypy")):
        return None
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "-m" or (arg.startswith("-m") and not arg.startswith("--")):
            module = argv[i + 1] if arg == "-m" and i + 1 < len(argv) else arg[2:]
            rest = argv[i + 2:] if arg == "-m" else argv[i + 1:]
            return rest[0] if module == "iop" and rest else None
        if arg == "-c":
            return None
        if arg in _WITH_VALUE:
            i += 2
            continue
        if arg.startswith("-"):
            i += 1
            continue
        # The script: the console script is a file named iop.
        return argv[i + 1] if os.path.basename(arg) == "iop" and i + 1 < len(argv) else None
    return None


def _spawned_server(argv: Sequence[str]) -> bool:
    """Whether ``argv`` is a process multiprocessing's spawn started (uvicorn's server processes)."""
    return "--multiprocessing-fork" in argv and any("spawn_main" in arg for arg in argv)


def argv_of(pid: int) -> list[str]:
    """The command line of ``pid``; OSError (FileNotFoundError: no such process) if unreadable."""
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return [part.decode(errors="replace") for part in raw.split(b"\0")[:-1]] if raw else []


def parent_of(pid: int) -> int:
    # The fields after the command name, which may hold spaces and parentheses itself.
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rpartition(")")[2].split()[1])


def config_file(pid: int, target: Target, default: Path) -> Path | None:
    """The config file the process ``pid`` (``target``) reads again on SIGHUP: its ``--config``,
    relative to its own working directory, ``default`` for an ``iop up`` without one (the demo).
    None: its command line does not say (OSError when ``/proc`` cannot)."""
    argv = target.argv
    if _spawned_server(argv):  # a server process of `iop api --workers N`: its parent's command line
        pid = parent_of(pid)
        argv = argv_of(pid)
    value = None
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--config="):
            value = arg.partition("=")[2]
    if value is None:
        return default if target.command == "up" else None
    return Path(os.readlink(f"/proc/{pid}/cwd")) / value


def process_at(pid: int) -> Target:
    """What ``pid`` is; OSError when ``/proc`` cannot say."""
    argv = argv_of(pid)
    command = iop_command(argv)
    if command is None and _spawned_server(argv):
        parent = iop_command(argv_of(parent_of(pid)))
        command = "api" if parent == "api" else None
    return Target(argv, command if command in RELOADING else None)
