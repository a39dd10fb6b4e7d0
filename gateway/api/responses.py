"""OpenAI's Responses API in the engines' chat format and back: a request's input items become chat messages
(the new ones only: a `previous_response_id` turn continues the stored conversation, turns/intake/continued.py),
its function tools chat tools; a chat completion becomes a response object with `message` and `function_call`
output items. Pure translation: the stream's typed events are response_events.py, the handlers agents.py.

    input item                          chat message
    {"role", "content"} / "message"     {"role", "content"} (content parts' texts joined; developer → system)
    "function_call"                     an assistant message's tool call (after that assistant's text, if any)
    "function_call_output"              {"role": "tool", "tool_call_id": call_id, "content": output}; one with
                                        no call_id but a `name` answers no call (context Codex injects, e.g.
                                        namespace "agent", name "goal_objective": its goal's objective): a
                                        user message with its output (chat has no tool message without a call)
    "reasoning"                         dropped (the engines' templates render no reasoning items)

    tool                                chat tool
    "function"                          a function tool
    "namespace" {tools: [...]}          its functions, flattened (Codex groups its MCP tools so)
    hosted (web_search, file_search,    dropped: the engines cannot run them (`hosted_tools` names them, the
    custom, computer_use_preview, ...)  handler says so in X-PD-Dropped-Tools)
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from gateway.api.validation import MEDIA_PARTS, media_part, not_json
from gateway.errors import InvalidRequestError

_TEXT_PARTS = ("input_text", "output_text", "text")
_CHOICES = ("auto", "none", "required")


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    text: dict[str, Any] | None = None
    background: bool | None = None
    conversation: Any = None


def parse_request(raw: bytes) -> ResponsesRequest:
    try:
        req = msgspec.json.decode(raw, type=ResponsesRequest)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise not_json(raw, exc) from None
    if req.background:
        raise InvalidRequestError("background responses are not supported", param="background")
    if req.conversation is not None:
        raise InvalidRequestError("conversation objects are not supported: continue with previous_response_id",
                                  param="conversation")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise InvalidRequestError("max_output_tokens must be at least 1", param="max_output_tokens")
    if not req.input:
        raise InvalidRequestError("input must not be empty", param="input")
    return req


def chat_body(req: ResponsesRequest, model: str | None) -> dict[str, Any]:
    """The chat request for this turn's new input items, after the instructions as a system message."""
    head = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {"model": model, "messages": [*head, *messages(req.input)], "stream": bool(req.stream)}
    tools = _functions(req.tools or (), "tools")
    if tools:
        body["tools"] = tools
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
    for name, value in (("max_tokens", req.max_output_tokens), ("temperature", req.temperature),
                        ("top_p", req.top_p), ("parallel_tool_calls", req.parallel_tool_calls), ("user", req.user)):
        if value is not None:
            body[name] = value
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    response_format = _format((req.text or {}).get("format"))
    if response_format is not None:
        body["response_format"] = response_format
    return body


def messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise InvalidRequestError("each input item must be an object", param=f"input[{i}]")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequestError("a message's role must be user, assistant, system or developer",
                                          param=f"input[{i}].role")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", i), "type": "function",
                    "function": {"name": _string(item, "name", i), "arguments": item.get("arguments") or ""}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":      # its text, then its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            content = _text(item.get("output"), f"input[{i}].output")
            out.append({"role": "user", "content": content} if _injected(item) else
                       {"role": "tool", "tool_call_id": _string(item, "call_id", i), "content": content})
        elif kind != "reasoning":
            raise InvalidRequestError(f"input items of type {kind!r} are not supported", param=f"input[{i}].type")
    return out


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where} must be a string or a list of text parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS:
            raise media_part(kind, f"{where}[{j}]")
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InvalidRequestError("only text content parts are supported", param=f"{where}[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def _injected(item: dict[str, Any]) -> bool:
    """A tool output that answers no call: Codex sends such (context it injects, as its goal's objective) with a
    `name` and `namespace` instead of a `call_id`, and OpenAI's API takes them."""
    return item.get("call_id") is None and isinstance(item.get("name"), str) and bool(item["name"])


def _string(item: dict[str, Any], name: str, i: int) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{name} must be a non-empty string", param=f"input[{i}].{name}")
    return value


def hosted_tools(tools: Any) -> list[str]:
    """The types of the hosted tools in `tools` (inside namespaces too), which the chat body leaves out."""
    out: list[str] = []
    for tool in tools or ():
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "namespace":
            out += hosted_tools(tool.get("tools"))
        elif isinstance(kind, str) and kind != "function":
            out.append(kind)
    return out


def _functions(tools: Any, where: str) -> list[dict[str, Any]]:
    """The function tools, namespaces flattened to their functions, hosted tools left out."""
    if not isinstance(tools, (list, tuple)):
        raise InvalidRequestError("tools must be a list", param=where)
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "namespace":
            out += _functions(tool.get("tools"), f"{where}[{i}].tools")
        elif kind == "function":
            out.append(_tool(tool, f"{where}[{i}]"))
        elif not isinstance(kind, str):
            raise InvalidRequestError("each tool must be an object with a type", param=f"{where}[{i}]")
    return out


def _tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    if isinstance(tool.get("function"), dict):             # already in the chat shape
        return tool
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise InvalidRequestError("a function tool needs a name", param=f"{where}.name")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if choice in _CHOICES:
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequestError('tool_choice must be "auto", "none", "required" or {"type": "function", "name"}',
                              param="tool_choice")


def _format(fmt: Any) -> dict[str, Any] | None:
    if fmt is None or fmt == {"type": "text"}:
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    raise InvalidRequestError("text.format must be text, json_object or json_schema", param="text.format")


# -- the answer ------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or new_id("msg"), "status": status, "role": "assistant",
            "content": [output_text(text)] if status == "completed" else []}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call: dict[str, Any], status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    function = call.get("function") or {}
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call.get("id") or new_id("call"),
            "name": function.get("name") or "", "arguments": function.get("arguments") or "", "status": status}


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    items = [message_item(message["content"])] if message.get("content") else []
    return items + [call_item(call) for call in message.get("tool_calls") or ()]


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not chat_usage:
        return None
    prompt, completion = chat_usage.get("prompt_tokens") or 0, chat_usage.get("completion_tokens") or 0
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}


def response(response_id: str, req: ResponsesRequest, model: str, *, status: str, output: list[dict[str, Any]],
             usage_: dict[str, Any] | None = None, finish_reason: str | None = None,
             error: dict[str, Any] | None = None, created_at: int | None = None) -> dict[str, Any]:
    """A response object as OpenAI's SDK reads it (`status`: in_progress, completed, incomplete, failed)."""
    if status == "completed" and finish_reason == "length":
        status = "incomplete"
    return {
        "id": response_id, "object": "response", "created_at": created_at or int(time.time()), "status": status,
        "error": error, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
        "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id, "reasoning": None, "store": req.store is not False,
        "temperature": req.temperature, "text": req.text or {"format": {"type": "text"}},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": req.tools or [],
        "top_p": req.top_p, "truncation": "disabled", "usage": usage_, "user": req.user,
        "metadata": req.metadata or {},
    }


def from_completion(response_id: str, req: ResponsesRequest, model: str, completion: dict[str, Any],
                    created_at: int) -> dict[str, Any]:
    choice = (completion.get("choices") or [{}])[0]
    return response(response_id, req, model, status="completed", output=output_items(choice.get("message") or {}),
                    usage_=usage(completion.get("usage")), finish_reason=choice.get("finish_reason"),
                    created_at=created_at)
