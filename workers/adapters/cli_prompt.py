"""The text a command line tool gets on stdin, rendered from an OpenAI request body.

Only text goes through: a request the tool cannot take as text is refused with a 400
(``ProviderRejected``), as the provider's own answer, rather than answered wrongly.
"""

from __future__ import annotations

from typing import Any

import msgspec

from api.errors import error_body
from dispatcher.exceptions import ProviderRejected
from workers.adapters.base import ProviderCall


def _rejected(message: str, code: str, param: str | None = None) -> ProviderRejected:
    body = error_body(message, "invalid_request_error", code=code, param=param)
    return ProviderRejected(400, msgspec.json.encode(body))


def parse_request(call: ProviderCall) -> tuple[str, dict[str, Any]]:
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
