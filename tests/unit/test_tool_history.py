"""Tool calls in the history: the client's tool_calls checked (400 naming the field), rendered as vLLM renders
them, and with `history_tokens: generated` sent as the ids D generated for them."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.errors import InvalidRequestError
from gateway.sim.chat_render import Renderer as SimRenderer
from gateway.turns.intake.generated import remember, tool_answer
from gateway.turns.intake.render import Renderer
from gateway.turns.intake.tools import calls_key, check_chat, merge_calls

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]


def call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def conversation(calls: list[dict[str, Any]], content: str | None = None) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Weather in Zürich?"},
            {"role": "assistant", "content": content, "tool_calls": calls},
            *({"role": "tool", "tool_call_id": c["id"], "content": "x" * 3000 + " ünï 中文"} for c in calls)]


@pytest.fixture(scope="module")
def renderer() -> Renderer:
    return Renderer("builtin:demo")


# -- bad input -----------------------------------------------------------------------------------------
ARGUMENTS = "messages[2].tool_calls[0].function.arguments"
BAD = [
    ({"messages": conversation([call("a", "get_weather", "{not json")])}, ARGUMENTS),
    ({"messages": conversation([call("a", "get_weather", 42)])}, ARGUMENTS),
    ({"messages": conversation([{"id": "a", "type": "function"}])}, "messages[2].tool_calls[0]"),
    ({"messages": conversation([call("a", "", "{}")])}, "messages[2].tool_calls[0].function.name"),
    ({"messages": [*conversation([call("a", "search", "{}")]), {"role": "tool", "tool_call_id": "zz",
                                                                 "content": "?"}]}, "messages[4].tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "orphan"}]},
     "messages[1].tool_call_id"),
    ({"messages": conversation([call("a", "search", "{}")])[:3], "tools": [{"type": "function"}]}, "tools[0]"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
      "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": "nope"}]}, "messages[0].tool_calls"),
]


@pytest.mark.parametrize(("body", "param"), BAD)
def test_malformed_tool_input_is_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        check_chat(body)
    assert caught.value.param == param and caught.value.status == 400


def test_well_formed_tool_input_passes() -> None:
    check_chat({"messages": conversation([call("a", "get_weather", '{"city": "Zürich"}'), call("b", "search", "")]),
                "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "search"}}})
    check_chat({"messages": conversation([call("a", "search", {"q": 1})]), "tools": TOOLS, "tool_choice": "auto"})


# -- rendering as vLLM ------------------------------------------------------------------------------------
def test_tool_calls_render_as_vllm_renders_them(renderer: Renderer) -> None:
    """The simulator renders as vLLM does (arguments parsed before templating): the gateway must match it."""
    sim = SimRenderer("builtin:demo")
    for calls in ([call("a", "get_weather", '{"city":"Zürich"}')],
                  [call("a", "get_weather", '{"city": "東京"}'), call("b", "search", "")],
                  []):
        messages = conversation(calls, content="Let me check.")
        assert renderer.render_chat(messages, tools=TOOLS) == sim.render_chat(messages, tools=TOOLS)
    text = renderer.template(conversation([call("a", "get_weather", '{"city":"Zürich"}')]), tools=TOOLS)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>' in text


# -- history_tokens generated ----------------------------------------------------------------------------
GENERATED = ('<tool_call>\n{"arguments":{"city":"Z\\u00fcrich"},"name":"get_weather"}\n</tool_call>\n'
             '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>')
CLIENT_CALLS = [call("c1", "get_weather", json.dumps({"city": "Zürich"}, ensure_ascii=False)),
                call("c2", "search", "{}")]


def turn_state(renderer: Renderer, generated: str = GENERATED) -> tuple[list[dict[str, Any]], list[int], list[int]]:
    """(the history up to the tool call, the prompt D answered, D's output ids as generated)."""
    before = conversation([])[:2]
    prompt = renderer.render_chat(before, tools=TOOLS)
    output = renderer.tokenizer.encode(generated, add_special_tokens=False)
    return before, prompt, output


def test_a_tool_call_answer_is_kept_by_its_parsed_calls(renderer: Renderer) -> None:
    _, _, output = turn_state(renderer)
    eos = renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")
    kept = renderer.answer([*output, eos], "", CLIENT_CALLS)
    assert kept is not None and kept.ids == output and (kept.chars, kept.text_hash) == calls_key("", CLIENT_CALLS)
    other = [call("c1", "get_weather", '{"city": "Paris"}'), CLIENT_CALLS[1]]
    assert renderer.answer(output, "", other) is None                      # D generated other calls
    assert renderer.answer(output, "something else", CLIENT_CALLS) is None  # nor that content
    assert renderer.answer(output, "", CLIENT_CALLS[:1]) is None            # nor only one of them


@pytest.mark.parametrize("content", [None, ""])
def test_generated_mode_sends_the_ids_d_generated_for_the_calls(renderer: Renderer, content: str | None) -> None:
    before, prompt, output = turn_state(renderer)
    eos = renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")
    answers = remember([], renderer.answer([*output, eos], "", CLIENT_CALLS))
    messages = [*before, {"role": "assistant", "content": content, "tool_calls": CLIENT_CALLS},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny " * 700},
                {"role": "tool", "tool_call_id": "c2", "content": "found"}]
    rendered = renderer.render_chat(messages, tools=TOOLS)
    spliced = renderer.render_chat(messages, tools=TOOLS, answers=answers)
    held = [*prompt, *output, eos]                         # what D holds after the turn
    assert spliced[:len(held)] == held                     # the new prompt extends D's tokens: full reuse
    assert rendered[:len(held)] != held                    # re-rendered JSON diverges inside the call...
    common = next(i for i, (a, b) in enumerate(zip(rendered, held)) if a != b)
    assert common > len(prompt)                            # ...after the prompt D answered (partial reuse)
    tail = len(spliced) - len(held)
    assert spliced[len(held):] == rendered[len(rendered) - tail:]        # the rest as the template renders it


def test_text_after_the_calls_streamed_as_content_is_recognised(renderer: Renderer) -> None:
    generated = "Checking.\n" + GENERATED + "\nDone soon"
    before, prompt, output = turn_state(renderer, generated)
    streamed_content = "Checking.\n\n\nDone soon"           # what a client assembles from content deltas
    answers = [renderer.answer(output, streamed_content, CLIENT_CALLS)]
    assert answers[0] is not None and renderer.answer(output, "Checking.\n", CLIENT_CALLS) is not None
    messages = [*before, {"role": "assistant", "content": streamed_content, "tool_calls": CLIENT_CALLS},
                {"role": "user", "content": "and?"}]
    spliced = renderer.render_chat(messages, tools=TOOLS, answers=answers)
    assert spliced[:len(prompt) + len(output)] == [*prompt, *output]


def test_unmatched_tool_calls_render_as_usual(renderer: Renderer) -> None:
    before, _, output = turn_state(renderer)
    answers = [renderer.answer(output, "", CLIENT_CALLS)]
    edited = [*before, {"role": "assistant", "content": None,
                        "tool_calls": [call("c1", "get_weather", '{"city": "Bern"}')]},
              {"role": "tool", "tool_call_id": "c1", "content": "cold"}]
    assert renderer.render_chat(edited, tools=TOOLS, answers=answers) == renderer.render_chat(edited, tools=TOOLS)


def test_a_template_that_rewrites_past_answers_keeps_the_plain_rendering(renderer: Renderer, tmp_path: Any) -> None:
    """A template that does not show D's text verbatim (here: it upper-cases assistant content) gets no splice."""
    template = renderer.tokenizer.chat_template.replace(
        "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}",
        "{{- '<|im_start|>' + message['role'] + '\\n' + content | upper + '<|im_end|>\\n' }}")
    assert template != renderer.tokenizer.chat_template
    path = tmp_path / "upper.jinja"
    path.write_text(template)
    upper = Renderer("builtin:demo", chat_template=str(path))
    before, _, output = turn_state(upper)
    answers = [upper.answer(output, "", CLIENT_CALLS)]
    messages = [*before, {"role": "assistant", "content": None, "tool_calls": CLIENT_CALLS},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    assert upper.render_chat(messages, tools=TOOLS, answers=answers) == upper.render_chat(messages, tools=TOOLS)


def test_streamed_tool_call_deltas_merge_per_index() -> None:
    calls: list[dict[str, Any]] = []
    for delta in ([{"index": 0, "id": "x", "type": "function", "function": {"name": "search"}}],
                  [{"index": 0, "function": {"arguments": '{"q": '}}], None,
                  [{"index": 1, "id": "y", "type": "function", "function": {"name": "get_weather", "arguments": ""}}],
                  [{"index": 0, "function": {"arguments": '"Zü"}'}}, {"index": 1, "function": {"arguments": "{}"}}]):
        merge_calls(calls, delta)
    assert calls == [{"id": "x", "function": {"name": "search", "arguments": '{"q": "Zü"}'}},
                     {"id": "y", "function": {"name": "get_weather", "arguments": "{}"}}]
    assert merge_calls([], CLIENT_CALLS)[1]["function"] == {"name": "search", "arguments": "{}"}
    assert tool_answer([1], "no calls", "", CLIENT_CALLS) is None


# -- whatever arrives: a 400 or a rendering, never another exception -------------------------------------
def _junk() -> st.SearchStrategy:
    scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8))
    json_like = st.recursive(scalar, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                             st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                             max_leaves=8)
    fn = st.fixed_dictionaries({}, optional={"name": st.one_of(st.sampled_from(["get_weather", "search"]), json_like),
                                             "arguments": st.one_of(st.sampled_from(['{"a": 1}', "", "{x", "[]"]),
                                                                    json_like)})
    call_ = st.fixed_dictionaries({}, optional={"id": st.one_of(st.sampled_from(["a", "b"]), json_like),
                                                "type": st.sampled_from(["function", "other"]),
                                                "function": st.one_of(fn, json_like), "index": json_like})
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "tool", "system"])},
        optional={"content": st.one_of(st.none(), st.text(max_size=10)),
                  "tool_calls": st.one_of(st.lists(call_, max_size=3), json_like),
                  "tool_call_id": st.one_of(st.sampled_from(["a", "b"]), json_like)})
    return st.fixed_dictionaries(
        {"messages": st.lists(message, min_size=1, max_size=5)},
        optional={"tools": st.one_of(st.just(TOOLS), json_like),
                  "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]), json_like)})


def test_any_tool_input_is_a_400_or_renders(renderer: Renderer) -> None:
    _, _, output = turn_state(renderer)
    answers = [renderer.answer(output, "", CLIENT_CALLS)]

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=_junk())
    def check(body: dict[str, Any]) -> None:
        try:
            check_chat(body)
        except InvalidRequestError:
            return
        for kept in (None, answers):
            try:
                renderer.render_chat(body["messages"], tools=body.get("tools"), answers=kept)
            except InvalidRequestError:
                pass

    check()


def test_a_template_that_renders_other_messages_by_the_calls_keeps_the_plain_rendering(renderer: Renderer,
                                                                                       tmp_path: Any) -> None:
    """Here tool results render differently after an assistant message without tool_calls: swapping in D's
    text would change more than the answer itself, so the plain rendering is sent."""
    template = renderer.tokenizer.chat_template.replace(
        "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}",
        "{{- '\\n<tool_response>\\n' + content + ('' if messages[loop.index0 - 1]['tool_calls'] is defined "
        "or messages[loop.index0 - 1]['role'] == 'tool' else ' (orphan)') + '\\n</tool_response>' }}")
    assert template != renderer.tokenizer.chat_template
    path = tmp_path / "strict.jinja"
    path.write_text(template)
    strict = Renderer("builtin:demo", chat_template=str(path))
    before, _, output = turn_state(strict)
    answers = [strict.answer(output, "", CLIENT_CALLS)]
    messages = [*before, {"role": "assistant", "content": None, "tool_calls": CLIENT_CALLS},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    assert "(orphan)" not in strict.template(messages, tools=TOOLS)
    assert strict.render_chat(messages, tools=TOOLS, answers=answers) == strict.render_chat(messages, tools=TOOLS)
