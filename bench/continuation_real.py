"""A streamed answer cut mid-stream and continued on another llama-server (issue 49, item 6).

    python -m bench.continuation_real [--trials 20] [--seed 49] [--model tiny|wide] [--work DIR]

Two llama.cpp ``llama-server`` processes on the same GGUF (``.venv-servers/llama-server``,
which ``./dev test`` builds), each the one provider (type ``llamacpp``) of a node of its own
with a worker process of its own, one model id served by both; iop's API, the workers and a
Redis as real processes (tests/e2e/system.py). Greedy decoding (temperature 0, a fixed seed,
``max_tokens`` 200, usage asked with ``stream_options.include_usage``). First the
uninterrupted answer, straight from one server and through iop; then each trial empties both
servers' prompt caches, streams the same request through iop, SIGKILLs the server writing it
(the ``x-iop-provider`` header names it) once the caller has read a random number of content
chunks (5 to 190), reads the stream to its end, and starts the killed server again on its
port. Printed: a row per trial (where the cut fell, whether the joined text is the
uninterrupted one and, if not, how far apart, the caller's wait at the cut) and a summary, in
Markdown; ``DIR/trials.json`` keeps every text. docs/notes/continuation-real-servers.md has
a run's figures and what they mean.

The servers hold no prompt cache across trials (``--cache-ram 0``, and their one slot
erased before each): the server that continues an answer has never seen it, as a provider
that did not write it has not. With the uninterrupted answer still cached, a server continues
from the very keys and values that wrote it, which hides half of what is measured here.

The models (both with the vocabulary and chat template of tests/realservers/tiny_gguf.py):

* ``tiny``: the suite's tiny GGUF (64 dimensions, 2 layers). It writes a token in about
  0.4 ms, 200 in 80 ms: no caller could read 5 chunks and kill the server before it is done.
  So while a trial runs the servers are *paced*: a thread here stops them (SIGSTOP) and lets
  them run (SIGCONT) PACE_RUN_S of every PACE_PERIOD_S, which slows their clock, not their
  arithmetic: the same tokens, about 130 a second.
* ``wide``: the same vocabulary in a wider model (768 dimensions, 4 layers, 140 MB), which
  writes about 140 tokens a second here by itself, unpaced.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from iop.processes import Child, wait_http
from iop.redis_server import RedisServer, free_port
from tests.e2e.system import System, fast_dispatch
from tests.realservers.servers import LLAMA_SERVED, START_TIMEOUT_S, llama_server_binary, python_of, write_tiny_gguf
from tests.realservers.tiny_gguf import N_CTX

COMMAND = "python -m bench.continuation_real"

MODEL = "tiny"  # the id callers use through iop
PROVIDERS = ("p1", "p2")
MAX_TOKENS = 200
FIRST_CUT, LAST_CUT = 5, 190
# A trial whose server had written the whole answer before the kill landed (nothing was cut)
# is run again at the same point, at most this many times.
UNCUT_RETRIES = 3
MESSAGES: list[dict[str, str]] = [{"role": "user", "content": "hello world"}]
BODY: dict[str, Any] = {
    "model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, "seed": 7,
    "stream": True, "stream_options": {"include_usage": True},
}
# Pacing of the ``tiny`` model: of every 20 ms a server runs 1 ms.
PACE_PERIOD_S = 0.020
PACE_RUN_S = 0.001
# The ``wide`` model's shapes (tiny_gguf's N_EMBD, N_HEAD, N_HEAD_KV, N_FF, N_LAYER).
WIDE_SHAPES = (768, 12, 4, 3072, 4)
_WIDE_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[2])
import tiny_gguf
tiny_gguf.N_EMBD, tiny_gguf.N_HEAD, tiny_gguf.N_HEAD_KV, tiny_gguf.N_FF, tiny_gguf.N_LAYER = map(int, sys.argv[3:8])
tiny_gguf.write(sys.argv[1])
"""


def write_model(kind: str, path: Path) -> Path:
    """The GGUF of ``kind`` (``tiny`` or ``wide``) at ``path``, written by the llama-server
    virtualenv's python (gguf and numpy live there)."""
    if kind == "tiny":
        return write_tiny_gguf("llama-server", path)
    here = Path(__file__).resolve().parents[1] / "tests" / "realservers"
    subprocess.run([str(python_of("llama-server")), "-c", _WIDE_SCRIPT, str(path), str(here),
                    *map(str, WIDE_SHAPES)], check=True, capture_output=True, timeout=300)
    return path


class LlamaServer:
    """One llama-server on a fixed port, one slot of the GGUF's whole context, no prompt cache
    beyond that slot's; it can be SIGKILLed and started again on its port."""

    def __init__(self, name: str, model: Path, work: Path) -> None:
        self.name = name
        self.port = free_port()
        slots = work / f"{name}-slots"
        slots.mkdir(parents=True, exist_ok=True)
        argv = [str(llama_server_binary()), "--model", str(model), "--alias", LLAMA_SERVED,
                "--host", "127.0.0.1", "--port", str(self.port), "--parallel", "1", "--ctx-size", str(N_CTX),
                "--n-gpu-layers", "0", "--threads", "1", "--threads-batch", "1", "--no-webui",
                # No prompt cache in memory beside the slot (it would outlive an erase), and
                # the slot's erasable (POST /slots/0?action=erase needs a --slot-save-path).
                "--cache-ram", "0", "--slot-save-path", str(slots)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
        self.proc = Child(name, argv, env, log_path=work / f"{name}.log", die_with_parent=False)
        self.lock = threading.Lock()  # around signals: the pacer's, a kill, a start

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with self.lock:
            self.proc.start()
        wait_http(self.proc, f"{self.url}/health", timeout=START_TIMEOUT_S)

    def erase(self) -> None:
        """Empty its slot: what it computed for earlier requests is gone."""
        httpx.post(f"{self.url}/slots/0?action=erase", timeout=30).raise_for_status()

    def kill(self) -> None:
        with self.lock:
            self.proc.kill()

    def stop(self) -> None:
        with self.lock:
            self.proc.signal(signal.SIGCONT)
        self.proc.stop(timeout=15)


class Pacer(threading.Thread):
    """Slows the servers' clocks: of every ``period_s`` each runs ``run_s`` and is stopped
    (SIGSTOP) the rest. Their arithmetic is untouched: the same tokens, written slower."""

    def __init__(self, servers: list[LlamaServer], period_s: float = PACE_PERIOD_S, run_s: float = PACE_RUN_S):
        super().__init__(daemon=True, name="pacer")
        self.servers = servers
        self.period_s, self.run_s = period_s, run_s
        self.halt = threading.Event()

    def _send(self, signum: int) -> None:
        for server in self.servers:
            with server.lock, contextlib.suppress(ProcessLookupError):
                server.proc.signal(signum)

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                self._send(signal.SIGCONT)
                time.sleep(self.run_s)
                self._send(signal.SIGSTOP)
                time.sleep(self.period_s - self.run_s)
        finally:
            self._send(signal.SIGCONT)

    def stop(self) -> None:
        self.halt.set()
        self.join()


@contextlib.contextmanager
def paced(servers: list[LlamaServer], on: bool) -> Iterator[None]:
    if not on:
        yield
        return
    pacer = Pacer(servers)
    pacer.start()
    try:
        yield
    finally:
        pacer.stop()


@dataclass
class Stream:
    """One streamed chat answer as the caller read it."""

    status: int
    headers: dict[str, str]
    started: float  # perf_counter() when the request was sent
    chunks: list[dict[str, Any]] = field(default_factory=list)
    content: list[str] = field(default_factory=list)  # the content deltas, in order
    content_at: list[float] = field(default_factory=list)  # perf_counter() when each arrived
    comments: list[tuple[int, str]] = field(default_factory=list)  # (content chunks before it, text)
    done: int = 0  # ``data: [DONE]`` lines
    other: str = ""  # the body of an answer that is not a stream, or lines that are not SSE

    @property
    def text(self) -> str:
        return "".join(self.content)

    def finish_reasons(self) -> list[str]:
        return [c["choices"][0]["finish_reason"] for c in self.chunks
                if c.get("choices") and c["choices"][0].get("finish_reason")]

    def usage(self) -> dict[str, Any] | None:
        found = [c["usage"] for c in self.chunks if c.get("usage")]
        return found[-1] if found else None

    def errors(self) -> list[Any]:
        return [c for c in self.chunks if "error" in c]

    def iop(self) -> dict[str, Any] | None:
        found = [c["iop"] for c in self.chunks if "iop" in c]
        return found[-1] if found else None


def stream(base: str, body: dict[str, Any], after_content: Callable[[Stream], None] | None = None,
           timeout: float = 120) -> Stream:
    """POST ``body`` to ``base``'s chat/completions and read the stream to its end, calling
    ``after_content`` after each content chunk."""
    with httpx.Client(timeout=timeout) as client:
        started = time.perf_counter()
        with client.stream("POST", base + "/v1/chat/completions", json=body) as resp:
            out = Stream(resp.status_code, dict(resp.headers), started)
            if resp.status_code != 200:
                out.other = resp.read().decode()[-2000:]
                return out
            for line in resp.iter_lines():
                if line.startswith(":"):
                    out.comments.append((len(out.content), line[1:].strip()))
                elif line == "data: [DONE]":
                    out.done += 1
                elif line.startswith("data: "):
                    chunk = json.loads(line.removeprefix("data: "))
                    out.chunks.append(chunk)
                    choices = chunk.get("choices") or []
                    piece = choices[0].get("delta", {}).get("content") if choices else None
                    if piece:
                        out.content.append(piece)
                        out.content_at.append(time.perf_counter())
                        if after_content is not None:
                            after_content(out)
                elif line:
                    out.other += line + "\n"
    return out


def edit_distance(a: list[str], b: list[str]) -> int:
    """Levenshtein distance between two token lists."""
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, start=1):
        current = [i]
        for j, y in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def first_difference(a: str, b: str) -> int | None:
    """The offset of the first character where ``a`` and ``b`` differ (None: equal)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def common_prefix(a: list[str], b: list[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


SPLICE = "iop continued on "


@dataclass
class Trial:
    number: int
    cut_after: int  # content chunks the caller had read when the server was killed
    killed: str  # the provider whose server was killed (the x-iop-provider header)
    stream: Stream
    reference: list[str]  # the uninterrupted answer's content chunks
    killed_at: float = 0.0
    runs: int = 1  # 1 + the runs that were not cut (the server had already written everything)
    direct_ttft_s: float | None = None  # the other server's time to first token on the prefilled prompt

    @property
    def identical(self) -> bool:
        return self.stream.text == "".join(self.reference)

    @property
    def splice(self) -> int | None:
        """Content chunks before the splice (the ``: iop continued on`` comment)."""
        return next((n for n, text in self.stream.comments if text.startswith(SPLICE)), None)

    @property
    def continued_on(self) -> str | None:
        return next((text.removeprefix(SPLICE).split()[0] for _, text in self.stream.comments
                     if text.startswith(SPLICE)), None)

    @property
    def gap_s(self) -> float | None:
        """The caller's wait at the cut: from the last content chunk before the splice to the
        first after it."""
        n, at = self.splice, self.stream.content_at
        return at[n] - at[n - 1] if n is not None and 0 < n < len(at) else None

    @property
    def after_kill_s(self) -> float | None:
        """From the SIGKILL to the first content chunk after the splice."""
        n, at = self.splice, self.stream.content_at
        return at[n] - self.killed_at if n is not None and n < len(at) else None

    def problems(self) -> list[str]:
        """What makes this stream other than one whole answer, normally ended and continued
        once, as the caller sees it."""
        s = self.stream
        found = []
        if s.status != 200:
            found.append(f"status {s.status}: {s.other[:500]}")
        if s.errors():
            found.append(f"error event: {s.errors()}")
        if s.done != 1:
            found.append(f"{s.done} [DONE] lines")
        if s.finish_reasons() != ["length"]:
            found.append(f"finish reasons {s.finish_reasons()}")
        usage = s.usage()
        if usage is None:
            found.append("no usage chunk")
        elif usage.get("completion_tokens") != MAX_TOKENS:
            found.append(f"usage {usage}: completion_tokens is not {MAX_TOKENS}")
        if len(s.content) != MAX_TOKENS:
            found.append(f"{len(s.content)} content chunks")
        if len({c.get("id") for c in s.chunks}) != 1:
            found.append(f"ids {sorted({str(c.get('id')) for c in s.chunks})}")
        roles = [c for c in s.chunks if c.get("choices") and "role" in c["choices"][0].get("delta", {})]
        if len(roles) > 1:
            found.append(f"{len(roles)} role chunks")
        if self.splice is None or self.continued_on == self.killed:
            found.append(f"spliced after {self.splice} on {self.continued_on} (comments {s.comments})")
        elif (s.iop() or {}).get("providers") != [self.killed, self.continued_on]:
            found.append(f"iop member {s.iop()}, killed {self.killed}, continued on {self.continued_on}")
        return found

    def prompt_tokens(self) -> int | None:
        usage = self.stream.usage()
        return None if usage is None else usage.get("prompt_tokens")

    def row(self) -> list[str]:
        s = self.stream
        diff = first_difference(s.text, "".join(self.reference))
        gap, after, ttft = self.gap_s, self.after_kill_s, self.direct_ttft_s

        def ms(x: float | None) -> str:
            return "" if x is None else f"{x * 1000:.0f}"

        return [
            str(self.number), str(self.cut_after), str(self.splice), f"{self.killed} → {self.continued_on}",
            "yes" if self.identical else "no", "" if diff is None else str(diff),
            str(common_prefix(s.content, self.reference)), str(edit_distance(s.content, self.reference)),
            ms(gap), ms(after), ms(ttft), str(self.prompt_tokens()),
        ]


HEADERS = ["trial", "cut after (chunks read)", "spliced after (chunks)", "killed → continued on", "identical",
           "first differing char", "common prefix (tokens)", "token edit distance", "wait at the cut (ms)",
           "kill → next chunk (ms)", "other server's TTFT, prefilled (ms)", "usage prompt_tokens"]


class Bench:
    """Two llama-servers on one GGUF behind iop (a node, a worker and a provider each)."""

    def __init__(self, work: Path, model_kind: str = "tiny") -> None:
        self.work = work
        self.pace = model_kind == "tiny"
        model = write_model(model_kind, work / f"{model_kind}.gguf")
        self.servers = {pid: LlamaServer(f"llama-server-{pid}", model, work) for pid in PROVIDERS}
        self.stack = contextlib.ExitStack()
        self._system: System | None = None

    def __enter__(self) -> Bench:
        try:
            for server in self.servers.values():
                server.start()
                self.stack.callback(server.stop)
            redis_server = self.stack.enter_context(RedisServer())
            (self.work / "iop").mkdir(exist_ok=True)
            system = System(self.work / "iop", redis_server)
            self.stack.callback(system.close)
            system.write_config({
                "dispatch": fast_dispatch(lease_ms=10_000),
                "queue": {"hold_when_unavailable_ms": 30_000},
                "models": [{"id": MODEL, "providers": {pid: LLAMA_SERVED for pid in PROVIDERS}}],
                "nodes": [{"id": f"n-{pid}", "providers": [{
                    "id": pid, "type": "llamacpp", "base_url": server.url, "capacity": 1,
                    "models": [LLAMA_SERVED], "endpoints": ["chat/completions", "completions"], "timeout_s": 60,
                }]} for pid, server in self.servers.items()],
            })
            for pid in PROVIDERS:
                system.worker(f"n-{pid}")
            system.api()
            system.wait_available(*PROVIDERS)
            self._system = system
        except BaseException:
            self.stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    @property
    def system(self) -> System:
        assert self._system is not None, "the bench is not running"
        return self._system

    def logs(self) -> str:
        servers = "\n".join(f"----- {s.name} -----\n{s.proc.log()[-3000:]}" for s in self.servers.values())
        return f"{self.system.logs()}\n{servers}"

    def _paced(self) -> contextlib.AbstractContextManager[None]:
        return paced(list(self.servers.values()), self.pace)

    def direct(self, body: dict[str, Any], pid: str = PROVIDERS[0]) -> Stream:
        """``body`` straight to ``pid``'s server."""
        with self._paced():
            return stream(self.servers[pid].url, {**body, "model": LLAMA_SERVED})

    def through_iop(self, body: dict[str, Any] = BODY) -> Stream:
        with self._paced():
            return stream(self.system.api_url, body)

    def cold(self) -> None:
        """Until iop has both providers, each server's cache empty."""
        self.system.wait_available(*PROVIDERS)
        for server in self.servers.values():
            server.erase()

    def trial(self, number: int, cut_after: int, reference: list[str]) -> Trial:
        """The request through iop, its server SIGKILLed once ``cut_after`` content chunks
        reached the caller, and that server started again; run again if the kill came after
        the server had written its whole answer."""
        for run in range(1, UNCUT_RETRIES + 2):
            trial = self._once(number, cut_after, reference)
            trial.runs = run
            if trial.splice is not None or trial.stream.errors() or not trial.identical:
                break
        return trial

    def _once(self, number: int, cut_after: int, reference: list[str]) -> Trial:
        self.cold()
        killed: dict[str, Any] = {}

        def cut(s: Stream) -> None:
            if len(s.content) == cut_after and not killed:
                pid = s.headers.get("x-iop-provider", "")
                killed.update(pid=pid, at=time.perf_counter())
                if pid in self.servers:
                    self.servers[pid].kill()

        with self._paced():
            got = stream(self.system.api_url, BODY, after_content=cut)
        pid = killed.get("pid", "")
        trial = Trial(number, cut_after, pid, got, reference, killed_at=killed.get("at", 0.0))
        if pid in self.servers:
            if trial.continued_on in self.servers:
                trial.direct_ttft_s = self.prefilled_ttft(trial.continued_on, trial)
            self.servers[pid].start()
        return trial

    def prefilled_ttft(self, pid: str, trial: Trial) -> float | None:
        """The time ``pid``'s server takes to its first token on the prompt the continuation
        sent it (the text before the splice as a trailing assistant message), straight, its
        cache empty, paced as in the trial."""
        n = trial.splice
        if n is None:
            return None
        body = {**BODY, "max_tokens": 1, "continue_final_message": True, "add_generation_prompt": False,
                "messages": [*MESSAGES, {"role": "assistant", "content": "".join(trial.stream.content[:n])}]}
        self.servers[pid].erase()
        s = self.direct(body, pid)
        return s.content_at[0] - s.started if s.content_at else None


@dataclass
class Run:
    direct: Stream  # the uninterrupted answer straight from a server
    via: Stream  # and through iop
    trials: list[Trial]

    def summary(self) -> str:
        usage = self.direct.usage() or {}
        prompt_tokens = usage.get("prompt_tokens")
        whole = [t for t in self.trials if not t.problems()]
        identical = [t for t in self.trials if t.identical]
        off = [t.number for t in self.trials if t.prompt_tokens() != prompt_tokens]
        gaps = sorted(t.gap_s for t in self.trials if t.gap_s is not None)
        over = [t.number for t in self.trials
                if t.gap_s is not None and t.direct_ttft_s is not None and t.gap_s > t.direct_ttft_s + 1.0]
        rerun = [f"{t.number} ({t.runs - 1})" for t in self.trials if t.runs > 1]
        lines = [
            f"- uninterrupted: {len(self.direct.content)} tokens, {len(self.direct.text)} characters, finish "
            f"{self.direct.finish_reasons()}, prompt_tokens {prompt_tokens}; the same through iop: "
            f"{self.via.text == self.direct.text}",
            f"- streams that ended normally, continued once (200, finish_reason, usage, one [DONE], no error "
            f"event): {len(whole)} of {len(self.trials)}",
            f"- joined text identical to the uninterrupted one: {len(identical)} of {len(self.trials)}",
            f"- usage.prompt_tokens other than the uninterrupted answer's: trials {off or 'none'}",
            f"- trials run again because the kill came after the whole answer: {', '.join(rerun) or 'none'}",
        ]
        if gaps:
            lines.append(f"- wait at the cut: median {gaps[len(gaps) // 2] * 1000:.0f} ms, max "
                         f"{gaps[-1] * 1000:.0f} ms; over the other server's prefilled TTFT + 1 s: {over or 'none'}")
        lines += [f"- trial {t.number}: {p}" for t in self.trials for p in t.problems()]
        return "\n".join(lines) + "\n"

    def markdown(self) -> str:
        out = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
        out += ["| " + " | ".join(t.row()) + " |" for t in self.trials]
        return "\n".join(out) + "\n"

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps({
            "reference": self.direct.content, "through_iop": self.via.content,
            "trials": [{"number": t.number, "cut_after": t.cut_after, "splice": t.splice, "killed": t.killed,
                        "continued_on": t.continued_on, "runs": t.runs, "content": t.stream.content,
                        "comments": t.stream.comments, "usage": t.stream.usage(), "iop": t.stream.iop(),
                        "errors": t.stream.errors()} for t in self.trials],
        }, indent=1))


def run(bench: Bench, trials: int, seed: int, progress: Callable[[Trial], None] = lambda _: None) -> Run:
    """The uninterrupted answer (straight and through iop) and ``trials`` cut ones, the cuts
    drawn from ``seed``."""
    rng = random.Random(seed)
    bench.cold()
    direct = bench.direct(BODY)
    bench.cold()
    via = bench.through_iop()
    done = []
    for number in range(1, trials + 1):
        done.append(bench.trial(number, rng.randint(FIRST_CUT, LAST_CUT), direct.content))
        progress(done[-1])
    return Run(direct, via, done)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=49)
    parser.add_argument("--model", choices=["tiny", "wide"], default="tiny")
    parser.add_argument("--work", type=Path, default=None, help="logs and trials.json (default: a new temporary dir)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="continuation-real-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"logs and trials.json under {work}", flush=True)
    with Bench(work, args.model) as bench:
        result = run(bench, args.trials, args.seed, progress=lambda t: print(" | ".join(t.row()), flush=True))
    result.dump(work / "trials.json")
    print(f"\n{result.markdown()}\n{result.summary()}")


if __name__ == "__main__":
    main()
