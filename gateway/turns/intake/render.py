"""Prompt rendering: the model's tokenizer and chat template (transformers) → the token ids the engine sees.

The only module that imports transformers, with template.py (which renders the chat template through
transformers' compiled template, as apply_chat_template does, without its per-call conversion of every message;
apply_chat_template itself for anything unusual). Rendering follows vLLM: template to text, then encode without
adding special tokens (the template carries them); completions prompts are encoded with them.

Encoding is incremental where that is exact: the rendered text is cut at the tokenizer's special tokens and
only pieces not seen before go through the tokenizer (`pieces.py`), and a conversation's next prompt continues
the ids of its previous one, found by its messages, from where their texts agree (`prompts.py`), so a turn's
cost does not grow with the history. Whether the cut is exact for this tokenizer is verified at start-up; if
not, every prompt is encoded whole.

The template itself is rendered whole, every turn: chat templates are arbitrary Jinja (the builtin one wraps
consecutive tool results in one block, reasoning templates drop a past answer's reasoning once a later user
message exists), so no part of the text is assumed to stay as it was; what is kept is each message's form for
the template (`messages.py`).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway.errors import InvalidRequestError
from gateway.store import Answer
from gateway.turns.intake.generated import answer, substitutions, text_of, tool_answer
from gateway.turns.intake.message_cache import each
from gateway.turns.intake.pieces import DEFAULT_CACHE_TOKENS, PieceEncoder, TokenIds, exact_specials
from gateway.turns.intake.prompts import DEFAULT_PREFIX_BYTES, Lineage, PromptEncoder
from gateway.turns.intake.template import DirectTemplate
from gateway.turns.intake.tools import template_calls

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The gateway encodes on its event loop: a thread pool would only wait for cores the engines and the loop need
# (and spin while it waits, which costs CPU). Measured: pooled batch encodes of two short pieces took 1-20 ms.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
_SERIAL = os.environ["TOKENIZERS_PARALLELISM"].strip().lower() in ("", "off", "false", "f", "no", "n", "0")

from transformers import AutoTokenizer  # noqa: E402  (after the verbosity setting)

try:       # private to transformers: what the direct render (template.py) compiles and aliases as it does
    from transformers.utils.chat_template_utils import _REASONING_FIELDS, _compile_jinja_template  # noqa: E402
except ImportError:                      # pragma: no cover  (then apply_chat_template renders every turn)
    _compile_jinja_template, _REASONING_FIELDS = None, ()

DEFAULT_DECODED_TOKENS = 1_000_000      # answers' ids kept with their decoded text (tool-call answers)
BUILTIN_DIR = Path(__file__).resolve().parents[2] / "tokenizers"
log = logging.getLogger(__name__)
_RENDERERS = itertools.count()


def tokenizer_path(spec: str) -> str:
    """`builtin:NAME` → the tokenizer shipped in this package; anything else is a path or hub id."""
    if spec.startswith("builtin:"):
        path = BUILTIN_DIR / spec.removeprefix("builtin:")
        if not path.is_dir():
            raise ValueError(f"unknown builtin tokenizer {spec!r}; have {sorted(p.name for p in BUILTIN_DIR.iterdir())}")
        return str(path)
    return spec


class Renderer:
    def __init__(self, tokenizer: str, chat_template: str | None = None, *, incremental: bool = True,
                 cache_tokens: int = DEFAULT_CACHE_TOKENS, prefix_bytes: int = DEFAULT_PREFIX_BYTES) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path(tokenizer))
        if chat_template:
            self.tokenizer.chat_template = Path(chat_template).read_text()
        if not self.tokenizer.chat_template:
            raise ValueError(f"tokenizer {tokenizer!r} has no chat template: pass --chat-template FILE")
        self.pieces = self._piece_encoder(cache_tokens) if incremental else None
        self.prompts = PromptEncoder(self.pieces, prefix_bytes) if self.pieces is not None else None
        self._decoded = _Decoded(self.decode)
        self.vocab_size = len(self.tokenizer)
        self.special_ids = set(self.tokenizer.all_special_ids)
        self.direct = DirectTemplate(self.tokenizer, normalize_message, _compile_jinja_template,
                                     tuple(_REASONING_FIELDS))
        self._splits_memo = f"splits#{next(_RENDERERS)}"     # this tokenizer's, with each message (generated.py)
        self.direct.verify(PROBES)

    def _piece_encoder(self, cache_tokens: int) -> PieceEncoder | None:
        specials = exact_specials(dict(getattr(self.tokenizer, "added_tokens_decoder", {}) or {}))
        if not getattr(self.tokenizer, "is_fast", False) or not specials:
            log.info("prompts are encoded whole: the tokenizer has no special tokens to cut them at")
            return None
        encoder = PieceEncoder(specials, self._encode_batch, cache_tokens)
        others = [str(t) for t in (getattr(self.tokenizer, "added_tokens_decoder", {}) or {}).values()
                  if str(t) not in specials]
        template = self.tokenizer.chat_template if isinstance(self.tokenizer.chat_template, str) else ""
        counterexample = encoder.verify(self._encode_whole, extra_pieces=[f"x{t} y{t}" for t in others[:4]],
                                        first=[s for s in specials if s in template])
        if counterexample is not None:
            log.info("prompts are encoded whole: cutting at special tokens is not exact for this tokenizer "
                     "(e.g. %r)", counterexample[:80])
            return None
        return encoder

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Straight to the Rust tokenizer, one piece at a time (transformers' wrapper costs more than a short
        piece; its batch call goes through a thread pool); start-up verification compares the result with
        transformers' own encode, so a difference disables cutting."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or backend.truncation is not None or backend.padding is not None:
            return self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        if _SERIAL and hasattr(backend, "encode_batch_fast"):
            # one call for all, no offsets computed (about 20 % less per piece); serial with parallelism off
            return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
        return [backend.encode(text, add_special_tokens=False).ids for text in texts]

    def _encode_whole(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode(self, text: str, lineage: Lineage | None = None) -> list[int]:
        """A rendered chat prompt → ids (a `TokenIds`). `lineage`: its messages', to continue the ids of the
        conversation's previous prompt (`prompts.py`)."""
        if self.prompts is None:
            return TokenIds(self._encode_whole(text))
        return self.prompts.encode(text, lineage)

    def render_chat(self, messages: list[dict[str, Any]], *, answers: list[Answer] | None = None,
                    rendered: str | None = None, lineage: Lineage | None = None, **template: Any) -> list[int]:
        """`answers`: past answers to send as the ids D generated (history_tokens "generated"); needs the
        incremental encoder's cut at special tokens, else the text is encoded as usual. `rendered`: these
        messages' template text, when the caller has it already (intake does), so it is not rendered again."""
        text = rendered if rendered is not None else self.template(messages, **template)
        if answers and self.prompts is not None:
            return self._spliced(messages, text, answers, template, lineage)
        return self.encode(text, lineage)

    def _spliced(self, messages: list[dict[str, Any]], text: str, answers: list[Answer],
                 template: dict[str, Any], lineage: Lineage | None) -> list[int]:
        """Assistant messages that carry the tool calls D generated are rendered as D's text (the template's
        re-rendering of the calls is not what D holds) and sent as D's ids, provided that is the only
        difference from the plain rendering: a template that rewrites past answers, or renders other messages
        differently once an assistant message has no tool_calls, keeps the plain rendering."""
        assert self.prompts is not None
        generated = substitutions(messages, answers, self._decoded, self._splits, self._splits_memo)
        if generated:
            try:
                swapped = self.template(generated.messages, **template)
            except InvalidRequestError:
                swapped = None
            if swapped is not None and generated.only_difference(swapped, text):
                return self.prompts.encode(swapped, lineage, answers, generated.spans)
        return self.prompts.encode(text, lineage, answers)

    def _splits(self, text: str) -> bool:
        """The text holds a token of its own (a special or added token's text): it is more than one piece."""
        assert self.pieces is not None
        return len(self.pieces.split(text)) > 1

    def template(self, messages: list[dict[str, Any]], *, tools: list[dict] | None = None,
                 add_generation_prompt: bool = True, continue_final_message: bool = False,
                 chat_template_kwargs: dict[str, Any] | None = None) -> str:
        text = self.direct.render(messages, tools, add_generation_prompt, continue_final_message,
                                  chat_template_kwargs)
        if text is not None:
            return text
        try:
            return self.tokenizer.apply_chat_template(
                each(messages, "template", normalize_message), tools=tools, tokenize=False,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}))
        except Exception as exc:  # jinja raises many kinds; all mean this request cannot be rendered
            raise InvalidRequestError(f"the chat template could not render these messages: {exc}",
                                      param="messages") from None

    def answer(self, output_ids: list[int], text: str,
               tool_calls: list[dict[str, Any]] | None = None) -> Answer | None:
        """D's output as a reusable answer: only if its ids (without the end-of-turn token) decode to the text
        the client got (`text_of`; not so with reasoning split out of the content, for one), or, when the client
        got tool calls, to text whose calls parse to exactly those."""
        ids = list(output_ids)
        while ids and ids[-1] in self.special_ids:
            ids.pop()
        if tool_calls:
            return tool_answer(ids, self.decode(ids), text, tool_calls) if ids else None
        return answer(text, ids) if ids and text and text_of(self.decode(ids), text) else None

    def render_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            if not all(0 <= token < self.vocab_size for token in prompt):
                raise InvalidRequestError(f"prompt token ids must lie in [0, {self.vocab_size})", param="prompt")
            return TokenIds(prompt)
        return TokenIds(self.tokenizer.encode(prompt))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


_PROBE_TOOL = {"type": "function", "function": {"name": "probe", "description": "A probe.", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
_PROBE_CHAT = [
    {"role": "system", "content": "You are a probe.", "name": None},
    {"role": "user", "content": [{"type": "text", "text": "Probe"}, {"type": "text", "text": "me."}]},
    {"role": "assistant", "content": "Thinking done.", "reasoning_content": "Let me see.", "tool_calls": None},
    {"role": "user", "content": "Call it."},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "probe", "arguments": '{"x": 1}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "1"},
    {"role": "user", "content": "ünïcödé 🙂 <think>x</think>"},
]
# What the direct render is checked on at start-up (template.py): None values, content parts, reasoning, tool
# calls and results, with and without tools and kwargs, with and without the generation prompt.
PROBES = [
    {"messages": _PROBE_CHAT[:2]},
    {"messages": _PROBE_CHAT[:4], "add_generation_prompt": False},
    {"messages": _PROBE_CHAT, "tools": [_PROBE_TOOL]},
    {"messages": _PROBE_CHAT, "kwargs": {"enable_thinking": False}},
]


def normalize_message(message: dict[str, Any]) -> dict[str, Any]:
    """As vLLM does for string-content templates: content parts → their texts joined by newlines; an
    assistant's tool call arguments parsed from their JSON strings, an empty tool_calls list dropped."""
    content = message.get("content")
    if isinstance(content, list):
        content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    out = {**message, "content": content if content is not None else ""}
    if message.get("role") == "assistant" and "tool_calls" in message:
        calls = template_calls(message["tool_calls"])
        if calls is None:
            del out["tool_calls"]
        else:
            out["tool_calls"] = calls
    return out


class _Decoded:
    """`decode` for recent answers' ids, kept: a tool-call answer is decoded on every turn that resends it.
    Least recently used out first beyond `max_tokens` ids."""

    def __init__(self, decode: Callable[[list[int]], str], max_tokens: int = DEFAULT_DECODED_TOKENS) -> None:
        self.decode, self.max_tokens = decode, max_tokens
        self._entries: OrderedDict[tuple[int, ...], str] = OrderedDict()
        self._tokens = 0

    def __call__(self, ids: list[int]) -> str:
        key = tuple(ids)
        text = self._entries.get(key)
        if text is not None:
            self._entries.move_to_end(key)
            return text
        text = self.decode(ids)
        if len(key) <= self.max_tokens:
            self._entries[key] = text
            self._tokens += len(key)
            while self._tokens > self.max_tokens:
                old, _ = self._entries.popitem(last=False)
                self._tokens -= len(old)
        return text
