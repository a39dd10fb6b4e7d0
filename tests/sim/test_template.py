"""The builtin demo templates' tool support (Qwen2.5/Qwen3 Hermes-style shapes), and that conversations without
tools render byte-identically to the plain ChatML templates the demo tokenizers shipped before it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from transformers import AutoTokenizer

from gateway.sim.chat_render import tokenizer_source

# The templates as they were before tool support (scripts/build_demo_tokenizer.py history).
OLD_CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
OLD_REASONING = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TOOL_FREE: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello there"}, {"role": "user", "content": "ünïcödé 中文 🙂\n\n  x"}],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "<think>hm</think>\n\nok"},
     {"role": "user", "content": "again"}, {"role": "assistant", "content": "<think>x</think>y"}],
    [{"role": "developer", "content": "rules"}, {"role": "user", "content": "{\"a\": 1}"}],
]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def tokenizer(name: str) -> Any:
    return AutoTokenizer.from_pretrained(tokenizer_source(f"builtin:{name}"))


def render(tok: Any, messages: list[dict[str, Any]], template: str | None = None, **kw: Any) -> str:
    return tok.apply_chat_template(messages, tokenize=False, chat_template=template, **kw)


@pytest.mark.parametrize(("name", "old"), [("demo", OLD_CHATML), ("demo-reasoning", OLD_REASONING)])
@pytest.mark.parametrize("messages", TOOL_FREE)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tool_free_conversations_render_as_before(name: str, old: str, messages: list[dict[str, Any]],
                                                  add_generation_prompt: bool) -> None:
    tok = tokenizer(name)
    assert render(tok, messages, add_generation_prompt=add_generation_prompt) == \
        render(tok, messages, old, add_generation_prompt=add_generation_prompt)
    assert render(tok, messages, tools=[]) == render(tok, messages, old)


@pytest.mark.parametrize("name", ["demo", "demo-reasoning"])
def test_tools_calls_and_responses_render_like_qwen(name: str) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        {"role": "assistant", "content": "Let me check more.", "tool_calls": [
            {"id": "call_3", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Rome\"}"}}]},
        {"role": "tool", "tool_call_id": "call_3", "content": "hot"},
    ]
    tools_block = "\n".join(json.dumps(t, ensure_ascii=False) for t in TOOLS)
    expected = (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{tools_block}\n</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
        "\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Zürich?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
        "</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"}}\n"
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
        "<|im_end|>\n"
        "<|im_start|>assistant\nLet me check more.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
        "{\"city\":\"Rome\"}}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nhot\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    tok = tokenizer(name)
    assert render(tok, messages, tools=TOOLS, add_generation_prompt=True) == expected
    without_system = render(tok, messages[1:2], tools=TOOLS)
    assert without_system.startswith("<|im_start|>system\n# Tools\n\n")


def test_tool_tags_are_single_tokens_kept_by_decode() -> None:
    tok = tokenizer("demo")
    for tag in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"):
        ids = tok.encode("x" + tag + "y", add_special_tokens=False)
        assert len(tok.encode(tag, add_special_tokens=False)) == 1
        assert tok.decode(ids, skip_special_tokens=True) == "x" + tag + "y"
