"""Tool calling in a chat request: checking what the client sent, shaping it as vLLM hands it to the chat
template, and recognising an assistant message as the tool call D generated.

- `check_chat(body)`: malformed `tools`, `tool_choice`, assistant `tool_calls` (arguments that are not a JSON
  string or object) and `tool` messages whose `tool_call_id` answers no earlier call are a 400 naming the field,
  before anything is rendered or stored.
- `template_calls(calls)`: as vLLM's chat parsing does before templating: arguments as parsed JSON (a JSON
  string is loaded, an empty one is `{}`), an empty list dropped.
- `calls_key(content, calls)`: what identifies an answer that called tools, for `history_tokens: generated`.
  A template re-renders `tool_calls` from parsed JSON (its own key order, spacing and escaping), so the
  rendered text is not the text D generated; the key is the content and the calls *as parsed*, so an
  assistant message that carries what D's answer was parsed into is recognised whatever its serialization.
- `parse_generated(text)`: D's generated text → (content, calls), as vLLM's hermes parser reads it.
- `merge_calls(calls, deltas)`: a response's `tool_calls`, or a stream's deltas, accumulated per call.
"""

from __future__ import annotations

import json
import re
from hashlib import blake2b
from typing import Any

from gateway.errors import InvalidRequestError
from gateway.turns.intake.message_cache import memo

TOOL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_KEY_PERSON = b"pdgw-tool-calls"     # a hash domain of its own: no answer text can hash to a tool-call key


def check_chat(body: dict[str, Any]) -> None:
    tools = body.get("tools")
    names = _tool_names(tools) if tools is not None else set()
    _check_choice(body.get("tool_choice"), names, tools is not None)
    seen: set[str] = set()
    messages = body.get("messages") or ()
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        if message.get("role") == "assistant" and message.get("tool_calls") is not None:
            seen |= memo(messages, i, "call_ids",
                         lambda: _check_calls(message["tool_calls"], f"messages[{i}].tool_calls"))
        elif message.get("role") == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in seen:
                raise InvalidRequestError(
                    f"messages[{i}].tool_call_id {call_id!r} answers no tool call of an earlier assistant message",
                    param=f"messages[{i}].tool_call_id")


def _tool_names(tools: Any) -> set[str]:
    if not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list of function tools", param="tools")
    names = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequestError('each tool must be {"type": "function", "function": {"name": ...}}',
                                      param=f"tools[{i}]")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise InvalidRequestError("a function's parameters must be a JSON Schema object",
                                      param=f"tools[{i}].function.parameters")
        names.add(fn["name"])
    return names


def _check_choice(choice: Any, names: set[str], has_tools: bool) -> None:
    if choice is None or choice == "none":
        return
    if choice in ("auto", "required") or isinstance(choice, dict):
        if not has_tools:
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        if not isinstance(choice, dict):
            return
        fn = choice.get("function")
        if choice.get("type") == "function" and isinstance(fn, dict) and fn.get("name") in names:
            return
        raise InvalidRequestError("tool_choice must name a function given in tools", param="tool_choice")
    raise InvalidRequestError('tool_choice must be "none", "auto", "required" or a named function',
                              param="tool_choice")


def _check_calls(calls: Any, where: str) -> set[str]:
    if not isinstance(calls, list):
        raise InvalidRequestError(f"{where} must be a list", param=where)
    ids = set()
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type", "function") != "function":
            raise InvalidRequestError('a tool call must be {"type": "function", "function": {...}}',
                                      param=f"{where}[{j}]")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequestError("a tool call needs a function name", param=f"{where}[{j}].function.name")
        _arguments(fn.get("arguments"), f"{where}[{j}].function.arguments")
        if isinstance(call.get("id"), str):
            ids.add(call["id"])
        elif call.get("id") is not None:
            raise InvalidRequestError("a tool call's id must be a string", param=f"{where}[{j}].id")
    return ids


def _arguments(arguments: Any, where: str) -> Any:
    """Parsed arguments, as vLLM gives them to the template; None or "" → {}."""
    if not arguments:
        return {}
    if isinstance(arguments, (dict, list)):
        return arguments
    if not isinstance(arguments, str):
        raise InvalidRequestError(f"{where} must be a JSON string", param=where)
    try:
        return json.loads(arguments)
    except ValueError:
        raise InvalidRequestError(f"{where} is not valid JSON", param=where) from None


def template_calls(calls: list[Any]) -> list[dict[str, Any]] | None:
    """An assistant's tool_calls as the template sees them in vLLM (arguments parsed; [] → no calls)."""
    if not calls:
        return None
    out = []
    for call in calls:
        fn = dict(call["function"])
        fn["arguments"] = _arguments(fn.get("arguments"), "tool_calls")
        out.append({**call, "function": fn})
    return out


# -- generated tool calls --------------------------------------------------------------------------------
def calls_key(content: str | None, calls: list[dict[str, Any]]) -> tuple[int, bytes]:
    """(length, hash) of the canonical form of an answer that called tools: its content and its calls parsed."""
    parsed = [[c["function"]["name"], _arguments(c["function"].get("arguments"), "tool_calls")] for c in calls]
    text = json.dumps([content or "", parsed], ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return len(text), blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16, person=_KEY_PERSON).digest()


def parse_generated(text: str) -> list[dict[str, Any]] | None:
    """The calls in D's text, as vLLM's hermes parser finds them; None if it has none or one is not JSON."""
    if "<tool_call>" not in text:
        return None
    calls = []
    try:
        for match in TOOL_BLOCK.finditer(text):
            raw = json.loads(match.group(1) if match.group(1) is not None else match.group(2))
            calls.append({"function": {"name": raw["name"], "arguments": raw["arguments"]}})
    except (ValueError, TypeError, KeyError):
        return None
    return calls


def same_calls(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    try:
        return calls_key("", a) == calls_key("", b)
    except (InvalidRequestError, KeyError, TypeError):
        return False


def merge_calls(calls: list[dict[str, Any]], got: Any) -> list[dict[str, Any]]:
    """`got`: a message's tool_calls (whole) or a delta's (by `index`: name once, arguments in fragments)."""
    for item in got if isinstance(got, list) else ():
        if not isinstance(item, dict):
            continue
        fn = item.get("function") or {}
        index = item.get("index")
        if not isinstance(index, int):
            calls.append({"id": item.get("id"), "function": {"name": fn.get("name"),
                                                             "arguments": fn.get("arguments") or ""}})
            continue
        while len(calls) <= index:
            calls.append({"id": None, "function": {"name": None, "arguments": ""}})
        call = calls[index]
        call["id"] = item.get("id") or call["id"]
        call["function"]["name"] = fn.get("name") or call["function"]["name"]
        call["function"]["arguments"] += fn.get("arguments") or ""
    return calls
