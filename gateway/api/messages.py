"""Anthropic's Messages API in the engines' chat format and back. Pure translation: the stream's events are
message_events.py, the handler and Anthropic's error shape messages_routes.py.

    Messages request                       chat request
    system (text or text blocks)           a leading system message
    {"role": "system"} inside messages     a system message in its place (Claude Code's mid-conversation system
                                           entries: rendered as the template renders any system message, so
                                           the same request always renders the same and reuse holds)
    user text / text blocks                a user message (texts joined by newlines)
    user tool_result blocks                tool messages (tool_call_id = tool_use_id), before the user's text
    assistant text + tool_use blocks       one assistant message: content + tool_calls (input as JSON arguments)
    thinking / redacted_thinking blocks    dropped (the engines' templates render no such blocks)
    tools {name, description, input_schema} function tools {name, description, parameters}
    server tools (web_search_20250305, ...) dropped: the engines cannot run them (`hosted_tools` names them,
                                           the handler says so in X-PD-Dropped-Tools)
    tool_choice auto / any / tool / none   "auto" / "required" / a named function / "none"
    max_tokens, stop_sequences, temperature, top_p, top_k, stream    max_tokens, stop, ..., stream

Later turns resend the whole conversation, as chat clients do: they reuse D's KV by session id (an agent's
session header) or by prefix lookup, and an answer that called tools is recognised as the one D generated
(history_tokens "generated") however its input was re-serialized.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import msgspec

from gateway.api.validation import MEDIA_PARTS, media_part, not_json
from gateway.errors import InvalidRequestError

_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


class MessagesRequest(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    model: str | None = None
    max_tokens: int = 0                 # required but by count_tokens (parse_request checks it)
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


def parse_request(raw: bytes, counting: bool = False) -> MessagesRequest:
    """`counting`: a `/v1/messages/count_tokens` body (no `max_tokens`: one token is assumed)."""
    try:
        req = msgspec.json.decode(raw, type=MessagesRequest)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise not_json(raw, exc) from None
    if counting:
        req.max_tokens, req.stream = 1, False
    elif req.max_tokens < 1:
        raise InvalidRequestError("max_tokens must be at least 1", param="max_tokens")
    if not req.messages:
        raise InvalidRequestError("messages must not be empty", param="messages")
    return req


def system_text(req: MessagesRequest) -> str | None:
    return _text(req.system, "system") if req.system else None


def chat_body(req: MessagesRequest, model: str | None) -> dict[str, Any]:
    system = system_text(req)
    body: dict[str, Any] = {
        "model": model, "max_tokens": req.max_tokens, "stream": bool(req.stream),
        "messages": [*([{"role": "system", "content": system}] if system else []), *chat_messages(req.messages)]}
    tools = [_tool(t, i) for i, t in enumerate(req.tools or ()) if not _hosted(t)]
    if tools:
        body["tools"] = tools
    if req.tool_choice is not None:
        body.update(_tool_choice(req.tool_choice))
    for name, value in (("stop", req.stop_sequences), ("temperature", req.temperature), ("top_p", req.top_p),
                        ("top_k", req.top_k)):
        if value is not None:
            body[name] = value
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    return body


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant", "system"):
            raise InvalidRequestError("a message's role must be user, assistant or system",
                                      param=f"messages[{i}].role")
        if role == "system":
            out.append({"role": "system", "content": _text(content, f"messages[{i}].content")})
        elif isinstance(content, str):
            out.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise InvalidRequestError("content must be a string or a list of blocks", param=f"messages[{i}].content")
        elif role == "assistant":
            out.append(_assistant(content, i))
        else:
            out += _user(content, i)
    return out


def _assistant(blocks: list[Any], i: int) -> dict[str, Any]:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_string(block, "text", f"messages[{i}].content[{j}]"))
        elif kind == "tool_use":
            where = f"messages[{i}].content[{j}]"
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise InvalidRequestError("a tool_use block's input must be an object", param=f"{where}.input")
            calls.append({"id": _string(block, "id", where), "type": "function", "function": {
                "name": _string(block, "name", where), "arguments": json.dumps(arguments, ensure_ascii=False)}})
        elif kind not in ("thinking", "redacted_thinking"):
            raise InvalidRequestError(f"assistant content blocks of type {kind!r} are not supported",
                                      param=f"messages[{i}].content[{j}]")
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    return message


def _user(blocks: list[Any], i: int) -> list[dict[str, Any]]:
    out, texts = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        where = f"messages[{i}].content[{j}]"
        if kind == "text":
            texts.append(_string(block, "text", where))
        elif kind in MEDIA_PARTS:
            raise media_part(kind, where)
        elif kind == "tool_result":
            out.append({"role": "tool", "tool_call_id": _string(block, "tool_use_id", where),
                        "content": _text(block.get("content") or "", f"{where}.content")})
        else:
            raise InvalidRequestError(f"user content blocks of type {kind!r} are not supported", param=where)
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where} must be a string or a list of text blocks", param=where)
    return "\n".join(_string(b, "text", f"{where}[{j}]") if isinstance(b, dict) and b.get("type") == "text"
                     else _not_text(b, f"{where}[{j}]") for j, b in enumerate(content))


def _not_text(block: Any, where: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind in MEDIA_PARTS:
        raise media_part(kind, where)
    raise InvalidRequestError("only text blocks are supported here", param=where)


def _string(block: dict[str, Any], name: str, where: str) -> str:
    value = block.get(name)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{name} must be a string", param=f"{where}.{name}")
    return value


def hosted_tools(req: MessagesRequest) -> list[str]:
    """The server tools of the request (Anthropic runs them, the engines cannot): dropped, named by type."""
    return [t["type"] for t in req.tools or () if _hosted(t)]


def _hosted(tool: Any) -> bool:
    """A server tool: a typed tool other than `custom` (web_search_20250305, bash_20250124, computer_*, ...)."""
    return isinstance(tool, dict) and isinstance(tool.get("type"), str) and tool["type"] != "custom"


def _tool(tool: Any, i: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") not in (None, "custom") or not isinstance(tool.get("name"), str):
        raise InvalidRequestError("only client tools {name, description, input_schema} are supported",
                                  param=f"tools[{i}]")
    function = {"name": tool["name"], **({"description": tool["description"]} if tool.get("description") else {}),
                "parameters": tool.get("input_schema") or {"type": "object"}}
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any]) -> dict[str, Any]:
    kind = choice.get("type") if isinstance(choice, dict) else None
    out: dict[str, Any] = {}
    if kind in _CHOICES:
        out["tool_choice"] = _CHOICES[kind]
    elif kind == "tool" and isinstance(choice.get("name"), str):
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise InvalidRequestError("tool_choice type must be auto, any, tool or none", param="tool_choice")
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


# -- the answer ------------------------------------------------------------------------------------------
def new_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def stop_reason(finish_reason: str | None, matched: Any) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) for a chat finish_reason and vLLM's `stop_reason` (the stop string hit)."""
    if finish_reason is None:
        return None, None
    if finish_reason == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return _STOP_REASONS.get(finish_reason, "end_turn"), None


def tool_use(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except ValueError:
        arguments = {}
    return {"type": "tool_use", "id": call.get("id") or f"toolu_{uuid.uuid4().hex}", "name": function.get("name"),
            "input": arguments if isinstance(arguments, dict) else {}}


def message(message_id: str, model: str, *, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
            input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1],
            "usage": usage(input_tokens, output_tokens, cached_tokens)}


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """Anthropic's usage: `input_tokens` are the prompt tokens not read from a cache, `cache_read_input_tokens`
    those served from D's KV (or P's prefix cache), so their sum is the prompt, as Anthropic counts it."""
    cached = min(max(cached_tokens, 0), prompt_tokens)
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def from_completion(message_id: str, model: str, completion: dict[str, Any]) -> dict[str, Any]:
    choice = (completion.get("choices") or [{}])[0]
    chat = choice.get("message") or {}
    content = [{"type": "text", "text": chat["content"]}] if chat.get("content") else []
    content += [tool_use(call) for call in chat.get("tool_calls") or ()]
    chat_usage = completion.get("usage") or {}
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return message(message_id, model, content=content,
                   stop=stop_reason(choice.get("finish_reason"), choice.get("stop_reason")),
                   input_tokens=chat_usage.get("prompt_tokens") or 0,
                   output_tokens=chat_usage.get("completion_tokens") or 0, cached_tokens=cached)
