"""Rerank, score, tokenize and detokenize, as vLLM (and Jina/Cohere, llama.cpp) serve them."""

from __future__ import annotations

import hashlib
import itertools
import re
import time
from typing import Any, Final

from aiohttp import web

from ._common import _Call, _count_words

_MAX_MODEL_LEN: Final = 32768
_WORD: Final = re.compile(r"\w+")
_TOK: Final = re.compile(r"tok(\d{1,9})")
_HASHED: Final = 1 << 30
"""Token ids from ``_HASHED`` up are hashes of words; below it, id ``i`` is the word ``tok<i>``."""
_MAX_VOCAB: Final = 100_000
# Hashed token id -> its word, shared by the fakes of a process so that any of them detokenizes.
_VOCAB: dict[int, str] = {}
_ids = itertools.count(1)


def _relevance(query: str, document: str) -> float:
    """Word overlap (Jaccard index of the lower-cased word sets), 6 decimals."""
    q = set(_WORD.findall(query.lower()))
    d = set(_WORD.findall(document.lower()))
    union = q | d
    return round(len(q & d) / len(union), 6) if union else 0.0


def _document_text(document: Any) -> str | None:
    if isinstance(document, str):
        return document
    if isinstance(document, dict) and isinstance(document.get("text"), str):
        text: str = document["text"]
        return text
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


async def rerank(call: _Call) -> web.StreamResponse:
    body = call.body
    query = body.get("query")
    if not isinstance(query, str):
        return call.fail(400, "'query' must be a string", param="query")
    documents = body.get("documents")
    texts = [_document_text(d) for d in documents] if isinstance(documents, list) else None
    if texts is None or any(t is None for t in texts):
        return call.fail(400, "'documents' must be a list of strings or of objects with a 'text'", param="documents")
    top_n = body.get("top_n")
    if top_n is not None and (not _is_int(top_n) or top_n < 0):
        return call.fail(400, "'top_n' must be a non-negative integer", param="top_n")
    scores = [_relevance(query, t or "") for t in texts]
    order = sorted(range(len(texts)), key=lambda i: -scores[i])
    if top_n:
        order = order[:top_n]
    with_documents = body.get("return_documents") is not False
    results: list[dict[str, Any]] = []
    for i in order:
        result: dict[str, Any] = {"index": i}
        if with_documents:
            result["document"] = {"text": texts[i]}
        result["relevance_score"] = scores[i]
        results.append(result)
    tokens = sum(_count_words(query) + _count_words(t) for t in texts)
    return call.json(
        {"id": f"rerank-fake{next(_ids):x}", "model": call.model, "usage": {"total_tokens": tokens}, "results": results}
    )


def _texts(value: Any) -> list[str] | None:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    return None


async def score(call: _Call) -> web.StreamResponse:
    body = call.body
    first, second = _texts(body.get("text_1")), _texts(body.get("text_2"))
    if first is None or second is None:
        return call.fail(400, "'text_1' and 'text_2' must be strings or non-empty lists of strings")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        return call.fail(400, "'text_1' and 'text_2' must have the same length (or 'text_1' one item)")
    pairs = list(zip(first, second, strict=True))
    data = [{"index": i, "object": "score", "score": _relevance(a, b)} for i, (a, b) in enumerate(pairs)]
    tokens = sum(_count_words(a) + _count_words(b) for a, b in pairs)
    return call.json(
        {
            "id": f"score-fake{next(_ids):x}",
            "object": "list",
            "created": int(time.time()),
            "model": call.model,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }
    )


def _token_id(word: str) -> int:
    match = _TOK.fullmatch(word)
    if match is not None:
        return int(match.group(1))
    token = _HASHED | int.from_bytes(hashlib.blake2b(word.encode(), digest_size=4).digest()) % _HASHED
    if token not in _VOCAB:
        if len(_VOCAB) >= _MAX_VOCAB:
            del _VOCAB[next(iter(_VOCAB))]
        _VOCAB[token] = word
    return token


def _token_word(token: int) -> str | None:
    if 0 <= token < _HASHED:
        return f"tok{token}"
    return _VOCAB.get(token)


def _prompt_text(body: dict[str, Any]) -> str | None:
    """What to tokenize: vLLM's ``prompt`` or ``messages``, llama.cpp's ``content``."""
    for key in ("prompt", "content"):
        value = body.get(key)
        if isinstance(value, str):
            return value
    messages = body.get("messages")
    if isinstance(messages, list):
        words: list[str] = []
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            blocks = [content] if isinstance(content, str) else content if isinstance(content, list) else []
            for block in blocks:
                text = block if isinstance(block, str) else block.get("text") if isinstance(block, dict) else None
                if isinstance(text, str):
                    words.extend(text.split())
        return " ".join(words)
    return None


async def tokenize(call: _Call) -> web.StreamResponse:
    text = _prompt_text(call.body)
    if text is None:
        return call.fail(400, "'prompt' must be a string (or 'messages' a list of messages)", param="prompt")
    words = text.split()
    answer: dict[str, Any] = {
        "count": len(words),
        "max_model_len": _MAX_MODEL_LEN,
        "tokens": [_token_id(w) for w in words],
        "token_strs": words if call.body.get("return_token_strs") is True else None,
    }
    return call.json(answer)


async def detokenize(call: _Call) -> web.StreamResponse:
    tokens = call.body.get("tokens")
    if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
        return call.fail(400, "'tokens' must be a list of integers", param="tokens")
    words: list[str] = []
    for token in tokens:
        word = _token_word(token)
        if word is None:
            return call.fail(400, f"Token id {token} is out of vocabulary", param="tokens")
        words.append(word)
    return call.json({"prompt": " ".join(words)})
