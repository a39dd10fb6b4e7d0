"""Anthropic's Messages API with the `anthropic` package unchanged (`client.messages.create`, streamed and not,
and its `messages.stream` helper), through the gateway on the simulators with their KV oracle: a tool-use loop
whose later turns reuse D's KV by an agent's session header (Claude Code's) and, without one, by prefix lookup;
answers equal the co-located baseline's given the same conversation; errors in Anthropic's shape."""

from __future__ import annotations

import uuid
from typing import Any

import anthropic
import pytest

from tests.e2e.stack import stack

pytestmark = pytest.mark.integration

SIM = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--tool-call-rate", "1.0"]
TOOLS = [{"name": "get_weather", "description": "Current weather for a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
SYSTEM = "You are a weather assistant."


@pytest.fixture(scope="module")
def pd():
    with stack(sim=SIM) as s:
        yield s


def client(pd) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=pd.gateway.url, api_key="unused", max_retries=0, timeout=60)


def baseline_calls(pd, system: str, messages: list[dict[str, Any]]) -> list[tuple[str, dict]]:
    """The tool calls the co-located engine makes given the same conversation (as chat, rendered by the sim)."""
    from gateway.api.messages import chat_messages

    chat = [{"role": "system", "content": system}, *chat_messages(messages)]
    tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                               "parameters": t["input_schema"]}} for t in TOOLS]
    message = pd.baseline_client().chat.completions.create(model="demo", messages=chat, tools=tools,
                                                           max_tokens=120).choices[0].message
    import json
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]


def tool_loop(pd, stream: bool, headers: dict[str, str]) -> list[tuple[str, str, bool]]:
    """4 tool-use steps: (plan, reason, whether an earlier answer mixed text and calls) per step. Each step is
    compared with the baseline while no answer did: the chat template renders text + calls with its own
    separator, not as D generated them, so from then on the gateway's prompt (D's own ids, history_tokens
    "generated") is no longer the baseline's rendering, and the KV oracle is the guard."""
    c = client(pd)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Zürich and Lyon? 🙂"}]
    plans, mixed = [], False
    for step in range(4):
        if stream:
            raw = c.messages.with_raw_response.create(model="demo", max_tokens=120, system=SYSTEM, tools=TOOLS,
                                                      messages=messages, stream=True, extra_headers=headers)
            events = list(raw.parse())
            assert [e.type for e in events][0] == "message_start" and events[-1].type == "message_stop"
            blocks = _blocks(events)
            stop = next(e.delta.stop_reason for e in events if e.type == "message_delta")
        else:
            raw = c.messages.with_raw_response.create(model="demo", max_tokens=120, system=SYSTEM, tools=TOOLS,
                                                      messages=messages, extra_headers=headers)
            message = raw.parse()
            blocks, stop = [b.model_dump(exclude_none=True) for b in message.content], message.stop_reason
        plans.append((raw.headers["x-pd-plan"], raw.headers["x-pd-reason"], mixed))
        uses = [b for b in blocks if b["type"] == "tool_use"]
        assert stop == "tool_use" and uses
        if not mixed:
            assert [(u["name"], u["input"]) for u in uses] == baseline_calls(pd, SYSTEM, messages), f"step {step + 1}"
        mixed = mixed or any(b["type"] == "text" for b in blocks)
        messages.append({"role": "assistant", "content": blocks})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": u["id"], "content": f"sunny, {20 + step} degrees"} for u in uses]})
    assert pd.total("kv_reads_corrupt") == 0
    return plans


def _blocks(events: list[Any]) -> list[dict[str, Any]]:
    """Content blocks from raw stream events, as a client accumulates them."""
    import json

    blocks: list[dict[str, Any]] = []
    for e in events:
        if e.type == "content_block_start":
            blocks.append({**e.content_block.model_dump(exclude_none=True), "_json": ""})
        elif e.type == "content_block_delta" and e.delta.type == "text_delta":
            blocks[e.index]["text"] += e.delta.text
        elif e.type == "content_block_delta" and e.delta.type == "input_json_delta":
            blocks[e.index]["_json"] += e.delta.partial_json
        elif e.type == "content_block_stop" and blocks[e.index]["type"] == "tool_use":
            blocks[e.index]["input"] = json.loads(blocks[e.index]["_json"] or "{}")
    return [{k: v for k, v in b.items() if k != "_json"} for b in blocks]


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_use_loop_reuses_by_the_claude_code_session_header(pd, stream) -> None:
    plans = tool_loop(pd, stream, {"X-Claude-Code-Session-Id": uuid.uuid4().hex})
    assert plans[0][:2] == ("full", "first_turn")
    assert all(plan[:2] == ("reuse", "continuous") for plan in plans[1:]), plans


def test_without_a_session_header_later_turns_reuse_by_prefix(pd) -> None:
    # Found by its tokens as rendered, before past answers are spliced in as D's ids: an answer that mixed text
    # and calls renders otherwise than D generated it, and no longer finds its conversation (docs/operations.md).
    plans = tool_loop(pd, False, {})
    assert all(plan[:2] == ("reuse", "continuous") for plan in plans[1:] if not plan[2]), plans
    assert all(plan[:2] in {("reuse", "continuous"), ("full", "no_session")} for plan in plans[1:]), plans


def test_the_stream_helper_accumulates_a_text_answer(pd) -> None:
    with client(pd).messages.stream(model="demo", max_tokens=40, system="Be brief.",
                                    messages=[{"role": "user", "content": "Say something."}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text and final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.input_tokens > 0 and final.usage.output_tokens > 0


def test_errors_are_anthropic_shaped(pd) -> None:
    c = client(pd)
    cases = [({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, 400),
             ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400),
             ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "model": "nope"}, 404)]
    for kwargs, status in cases:
        kwargs.setdefault("model", "demo")
        with pytest.raises(anthropic.APIStatusError) as caught:
            c.messages.create(**kwargs)
        assert caught.value.status_code == status
        body = caught.value.body
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        assert body["error"]["type"] == ("invalid_request_error" if status == 400 else "not_found_error")
