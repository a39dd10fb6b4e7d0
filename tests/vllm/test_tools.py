"""A conversation whose history carries client-built tool calls (the tiny model cannot call tools itself): P and
D run vLLM's Hermes tool parser, the demo template renders `tools`, assistant `tool_calls` and `tool` messages as
Qwen/Hermes templates do. The gateway's prompt equals vLLM's own rendering (`/tokenize`, and the baseline given
the same messages and tools), and every later turn reads D's KV."""

from __future__ import annotations

import json

import pytest

from tests.vllm.chat import Chat
from tests.vllm.engines import BLOCK_SIZE, SERVED_MODEL

pytestmark = pytest.mark.vllm

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Its name."},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}]


def tool_history(tag: str) -> list[dict]:
    """An agent step as a client keeps it: two parallel calls (arguments as JSON text), their results, a reply."""
    calls = [{"id": f"call_{i}", "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps(args, ensure_ascii=False)}}
             for i, args in enumerate([{"city": "Paris"}, {"city": "Zürich", "unit": "celsius"}])]
    return [
        {"role": "system", "content": f"Conversation {tag}. You can look up the weather."},
        {"role": "user", "content": "What is the weather in Paris and in Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_0", "content": '{"temperature": 18, "sky": "sunny"}'},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 12, "sky": "rain – 5 mm"}'},
        {"role": "assistant", "content": "Paris is sunny at 18 degrees; Zürich has rain at 12."},
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_tool_call_history_renders_as_vllm_does_and_reuses(engines, gateway, stream):
    c = Chat(gateway, engines.prefill, engines.decode, engines.baseline, tools=TOOLS,
             messages=tool_history(f"tools-{stream}"), compare_later=True)
    questions = ["And tomorrow?", "Which city is warmer?", "Thanks, that is all."]
    for question in questions:
        c.say(question, stream=stream)
    c.compare()
    for i, turn in enumerate(c.turns):
        assert turn.exact, f"turn {i + 1} differs from the co-located engine given the same messages and tools"
        if i == 0:
            assert (turn.plan, turn.reason) == ("full", "first_turn")
            first = c.messages[:len(c.messages) - 2 * len(questions) + 1]      # the history and question 1
            tokenized = engines.prefill.post("/tokenize", {"model": SERVED_MODEL, "messages": first,
                                                           "tools": TOOLS, "add_generation_prompt": True})
            assert tokenized["tokens"] == turn.prompt_ids          # /tokenize parity, tools and tool calls included
            continue
        previous = c.turns[i - 1]
        held = len(previous.prompt_ids) + len(previous.token_ids) - 1
        assert (turn.plan, turn.reason, turn.reused) == ("reuse", "continuous", held), f"turn {i + 1}"
        assert turn.prefill_loaded == held - len(previous.prompt_ids) // BLOCK_SIZE * BLOCK_SIZE > 0
