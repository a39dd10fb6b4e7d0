"""Checks that match what the upstream APIs refuse, where they are cheap: a clear 400 naming the field here
rather than an engine's 400 (or a silently odd answer) later.

- chat roles: OpenAI's (`system`, `developer`, `user`, `assistant`, `tool`, `function`); another is a 400.
- content parts that are not text (images, audio, files, video): the served models are text-only here (the
  gateway renders and pins the prompt's token ids, which carry no media), so such a part is a 400 naming it.
- `temperature` below 0 (OpenAI, Anthropic and vLLM all refuse it) and a `stop` list longer than OpenAI's 4.
Numeric ranges of other sampling fields (seed, n, logprobs, max_tokens) are checked in schemas.py.
"""

from __future__ import annotations

from typing import Any

from gateway.api import jsontext
from gateway.errors import InvalidRequestError

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
MAX_STOP = 4                                                     # OpenAI's limit on `stop` sequences
# content part (or block) types that carry media, per API: chat's, Responses' and Anthropic's
MEDIA_PARTS = frozenset({"image_url", "input_audio", "audio", "file", "video_url", "input_image", "input_file",
                         "image", "document"})


def check_message(message: dict[str, Any], where: str) -> None:
    """One chat message, not seen before (its role and content parts)."""
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise InvalidRequestError(f"{role!r} is not a chat role: one of {', '.join(sorted(CHAT_ROLES))}",
                                  param=f"{where}.role")
    content = message.get("content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in MEDIA_PARTS:
                raise media_part(kind, f"{where}.content[{j}]")


def media_part(kind: str, where: str) -> InvalidRequestError:
    return InvalidRequestError(f"{kind} content is not supported: the model is served text-only (send the text)",
                               param=where)


def check_sampling(body: dict[str, Any]) -> None:
    """Every API's chat body (the translations' too)."""
    temperature = body.get("temperature")
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature < 0:
        raise InvalidRequestError("temperature must be at least 0", param="temperature")


def check_stop(body: dict[str, Any]) -> None:
    """OpenAI's chat and completions only: Anthropic's `stop_sequences` have no such limit (and vLLM none)."""
    stop = body.get("stop")
    if isinstance(stop, list) and len(stop) > MAX_STOP:
        raise InvalidRequestError(f"stop may hold at most {MAX_STOP} sequences", param="stop")


def not_json(raw: bytes, exc: Exception) -> InvalidRequestError:
    """The decoder's refusal of a whole body, naming the field whose text is not UTF-8 or holds a lone surrogate
    escape: the same words on every API (schemas.py says them for chat)."""
    found = jsontext.fault(raw)
    if found is None:
        return InvalidRequestError(f"the request body is not valid JSON: {exc}")
    message, path = found
    return InvalidRequestError(f"the request body is not valid JSON: {message}", param=path)
