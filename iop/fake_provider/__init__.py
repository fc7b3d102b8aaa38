"""A fake OpenAI-compatible upstream: the provider of the tests, the demo (``iop up``) and the benchmarks.

``iop fake-provider`` runs it from the command line; tests start it in-process with ``start``.

It answers the endpoints a gateway relays the way vLLM, OpenAI and Anthropic do, always echoing
the received ``model`` (the served name) in its answers; imitates the health/probe endpoints of
vLLM, SGLang, Ollama and Lemonade; and can be told at run time (``POST /_fake/control``) to be
slow, to fail, to hang, to answer garbage, to look unhealthy or to show some real servers' quirks.
``/_fake/requests`` and ``/_fake/stats`` let tests see what it received and how many requests
were in flight at once.

It is built to be cheap per request, so that benchmarks measure the gateway and not the fake:
for chat/completions constant byte strings are encoded once, answers are assembled by byte
concatenation around the JSON-encoded ``model`` echo, nothing is logged per request, and a
stream with no ``token_interval_ms`` pause is written in one piece (with a Content-Length).

Endpoints
=========

The *pipeline* endpoints (all but the probes, ``GET /v1/models`` and ``/_fake/*``); the answer
text is ``tokens`` words ``"tok0 tok1 ... tokN-1"`` wherever the model generates text:

``POST /v1/chat/completions``, ``POST /v1/completions``
    JSON, or SSE ``data:`` chunks with ``stream: true``: a role chunk (chat), one chunk per token
    (``"tok0 "``, ``"tok1 "``, ..., ``"tokN-1"``), a ``finish_reason: "stop"`` chunk, a usage chunk
    with ``stream_options.include_usage``, then ``data: [DONE]``. ``prompt_tokens`` is the body's
    length / 4. ``max_tokens`` / ``max_completion_tokens`` (the smaller positive integer) cap the
    words: fewer than ``tokens`` end with ``finish_reason: "length"``.

    *Continuations* (a stream cut on one provider going on on another, issue 49): a chat request
    whose last message is ``role: assistant`` (content a string or text parts; vLLM's
    ``continue_final_message`` / ``add_generation_prompt`` are accepted, not needed, as llama.cpp's
    server) whose text ends in the answer's first ``k`` words ``tok0 tok1 ... tok{k-1}`` (single
    spaces, maybe a trailing space) goes on from there: the answer is words ``k`` to ``N-1``, as the
    uninterrupted one would have had them, with a space before the first when the text ends in a
    word (``" tok3 tok4 ..."`` after ``"tok0 tok1 tok2"``, ``"tok3 tok4 ..."`` after ``"... tok2 "``),
    and ``completion_tokens`` N - k; ``max_tokens`` caps the words it adds. A completions ``prompt``
    (a string) ending in that run -- after whatever the original prompt was, even glued to its last
    word -- continues likewise. Any other trailing text (k = 0: ``"Sure, "``, a run not from
    ``tok0``, one longer than the answer) gets the whole answer. A continuation's ``prompt_tokens`` is
    the continued request's -- its body without the text so far (the trailing assistant message,
    the prompt's run) and the two flags, ``max_tokens``/``max_completion_tokens`` plus k, encoded as
    compact JSON, length / 4 -- plus k: what iop subtracts again, so that for a body sent as compact
    JSON the continued answer's usage has the uninterrupted one's prompt. The other endpoints do
    not continue.
``POST /v1/embeddings``
    8-dimensional vectors derived from each input (string, list of strings, token list(s));
    ``encoding_format: "base64"`` packs them as little-endian float32.
``POST /v1/responses`` (OpenAI Responses API)
    ``{"id": "resp_…", "object": "response", "created_at", "status": "completed", "model",
    "output": [{"type": "message", "id": "msg_…", "role": "assistant", "status": "completed",
    "content": [{"type": "output_text", "text", "annotations": [], "logprobs": []}]}],
    "usage": {"input_tokens", "output_tokens", "total_tokens", …}, "previous_response_id",
    "store", …}``. With ``stream: true``: SSE events, each an ``event:`` line and a ``data:``
    object whose ``type`` is the event name and which carries a ``sequence_number`` (from 0):
    ``response.created``, ``response.in_progress``, ``response.output_item.added``,
    ``response.content_part.added``, one ``response.output_text.delta`` per token,
    ``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``,
    ``response.completed``; the lifecycle events carry the response (model in ``response.model``).
    No ``data: [DONE]`` (as OpenAI). Unless ``store: false`` the response is kept, per fake
    instance (the last 10,000), under its id; ``previous_response_id`` naming an id this instance
    does not hold answers 404 ("Previous response with id '…' not found.", code
    ``previous_response_not_found``). ``background: true`` answers at once with status ``queued``
    (no output); the stored response is already completed.
``GET /v1/responses/{id}``, ``DELETE …/{id}``, ``POST …/{id}/cancel``, ``GET …/{id}/input_items``
    The stored response; ``{"id", "object": "response", "deleted": true}``; the response with
    status ``cancelled`` if it was created with ``background: true``, else 400 ("Cannot cancel a
    synchronous response."); ``{"object": "list", "data": [input items], "first_id", "last_id",
    "has_more"}`` (query ``order`` ``desc`` by default / ``asc``, ``limit`` 1-100 default 20,
    ``after``); a string ``input`` is one user message item with ``input_text`` content, and items
    get ids when they have none. An unknown id answers 404 ("Response with id '…' not found.").
``POST /v1/messages`` (Anthropic Messages API)
    ``{"id": "msg_…", "type": "message", "role": "assistant", "model", "content": [{"type": "text",
    "text"}], "stop_reason": "end_turn", "stop_sequence": null, "usage": {"input_tokens",
    "output_tokens", "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}``.
    ``max_tokens`` is required (400 otherwise); when it is below ``tokens`` the answer stops after
    ``max_tokens`` words with ``stop_reason: "max_tokens"``. ``messages`` must be a list.
    ``input_tokens`` counts the words of ``system`` and of the messages' text. With ``stream:
    true``: ``message_start`` (the message with empty content, no stop reason), ``content_block_start``,
    ``ping``, one ``content_block_delta`` (``text_delta``) per token, ``content_block_stop``,
    ``message_delta`` (``stop_reason``, ``usage.output_tokens``), ``message_stop``; each an
    ``event:`` line and a ``data:`` object with that ``type``. Errors are Anthropic-shaped:
    ``{"type": "error", "error": {"type": "invalid_request_error" | "authentication_error" |
    "rate_limit_error" | "api_error" | "overloaded_error" | …, "message"}, "request_id"}``.
    Answers carry ``request-id: req_fake…`` and ``anthropic-ratelimit-requests-remaining: 99``,
    and echo the request's ``anthropic-version`` / ``anthropic-beta`` headers as
    ``x-fake-anthropic-version`` / ``x-fake-anthropic-beta``.
``POST /v1/messages/count_tokens``
    ``{"input_tokens": N}``, the same count as the messages answer's ``usage.input_tokens``.
``POST /v1/rerank``, ``/rerank``, ``/v2/rerank`` (vLLM, Jina, Cohere)
    ``{model, query, documents: [str | {"text"}], top_n?, return_documents?}`` → ``{"id", "model",
    "usage": {"total_tokens"}, "results": [{"index", "document": {"text"}, "relevance_score"}]}``
    sorted by score, highest first (ties: by index); the score is the word overlap (Jaccard index
    of the lower-cased word sets) of query and document; ``top_n`` (0: all) keeps the best ones.
``POST /v1/score``, ``/score`` (vLLM)
    ``{model, text_1, text_2}`` (strings, or lists: one ``text_1`` against each ``text_2``, or
    pairwise) → ``{"id", "object": "list", "created", "model", "data": [{"index", "object":
    "score", "score"}], "usage"}``, the same score as rerank.
``POST /tokenize``, ``/detokenize``, ``/v1/tokenize``, ``/v1/detokenize`` (vLLM, llama.cpp)
    ``{model?, prompt}`` (or llama.cpp's ``content``, or vLLM's chat ``messages``) → ``{"count",
    "max_model_len": 32768, "tokens", "token_strs"}``: one token per whitespace-separated word,
    ``tok<i>`` is token ``i``, any other word a hash ≥ 2**30 remembered by the process;
    ``{model?, tokens}`` → ``{"prompt"}``, the words joined by spaces (400 for an unknown id).
``POST /v1/audio/transcriptions``, ``/v1/audio/translations``
    multipart/form-data (``file``, ``model``, ``response_format``, …; anything else: 400). The text
    is ``"fake transcript of <N> bytes by <model>"`` (``translation`` for translations), N the
    size of the received file. ``response_format``: ``json`` (default) ``{"text"}``; ``text``
    (text/plain); ``srt`` (text/plain); ``vtt`` (text/vtt); ``verbose_json`` (task, language,
    duration, text, segments, ``words`` with ``timestamp_granularities[]=word``, usage). A
    transcription with ``stream=true``: SSE ``transcript.text.delta`` events (one per word) then
    ``transcript.text.done`` (with usage), each with an ``event:`` line; no ``[DONE]``.
``POST /v1/audio/speech``
    ``{model, input, voice, response_format?, stream_format?}`` → audio: 480 times ``len(input)``
    bytes of samples derived from ``input``, after a valid WAV header (``wav``) or the format's
    magic bytes (``mp3`` default audio/mpeg, ``opus`` audio/ogg, ``aac``, ``flac``; ``pcm``: none),
    with ``x-fake-audio-bytes: <total size>``; always chunked, in ``tokens`` writes with
    ``token_interval_ms`` between them. ``stream_format: "sse"``: ``speech.audio.delta`` events
    (base64 ``audio``) then ``speech.audio.done``.
``POST /api/generate``, ``POST /api/chat`` (Ollama's native API)
    ``{model, prompt?, keep_alive?, stream?}`` / ``{model, messages?, keep_alive?, stream?}``. With no
    prompt (messages) the model is loaded: ``{"model", "created_at", "response": "", "done": true,
    "done_reason": "load"}`` (``/api/chat``: ``"message": {"role": "assistant", "content": ""}``
    instead of ``response``) once it is; with ``keep_alive`` 0 too it is unloaded (``done_reason:
    "unload"``, at once, the model going when its requests end). ``keep_alive`` as Ollama reads
    it: seconds, or a Go duration string (``"5m"``, ``"1h30m"``), negative: forever; anything else
    400 with Go's message. Otherwise it generates: NDJSON lines ``{"model", "created_at", "response":
    "tok0 ", "done": false}`` then a ``done: true, done_reason: "stop"`` line with ``context`` and
    the metrics (``load_duration`` … in ns), or one object with ``stream: false``. A model not in
    ``models`` answers 404 ``{"error": "model '…' not found"}``; errors are ``{"error": message}``.
``POST /v1/images/generations``
    ``{model, prompt, n?, response_format?}`` → ``{"created", "data": [{"b64_json": <a valid 1x1
    PNG, its colour derived from the prompt and index>, "revised_prompt"}, … n of them]}`` (``url``: a
    ``data:image/png;base64,`` URL).

Every pipeline answer, and every other ``/v1`` answer (``/v1/models``, a 404 or 405), carries
``x-request-id: <uuid>`` (unique), ``openai-processing-ms: <n>``,
``x-ratelimit-remaining-requests: 99`` and the hop-by-hop ``Keep-Alive: timeout=5`` (which a
gateway must not relay). ``GET /v1/models`` lists ``models``; ``/health``,
``/health_generate``, ``/api/tags``, ``/api/ps``, ``/api/version``, ``/api/v1/health`` and
``/api/v1/models`` are the probes. An unknown path answers 404, a wrong method 405 (OpenAI-shaped).
``/api/tags`` lists ``models`` as Ollama (``{"models": [{"name", "model", "modified_at", "size",
"digest", "details"}]}``); ``/api/ps`` the loaded ones (``{"models": [{"name", "model", "size",
"digest", "details", "expires_at", "size_vram", "context_length"}]}``, the longest time left first).

Ollama's model lifecycle
========================

Off unless one of ``max_loaded``, ``load_ms``, ``keep_alive_s`` is set (``--max-loaded``,
``--load-ms``, ``--keep-alive-s``). Off, every model of ``models`` is loaded at all times
(``/api/ps`` lists them all, ``/api/generate`` load/unload answer and change nothing). On, the
fake starts with nothing loaded, as a fresh Ollama (``_lifecycle``, after Ollama's server/sched.go):

* a request for a model of ``models`` that is not loaded -- on any pipeline endpoint, after the
  checks of the pipeline and ``delay_ms`` -- first loads it, taking ``load_ms`` (counted in its
  time to first token); a request for another name answers as without the lifecycle;
* one load at a time; concurrent requests for a loading model wait for that one load;
* at ``max_loaded`` the least recently used idle model is unloaded first (Ollama evicts the idle
  one with the shortest keep-alive, then by name); when every loaded model is busy (a request
  running on it), the load waits until one is idle;
* a model whose last request ended is unloaded after its keep-alive: the ``keep_alive`` of the
  last ``/api/generate`` / ``/api/chat`` that named it, else ``keep_alive_s`` (Ollama's
  ``OLLAMA_KEEP_ALIVE``, 300 s there; None: never). The OpenAI-shaped endpoints carry none, as
  Ollama's.

``GET /_fake/lifecycle``: ``{"on", "loaded": [least recently used first], "loading": [...],
"waiting": [a model whose load waits for an idle one], "in_use": {model: requests},
"loads": {model: {"request": n, "api": n}}, "unloads": {model: {"api": n, "keep_alive": n,
"evict": n}}, "total_loads", "total_unloads"}`` -- a load is ``api`` when asked for by a
``/api/generate`` / ``/api/chat`` without prompt, an unload ``api`` when asked for with
``keep_alive`` 0, ``keep_alive`` when the keep-alive ran out, ``evict`` to make room.
``POST /_fake/lifecycle/reset`` zeroes the counters (not what is loaded).

Options and the pipeline
========================

Order of the checks of a pipeline request: the request is recorded (even a malformed one, with
``body: null``), then ``api_key`` (401), the ``fake`` overrides when enabled (400), ``hang``,
``delay_ms``, ``fail_status``, ``fail_with``, ``garbage``, ``empty_200``, and only then the body
itself is validated (400). Options (``FakeOptions``, all changed by ``POST /_fake/control``):

``delay_ms``, ``tokens``, ``token_interval_ms``
    Wait before answering; words per generated answer (and stream chunks, speech writes); pause
    between stream chunks.
``api_key``
    Required as ``Authorization: Bearer <key>`` (the Anthropic endpoints also take ``x-api-key``).
``fail_status``, ``hang``, ``garbage``, ``healthy``
    Every pipeline request answers this status; is held until the client goes away, the server
    shuts down (503), or ``hang`` is switched off again (then answered normally); answers 200
    with invalid JSON (non-stream) or a stream with a broken line; ``healthy: false`` makes the
    probes and ``/v1/models`` answer 503 (not the pipeline).
``fail_with``
    ``{"status", "body", "content_type", "headers"}`` (``FakeError``): every pipeline request
    gets exactly this answer, streamed request or not, with the usual per-request headers under
    the given ones -- what no runtime of the fake's own shapes answers: an HTML page from a proxy,
    FastAPI's ``{"detail": "Not Found"}`` for a route the server lacks, an Anthropic 529 with its
    ``retry-after``, an error body of any size.
``stream_no_done``
    Chat/completions streams end without ``data: [DONE]``.
``empty_200``
    Every pipeline request answers 200 with an empty body (JSON or event-stream content type).
``close_idle_keepalive``
    Each connection answers one pipeline request with an ordinary keep-alive answer; when the next
    one arrives on it, the server closes it without answering (nor counting or recording it), as a
    server does that closed an idle keep-alive connection just as the client reused it from its
    pool: the client sees "Server disconnected" and must retry on a new connection.
``cut_after``
    A chat/completions *stream* writes its first chunk(s) (the role chunk) and this many content
    chunks (pausing ``token_interval_ms`` as usual), then, where the next chunk would come (after
    the pause), the server closes the connection: no finish chunk, no ``[DONE]``, no end of the
    chunked body -- a provider dying mid-stream; the client reads what was written, then aiohttp
    raises ``ClientPayloadError`` ("Response payload is not completed"). Without a pause the
    client may lose the last chunks: aiohttp drops what it holds unread when the payload breaks.
    It counts the chunks of that answer (a continuation's own, from word k); 0: right after the
    role chunk; more than the answer has: no cut. Read when the request arrives (a control
    changing it affects the streams that come after). JSON answers are never cut.
    ``/_fake/stats`` counts a cut request ``completed``, ``/_fake/executions`` as ``cut``.
``max_loaded``, ``load_ms``, ``keep_alive_s``
    Ollama's model lifecycle, below: models loaded at once (at least 1), how long a load takes,
    the default keep-alive in seconds; all None (the default): off, every model always loaded.
    A load waits after the checks above and ``delay_ms``, inside a ``parallel`` slot.

Test hooks
==========

``/_fake/requests`` lists the last 1,000 pipeline requests: ``path``, ``model``, ``stream``,
``authorization`` and ``body`` (the JSON body; for a multipart request its form fields, a file
as ``{"filename", "content_type", "size", "sha256"}`` and a repeated field as a list), plus
``method`` when not POST and ``headers`` when the request had any of ``anthropic-version``,
``anthropic-beta``, ``x-api-key``, ``openai-beta``, ``idempotency-key``.
``DELETE /_fake/requests`` clears it.

Counters of ``/_fake/stats``: ``total`` pipeline requests received, ``completed`` ones answered
(whatever the status), ``disconnected`` ones whose client went away first (also a request
still held when the server stops); ``total == completed + disconnected + in_flight``.
``POST /_fake/stats/reset`` zeroes them, except ``in_flight`` (``max_in_flight`` restarts from it).

Two more test hooks, both off until ``POST /_fake/hooks`` switches them on (so they cost
nothing otherwise): ``track_executions`` logs every pipeline request in ``/_fake/executions``
with its marker (the body's ``user`` string, or an Anthropic body's ``metadata.user_id``), the
caller's TCP port, its start and end (wall-clock seconds) and its outcome (``running``,
``completed``, ``cut`` (``cut_after``), ``disconnected`` or ``failed``), so a test can count
how often the provider ran each request; ``body_overrides`` lets a JSON request carry a
``fake`` object (``delay_ms``, ``tokens``, ``token_interval_ms``, ``fail_status``,
``cut_after``) that replaces those options for that request alone (``fail_status``: a request
the runtime fails by what it carries). A continuation iop makes carries the same ``fake``
object: a ``cut_after`` there cuts it too, on a fake with ``body_overrides`` on.

Code: ``_server`` (the pipeline, chat/completions/embeddings, probes, test hooks, the app),
``_responses``, ``_anthropic``, ``_pooling`` (rerank, score, tokenize), ``_media`` (audio,
images), ``_ollama`` (Ollama's native API), ``_lifecycle`` (Ollama's model lifecycle), ``_common``
(options, the per-request ``_Call``, errors, stream writing).
"""

from __future__ import annotations

from ._common import FakeError, FakeOptions
from ._common import _OptionsPatch as _OptionsPatch  # the tests check that it covers every option
from ._server import create_app, run, start

__all__ = ["FakeError", "FakeOptions", "create_app", "run", "start"]
