"""The chat template rendered straight through its compiled Jinja template: what transformers'
`apply_chat_template(tokenize=False)` renders, without its per-call conversion of every message.

transformers 5.x converts the whole conversation on every call before rendering it (message objects to dicts,
keys with a None value dropped, everything rebuilt from plain JSON types for the sandbox, reasoning fields
aliased): that is most of a render's cost, and it grows with the number of messages. Here each message's form
for the template is made once, when the message is first seen (kept with it: messages.py), by the same steps,
and only the render runs per turn, with the same compiled template (transformers' own, handed over by render.py:
its environment, filters and globals) and the same arguments. Sharing the forms between renders is safe: the
template runs in Jinja's immutable sandbox, which cannot change a list or dict it is given.

Only the plain case: a single template string, no `continue_final_message`, messages, tools and kwargs of
exact JSON types, no kwarg that apply_chat_template would take as its own parameter. Anything else, and any
error, goes through apply_chat_template itself (its error is the one the client sees). Whether the direct render
equals apply_chat_template on this transformers version is checked at start-up on probe conversations
(`DirectTemplate.verify`); tests/unit/test_template_direct.py compares both on every template the repo ships.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

from gateway.turns.intake.message_cache import each

log = logging.getLogger(__name__)

_SCALARS = frozenset({str, int, float, bool, type(None)})
_NOT_PLAIN = object()                           # a message's memo: it needs apply_chat_template
Normalize = Callable[[dict[str, Any]], dict[str, Any]]
Compile = Callable[[str], Any]


def plain(value: Any) -> bool:
    """Exact JSON types all the way down (what transformers' sandbox conversion keeps as it is)."""
    kind = type(value)
    if kind in _SCALARS:
        return True
    if kind is dict:
        return all(type(k) in _SCALARS and plain(v) for k, v in value.items())
    if kind is list or kind is tuple:
        return all(map(plain, value))
    return False


def template_form(message: dict[str, Any], normalize: Normalize, reasoning_fields: tuple[str, ...]) -> Any:
    """A message as the template sees it: the gateway's normalization (vLLM's), then transformers': keys whose
    value is None dropped, the reasoning copied under its other names. `_NOT_PLAIN` when it is not plain JSON."""
    form = {k: v for k, v in normalize(message).items() if v is not None}
    if not plain(form):
        return _NOT_PLAIN
    reasoning = next((form[k] for k in reasoning_fields if form.get(k) is not None), None)
    if reasoning is not None:
        form = {"thinking": reasoning, **form, "reasoning_content": reasoning}
    return form


class DirectTemplate:
    """`render(...)` the text apply_chat_template would give, or None where only apply_chat_template may say."""

    def __init__(self, tokenizer: Any, normalize: Normalize, compile_template: Compile | None,
                 reasoning_fields: tuple[str, ...] = ()) -> None:
        """`compile_template`, `reasoning_fields`: transformers' own (render.py imports them; None: not found in
        this version, every render goes through apply_chat_template)."""
        self.tokenizer, self.normalize = tokenizer, normalize
        self._compile, self._reasoning = compile_template, reasoning_fields
        self._source: str | None = None
        self._compiled: Any = None
        # kwargs apply_chat_template would bind to its own parameters, or pass twice to the render
        self._reserved = frozenset(inspect.signature(type(tokenizer).apply_chat_template).parameters) | {
            "messages", "conversations", "tools", "documents", "add_generation_prompt"}
        self.enabled = compile_template is not None

    def _template(self) -> Any:
        source = self.tokenizer.chat_template
        if not isinstance(source, str):
            return None
        if source is not self._source:
            self._compiled, self._source = self._compile(source), source
        return self._compiled

    def render(self, messages: list[dict[str, Any]], tools: list[dict] | None, add_generation_prompt: bool,
               continue_final_message: bool, kwargs: dict[str, Any] | None) -> str | None:
        if not self.enabled or continue_final_message or not messages:
            return None
        compiled = self._template()
        if compiled is None:
            return None
        if kwargs and (not self._reserved.isdisjoint(kwargs) or not plain(kwargs)):
            return None
        if tools is not None and (type(tools) is not list or not all(type(t) is dict for t in tools)
                                  or not plain(tools)):
            return None
        normalize, reasoning = self.normalize, self._reasoning
        forms = each(messages, "template_form", lambda m: template_form(m, normalize, reasoning))
        if any(f is _NOT_PLAIN for f in forms):
            return None
        try:
            return compiled.render(messages=forms, tools=tools, documents=None,
                                   add_generation_prompt=add_generation_prompt,
                                   **{**self.tokenizer.special_tokens_map, **(kwargs or {})})
        except Exception:  # the same error again from apply_chat_template, in its words
            return None

    def verify(self, probes: list[dict[str, Any]]) -> bool:
        """Each probe's (apply_chat_template's keyword arguments) direct render equals apply_chat_template's;
        disables the direct render if one does not. Run once at start-up."""
        for probe in probes:
            try:
                expected = self.tokenizer.apply_chat_template(
                    [self.normalize(m) for m in probe["messages"]], tools=probe.get("tools"), tokenize=False,
                    add_generation_prompt=probe.get("add_generation_prompt", True),
                    **(probe.get("kwargs") or {}))
            except Exception:
                continue                        # a template that refuses the probe: nothing to compare
            got = self.render(probe["messages"], probe.get("tools"), probe.get("add_generation_prompt", True),
                              False, probe.get("kwargs"))
            if got != expected:
                log.info("the chat template is rendered through apply_chat_template: the direct render differs")
                self.enabled = False
                return False
        return True
