"""The direct render (turns/intake/template.py) must give, byte for byte, what transformers' apply_chat_template
gives, on every template the repo ships, with tools, tool calls and results, reasoning, None values and content
parts; and fall back to apply_chat_template (same text, same refusal) for anything else."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.api.schemas import ChatRequest, parse
from gateway.errors import InvalidRequestError
from gateway.turns.intake.message_cache import MessageCache
from gateway.turns.intake.render import PROBES, Renderer, normalize_message
from tests.unit.test_render_incremental import TEXT, TOKENIZERS

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Find it.", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"}}, "required": ["q"]}}}]


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def renderer(request) -> Renderer:
    r = Renderer(*TOKENIZERS[request.param]())
    assert r.direct.enabled, "the start-up probe agrees on every shipped template"
    return r


def expected(r: Renderer, messages: list[dict[str, Any]], **template: Any) -> str:
    kwargs = template.pop("chat_template_kwargs", None) or {}
    return r.tokenizer.apply_chat_template([normalize_message(m) for m in messages], tokenize=False, **template,
                                           **kwargs)


def direct(r: Renderer, messages: list[dict[str, Any]], **template: Any) -> str | None:
    return r.direct.render(messages, template.get("tools"), template.get("add_generation_prompt", True),
                           template.get("continue_final_message", False), template.get("chat_template_kwargs"))


CALL = st.fixed_dictionaries({"id": st.sampled_from(["c1", "c2"]), "type": st.just("function"), "function":
                              st.fixed_dictionaries({"name": st.just("lookup"), "arguments": st.sampled_from(
                                  ['{"q": "x"}', '{"q": "é", "n": 2}', "{}"])})})
CONTENT = st.one_of(TEXT, st.none(), st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
                                              min_size=1, max_size=3))
USER = st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]), "content": CONTENT},
                             optional={"name": st.one_of(st.none(), st.just("ann"))})
ASSISTANT = st.fixed_dictionaries({"role": st.just("assistant"), "content": CONTENT}, optional={
    "tool_calls": st.one_of(st.none(), st.lists(CALL, max_size=2)),
    "reasoning_content": st.one_of(st.none(), TEXT), "reasoning": TEXT})
TOOL = st.fixed_dictionaries({"role": st.just("tool"), "tool_call_id": st.sampled_from(["c1", "c2"]),
                              "content": CONTENT})
MESSAGES = st.lists(st.one_of(USER, ASSISTANT, TOOL), min_size=1, max_size=7)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=MESSAGES, tools=st.sampled_from([None, TOOLS, []]), generation=st.booleans(),
       kwargs=st.sampled_from([None, {}, {"enable_thinking": False}, {"enable_thinking": True}]))
def test_direct_render_equals_apply_chat_template(renderer, messages, tools, generation, kwargs):
    template = {"tools": tools, "add_generation_prompt": generation, "chat_template_kwargs": kwargs}
    try:
        want = expected(renderer, messages, **template)
    except Exception:                  # refused by the template: the direct render gives way, the renderer refuses
        assert direct(renderer, messages, **template) is None
        with pytest.raises(InvalidRequestError):
            renderer.template(messages, **template)
        return
    assert direct(renderer, messages, **template) == want
    assert renderer.template(messages, **template) == want


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=MESSAGES, generation=st.booleans())
def test_parsed_messages_render_the_same_turn_after_turn(renderer, messages, generation):
    """As the gateway renders them: parsed (the messages' forms kept with them), twice (the second from the memo)."""
    cache = MessageCache()
    raw = msgspec.json.encode({"model": "demo", "messages": messages})
    try:
        want = expected(renderer, messages, add_generation_prompt=generation)
        body, _ = parse(raw, ChatRequest, cache=cache)
    except Exception:
        return
    for _ in range(2):
        body, _ = parse(raw, ChatRequest, cache=cache)
        assert renderer.template(body["messages"], add_generation_prompt=generation) == want


def test_probes_render_directly(renderer):
    for probe in PROBES:
        got = direct(renderer, probe["messages"], tools=probe.get("tools"),
                     add_generation_prompt=probe.get("add_generation_prompt", True),
                     chat_template_kwargs=probe.get("kwargs"))
        assert got == expected(renderer, probe["messages"], tools=probe.get("tools"),
                               add_generation_prompt=probe.get("add_generation_prompt", True),
                               chat_template_kwargs=probe.get("kwargs"))


class Role(StrEnum):
    USER = "user"


@pytest.mark.parametrize("case", ["continue", "reserved kwarg", "not plain", "dict template", "callable tool"])
def test_unusual_requests_go_through_apply_chat_template(case):
    r = Renderer("builtin:demo")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    template: dict[str, Any] = {"add_generation_prompt": False}
    if case == "continue":
        template["continue_final_message"] = True
    elif case == "reserved kwarg":
        template["chat_template_kwargs"] = {"documents": [{"title": "t", "text": "d"}]}
    elif case == "not plain":
        messages = [{"role": Role.USER, "content": "Hi"}]
    elif case == "dict template":
        r.tokenizer.chat_template = {"default": r.tokenizer.chat_template}
    else:
        template["tools"] = [lambda q: q]
    assert direct(r, messages, **template) is None
    try:
        want = expected(r, messages, **template)
    except Exception:
        with pytest.raises(InvalidRequestError):
            r.template(messages, **template)
        return
    assert r.template(messages, **template) == want


def test_a_new_template_is_compiled_again():
    r = Renderer("builtin:demo")
    messages = [{"role": "user", "content": "Hi"}]
    before = r.template(messages)
    r.tokenizer.chat_template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    assert r.template(messages) == "[user] Hi\n" != before


def test_a_probe_that_differs_disables_the_direct_render(monkeypatch):
    r = Renderer("builtin:demo")
    monkeypatch.setattr(r.direct, "render", lambda *a, **k: "something else")
    assert not type(r.direct).verify(r.direct, PROBES)
    assert not r.direct.enabled
