"""A simulated LLM inference server with a prefix cache and continuous batching, for
benchmarks of cache-aware dispatch (bench/prefix_fleet.py) and of learned capacity
(bench/capacity_fleet.py); one process per server:

    python -m bench.fleet_sim --port P --kv-blocks N [--max-batch 8] [--step-ms 20] ...

It serves what a gateway or a router asks of a vLLM or SGLang server, without a model:
``POST /v1/chat/completions`` and ``POST /v1/completions`` (JSON, or SSE with ``stream:
true`` ending in ``data: [DONE]``, the usage chunk when ``stream_options.include_usage``;
``usage`` carries ``prompt_tokens``, ``completion_tokens`` and
``prompt_tokens_details.cached_tokens``), ``GET /v1/models``, ``GET /health``, and what
sglang-router reads from an SGLang server: ``GET /get_server_info`` (alias
``/server_info``), ``/get_model_info`` (alias ``/model_info``), ``/health_generate``,
``/get_load``. ``GET /metrics`` serves the engine's gauges in Prometheus text format, as
vLLM or as SGLang names them (``--metrics vllm|sglang|none``; none: 404, a server without
metrics). ``GET /sim/stats`` reports the server's counters and its current settings (and
every path it was asked, to see what a router probes); ``POST /sim/control`` changes the
step costs, the batch, a ``slowdown`` factor or the metrics while it runs (a JSON object of
the settings to change; what runs from the next step on uses them); ``POST /sim/reset``
empties the cache, zeroes the counters and restores the start-up settings between benchmark
runs (409 while requests run).

With ``--models a,b,c`` it swaps models as llama.cpp's llama-server does in router mode
(``--models-dir``, ``--models-max``; tools/server/server-models.cpp and server.cpp), and
serves its model-management API instead of SGLang's: see *Model swapping* below. Without
``--models`` nothing of it exists and the server is the one described here.

What is modelled
================

* **Tokens.** One token per whitespace-separated word of the prompt text, so prompts that
  share text share tokens. A chat prompt is, per message, a ``<|role|>`` token then its
  content's words (text parts of a content list joined), and an ``<|assistant|>`` token
  at the end -- the shape a chat template gives. The answer is ``max_tokens`` tokens
  (``max_tokens`` or ``max_completion_tokens`` of the body, else ``--max-tokens``), always
  that many (as with ``ignore_eos``; ``finish_reason`` is ``length``).
* **KV memory and the prefix cache.** ``--kv-blocks`` blocks of ``--block-tokens`` tokens
  (16). Every full block of a prompt has a chained hash (block i's hash covers blocks
  0..i); a request's cached prefix is the longest run of its leading blocks present in the
  cache. Admission reserves a block for each token it will hold that is not cached (the
  uncached prompt, the last partial prompt block, the whole answer); when a chunk of
  prefill reaches the end of a full prompt block, that block enters the cache (a block
  that another request entered meanwhile is shared, its reservation given back). Cached
  blocks used by running requests are pinned; the others form an LRU, evicted to make room
  for an admission. A finishing request returns its blocks to the LRU deepest first, so
  that a prefix is evicted from its end, as a radix tree evicts leaves first.
* **Continuous batching.** A step loop: each step admits waiting requests (FIFO; the head
  waits while the batch is full, at ``--max-batch`` running requests, or while the memory
  it needs is pinned, and those behind it wait too), then runs one step that takes
  ``step_ms + prefill_ms_per_token x prefill tokens + decode_ms_per_seq x decoding
  requests``. Prefill is chunked: at most ``--prefill-budget`` uncached prompt tokens per
  step, given to the running requests in admission order; the step that ends a request's
  prefill gives it its first output token (its time to first token), and each later step
  gives it one more until ``max_tokens``. Requests whose client goes away leave at once.
* **Engine metrics** (``GET /metrics``), with the names, types, help texts and labels of
  the engines' own Prometheus collectors. ``vllm`` (vllm/v1/metrics/loggers.py; labels
  ``engine="0"``, ``model_name``): ``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (0-1), set after every step as
  vLLM sets them from each step's scheduler stats, and the counters
  ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
  ``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total`` (of finished
  requests); *waiting* is what the step's scheduling left waiting: a request that arrives
  during a step is not counted before the next one schedules it (vLLM's engine core adds
  new requests between steps). ``sglang`` (sglang/srt/metrics/collector.py; labels ``engine_type="unified"``,
  ``model_name``, ``pp_rank="0"``, ``tp_rank="0"``): ``sglang:num_running_reqs``,
  ``sglang:num_queue_reqs``, ``sglang:token_usage`` (0-1), ``sglang:num_used_tokens``,
  ``sglang:max_total_num_tokens``, refreshed only when SGLang logs its stats: when a prefill
  batch forms (running: the requests already running before it; waiting: what is left
  queued), every 40th decoding step (its ``--decode-log-interval`` default), and, idle, 30 s
  after the last refresh -- so they can be up to 40 steps old while busy, and keep their
  last busy values for 30 s once idle, as SGLang's do. KV use is the blocks held by running
  requests (their pinned prefix and their reservations) over the KV size: evictable cached
  blocks count as free, as both engines count them.
* **Run-time control** (``POST /sim/control``): ``step_ms``, ``decode_ms_per_seq``,
  ``prefill_ms_per_token``, ``max_batch``, ``slowdown`` (multiplies the whole cost of every
  step) and ``metrics``. A step already under way keeps the duration it was planned with; a
  smaller ``max_batch`` lets the requests running beyond it finish and admits none until
  the batch is under it.
* **Time** is real: the loop sleeps for each step's simulated duration, so the gateway or
  router in front is measured for real. A step that ends late (the machine was busy) is
  made up by starting the next one at the planned time, unless the loop fell more than
  ``--catch-up-ms`` (50) behind, when the schedule restarts from now.

Defaults (the benchmark's figures): 20 ms per step plus 0.5 ms per decoding request, 0.1
ms per prefilled token (a 1,800-token prompt: 180 ms; its 300 uncached tokens after a
prefix hit: 30 ms), 2,048 prefill tokens per step, 8 running requests at most. Absolute
figures are therefore simulated, not those of any GPU; the ratios between prefill and
decode are in the range of a mid-sized model on one accelerator.

Model swapping (``--models``, llama.cpp's router mode)
=====================================================

    python -m bench.fleet_sim --port P --models a,b,c [--models-max 4] [--load-ms 1000] [--preload a]

The server holds at most ``--models-max`` of the models it can serve (0: no limit; 4 is
llama-server's default) and ``--preload`` ones are loaded at start (llama-server's
``load-on-startup`` presets; more than ``--models-max`` is refused, as llama-server refuses
them). As the router runs one child llama-server per loaded model, each loaded model here
has a batch, a KV cache and a step loop of its own (a ``Scheduler`` each, with the settings
above): loaded models run independently, and a load costs time only to the requests of the
model it loads. A load takes ``--load-ms`` (the child's start and the model's reading),
during which the model is ``loading``; an unload is immediate. What the router does, done
here the same way:

* ``GET /models`` and ``GET /v1/models`` list every model: ``{"data": [{"aliases": [],
  "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
  "can_remove": false, "created": <unix time>, "id": "a", "object": "model", "owned_by":
  "llamacpp", "source": "models_dir", "status": {"args": [...], "value":
  "loaded"|"loading"|"unloaded"}, "tags": []}, ...], "object": "list"}`` (keys sorted, as
  nlohmann::json writes them; a model whose load was cut short also has ``"exit_code": 1,
  "failed": true`` in its status until it loads again).
* ``POST /models/load`` ``{"model": "a"}``: starts the load and answers ``{"success": true}``
  at once (the load goes on; ``GET /models`` shows it); 404 ``model is not found``, 400
  ``model is already running`` (loaded or loading). ``POST /models/unload`` ``{"model":
  "a"}``: ``{"success": true}``; 400 ``model is not found`` or ``model is not running``.
  Errors are the router's: ``{"error": {"code": 400, "message": ..., "type":
  "invalid_request_error"}}`` (404: ``not_found_error``; 500: ``server_error``).
* A chat or completion request names its model (400 ``model name is missing from the
  request`` or ``model 'x' not found`` otherwise); one for a model not loaded loads it
  (autoload, the router's default) and waits, with every other request for it, until it is
  loaded: the load is part of their time to first token. A request marks its model used
  when it is sent on to it (after any load); loads mark it too.
* A load with ``--models-max`` models loaded or loading first unloads the least recently
  used of them -- whether or not it is busy, as the router's ``unload_lru`` does: the
  requests running or queued on it are cut off (a stream ends without ``[DONE]``, the
  connection closed; a JSON answer not yet begun is a 500), and a model still loading is
  killed, failing the requests that waited for it (500 ``model name=a failed to load``).
* ``GET /props`` is the router's (``{"build_info": ..., "cors_proxy_enabled": false,
  "default_generation_settings": {"n_ctx": 0, "params": {}}, "max_instances": <--models-max>,
  "model_alias": "llama-server", "model_path": "none", "models_autoload": true, "role":
  "router", "ui_settings": {}}``); ``GET /props?model=a`` its child's (``total_slots``: the
  batch, ``n_ctx``, ``model_alias``), while it runs.
* ``GET /metrics?model=a`` is that model's engine metrics (as ``--metrics`` says) while it
  runs, 400 ``model is not loaded`` when it does not (the router would load it: not here,
  so that a scraper cannot move models), 400 without ``model``. SGLang's endpoints
  (``/get_server_info``, ``/get_load``, ...) are not served (404), as llama-server has none.
* ``/sim/stats`` adds ``models`` (each one's ``status``, ``running``, ``waiting``, and
  ``requests`` its engine answered since it last loaded), ``loads`` (``{"request": n, "api": n}``: autoloads and
  ``/models/load``'s), ``unloads`` (``{"api": n, "lru": n}``), ``cut_off`` (requests cut off
  by an unload), ``failed_loads`` (loads killed while loading) and ``swap`` (the settings);
  the engine counters are summed over every model's engine since the last reset (those
  unloaded since included), ``max_waiting`` their largest. ``/sim/control`` changes every
  model's engine and those loaded later. ``/sim/reset`` (409 while a request runs or a
  model loads) unloads everything, zeroes the counters and loads the ``--preload`` models
  again, at once.

Left out of it: the router's own cost (it proxies every request to its child over HTTP),
presets, aliases, downloads, sleeping children, a child's ``loaded_info`` in ``/models``,
the models' sharing of one accelerator (they run side by side without slowing each other),
and a failed load (every load succeeds unless an unload kills it).

Left out
========

Memory-pressure preemption and recomputation (admission waits for memory instead, so a
running request never loses its blocks); swapping or offloading KV to host memory or disk
(hierarchical caches); caching of generated tokens (only prompt blocks enter the cache, so
a multi-turn conversation's previous answer is not a hit); speculative decoding; the
real cost curve of attention (a decode step's cost grows linearly with the batch, not
with the context length); a maximum context length other than the KV size (a request that
could never fit is answered 400); sampling, stop sequences and EOS (every answer is
``max_tokens`` long); priorities and scheduling policies other than FIFO (SGLang's
longest-prefix-first ordering of its waiting queue, for instance); data parallelism
inside one server (``dp_size`` is 1); tokenization and detokenization cost; network time;
the engines' other metrics (histograms, Python process metrics, counters' ``_created``
series) and their multi-engine labels; changing the KV size while running.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import math
import signal
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Final

import msgspec
from aiohttp import web

_JSON: Final = "application/json"
_DONE: Final = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class SimConfig:
    kv_blocks: int = 800
    block_tokens: int = 16
    max_batch: int = 8
    prefill_budget: int = 2048
    step_ms: float = 20.0
    prefill_ms_per_token: float = 0.1
    decode_ms_per_seq: float = 0.5
    max_tokens: int = 64  # the answer's length when the body names none
    model: str = "sim"
    catch_up_ms: float = 50.0
    slowdown: float = 1.0  # multiplies every step's cost: a server slowed down (another model, a shared GPU)
    metrics: str = "vllm"  # the engine whose /metrics it serves (METRICS), or none


@dataclass(frozen=True)
class SwapConfig:
    """Model swapping as llama.cpp's llama-server does it in router mode (see *Model swapping*)."""

    models: tuple[str, ...]  # what it can serve (its --models-dir)
    models_max: int = 4  # loaded (or loading) at once; 0: no limit -- llama-server's --models-max
    load_ms: float = 1000.0  # a load's duration
    preload: tuple[str, ...] = ()  # loaded at start (load-on-startup presets), in this order

    def problems(self) -> list[str]:
        """What is wrong with these settings (llama-server refuses the same at start)."""
        out = []
        if not self.models or len(set(self.models)) != len(self.models) or not all(self.models):
            out.append("--models must name distinct, non-empty models")
        if self.models_max < 0:
            out.append("--models-max must be 0 (no limit) or more")
        if self.load_ms < 0:
            out.append("--load-ms must be 0 or more")
        unknown = [m for m in self.preload if m not in self.models]
        if unknown:
            out.append(f"--preload names models not in --models: {', '.join(unknown)}")
        if len(set(self.preload)) != len(self.preload):
            out.append("--preload names a model twice")
        if self.models_max and len(self.preload) > self.models_max:
            out.append(f"number of models to load on startup ({len(self.preload)}) exceeds models_max "
                       f"({self.models_max})")
        return out


METRICS: Final = ("vllm", "sglang", "none")
SGLANG_DECODE_LOG_INTERVAL: Final = 40  # sglang's --decode-log-interval default: decode steps between refreshes
SGLANG_IDLE_LOG_S: Final = 30.0  # an idle SGLang scheduler refreshes its gauges this long after the last time


def _number(minimum: float, strict: bool = False) -> tuple[Callable[[Any], bool], str]:
    def ok(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool) and (v > minimum if strict else v >= minimum)
    return ok, f"a number {'>' if strict else '≥'} {minimum:g}"


# What /sim/control may change while the server runs: a check and what it says it wants.
CONTROLS: Final[dict[str, tuple[Callable[[Any], bool], str]]] = {
    "step_ms": _number(0),
    "decode_ms_per_seq": _number(0),
    "prefill_ms_per_token": _number(0),
    "max_batch": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "a whole number ≥ 1"),
    "slowdown": _number(0, strict=True),
    "metrics": (lambda v: v in METRICS, "one of " + ", ".join(METRICS)),
}


def controlled(config: SimConfig, changes: Any) -> SimConfig:
    """``config`` with the run-time ``changes`` of ``POST /sim/control``; ValueError saying
    what is wrong, and nothing changed, when one of them is not a setting or not valid."""
    if not isinstance(changes, dict):
        raise ValueError("the body must be a JSON object of settings to change")
    unknown = sorted(set(changes) - set(CONTROLS))
    if unknown:
        raise ValueError(f"not a run-time setting: {', '.join(unknown)} (settings: {', '.join(CONTROLS)})")
    for name, value in changes.items():
        ok, wanted = CONTROLS[name]
        if not ok(value):
            raise ValueError(f"'{name}' must be {wanted}, not {value!r}")
    floats = {k: float(v) for k, v in changes.items() if isinstance(getattr(config, k), float)}
    return replace(config, **{**changes, **floats})


# --------------------------------------------------------------------------- tokens


def content_text(content: Any) -> str:
    """A message's text: a string, or the ``text`` of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def chat_tokens(messages: Sequence[Any]) -> list[str]:
    tokens: list[str] = []
    for message in messages:
        role = message.get("role", "user") if isinstance(message, dict) else "user"
        tokens.append(f"<|{role}|>")
        tokens.extend(content_text(message.get("content") if isinstance(message, dict) else None).split())
    tokens.append("<|assistant|>")
    return tokens


def block_hashes(tokens: Sequence[str], block_tokens: int) -> list[bytes]:
    """The chained hash of every full block: block i's covers the tokens of blocks 0..i."""
    hashes: list[bytes] = []
    previous = b""
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        h = hashlib.blake2b(previous, digest_size=16)  # previous is 0 or 16 bytes: no ambiguity
        h.update("\x1f".join(tokens[start:start + block_tokens]).encode())
        previous = h.digest()
        hashes.append(previous)
    return hashes


# --------------------------------------------------------------------------- KV memory


class KVCache:
    """``capacity`` blocks: cached prompt blocks (pinned by running requests, or in an LRU)
    and blocks reserved by running requests for what is not cached yet."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[bytes, None] = OrderedDict()  # cached, unpinned; first = least recently used
        self.refs: dict[bytes, int] = {}  # cached and pinned: how many running requests use it
        self.reserved = 0
        self.evictions = 0

    @property
    def used(self) -> int:
        return len(self.lru) + len(self.refs) + self.reserved

    def cached(self, h: bytes) -> bool:
        return h in self.refs or h in self.lru

    def match(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``hashes`` are cached."""
        n = 0
        for h in hashes:
            if not self.cached(h):
                break
            n += 1
        return n

    def try_admit(self, hashes: Sequence[bytes], total_blocks: int) -> int | None:
        """Pin the cached prefix of ``hashes`` and reserve the other ``total_blocks`` blocks,
        evicting unpinned blocks as needed; the number of cached blocks, or None (and
        nothing changed) when the memory is not there."""
        matched = self.match(hashes)
        need = total_blocks - matched
        # Blocks of the prefix about to be pinned cannot be evicted to make room for it.
        evictable = len(self.lru) - sum(1 for h in hashes[:matched] if h in self.lru)
        if need > self.capacity - self.used + evictable:
            return None
        for h in hashes[:matched]:
            self._pin(h)
        while self.capacity - self.used < need:
            self.lru.popitem(last=False)
            self.evictions += 1
        self.reserved += need
        return matched

    def register(self, h: bytes) -> None:
        """One reserved block now holds the computed prompt block ``h``, pinned by its
        request; a copy another request entered meanwhile is shared instead."""
        self.reserved -= 1
        self._pin(h)

    def _pin(self, h: bytes) -> None:
        if h in self.refs:
            self.refs[h] += 1
        else:
            self.lru.pop(h, None)
            self.refs[h] = 1

    def release(self, pinned: Sequence[bytes], reserved: int) -> None:
        """A request leaves: its reservations end, its pinned blocks go back to the LRU once
        nobody uses them -- deepest first, so that a prefix's root is evicted last."""
        self.reserved -= reserved
        for h in reversed(pinned):
            n = self.refs[h] - 1
            if n:
                self.refs[h] = n
            else:
                del self.refs[h]
                self.lru[h] = None

    def clear(self) -> None:
        assert not self.refs, "clear() with requests running"
        assert not self.reserved, "clear() with requests running"
        self.lru.clear()
        self.evictions = 0


# --------------------------------------------------------------------------- scheduling


class TooLong(ValueError):
    pass


class SimRequest:
    __slots__ = ("aborted", "arrival", "cached_tokens", "done", "event", "first_token_at", "generated", "hashes",
                 "max_tokens", "pinned", "prefilled", "prompt_tokens", "registered", "reserved", "total_blocks")

    def __init__(self, prompt_tokens: int, hashes: list[bytes], max_tokens: int, total_blocks: int,
                 arrival: float) -> None:
        self.prompt_tokens = prompt_tokens
        self.hashes = hashes
        self.max_tokens = max_tokens
        self.total_blocks = total_blocks
        self.arrival = arrival
        self.cached_tokens = 0
        self.prefilled = 0  # prompt tokens whose KV exists (cached or computed)
        self.registered = 0  # leading full prompt blocks pinned (cached at admission or computed)
        self.generated = 0
        self.reserved = 0
        self.pinned: list[bytes] = []
        self.first_token_at: float | None = None
        self.done = False
        self.aborted = False  # cut off: its model was unloaded under it (model swapping)
        self.event = asyncio.Event()  # set whenever generated or done changes


@dataclass
class Stats:
    requests: int = 0  # completed
    cancelled: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_tokens: int = 0
    output_tokens: int = 0
    steps: int = 0
    busy_s: float = 0.0
    max_waiting: int = 0
    late_steps: int = 0  # steps that ended more than catch_up_ms late (the machine was busy)


@dataclass(frozen=True)
class Gauges:
    """What the engine's metrics say, as of ``at`` (monotonic seconds)."""

    running: int = 0
    waiting: int = 0
    kv_used: int = 0  # blocks held by running requests: pinned prefix blocks and reservations
    at: float = 0.0


class Scheduler:
    def __init__(self, config: SimConfig) -> None:
        self.initial = config
        self.config = config
        self.kv = KVCache(config.kv_blocks)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.stats = Stats()
        self.gauges = Gauges(at=time.monotonic())
        self._decode_steps = 0
        # What the last scheduling left waiting. Requests that arrive during a step are not
        # the engine's until the next one: vLLM's engine core adds them to its scheduler
        # between steps, SGLang's scheduler receives them at the top of its loop; neither
        # counts them in the stats of the step they arrived during.
        self._unscheduled = 0
        self._wake = asyncio.Event()

    def configure(self, changes: Any) -> SimConfig:
        """Apply ``POST /sim/control``'s ``changes`` (see ``controlled``) from the next step on."""
        self.config = controlled(self.config, changes)
        self._wake.set()  # a larger batch may admit what waits
        return self.config

    def measure(self, running: int | None = None) -> None:
        """Refresh the gauges from the scheduler's state now (``running``: the count to report)."""
        held = self.kv.used - len(self.kv.lru)  # evictable cached blocks are free to both engines
        self.gauges = Gauges(len(self.running) if running is None else running,
                             min(len(self.waiting), self._unscheduled), held, time.monotonic())

    def current_gauges(self) -> Gauges:
        """The gauges a scrape sees now: SGLang's idle scheduler refreshes them only once
        ``SGLANG_IDLE_LOG_S`` have passed since the last refresh."""
        if (self.config.metrics == "sglang" and not self.running
                and time.monotonic() - self.gauges.at > SGLANG_IDLE_LOG_S):
            self.measure()
        return self.gauges

    def submit(self, tokens: Sequence[str], max_tokens: int) -> SimRequest:
        bt = self.config.block_tokens
        total_blocks = math.ceil((len(tokens) + max_tokens) / bt)
        if total_blocks > self.config.kv_blocks:
            self.stats.rejected += 1
            raise TooLong(f"{len(tokens)} prompt + {max_tokens} output tokens need {total_blocks} KV blocks; "
                          f"the server has {self.config.kv_blocks}")
        request = SimRequest(len(tokens), block_hashes(tokens, bt), max_tokens, total_blocks, time.monotonic())
        self.waiting.append(request)
        self.stats.max_waiting = max(self.stats.max_waiting, len(self.waiting))
        self._wake.set()
        return request

    def cancel(self, request: SimRequest) -> None:
        """The client went away: the request leaves the queue or the batch now."""
        if request.done:
            return
        if request in self.waiting:
            self.waiting.remove(request)
            request.done = True
        else:
            self._finish(request)
        self.stats.cancelled += 1

    def admit(self) -> None:
        before = len(self.running)
        self._admit()
        self._unscheduled = len(self.waiting)
        if self.config.metrics == "sglang" and len(self.running) > before:
            # SGLang logs its stats when a prefill batch forms: the running batch before it joins.
            self.measure(running=before)

    def _admit(self) -> None:
        bt = self.config.block_tokens
        while self.waiting and len(self.running) < self.config.max_batch:
            request = self.waiting[0]
            matched = self.kv.try_admit(request.hashes, request.total_blocks)
            if matched is None:
                return  # FIFO: the head waits for memory, and everything behind it
            self.waiting.popleft()
            request.pinned = list(request.hashes[:matched])
            request.registered = matched
            request.reserved = request.total_blocks - matched
            # A prompt cached to its last token still computes that token (its logits give the first output).
            request.cached_tokens = min(matched * bt, request.prompt_tokens - 1) if request.prompt_tokens else 0
            request.prefilled = request.cached_tokens
            self.running.append(request)

    def plan(self) -> tuple[list[tuple[SimRequest, int]], list[SimRequest], float]:
        """This step's prefill chunks, its decoding requests and its duration in seconds."""
        budget = self.config.prefill_budget
        chunks: list[tuple[SimRequest, int]] = []
        decoding: list[SimRequest] = []
        for request in self.running:
            left = request.prompt_tokens - request.prefilled
            if left <= 0:
                decoding.append(request)
            elif budget > 0:
                n = min(left, budget)
                chunks.append((request, n))
                budget -= n
        prefill = sum(n for _, n in chunks)
        c = self.config
        ms = (c.step_ms + c.prefill_ms_per_token * prefill + c.decode_ms_per_seq * len(decoding)) * c.slowdown
        return chunks, decoding, ms / 1000

    def apply(self, chunks: list[tuple[SimRequest, int]], decoding: list[SimRequest], now: float) -> None:
        bt = self.config.block_tokens
        touched: list[SimRequest] = []
        for request, n in chunks:
            if request.done:  # cancelled during the step
                continue
            request.prefilled += n
            self.stats.prefill_tokens += n
            full = min(request.prefilled // bt, len(request.hashes))
            while request.registered < full:
                h = request.hashes[request.registered]
                self.kv.register(h)
                request.pinned.append(h)
                request.reserved -= 1
                request.registered += 1
            if request.prefilled >= request.prompt_tokens:
                request.generated = 1
                request.first_token_at = now
                touched.append(request)
        for request in decoding:
            if not request.done:
                request.generated += 1
                touched.append(request)
        for request in touched:
            if request.generated >= request.max_tokens:
                self._finish(request)
                s = self.stats
                s.requests += 1
                s.prompt_tokens += request.prompt_tokens
                s.cached_tokens += request.cached_tokens
                s.output_tokens += request.generated
            request.event.set()
        if self.config.metrics == "vllm":
            self.measure()  # vLLM sets its gauges from every step's scheduler stats
        elif decoding:
            self._decode_steps += 1
            if self._decode_steps % SGLANG_DECODE_LOG_INTERVAL == 0:
                self.measure()

    def _finish(self, request: SimRequest) -> None:
        request.done = True
        self.kv.release(request.pinned, request.reserved)
        request.reserved = 0
        request.pinned = []
        self.running.remove(request)
        request.event.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        catch_up = self.config.catch_up_ms / 1000
        next_start: float | None = None
        while True:
            self.admit()
            if not self.running:
                next_start = None
                self._wake.clear()
                await self._wake.wait()
                continue
            chunks, decoding, duration = self.plan()
            now = loop.time()
            if next_start is None or now - next_start > catch_up:
                if next_start is not None:
                    self.stats.late_steps += 1
                next_start = now
            end = next_start + duration
            await asyncio.sleep(max(0.0, end - now))
            next_start = end
            self.stats.steps += 1
            self.stats.busy_s += duration
            self.apply(chunks, decoding, time.monotonic())

    def reset(self) -> None:
        if self.running or self.waiting:
            raise RuntimeError("requests are running")
        self.kv.clear()
        self.stats = Stats()
        self.config = self.initial
        self._decode_steps = 0
        self.measure()


# --------------------------------------------------------------------------- model swapping


LOADED: Final = "loaded"
LOADING: Final = "loading"
UNLOADED: Final = "unloaded"


class LoadFailed(RuntimeError):
    pass


def summed(a: Stats, b: Stats) -> Stats:
    """Two engines' counters together (the deepest queue: the larger)."""
    out = Stats(**{k: v + getattr(b, k) for k, v in asdict(a).items()})
    out.max_waiting = max(a.max_waiting, b.max_waiting)
    return out


class Instance:
    """One model of a router: unloaded, loading, or loaded with an engine (a child
    llama-server: a ``Scheduler`` and its step loop) of its own."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.status = UNLOADED
        self.failed = False  # its last load was killed (llama-server: unloaded with an exit code)
        self.last_used = 0.0  # monotonic; the router's LRU order
        self.scheduler: Scheduler | None = None
        self.task: asyncio.Task[None] | None = None  # the load, then the engine's step loop
        self._changed = asyncio.Event()

    def set_status(self, status: str) -> None:
        self.status = status
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()  # wakes whoever waits for this change

    async def changed(self) -> None:
        await self._changed.wait()


class Router:
    """The models of a server that swaps them (``SwapConfig``), as llama-server's router
    keeps them (tools/server/server-models.cpp: ``load``, ``unload_lru``,
    ``ensure_model_ready``)."""

    def __init__(self, config: SimConfig, swap: SwapConfig) -> None:
        problems = swap.problems()
        if problems:
            raise ValueError("; ".join(problems))
        self.config = config
        self.swap = swap
        self.instances = {name: Instance(name) for name in swap.models}
        self._zero()

    def _zero(self) -> None:
        self.retired = Stats()  # the counters of engines since unloaded
        self.retired_kv_evictions = 0
        self.loads: Counter[str] = Counter({"request": 0, "api": 0})
        self.unloads: Counter[str] = Counter({"api": 0, "lru": 0})
        self.cut_off = 0
        self.failed_loads = 0

    def preload(self) -> None:
        """Load the ``--preload`` models at once (in their order: the first is the least recently used)."""
        for name in self.swap.preload:
            inst = self.instances[name]
            inst.last_used = time.monotonic()
            self._start_engine(inst)

    def running(self) -> list[Instance]:
        """Loaded or loading: what counts against ``models_max`` (llama-server's ``is_running``)."""
        return [i for i in self.instances.values() if i.status != UNLOADED]

    def load(self, name: str, reason: str) -> None:
        """Start loading ``name`` (unloaded), first unloading the least recently used model
        when ``models_max`` are loaded or loading, busy or not (llama-server's ``unload_lru``)."""
        inst = self.instances[name]
        running = self.running()
        if self.swap.models_max and len(running) >= self.swap.models_max:
            self.unload(min(running, key=lambda i: i.last_used).name, "lru")
        inst.failed = False
        inst.last_used = time.monotonic()
        self.loads[reason] += 1
        inst.set_status(LOADING)
        inst.task = asyncio.create_task(self._load(inst))

    async def _load(self, inst: Instance) -> None:
        await asyncio.sleep(self.swap.load_ms / 1000)
        self._start_engine(inst)

    def _start_engine(self, inst: Instance) -> None:
        scheduler = Scheduler(self.config)
        inst.scheduler = scheduler
        inst.task = asyncio.create_task(scheduler.run())
        inst.set_status(LOADED)

    def unload(self, name: str, reason: str) -> None:
        """Unload ``name`` (loaded or loading) now: a load is killed, the requests running or
        queued on its engine are cut off."""
        inst = self.instances[name]
        if inst.task is not None:
            inst.task.cancel()  # the load's sleep or the engine's loop
            inst.task = None
        if inst.status == LOADING:
            inst.failed = True
            self.failed_loads += 1
        s = inst.scheduler
        if s is not None:
            for request in [*s.running, *s.waiting]:
                request.aborted = request.done = True
                request.event.set()
                self.cut_off += 1
            self.retired = summed(self.retired, s.stats)
            self.retired_kv_evictions += s.kv.evictions
            inst.scheduler = None
        self.unloads[reason] += 1
        inst.set_status(UNLOADED)

    async def ready(self, name: str) -> Scheduler:
        """The engine of ``name`` for a request, loading it first when it is not loaded
        (llama-server's ``ensure_model_ready``, then ``proxy_request``, which marks it used)."""
        inst = self.instances[name]
        if inst.status == UNLOADED:
            self.load(name, "request")
        while inst.status == LOADING:
            await inst.changed()
        if inst.status != LOADED or inst.scheduler is None:
            raise LoadFailed(f"model name={name} failed to load")
        inst.last_used = time.monotonic()
        return inst.scheduler

    def schedulers(self) -> list[Scheduler]:
        return [i.scheduler for i in self.instances.values() if i.scheduler is not None]

    def busy(self) -> str | None:
        """Why the router cannot be reset now, or None."""
        if any(i.status == LOADING for i in self.instances.values()):
            return "a model is loading"
        if any(s.running or s.waiting for s in self.schedulers()):
            return "requests are running"
        return None

    def reset(self) -> None:
        """Everything unloaded, counters zeroed, the preload loaded again (``busy()`` first)."""
        for inst in self.instances.values():
            if inst.task is not None:
                inst.task.cancel()
                inst.task = None
            inst.scheduler = None
            inst.failed = False
            inst.last_used = 0.0
            inst.set_status(UNLOADED)
        self._zero()
        self.preload()

    def stop(self) -> list[asyncio.Task[None]]:
        """Cancel every load and engine loop; the tasks, to be awaited."""
        tasks = [i.task for i in self.instances.values() if i.task is not None]
        for task in tasks:
            task.cancel()
        return tasks

    def models_json(self) -> dict[str, Any]:
        """``GET /models`` as llama-server's router writes it (nlohmann::json: keys sorted)."""
        created = int(time.time())
        data = []
        for inst in self.instances.values():
            status: dict[str, Any] = {"args": ["llama-server", "--alias", inst.name, "--host", "127.0.0.1"],
                                      "value": inst.status}
            if inst.failed and inst.status == UNLOADED:
                status = {"args": status["args"], "exit_code": 1, "failed": True, "value": inst.status}
            data.append({"aliases": [], "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
                         "can_remove": False, "created": created, "id": inst.name, "object": "model",
                         "owned_by": "llamacpp", "source": "models_dir", "status": status, "tags": []})
        return {"data": data, "object": "list"}

    def stats(self) -> dict[str, Any]:
        total = self.retired
        for s in self.schedulers():
            total = summed(total, s.stats)
        scheds = self.schedulers()
        return {**asdict(total), "running": sum(len(s.running) for s in scheds),
                "waiting": sum(len(s.waiting) for s in scheds), "kv_used": sum(s.kv.used for s in scheds),
                "kv_cached": sum(len(s.kv.lru) + len(s.kv.refs) for s in scheds),
                "kv_evictions": self.retired_kv_evictions + sum(s.kv.evictions for s in scheds),
                "models": {i.name: {"status": i.status,
                                    "running": len(i.scheduler.running) if i.scheduler else 0,
                                    "waiting": len(i.scheduler.waiting) if i.scheduler else 0,
                                    "requests": i.scheduler.stats.requests if i.scheduler else 0}
                           for i in self.instances.values()},
                "loads": dict(self.loads), "unloads": dict(self.unloads), "cut_off": self.cut_off,
                "failed_loads": self.failed_loads, "swap": asdict(self.swap)}


# --------------------------------------------------------------------------- HTTP


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
    return web.Response(status=status, body=msgspec.json.encode(body), content_type=_JSON)


_ROUTER_ERRORS: Final = {400: "invalid_request_error", 404: "not_found_error", 500: "server_error"}


def _router_error(status: int, message: str) -> web.Response:
    """An error as llama-server writes it (``format_error_response``)."""
    return _json({"error": {"code": status, "message": message, "type": _ROUTER_ERRORS[status]}}, status=status)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(data), content_type=_JSON)


def _usage(request: SimRequest) -> dict[str, Any]:
    return {"prompt_tokens": request.prompt_tokens, "completion_tokens": request.generated,
            "total_tokens": request.prompt_tokens + request.generated,
            "prompt_tokens_details": {"cached_tokens": request.cached_tokens}}


_PROMETHEUS: Final = "text/plain; version=0.0.4; charset=utf-8"  # prometheus_client's CONTENT_TYPE_LATEST

# Each engine's families: name, type, help text (its collector's own), and what gives the value.
_Family = tuple[str, str, str, Callable[[Gauges, Stats, SimConfig], float]]
VLLM_FAMILIES: Final[tuple[_Family, ...]] = (
    ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
     lambda g, s, c: g.running),
    ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", lambda g, s, c: g.waiting),
    ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
     lambda g, s, c: g.kv_used / c.kv_blocks),
    ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", lambda g, s, c: s.prompt_tokens),
    ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
     lambda g, s, c: s.output_tokens),
    ("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.",
     lambda g, s, c: s.prompt_tokens),
    ("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.",
     lambda g, s, c: s.cached_tokens),
)
SGLANG_FAMILIES: Final[tuple[_Family, ...]] = (
    ("sglang:num_running_reqs", "gauge", "The number of running requests.", lambda g, s, c: g.running),
    ("sglang:num_used_tokens", "gauge", "The number of used tokens.", lambda g, s, c: g.kv_used * c.block_tokens),
    ("sglang:token_usage", "gauge", "The token usage.", lambda g, s, c: g.kv_used / c.kv_blocks),
    ("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.", lambda g, s, c: g.waiting),
    ("sglang:max_total_num_tokens", "gauge", "Maximum total number of tokens in the KV cache pool.",
     lambda g, s, c: c.kv_blocks * c.block_tokens),
)


def _label_value(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def prometheus_text(config: SimConfig, gauges: Gauges, stats: Stats) -> str:
    """``/metrics`` as the engine ``config.metrics`` writes it (prometheus_client's text
    format: HELP and TYPE lines, labels sorted by name, values as floats)."""
    if config.metrics == "vllm":
        families, labels = VLLM_FAMILIES, {"engine": "0", "model_name": config.model}
    else:
        families = SGLANG_FAMILIES
        labels = {"engine_type": "unified", "model_name": config.model, "pp_rank": "0", "tp_rank": "0"}
    label_text = ",".join(f'{k}="{_label_value(v)}"' for k, v in sorted(labels.items()))
    lines = []
    for name, kind, doc, value in families:
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}",
                  f"{name}{{{label_text}}} {float(value(gauges, stats, config))!r}"]
    return "\n".join(lines) + "\n"


class SimServer:
    def __init__(self, config: SimConfig, swap: SwapConfig | None = None) -> None:
        # With model swapping, this scheduler runs nothing: it holds the settings every
        # model's engine gets (``/sim/control`` changes them, ``/sim/reset`` restores them).
        self.scheduler = Scheduler(config)
        self.router = Router(config, swap) if swap is not None else None
        self.paths: Counter[str] = Counter()  # every path asked, to see what a router probes
        self._ids = itertools.count(1)
        self._task: asyncio.Task[None] | None = None

    @property
    def config(self) -> SimConfig:
        """The settings in force now (``POST /sim/control`` changes them)."""
        return self.scheduler.config

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._count_paths], client_max_size=64 * 2**20)
        add = app.router.add_route
        add("POST", "/v1/chat/completions", self._chat)
        add("POST", "/v1/completions", self._completions)
        if self.router is not None:  # llama-server's router: its model list and management, no SGLang
            for path in ("/models", "/v1/models"):
                add("GET", path, self._router_models)
            add("GET", "/props", self._router_props)
            add("POST", "/models/load", self._router_load)
            add("POST", "/models/unload", self._router_unload)
            add("GET", "/health", self._health)
            add("GET", "/metrics", self._router_metrics)
        else:
            add("GET", "/v1/models", self._models)
            for path in ("/health", "/health_generate"):
                add("GET", path, self._health)
            for path in ("/get_model_info", "/model_info"):
                add("GET", path, self._model_info)
            for path in ("/get_server_info", "/server_info"):
                add("GET", path, self._server_info)
            add("GET", "/get_load", self._load)
            add("GET", "/metrics", self._metrics)
        add("GET", "/sim/stats", self._stats)
        add("POST", "/sim/control", self._control)
        add("POST", "/sim/reset", self._reset)
        app.on_startup.append(self._start_loop)
        app.on_cleanup.append(self._stop_loop)
        return app

    @web.middleware
    async def _count_paths(self, request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        self.paths[f"{request.method} {request.path}"] += 1
        return await handler(request)

    async def _start_loop(self, app: web.Application) -> None:
        self._task = asyncio.create_task(self.scheduler.run())
        if self.router is not None:
            self.router.preload()

    async def _stop_loop(self, app: web.Application) -> None:
        tasks = self.router.stop() if self.router is not None else []
        if self._task is not None:
            self._task.cancel()
            tasks.append(self._task)
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # ----- generation

    async def _body(self, request: web.Request) -> dict[str, Any] | web.Response:
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError:
            return _error(400, "the body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        return body

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return _error(400, "'messages' must be a non-empty list")
        return await self._generate(request, body, chat_tokens(messages), chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        prompt = body.get("prompt")
        if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            prompt = " ".join(prompt)
        if not isinstance(prompt, str):
            return _error(400, "'prompt' must be a string or a list of strings")
        return await self._generate(request, body, prompt.split(), chat=False)

    async def _generate(self, http: web.Request, body: dict[str, Any], tokens: list[str],
                        chat: bool) -> web.StreamResponse:
        scheduler = self.scheduler
        if self.router is not None:  # the router's checks and autoload, before its child sees the request
            name = body.get("model")
            if not isinstance(name, str) or not name:
                return _router_error(400, "model name is missing from the request")
            if name not in self.router.instances:
                return _router_error(400, f"model '{name}' not found")
            try:
                scheduler = await self.router.ready(name)
            except LoadFailed as exc:
                return _router_error(500, str(exc))
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or self.config.max_tokens
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return _error(400, "'max_tokens' must be a positive integer")
        try:
            request = scheduler.submit(tokens, max_tokens)
        except TooLong as exc:
            return _error(400, str(exc))
        model = body["model"] if isinstance(body.get("model"), str) else self.config.model
        rid = f"{'chatcmpl' if chat else 'cmpl'}-sim{next(self._ids)}"
        try:
            if body.get("stream"):
                options = body.get("stream_options")
                usage = isinstance(options, dict) and bool(options.get("include_usage"))
                return await self._stream(http, request, rid, model, chat, usage)
            while not request.done:
                request.event.clear()
                await request.event.wait()
            if request.aborted:  # its model was unloaded: the router's proxy lost its child
                return _router_error(500, f"model {model} was unloaded")
            text = "".join(f"tok{i} " for i in range(request.generated))
            choice: dict[str, Any] = (
                {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"index": 0, "text": text})
            choice |= {"logprobs": None, "finish_reason": "length"}
            return _json({"id": rid, "object": "chat.completion" if chat else "text_completion",
                          "created": int(time.time()), "model": model, "choices": [choice],
                          "usage": _usage(request)})
        finally:
            scheduler.cancel(request)  # a no-op once it is done

    async def _stream(self, http: web.Request, request: SimRequest, rid: str, model: str, chat: bool,
                      usage: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(http)
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choice: dict[str, Any]) -> bytes:
            data = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
            return b"data: " + msgspec.json.encode(data) + b"\n\n"

        sent = 0
        while True:
            if request.generated > sent:
                out = []
                if chat and sent == 0:  # as vLLM and SGLang do: the role first, with the first token
                    out.append(chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}))
                for i in range(sent, request.generated):
                    text = f"tok{i} "
                    out.append(chunk({"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
                                     if chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": None}))
                sent = request.generated
                await response.write(b"".join(out))
            if request.aborted:  # its model was unloaded: the stream breaks off, without [DONE]
                if http.transport is not None:
                    http.transport.close()
                return response
            if request.done:
                break
            request.event.clear()
            await request.event.wait()
        end = [chunk({"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"} if chat
                     else {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"})]
        if usage:
            data = {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                    "usage": _usage(request)}
            end.append(b"data: " + msgspec.json.encode(data) + b"\n\n")
        end.append(_DONE)
        await response.write(b"".join(end))
        await response.write_eof()
        return response

    # ----- probes and what routers read

    async def _models(self, request: web.Request) -> web.Response:
        c = self.config
        return _json({"object": "list", "data": [{"id": c.model, "object": "model", "created": 0, "owned_by": "sim",
                                                  "max_model_len": c.kv_blocks * c.block_tokens}]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _model_info(self, request: web.Request) -> web.Response:
        # sglang's /get_model_info.
        return _json({"model_path": self.config.model, "tokenizer_path": self.config.model, "is_generation": True})

    async def _server_info(self, request: web.Request) -> web.Response:
        # sglang's /get_server_info: its server args, scheduler info, internal states, version.
        c = self.config
        max_total_tokens = c.kv_blocks * c.block_tokens
        return _json({
            "model_path": c.model, "tokenizer_path": c.model, "served_model_name": c.model, "dp_size": 1,
            "tp_size": 1, "page_size": c.block_tokens, "chunked_prefill_size": c.prefill_budget,
            "max_prefill_tokens": c.prefill_budget, "max_running_requests": c.max_batch,
            "max_total_num_tokens": max_total_tokens, "max_total_tokens": max_total_tokens,
            "disable_radix_cache": False, "enable_cache_report": True,
            "internal_states": [{"max_total_num_tokens": max_total_tokens, "max_running_requests": c.max_batch}],
            "version": "fleet-sim", "sim": asdict(c),
        })

    async def _load(self, request: web.Request) -> web.Response:
        # sglang's /get_load: one entry per data-parallel rank.
        s = self.scheduler
        used = s.kv.used * self.config.block_tokens
        return _json([{"dp_rank": 0, "num_reqs": len(s.running) + len(s.waiting), "num_waiting_reqs": len(s.waiting),
                       "num_tokens": used, "num_pending_tokens": 0, "ts_tic": time.perf_counter()}])

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.config.metrics == "none":  # as a server without metrics: FastAPI's 404
            return _json({"detail": "Not Found"}, status=404)
        text = prometheus_text(self.config, self.scheduler.current_gauges(), self.scheduler.stats)
        return web.Response(body=text.encode(), headers={"Content-Type": _PROMETHEUS})

    async def _control(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        try:
            config = self.scheduler.configure(body)
        except ValueError as exc:
            return _error(400, str(exc))
        if self.router is not None:  # every model's engine, and those loaded later
            self.router.config = config
            for scheduler in self.router.schedulers():
                scheduler.configure(body)
        return _json({"config": asdict(config)})

    async def _stats(self, request: web.Request) -> web.Response:
        if self.router is not None:
            return _json({**self.router.stats(), "config": asdict(self.config), "paths": dict(self.paths)})
        s = self.scheduler
        return _json({**asdict(s.stats), "running": len(s.running), "waiting": len(s.waiting),
                      "kv_used": s.kv.used, "kv_cached": len(s.kv.lru) + len(s.kv.refs), "kv_evictions": s.kv.evictions,
                      "config": asdict(self.config), "paths": dict(self.paths)})

    async def _reset(self, request: web.Request) -> web.Response:
        busy = self.router.busy() if self.router is not None else None
        if busy is not None:
            return _error(409, busy)
        try:
            self.scheduler.reset()
        except RuntimeError as exc:
            return _error(409, str(exc))
        if self.router is not None:
            self.router.config = self.scheduler.config
            self.router.reset()
        self.paths.clear()
        return _json({"reset": True})

    # ----- llama-server's router (model swapping)

    async def _model_named(self, request: web.Request) -> str | web.Response:
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError as exc:  # llama-server: json::parse throws, answered as a server error
            return _router_error(500, f"[json.exception.parse_error] {exc}")
        name = body.get("model") if isinstance(body, dict) else None
        return name if isinstance(name, str) else ""

    async def _router_models(self, request: web.Request) -> web.Response:
        assert self.router is not None
        return _json(self.router.models_json())

    async def _router_props(self, request: web.Request) -> web.Response:
        # The router's own props (get_router_props; keys sorted), or with ?model= its child's.
        assert self.router is not None
        name = request.query.get("model", "")
        c = self.config
        if not name:
            return _json({"build_info": "fleet-sim", "cors_proxy_enabled": False,
                          "default_generation_settings": {"n_ctx": 0, "params": {}},
                          "max_instances": self.router.swap.models_max, "model_alias": "llama-server",
                          "model_path": "none", "models_autoload": True, "role": "router", "ui_settings": {}})
        inst = self.router.instances.get(name)
        if inst is None:
            return _router_error(400, f"model '{name}' not found")
        if inst.scheduler is None:
            return _router_error(400, "model is not loaded")
        return _json({"default_generation_settings": {"n_ctx": c.kv_blocks * c.block_tokens, "params": {}},
                      "model_alias": name, "model_path": name, "total_slots": c.max_batch})

    async def _router_load(self, request: web.Request) -> web.Response:
        assert self.router is not None
        name = await self._model_named(request)
        if isinstance(name, web.Response):
            return name
        inst = self.router.instances.get(name)
        if inst is None:
            return _router_error(404, "model is not found")
        if inst.status != UNLOADED:
            return _router_error(400, "model is already running")
        self.router.load(name, "api")
        return _json({"success": True})

    async def _router_unload(self, request: web.Request) -> web.Response:
        assert self.router is not None
        name = await self._model_named(request)
        if isinstance(name, web.Response):
            return name
        inst = self.router.instances.get(name)
        if inst is None:
            return _router_error(400, "model is not found")
        if inst.status == UNLOADED:
            return _router_error(400, "model is not running")
        self.router.unload(name, "api")
        return _json({"success": True})

    async def _router_metrics(self, request: web.Request) -> web.Response:
        # The router proxies /metrics to the child of ?model= (loading it, which this does not).
        assert self.router is not None
        if self.config.metrics == "none":
            return _json({"detail": "Not Found"}, status=404)
        name = request.query.get("model", "")
        if not name:
            return _router_error(400, "model name is missing from the request")
        inst = self.router.instances.get(name)
        if inst is None:
            return _router_error(400, f"model '{name}' not found")
        if inst.scheduler is None:
            return _router_error(400, "model is not loaded")
        config = replace(self.config, model=name)
        text = prometheus_text(config, inst.scheduler.current_gauges(), inst.scheduler.stats)
        return web.Response(body=text.encode(), headers={"Content-Type": _PROMETHEUS})


async def start(config: SimConfig, host: str, port: int, swap: SwapConfig | None = None) -> web.AppRunner:
    """Serve ``config`` (swapping models as ``swap`` says) on ``host:port`` in this event
    loop; the caller awaits ``runner.cleanup()``."""
    # handler_cancellation: a client that goes away cancels its handler, which takes the request out.
    runner = web.AppRunner(SimServer(config, swap).app(), access_log=None, handler_cancellation=True,
                           shutdown_timeout=1.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner


async def _serve(config: SimConfig, host: str, port: int, swap: SwapConfig | None = None) -> None:
    runner = await start(config, host, port, swap)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    print(f"fleet_sim listening on http://{host}:{port} ({config}{f', {swap}' if swap else ''})", flush=True)
    await stop.wait()
    await runner.cleanup()


def parse_args(argv: Sequence[str] | None = None) -> tuple[SimConfig, str, int]:
    """The server's settings, host and port (model swapping's flags are checked, not returned:
    ``parse_command``)."""
    config, _, host, port = parse_command(argv)
    return config, host, port


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


def parse_command(argv: Sequence[str] | None = None) -> tuple[SimConfig, SwapConfig | None, str, int]:
    """The server's settings, its model swapping (None without ``--models``), host and port."""
    d = SimConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--kv-blocks", type=int, default=d.kv_blocks, help="KV memory, in blocks")
    parser.add_argument("--block-tokens", type=int, default=d.block_tokens)
    parser.add_argument("--max-batch", type=int, default=d.max_batch, help="running requests at most")
    parser.add_argument("--prefill-budget", type=int, default=d.prefill_budget, help="prefill tokens per step")
    parser.add_argument("--step-ms", type=float, default=d.step_ms, help="fixed cost of a step")
    parser.add_argument("--prefill-ms-per-token", type=float, default=d.prefill_ms_per_token)
    parser.add_argument("--decode-ms-per-seq", type=float, default=d.decode_ms_per_seq)
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens, help="answer length when the body names none")
    parser.add_argument("--model", default=d.model, help="the id /v1/models lists")
    parser.add_argument("--catch-up-ms", type=float, default=d.catch_up_ms)
    parser.add_argument("--slowdown", type=float, default=d.slowdown, help="multiplies every step's cost")
    parser.add_argument("--metrics", choices=METRICS, default=d.metrics,
                        help="the engine whose /metrics to serve (none: 404)")
    s = SwapConfig(models=())
    parser.add_argument("--models", type=_names, default=None,
                        help="model swapping: the models it can serve, comma-separated (llama.cpp router mode)")
    parser.add_argument("--models-max", type=int, default=s.models_max,
                        help="model swapping: models loaded at once (0: no limit)")
    parser.add_argument("--load-ms", type=float, default=s.load_ms, help="model swapping: a load's duration")
    parser.add_argument("--preload", type=_names, default=(), help="model swapping: models loaded at start")
    a = parser.parse_args(argv)
    if a.slowdown <= 0:
        parser.error("--slowdown must be above 0")
    swap = None
    if a.models is not None:
        swap = SwapConfig(models=a.models, models_max=a.models_max, load_ms=a.load_ms, preload=a.preload)
        if swap.problems():
            parser.error("; ".join(swap.problems()))
    elif a.preload or a.models_max != s.models_max or a.load_ms != s.load_ms:
        parser.error("--models-max, --load-ms and --preload need --models")
    config = SimConfig(kv_blocks=a.kv_blocks, block_tokens=a.block_tokens, max_batch=a.max_batch,
                       prefill_budget=a.prefill_budget, step_ms=a.step_ms,
                       prefill_ms_per_token=a.prefill_ms_per_token, decode_ms_per_seq=a.decode_ms_per_seq,
                       max_tokens=a.max_tokens, model=a.model, catch_up_ms=a.catch_up_ms, slowdown=a.slowdown,
                       metrics=a.metrics)
    return config, swap, a.host, a.port


def command_args(config: SimConfig) -> list[str]:
    """The command-line arguments (all but ``--host`` and ``--port``) that serve ``config``."""
    return [arg for name, value in asdict(config).items()
            for arg in (f"--{name.replace('_', '-')}", str(value))]


def swap_args(swap: SwapConfig) -> list[str]:
    """The command-line arguments that swap models as ``swap`` says."""
    args = ["--models", ",".join(swap.models), "--models-max", str(swap.models_max), "--load-ms", str(swap.load_ms)]
    return args + (["--preload", ",".join(swap.preload)] if swap.preload else [])


def main(argv: Sequence[str] | None = None) -> None:
    config, swap, host, port = parse_command(argv)
    try:
        import uvloop
        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is one of iop's dependencies (uvicorn[standard])
        loop_factory = None
    with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(_serve(config, host, port, swap))


if __name__ == "__main__":
    main()
