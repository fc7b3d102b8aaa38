"""Audio and images: transcriptions/translations (multipart), speech (binary, chunked), image generation."""

from __future__ import annotations

import base64
import hashlib
import math
import struct
import time
import zlib
from typing import Any, Final

import msgspec
from aiohttp import web
from multidict import CIMultiDict

from ._common import _Call, _event, _groups, _split, _stream, _v1_headers

_FORM_TYPES: Final = ("multipart/form-data", "application/x-www-form-urlencoded")
_TRANSCRIPTION_FORMATS: Final = ("json", "text", "srt", "verbose_json", "vtt")
_BYTES_PER_SECOND: Final = 32_000
"""How long the fake thinks an uploaded file plays: 16 kHz, 16-bit mono."""

_SAMPLE_RATE: Final = 24_000
_SPEECH_BYTES_PER_CHAR: Final = 480
"""10 ms of 24 kHz 16-bit mono per byte of ``input``."""
_SPEECH_TYPES: Final = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
_SPEECH_MAGIC: Final = {
    "mp3": b"ID3\x04\x00\x00\x00\x00\x00\x00",
    "opus": b"OggS\x00\x02" + bytes(22),
    "aac": b"\xff\xf1\x50\x80\x00\x1f\xfc",
    "flac": b"fLaC",
    "pcm": b"",
}
_MAX_IMAGES: Final = 10


async def read_form(request: web.Request) -> tuple[Any, bytes | None, str | None]:
    """A multipart request's fields as recorded (a file as its filename, content type, size and sha256),
    the content of its ``file`` field, and what is wrong with it (None: nothing)."""
    content_type = request.content_type
    if content_type not in _FORM_TYPES:
        raw = await request.read()
        try:
            body = msgspec.json.decode(raw) if raw else None
        except msgspec.DecodeError:
            body = None
        return body, None, f"Invalid Content-Type header ({content_type}), expected multipart/form-data."
    try:
        form = await request.post()
    except web.HTTPException:
        raise
    except Exception:
        return None, None, "Could not parse the multipart form."
    values: dict[str, list[Any]] = {}
    file: bytes | None = None
    for name, value in form.items():
        entry: Any
        if isinstance(value, web.FileField):
            data = value.file.read()
            value.file.close()
            if name == "file" and file is None:
                file = data
            entry = {
                "filename": value.filename,
                "content_type": value.content_type,
                "size": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        elif isinstance(value, (bytes, bytearray)):
            entry = bytes(value).decode(errors="replace")
        else:
            entry = value
        values.setdefault(name, []).append(entry)
    fields = {name: entries[0] if len(entries) == 1 else entries for name, entries in values.items()}
    return fields, file, None


# --------------------------------------------------------------------------- transcriptions, translations


_TEXT_V1: Final = _v1_headers({"Content-Type": "text/plain; charset=utf-8"})
_VTT_V1: Final = _v1_headers({"Content-Type": "text/vtt; charset=utf-8"})


def _text_answer(call: _Call, text: str, headers: CIMultiDict[str]) -> web.Response:
    return web.Response(body=text.encode(), headers=call.headers(headers))


def _timestamp(seconds: float, separator: str) -> str:
    millis = round(seconds * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{millis:03d}"


async def _audio_text(call: _Call, task: str) -> web.StreamResponse:
    form: dict[str, Any] = call.body
    file = call.file
    if file is None:
        return call.fail(400, "Missing required parameter: 'file'.", param="file")
    fmt = form.get("response_format", "json")
    if fmt not in _TRANSCRIPTION_FORMATS:
        message = f"Invalid value for 'response_format': '{fmt}'. Expected one of {', '.join(_TRANSCRIPTION_FORMATS)}."
        return call.fail(400, message, param="response_format")
    noun = "transcript" if task == "transcribe" else "translation"
    text, pieces = _split(f"fake {noun} of {len(file)} bytes by {call.model}")
    duration = round(max(len(file) / _BYTES_PER_SECOND, 0.01), 2)
    if call.stream:
        input_tokens = max(1, len(file) // 1000)
        total = input_tokens + len(pieces)
        usage = {"type": "tokens", "input_tokens": input_tokens, "output_tokens": len(pieces), "total_tokens": total}
        deltas = [
            _event("transcript.text.delta", {"type": "transcript.text.delta", "delta": p, "logprobs": []})
            for p in pieces
        ]
        done = {"type": "transcript.text.done", "text": text, "logprobs": [], "usage": usage}
        return await _stream(call, _groups(b"", deltas, _event("transcript.text.done", done)), call.interval_ms)
    if fmt == "json":
        return call.json({"text": text})
    if fmt == "text":
        return _text_answer(call, text + "\n", _TEXT_V1)
    if fmt == "srt":
        srt = f"1\n{_timestamp(0, ',')} --> {_timestamp(duration, ',')}\n{text}\n\n"
        return _text_answer(call, srt, _TEXT_V1)
    if fmt == "vtt":
        vtt = f"WEBVTT\n\n{_timestamp(0, '.')} --> {_timestamp(duration, '.')}\n{text}\n\n"
        return _text_answer(call, vtt, _VTT_V1)
    words = text.split()
    step = duration / len(words)
    segment = {
        "id": 0,
        "seek": 0,
        "start": 0.0,
        "end": duration,
        "text": text,
        "tokens": list(range(len(words))),
        "temperature": 0.0,
        "avg_logprob": -0.1,
        "compression_ratio": 1.0,
        "no_speech_prob": 0.0,
    }
    verbose: dict[str, Any] = {
        "task": task,
        "language": "english",
        "duration": duration,
        "text": text,
        "segments": [segment],
        "usage": {"type": "duration", "seconds": math.ceil(duration)},
    }
    granularities = form.get("timestamp_granularities[]", form.get("timestamp_granularities", []))
    if "word" in (granularities if isinstance(granularities, list) else [granularities]):
        verbose["words"] = [
            {"word": w, "start": round(i * step, 3), "end": round((i + 1) * step, 3)} for i, w in enumerate(words)
        ]
    return call.json(verbose)


async def transcription(call: _Call) -> web.StreamResponse:
    return await _audio_text(call, "transcribe")


async def translation(call: _Call) -> web.StreamResponse:
    return await _audio_text(call, "translate")


# --------------------------------------------------------------------------- speech


def _wav_header(data_size: int) -> bytes:
    byte_rate = _SAMPLE_RATE * 2
    return (
        b"RIFF" + struct.pack("<I", 36 + data_size) + b"WAVE"
        + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, _SAMPLE_RATE, byte_rate, 2, 16)
        + b"data" + struct.pack("<I", data_size)
    )


def _speech_audio(text: str, fmt: str) -> bytes:
    """Deterministic audio for ``text``: the format's header / magic bytes, then samples derived from it."""
    size = len(text.encode()) * _SPEECH_BYTES_PER_CHAR
    digest = hashlib.sha256(text.encode()).digest()
    samples = (digest * (size // len(digest) + 1))[:size]
    header = _wav_header(size) if fmt == "wav" else _SPEECH_MAGIC[fmt]
    return header + samples


async def speech(call: _Call) -> web.StreamResponse:
    body = call.body
    text = body.get("input")
    if not isinstance(text, str) or not text:
        return call.fail(400, "Missing required parameter: 'input'.", param="input")
    voice = body.get("voice")
    if not isinstance(voice, (str, dict)) or not voice:
        return call.fail(400, "Missing required parameter: 'voice'.", param="voice")
    fmt = body.get("response_format", "mp3")
    if fmt not in _SPEECH_TYPES:
        message = f"Invalid value for 'response_format': '{fmt}'. Expected one of {', '.join(_SPEECH_TYPES)}."
        return call.fail(400, message, param="response_format")
    stream_format = body.get("stream_format", "audio")
    if stream_format not in ("audio", "sse"):
        return call.fail(400, "Invalid value for 'stream_format': expected 'audio' or 'sse'.", param="stream_format")
    audio = _speech_audio(text, fmt)
    count = max(1, min(call.tokens, len(audio)))
    size = -(-len(audio) // count)
    pieces = [audio[i : i + size] for i in range(0, len(audio), size)]
    if stream_format == "sse":
        deltas = [
            _event("speech.audio.delta", {"type": "speech.audio.delta", "audio": base64.b64encode(p).decode()})
            for p in pieces
        ]
        input_tokens = max(1, len(text.split()))
        usage = {"input_tokens": input_tokens, "output_tokens": len(pieces), "total_tokens": input_tokens + len(pieces)}
        done = _event("speech.audio.done", {"type": "speech.audio.done", "usage": usage})
        return await _stream(call, _groups(b"", deltas, done), call.interval_ms)
    headers = _v1_headers({"Content-Type": _SPEECH_TYPES[fmt], "x-fake-audio-bytes": str(len(audio))})
    return await _stream(call, pieces, call.interval_ms, headers, chunked=True)


# --------------------------------------------------------------------------- images


def _png(seed: bytes) -> bytes:
    """A valid 1x1 RGB PNG whose colour is derived from ``seed``."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    pixel = b"\x00" + hashlib.sha256(seed).digest()[:3]  # filter type 0, then R, G, B
    header = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(pixel)) + chunk(b"IEND", b"")


async def images(call: _Call) -> web.StreamResponse:
    body = call.body
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        return call.fail(400, "Missing required parameter: 'prompt'.", param="prompt")
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= _MAX_IMAGES:
        return call.fail(400, f"Invalid 'n': expected an integer between 1 and {_MAX_IMAGES}.", param="n")
    fmt = body.get("response_format") or "b64_json"
    if fmt not in ("b64_json", "url"):
        message = "Invalid value for 'response_format': expected 'b64_json' or 'url'."
        return call.fail(400, message, param="response_format")
    data: list[dict[str, Any]] = []
    for index in range(n):
        encoded = base64.b64encode(_png(f"{index}:{prompt}".encode())).decode()
        image = {"b64_json": encoded} if fmt == "b64_json" else {"url": "data:image/png;base64," + encoded}
        data.append({**image, "revised_prompt": prompt})
    return call.json({"created": int(time.time()), "data": data})
