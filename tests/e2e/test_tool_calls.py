"""The openai client's tool-calling flow, unchanged, through the gateway on the simulators (non-streamed, and
streamed with the SDK's own accumulation), and malformed tool input: a 400 naming the field that leaves the
conversation's stored state as it was."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.stack import stack

pytestmark = pytest.mark.integration

SIM = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--tool-call-style", "varied",
       "--tool-call-rate", "1.0"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city"]}}}]


def weather(arguments: str) -> str:
    return json.dumps({"city": json.loads(arguments).get("city"), "sky": "clear", "temp": 21})


@pytest.fixture(scope="module", params=[False, True], ids=["p_path", "local"])
def pd(request):
    """P reading D's KV, and with the local path on (a tool result is a short suffix: D alone computes it)."""
    with stack(sim=SIM, gateway=["--history-tokens", "generated"], local=request.param) as s:
        s.warm = ("local", "short_suffix") if request.param else ("reuse", "continuous")
        yield s


def test_openai_tool_flow_non_streamed(pd) -> None:
    client, session = pd.client(), {"X-Session-Id": uuid.uuid4().hex}
    messages: list[Any] = [{"role": "user", "content": "What's the weather in Zürich?"}]
    for step in range(4):
        raw = client.chat.completions.with_raw_response.create(
            model="demo", messages=messages, tools=TOOLS, extra_headers=session)
        completion = raw.parse()
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "tool_calls" and message.tool_calls
        if step:
            assert (raw.headers["x-pd-plan"], raw.headers["x-pd-reason"]) == pd.warm
        messages.append(message)                               # the SDK's own message object, as documented
        for call in message.tool_calls:
            assert call.type == "function" and call.function.name == "get_weather"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": weather(call.function.arguments)})
    assert pd.total("kv_reads_corrupt") == 0


def test_openai_tool_flow_streamed(pd) -> None:
    client, session = pd.client(), {"X-Session-Id": uuid.uuid4().hex}
    messages: list[Any] = [{"role": "user", "content": "And in 東京?"}]
    for _ in range(3):
        with client.chat.completions.stream(model="demo", messages=messages, tools=TOOLS,
                                            extra_headers=session) as stream:
            for _event in stream:
                pass
            completion = stream.get_final_completion()
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "tool_calls" and message.tool_calls
        messages.append(message)
        for call in message.tool_calls:
            assert json.loads(call.function.arguments)["city"]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": weather(call.function.arguments)})
    last = client.chat.completions.with_raw_response.create(model="demo", messages=messages, tools=TOOLS,
                                                            extra_headers=session)
    assert (last.headers["x-pd-plan"], last.headers["x-pd-reason"]) == pd.warm


BAD: list[tuple[str, dict[str, Any]]] = [
    ("messages[1].tool_calls[0].function.arguments",
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Bern"}}]}),
    ("messages[2].tool_call_id", {"role": "tool", "tool_call_id": "nobody", "content": "sunny"}),
]


@pytest.mark.parametrize(("param", "bad"), BAD, ids=["arguments", "tool_call_id"])
def test_malformed_tool_input_is_a_400_and_leaves_the_conversation_alone(pd, param: str, bad: dict) -> None:
    session = uuid.uuid4().hex
    headers = {"X-Session-Id": session}
    messages: list[Any] = [{"role": "user", "content": "Weather in Bern?"}]
    first = pd.client().chat.completions.create(model="demo", messages=messages, tools=TOOLS, extra_headers=headers)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    bad_messages = [*messages[:1], bad] if param.startswith("messages[1]") else [*messages, bad]
    resp = httpx.post(pd.gateway.url + "/v1/chat/completions", headers=headers, timeout=30,
                      json={"model": "demo", "messages": bad_messages, "tools": TOOLS})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param and resp.json()["error"]["type"] == "invalid_request_error"
    for call in messages[-1]["tool_calls"]:
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": weather(call["function"]["arguments"])})
    good = pd.client().chat.completions.with_raw_response.create(model="demo", messages=messages, tools=TOOLS,
                                                                 extra_headers=headers)
    assert (good.headers["x-pd-plan"], good.headers["x-pd-reason"]) == pd.warm


def test_a_template_that_raises_is_a_400(tmp_path) -> None:
    template = tmp_path / "strict.jinja"
    template.write_text("{%- for m in messages %}{%- if m['role'] == 'tool' %}"
                        "{{ raise_exception('tool messages are not supported') }}{%- endif %}"
                        "{{- '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') + '<|im_end|>\\n' }}"
                        "{%- endfor %}{{- '<|im_start|>assistant\\n' }}")
    with stack(gateway=["--chat-template", str(template)]) as s:
        messages = [{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "x"}]
        with pytest.raises(openai.BadRequestError) as caught:
            s.client().chat.completions.create(model="demo", messages=messages,
                                               extra_headers={"X-Session-Id": uuid.uuid4().hex})
        assert caught.value.status_code == 400 and caught.value.body["param"] == "messages"


@pytest.mark.parametrize("choice", ["required", "named", "none"])
def test_tool_choice_through_the_gateway(pd, choice: str) -> None:
    """required/named are vLLM's guided paths: D generates bare JSON, which the template re-renders inside
    <tool_call> tags, so the next turn reuses up to that answer (partial), never a wrong prefix."""
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else choice
    headers = {"X-Session-Id": uuid.uuid4().hex}
    messages: list[Any] = [{"role": "user", "content": f"Weather, {choice}?"}]
    out = pd.client().chat.completions.create(model="demo", messages=messages, tools=TOOLS, tool_choice=tool_choice,
                                              extra_headers=headers)
    choice0 = out.choices[0]
    if choice == "none":
        assert choice0.finish_reason == "stop" and not choice0.message.tool_calls
        messages += [{"role": "assistant", "content": choice0.message.content}, {"role": "user", "content": "ok"}]
        expected = ("reuse", "continuous")
    else:
        assert choice0.finish_reason == ("stop" if choice == "named" else "tool_calls")
        assert choice0.message.tool_calls[0].function.name == "get_weather"
        messages.append(choice0.message)
        messages += [{"role": "tool", "tool_call_id": c.id, "content": weather(c.function.arguments)}
                     for c in choice0.message.tool_calls]
        expected = ("partial", "prefix_diverged")
    raw = pd.client().chat.completions.with_raw_response.create(model="demo", messages=messages, tools=TOOLS,
                                                                extra_headers=headers)
    if pd.warm[0] == "local":            # a short suffix either way: D's cache holds the common blocks
        expected = pd.warm
    assert (raw.headers["x-pd-plan"], raw.headers["x-pd-reason"]) == expected
    assert pd.total("kv_reads_corrupt") == 0


def test_streamed_tool_calls_with_the_buffer_policy() -> None:
    """D without its handle in the stream: the gateway fetches the whole answer and re-streams it; tool calls
    must come out as stream deltas (with their `index`) that the SDK assembles."""
    with stack(sim=SIM, decode=[], gateway=["--stream-handle-policy", "buffer", "--history-tokens", "generated"]) as s:
        headers = {"X-Session-Id": uuid.uuid4().hex}
        messages: list[Any] = [{"role": "user", "content": "Weather in Oslo?"}]
        with s.client().chat.completions.stream(model="demo", messages=messages, tools=TOOLS,
                                                 extra_headers=headers) as stream:
            completion = stream.get_final_completion()
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "tool_calls" and message.tool_calls
        assert json.loads(message.tool_calls[0].function.arguments)["city"]
        messages.append(message)
        messages += [{"role": "tool", "tool_call_id": c.id, "content": weather(c.function.arguments)}
                     for c in message.tool_calls]
        raw = s.client().chat.completions.with_raw_response.create(model="demo", messages=messages, tools=TOOLS,
                                                                   extra_headers=headers)
        assert raw.headers["x-pd-plan"] == "reuse"
