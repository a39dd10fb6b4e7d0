"""OpenAI request schemas (msgspec): validate what the gateway relies on, keep every other field as sent."""

from __future__ import annotations

import re
from typing import Any

import msgspec

from gateway.api import jsontext, ranges
from gateway.api.validation import check_message, check_sampling
from gateway.errors import InvalidRequestError
from gateway.turns.intake.message_cache import KnownMessage, MessageCache, Messages

_decode = msgspec.json.Decoder().decode
_decode_fields = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_decode_items = msgspec.json.Decoder(list[msgspec.Raw]).decode
# The messages of recent requests, by their bytes: a continuous turn's history is decoded once.
MESSAGES = MessageCache()
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


def parse(raw: bytes, schema: type[msgspec.Struct], *, cache: MessageCache | None = None) -> tuple[dict[str, Any], Any]:
    """→ (the body as a dict, for forwarding; the validated struct). Errors name the offending field.

    A chat request's messages are decoded one by one, and only those not seen before (`turns/intake/message_cache.py`):
    a continuous turn resends its whole history, which is then found rather than decoded and checked again.
    `cache`: where they are found (default: this process's `MESSAGES`)."""
    try:
        fields = _decode_fields(raw)
    except msgspec.ValidationError:
        raise InvalidRequestError("the request body must be a JSON object") from None
    except msgspec.DecodeError as exc:
        raise _not_json(raw, exc) from None
    except RecursionError:
        raise _too_deep() from None
    chat = schema is ChatRequest and "messages" in fields
    body = {key: _value(value, MAX_JSON_DEPTH - 1, key) for key, value in fields.items()
            if not (chat and key == "messages")}
    messages = _messages(fields["messages"], MESSAGES if cache is None else cache) if chat else None
    try:
        parsed = msgspec.convert({**body, "messages": []} if chat else body, schema)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(f"invalid request: {exc}", param=_param(str(exc))) from None
    if messages is not None:
        parsed.messages = [known.struct for known in messages.known]
        body["messages"] = messages
    _check(parsed)
    check_sampling(body)
    ranges.check(body)
    return body, parsed


def _value(raw: msgspec.Raw | bytes, max_depth: int, where: str) -> Any:
    """One JSON value, refused if it nests deeper than `max_depth` (counted from 1 at the value itself).
    `where`: its path in the body, for an error about its text."""
    raw = bytes(raw) if isinstance(raw, msgspec.Raw) else raw
    try:
        value = _decode(raw)
    except RecursionError:
        raise _too_deep() from None
    except msgspec.DecodeError as exc:   # the top level splits values without checking their strings' bytes
        raise _not_json(raw, exc, where) from None
    if len(raw) > max_depth and _depth_bound(raw) > max_depth and _depth(value) > max_depth:
        raise _too_deep()
    return value


def _messages(raw: msgspec.Raw, cache: MessageCache) -> Messages:
    try:
        items = _decode_items(raw)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(f"invalid request: {exc} - at `$.messages`", param="messages") from None
    except RecursionError:
        raise _too_deep() from None
    except msgspec.DecodeError as exc:
        raise _not_json(bytes(raw), exc, "messages") from None
    raws = [bytes(item) for item in items]
    known = cache.get_all(raws)
    for i, found in enumerate(known):
        if found is None:
            known[i] = found = _known(raws[i], f"messages[{i}]")
            cache.put(raws[i], found)
    return Messages(known, list(map(hash, raws)))      # bytes keep their hash: computed by the lookup already


def _known(raw: bytes, where: str) -> KnownMessage:
    """A message not seen before: decoded and validated (the body, its list and the message: 2 levels above)."""
    value = _value(raw, MAX_JSON_DEPTH - 2, where)
    try:
        struct = msgspec.convert(value, Message)
    except msgspec.ValidationError as exc:
        error = _at(str(exc), where)
        raise InvalidRequestError(f"invalid request: {error}", param=_param(error)) from None
    check_message(value, where)
    return KnownMessage(value, struct, msgspec.json.encode(value), 4 * len(raw) + 1024)


def _at(error: str, where: str) -> str:
    """msgspec's error for one message, with its path within the whole body."""
    if " - at `$" in error:
        return error.replace(" - at `$", f" - at `$.{where}", 1)
    return f"{error} - at `$.{where}`"


def _not_json(raw: bytes, exc: msgspec.DecodeError, where: str | None = None) -> InvalidRequestError:
    """The decoder's refusal, saying which field holds bytes that are not text when that is the cause.
    `where`: the path of `raw` within the body (None: `raw` is the body)."""
    found = jsontext.fault(raw)
    if found is None:
        return InvalidRequestError(f"the request body is not valid JSON: {exc}", param=where)
    message, inner = found
    path = _join(where, inner)
    if where is not None:
        message = message.replace(f"`{inner}`" if inner else "the request body", f"`{path}`", 1)
    return InvalidRequestError(f"the request body is not valid JSON: {message}", param=path)


def _join(outer: str | None, inner: str | None) -> str | None:
    if not outer or not inner:
        return outer or inner
    return f"{outer}{inner}" if inner.startswith("[") else f"{outer}.{inner}"


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
