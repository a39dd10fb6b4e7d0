"""OpenAI request schemas (msgspec): validate what the gateway relies on, keep every other field as sent."""

from __future__ import annotations

import re
from typing import Any

import msgspec

from gateway.errors import InvalidRequestError

_decode = msgspec.json.Decoder().decode
# Deeper JSON than this is refused: decoding, re-encoding for the engines and template rendering all recurse,
# and Python's stack (1000 frames) must keep room for the server's own frames around them.
MAX_JSON_DEPTH = 512


class Message(msgspec.Struct, forbid_unknown_fields=False):
    role: str
    content: str | list[dict[str, Any]] | None = None


class StreamOptions(msgspec.Struct, forbid_unknown_fields=False):
    include_usage: bool | None = None


class _Common(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    return_token_ids: bool | None = False
    conversation_id: str | None = None
    session_id: str | None = None


class ChatRequest(_Common, kw_only=True):
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[int]


_PATH = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")


def parse(raw: bytes, schema: type[msgspec.Struct]) -> tuple[dict[str, Any], Any]:
    """→ (the body as a dict, for forwarding; the validated struct). Errors name the offending field."""
    try:
        body = _decode(raw)
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise _too_deep() from None
    if _depth_bound(raw) > MAX_JSON_DEPTH and _depth(body) > MAX_JSON_DEPTH:
        raise _too_deep()
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    try:
        parsed = msgspec.convert(body, schema)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(f"invalid request: {exc}", param=_param(str(exc))) from None
    _check(parsed)
    return body, parsed


def _too_deep() -> InvalidRequestError:
    return InvalidRequestError(f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels")


def _depth_bound(raw: bytes) -> int:
    """An upper bound on the nesting depth, at C speed: most bodies open too few brackets to need a walk."""
    return raw.count(b"[") + raw.count(b"{")


def _depth(value: Any) -> int:
    """Nesting depth of decoded JSON, without recursion (a deep body must not exhaust the stack here either)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, dict):
            node = node.values()
        elif not isinstance(node, list):
            continue
        deepest = max(deepest, depth)
        todo.extend((child, depth + 1) for child in node if isinstance(child, (dict, list)))
    return deepest


def _param(error: str) -> str | None:
    """msgspec's "... - at `$.messages[0]`" (+ "missing required field `role`") → "messages[0].role"."""
    path, missing = _PATH.search(error), _MISSING.search(error)
    parts = [p for p in (path and path.group(1), missing and missing.group(1)) if p]
    return ".".join(parts) or None


def _check(req: _Common) -> None:
    if req.n not in (None, 1):
        raise InvalidRequestError("only n=1 is supported for disaggregated serving", param="n")
    for name in ("max_tokens", "max_completion_tokens"):
        value = getattr(req, name)
        if value is not None and value < 1:
            raise InvalidRequestError(f"{name} must be at least 1", param=name)
    if isinstance(req, ChatRequest):
        if not req.messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        if req.chat_template is not None:
            raise InvalidRequestError("a chat template in the request is not accepted", param="chat_template")
    if isinstance(req, CompletionRequest) and isinstance(req.prompt, list) and not req.prompt:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
