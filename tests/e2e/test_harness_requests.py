"""The requests real agent harnesses send (issue 37), with the `openai` and `anthropic` packages unchanged, through
the gateway on the simulators: streamed answers with two and three parallel tool calls, accumulated by the SDKs'
own stream helpers and compared with the co-located baseline's calls."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
import pytest

from gateway.api.messages import chat_messages
from tests.e2e.stack import stack

pytestmark = pytest.mark.integration

SIM = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--tool-call-rate", "1.0",
       "--max-model-len", "65536", "--num-blocks", "8000"]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
NAMES = ["get_weather", "get_time", "get_news"]
CLAUDE_TOOLS = [{"name": n, "description": f"{n} for a city", "input_schema": SCHEMA} for n in NAMES]
CHAT_TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n} for a city", "parameters": SCHEMA}}
              for n in NAMES]
RESPONSES_TOOLS = [{"type": "function", "name": n, "description": f"{n} for a city", "parameters": SCHEMA}
                   for n in NAMES]


@pytest.fixture(scope="module")
def pd():
    with stack(sim=SIM) as s:
        yield s


def anthropic_client(pd) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=pd.gateway.url, api_key="unused", max_retries=0, timeout=60)


def baseline_calls(pd, messages: list[dict[str, Any]], choice: str = "auto") -> list[tuple[str, dict]]:
    """The calls the co-located engine makes, non-streamed, given the same conversation as chat."""
    message = pd.baseline_client().chat.completions.create(model="demo", messages=messages, tools=CHAT_TOOLS,
                                                           tool_choice=choice, max_tokens=300).choices[0].message
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]


# -- streamed parallel calls ---------------------------------------------------------------------------------
# "required" (Anthropic's `any`): the engine streams the calls' argument fragments side by side (the simulator's
# guided output), "auto": one call after the other (the hermes parser)
@pytest.mark.parametrize("choice", ["auto", "required"])
def test_streamed_parallel_calls_through_the_anthropic_stream_helper(pd, choice) -> None:
    seen: set[int] = set()
    tool_choice = {"type": "any" if choice == "required" else "auto"}
    for n in range(40):
        messages = [{"role": "user", "content": f"Weather, time and news for city number {n}?"}]
        with anthropic_client(pd).messages.stream(model="demo", max_tokens=300, system="Use tools.",
                                                  tools=CLAUDE_TOOLS, tool_choice=tool_choice,
                                                  messages=messages) as stream:
            final = stream.get_final_message()
        uses = [(b.name, b.input) for b in final.content if b.type == "tool_use"]
        assert final.stop_reason == "tool_use" and len({b.id for b in final.content if b.type == "tool_use"}) == \
            len(uses)
        assert uses == baseline_calls(pd, [{"role": "system", "content": "Use tools."}, *chat_messages(messages)],
                                      choice)
        seen.add(len(uses))
        if {2, 3} <= seen:
            return
    pytest.fail(f"no answer with two and three calls in 40 tries: {seen}")


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_streamed_parallel_calls_through_the_openai_responses_stream(pd, choice) -> None:
    client, seen = pd.client(), set()
    for n in range(40):
        question = f"Weather, time and news for town number {n}?"
        with client.responses.stream(model="demo", input=question, tools=RESPONSES_TOOLS, tool_choice=choice,
                                     store=False) as stream:
            events = list(stream)
            final = stream.get_final_response()
        calls = [(i.name, json.loads(i.arguments)) for i in final.output if i.type == "function_call"]
        added = [e for e in events if e.type == "response.output_item.added"]
        assert len(added) == len(final.output) and all(i.status == "completed" for i in final.output)
        assert calls == baseline_calls(pd, [{"role": "user", "content": question}], choice)
        seen.add(len(calls))
        if {2, 3} <= seen:
            return
    pytest.fail(f"no answer with two and three calls in 40 tries: {seen}")

