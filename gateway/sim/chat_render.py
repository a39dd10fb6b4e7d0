"""Prompt rendering and detokenization, done on the simulator's own (as vLLM does, through transformers).

The simulator never uses the gateway's renderer: it is the independent side of every parity check.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from transformers import AutoTokenizer

from gateway.sim.hermes_tools import prompt_tool_rounds

BUILTIN_PREFIX = "builtin:"
BUILTIN_DIR = Path(__file__).resolve().parent.parent / "tokenizers"


def tokenizer_source(spec: str) -> str:
    """`builtin:NAME` → the shipped tokenizer dir; anything else is a local path or a HF id."""
    if spec.startswith(BUILTIN_PREFIX):
        path = BUILTIN_DIR / spec[len(BUILTIN_PREFIX):]
        if not path.is_dir():
            raise ValueError(f"no builtin tokenizer {spec!r} in {BUILTIN_DIR}")
        return str(path)
    return spec


class RenderError(ValueError):
    """Messages the chat template cannot render (vLLM answers 400)."""


class Renderer:
    """Messages or prompts → token ids, and ids → text, exactly as a vLLM frontend would."""

    def __init__(self, tokenizer: str, chat_template: str | None = None) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_source(tokenizer))
        self.chat_template = Path(chat_template).read_text() if chat_template else None
        self.eos_token_id: int = self.tokenizer.eos_token_id

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                    tools: list[Any] | None = None, template_kwargs: dict[str, Any] | None = None) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                [_flatten(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt,
                tools=tools, chat_template=self.chat_template, **(template_kwargs or {}))
        except (ValueError, TypeError, KeyError, TemplateError) as exc:
            raise RenderError(str(exc)) from exc
        return self.encode(text)

    @functools.cached_property
    def turn_headers(self) -> tuple[str, str] | None:
        """The text between one turn's content and the next user's, and the next assistant's, in this template
        (learned by rendering marks); None where the template does not render them in order."""
        marks = ("\ue000q", "\ue000a", "\ue000r")          # private-use characters no conversation holds
        roles = ("user", "assistant", "user")
        try:
            text = self.tokenizer.apply_chat_template([{"role": r, "content": m} for r, m in zip(roles, marks)],
                                                      tokenize=False, chat_template=self.chat_template)
        except (ValueError, TypeError, KeyError, TemplateError):
            return None
        q, a, r = (text.find(m) for m in marks)
        if not 0 <= q < a < r:
            return None
        return text[a + len(marks[1]):r], text[q + len(marks[0]):a]

    def tool_rounds(self, prompt: list[int]) -> int | None:
        """The agent loop's rounds in a rendered prompt (hermes_tools.prompt_tool_rounds), decoding only as much
        of its end as holds the last question; None where the template's turns cannot be told apart."""
        if self.turn_headers is None:
            return None
        n = 4096
        while True:
            text = self.tokenizer.decode(prompt[-n:], skip_special_tokens=False)
            rounds = prompt_tool_rounds(text, *self.turn_headers, whole=n >= len(prompt))
            if rounds is not None:
                return rounds
            n *= 4

    def render_prompt(self, prompt: str) -> list[int]:
        # /v1/completions: the tokenizer's own default for special tokens (BOS where it has one).
        return list(self.tokenizer.encode(prompt))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_strs(self, ids: list[int]) -> list[str]:
        return self.tokenizer.convert_ids_to_tokens(ids)

    def __len__(self) -> int:
        return len(self.tokenizer)


def _flatten(message: dict[str, Any]) -> dict[str, Any]:
    """A list of content parts becomes one string: text parts joined with newlines (vLLM's "string" format)."""
    content = message.get("content")
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text"]
        message = {**message, "content": "\n".join(texts)}
    elif content is None and "content" in message:
        message = {**message, "content": ""}
    if message.get("role") == "assistant" and isinstance(message.get("tool_calls"), list):
        message = _parsed_tool_calls(message)
    return message


def _parsed_tool_calls(message: dict[str, Any]) -> dict[str, Any]:
    """vLLM hands templates tool call arguments as parsed JSON (a string is loaded, an empty one is {}) and
    drops an empty tool_calls list."""
    if not message["tool_calls"]:
        return {k: v for k, v in message.items() if k != "tool_calls"}
    calls = []
    for call in message["tool_calls"]:
        fn = dict(call["function"])
        args = fn.get("arguments")
        fn["arguments"] = (args if isinstance(args, (dict, list)) else json.loads(args)) if args else {}
        calls.append({**call, "function": fn})
    return {**message, "tool_calls": calls}
