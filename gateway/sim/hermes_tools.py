"""Tool calling as vLLM serves it with `--enable-auto-tool-choice --tool-call-parser hermes`.

What the simulated model writes (`compose`), and how the serving turns that text into OpenAI `tool_calls`
(`extract`, non-streamed; `ToolStream`, streamed), after vLLM's hermes parser and chat serving:

- `tool_choice` "auto" (the default when `tools` are given; needs the two flags, else 400): the model may write
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks. Non-streamed, `content` is the text
  before the first block (null when empty; text after the last block is dropped), each call's `arguments` is
  `json.dumps(arguments, ensure_ascii=False)`; finish_reason "tool_calls". A block that is not JSON: no calls,
  the whole text is the content. Streamed, text outside the blocks goes out as `content`; a call goes out as a
  first delta with `id`, `type` and the name, then fragments of its arguments string.
- "required" (guided decoding in vLLM): the model writes a JSON array `[{"name": ..., "parameters": {...}}]`;
  finish_reason "tool_calls". A named function: the model writes the arguments object; finish_reason "stop".
- "none", or no tools: plain text.

The model's JSON is `json.dumps` with the template's own spacing unless the sim runs with
`--tool-call-style varied`: then some calls come compact, arguments-first or with `\\uXXXX` escapes, which a
chat template re-renders differently from the tokens the model generated (what `history_tokens: generated`
is for).
"""

from __future__ import annotations

import json
import random
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"     # how hermes templates open a tool result inside a user turn
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_NAME = re.compile(r'"name"\s*:\s*"(?:[^"\\]|\\.)*"')
Mode = Literal["auto", "required", "named"]
Style = Literal["template", "varied"]

PLAIN_WORDS = "alpha bravo delta echo river stone cloud light garden window market signal forest".split()
UNICODE_WORDS = ("Zürich", "東京", "naïve café", "Ελλάδα", "🙂 ok", "São Paulo", "Łódź",
                 "ümlaut — dash")


class ToolRequestError(ValueError):
    """A request's tools or tool_choice vLLM would refuse (400)."""


@dataclass(frozen=True)
class Function:
    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolSpec:
    """What a request lets the model call: `named` is the function a named tool_choice forces."""
    mode: Mode
    functions: tuple[Function, ...]
    named: str | None = None


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str                     # JSON text, as OpenAI sends it


def tool_spec(tools: list[dict[str, Any]] | None, tool_choice: Any, *, auto_enabled: bool) -> ToolSpec | None:
    """The request's tool settings checked as vLLM checks them; None when the model answers in plain text."""
    functions = tuple(_function(t) for t in tools or ())
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if tool_choice == "none":
        return None
    if not functions:
        raise ToolRequestError("When using `tool_choice`, `tools` must be set.")
    if tool_choice == "auto":
        if not auto_enabled:
            raise ToolRequestError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                   "to be set")
        return ToolSpec("auto", functions)
    if tool_choice == "required":
        return ToolSpec("required", functions)
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in {f.name for f in functions}:
            raise ToolRequestError(f"Tool '{name}' has not been passed in `tools`.")
        return ToolSpec("named", functions, named=name)
    raise ToolRequestError(f"Invalid tool_choice: {tool_choice!r}")


def tool_rounds(messages: list[dict[str, Any]]) -> int:
    """Rounds of tool calls since the user last spoke: assistant messages with `tool_calls` after the last user
    message (an agent loop's steps). The simulated model stops calling tools after `--tool-call-rounds` of them,
    so an agent harness's loop ends in a text answer, as a real model's does once it has what it needs. The
    count over the request's messages, where the prompt's turns cannot be told apart (`prompt_tool_rounds`)."""
    rounds = 0
    for message in reversed(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role == "user":
            break
        if role == "assistant" and message.get("tool_calls"):
            rounds += 1
    return rounds


def prompt_tool_rounds(text: str, user_header: str, assistant_header: str, *, whole: bool) -> int | None:
    """`tool_rounds` read from the rendered prompt, which is what the model sees (a gateway may send only the last
    message beside vLLM's pinned `prompt_token_ids`): assistant turns that wrote a call since the last user turn
    that is not a tool result. None when `text` holds no such user turn, unless it is the `whole` prompt (then
    the question opened it, with no turn before its header)."""
    turns = text.split(user_header)
    start = next((i for i in range(len(turns) - 1, 0, -1) if not turns[i].startswith(TOOL_RESPONSE_OPEN)), None)
    if start is None and not whole:
        return None
    # each user turn runs to the next one; what follows an assistant header in it is that assistant's reply
    replies = (reply for turn in turns[start or 0:] for reply in turn.split(assistant_header)[1:])
    return sum(TOOL_CALL_OPEN in reply for reply in replies)


def _function(tool: Any) -> Function:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ToolRequestError("each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}")
    params = fn.get("parameters")
    return Function(fn["name"], params if isinstance(params, dict) else {})


# -- what the model writes ---------------------------------------------------------------------------------
def compose(rng: random.Random, spec: ToolSpec, *, rate: float, style: Style) -> str | None:
    """The model's text for a request with tools, or None when it answers in plain text instead."""
    if spec.mode == "named":
        fn = next(f for f in spec.functions if f.name == spec.named)
        return _dumps(rng, _arguments(rng, fn.parameters), style)
    if spec.mode == "required":
        items = [{"name": f.name, "parameters": _arguments(rng, f.parameters)} for f in _pick(rng, spec)]
        return json.dumps(items, ensure_ascii=False)
    if rng.random() >= rate:
        return None
    blocks = [TOOL_CALL_OPEN + "\n" + _call_json(rng, f, style) + "\n" + TOOL_CALL_CLOSE for f in _pick(rng, spec)]
    before = " ".join(rng.choice(PLAIN_WORDS) for _ in range(rng.randint(2, 6))) + "\n" if rng.random() < 0.2 else ""
    after = "\n" + " ".join(rng.choice(PLAIN_WORDS) for _ in range(3)) if rng.random() < 0.1 else ""
    return before + "\n".join(blocks) + after


def _pick(rng: random.Random, spec: ToolSpec) -> list[Function]:
    count = rng.choices((1, 2, 3), weights=(7, 2, 1))[0]       # parallel calls now and then
    return [rng.choice(spec.functions) for _ in range(count)]


def _call_json(rng: random.Random, fn: Function, style: Style) -> str:
    args = _arguments(rng, fn.parameters)
    if style == "varied" and rng.random() < 0.3:
        return _dumps(rng, {"arguments": args, "name": fn.name}, style)        # arguments first
    return _dumps(rng, {"name": fn.name, "arguments": args}, style)


def _dumps(rng: random.Random, value: Any, style: Style) -> str:
    if style == "varied":
        form = rng.randrange(3)
        if form == 1:
            return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
        if form == 2:
            return json.dumps(value)                                 # \uXXXX escapes for non-ASCII
    return json.dumps(value, ensure_ascii=False)


def _arguments(rng: random.Random, schema: dict[str, Any]) -> dict[str, Any]:
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    if not props:
        return {"query": _string(rng)}
    required = set(schema.get("required") or ())
    return {k: _value(rng, v if isinstance(v, dict) else {}, 0) for k, v in props.items()
            if k in required or rng.random() < 0.5}


def instance(rng: random.Random, schema: dict[str, Any]) -> Any:
    """A value `schema` accepts (types, enums, properties; two levels deep): tool arguments, structured output."""
    if schema.get("type") == "object" or "properties" in schema:
        return _arguments(rng, schema)
    return _value(rng, schema, 0)


def _value(rng: random.Random, schema: dict[str, Any], depth: int) -> Any:
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return rng.choice(schema["enum"])
    kind = schema.get("type")
    if kind == "integer":
        return rng.randint(-5, 10_000)
    if kind == "number":
        return round(rng.uniform(-100, 100), 3)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array" and depth < 2:
        return [_value(rng, schema.get("items") or {"type": "string"}, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "object" and depth < 2:
        return {k: _value(rng, v, depth + 1) for k, v in (schema.get("properties") or {}).items()}
    return _string(rng)


def _string(rng: random.Random) -> str:
    if rng.random() < 0.25:
        return rng.choice(UNICODE_WORDS)
    return " ".join(rng.choice(PLAIN_WORDS) for _ in range(rng.randint(1, 4)))


# -- what the serving returns ------------------------------------------------------------------------------
@dataclass
class Extracted:
    content: str | None
    calls: list[Call]
    spans: list[tuple[int, int]] = field(default_factory=list)   # each call's block in the text (auto)

    @property
    def called(self) -> bool:
        return bool(self.calls)


def extract(spec: ToolSpec, text: str) -> Extracted:
    """The model's whole text → content and calls, as vLLM's non-streamed chat response has them."""
    if spec.mode == "named":
        return Extracted("", [Call(spec.named or "", text)])
    if spec.mode == "required":
        try:
            items = json.loads(text)
            calls = [Call(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]
        except (ValueError, TypeError, KeyError):
            return Extracted(text, [])
        return Extracted("", calls)
    return parse_hermes(text)


def parse_hermes(text: str) -> Extracted:
    if TOOL_CALL_OPEN not in text:
        return Extracted(text, [])
    calls, spans = [], []
    try:
        for match in _BLOCK.finditer(text):
            raw = json.loads(match.group(1) if match.group(1) is not None else match.group(2))
            calls.append(Call(raw["name"], json.dumps(raw["arguments"], ensure_ascii=False)))
            spans.append(match.span())
    except (ValueError, TypeError, KeyError):
        return Extracted(text, [])
    content = text[:text.find(TOOL_CALL_OPEN)]
    return Extracted(content or None, calls, spans)


def finish_reason(spec: ToolSpec | None, extracted: Extracted | None, engine_finish: str) -> str:
    if spec is None or extracted is None or not extracted.called:
        return engine_finish
    if spec.mode == "named":
        return engine_finish                   # OpenAI: "stop" for a named function
    return "tool_calls"


def message_calls(extracted: Extracted) -> list[dict[str, Any]]:
    return [{"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in extracted.calls]


def call_id() -> str:
    return f"chatcmpl-tool-{secrets.token_hex(16)}"


class ToolStream:
    """Streamed deltas for a request with tools. The simulated model's whole answer is known up front, so each
    step maps the text decoded so far onto the final parse: text outside call blocks as `content`; per call,
    once its name is complete, a first delta (id, type, name) and then its arguments string in fragments, in
    proportion to how much of the block has been generated, the rest when the block closes."""

    def __init__(self, spec: ToolSpec, final_text: str) -> None:
        self.spec, self.final = spec, final_text
        parsed = extract(spec, final_text)
        self.calls = parsed.calls
        if spec.mode == "auto":
            self.spans = parsed.spans
        else:                                  # guided output: the whole text is the call(s)
            self.spans = [(0, len(final_text))] * len(self.calls)
        self.sent_text = 0                     # chars of the final text accounted for
        self.name_sent = [False] * len(self.calls)
        self.args_sent = [0] * len(self.calls)

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def delta(self, text: str) -> dict[str, Any] | None:
        upto = _common_prefix(text, self.final)
        if not self.calls:
            return self._content(self.sent_text, upto)
        content = self._outside(upto)
        deltas = [d for i in range(len(self.calls)) if (d := self._call_delta(i, upto)) is not None]
        self.sent_text = max(self.sent_text, upto)
        out: dict[str, Any] = {}
        if content:
            out["content"] = content
        if deltas:
            out["tool_calls"] = deltas
        return out or None

    def _content(self, start: int, end: int) -> dict[str, Any] | None:
        self.sent_text = max(start, end)
        return {"content": self.final[start:end]} if end > start else None

    def _outside(self, upto: int) -> str:
        if self.spec.mode != "auto":
            return ""
        pieces, pos = [], self.sent_text
        for start, end in self.spans:
            if pos < start:
                pieces.append(self.final[pos:min(start, upto)])
            pos = max(pos, end)
        if pos < upto:
            pieces.append(self.final[pos:upto])
        return "".join(p for p in pieces if p)

    def _call_delta(self, i: int, upto: int) -> dict[str, Any] | None:
        start, end = self.spans[i]
        if upto <= start:
            return None
        call, delta = self.calls[i], {"index": i}
        if not self.name_sent[i]:
            name = _NAME.search(self.final, start, end)
            named_at = name.end() if name and self.spec.mode == "auto" else start
            if upto < named_at:
                return None
            self.name_sent[i] = True
            delta.update(id=call_id(), type="function")
            delta["function"] = {"name": call.name}
        target = len(call.arguments) if upto >= end else len(call.arguments) * (upto - start) // (end - start)
        if target > self.args_sent[i]:
            delta.setdefault("function", {})["arguments"] = call.arguments[self.args_sent[i]:target]
            self.args_sent[i] = target
        return delta if len(delta) > 1 else None


def _common_prefix(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
