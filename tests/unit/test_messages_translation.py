"""api/messages.py and api/message_events.py: Anthropic Messages requests to chat, chat answers and streams to
messages and Anthropic's events, table-driven."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from gateway.api import messages as api
from gateway.api.message_events import MessageEvents
from gateway.errors import InvalidRequestError


def req(**fields) -> api.MessagesRequest:
    return api.parse_request(msgspec.json.encode({"max_tokens": 16, "messages": [{"role": "user", "content": "hi"}],
                                                  **fields}))


@pytest.mark.parametrize(("messages", "want"), [
    ([{"role": "user", "content": "Hello"}], [{"role": "user", "content": "Hello"}]),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
     [{"role": "user", "content": "a\nb"}]),
    ([{"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"}, {"type": "text", "text": "Sure."},
                                        {"type": "tool_use", "id": "t1", "name": "f", "input": {"city": "Zürich"}}]},
      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                                   {"type": "tool_result", "tool_use_id": "t2",
                                    "content": [{"type": "text", "text": "rain"}]},
                                   {"type": "text", "text": "Thanks"}]}],
     [{"role": "assistant", "content": "Sure.", "tool_calls": [
         {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Zürich"}'}}]},
      {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
      {"role": "tool", "tool_call_id": "t2", "content": "rain"},
      {"role": "user", "content": "Thanks"}]),
])
def test_messages_become_chat_messages(messages, want):
    assert api.chat_messages(messages) == want


def test_system_entries_inside_messages_are_rendered_in_place():
    # Claude Code's mid-conversation system entries: a system message where it stands, the same every time
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "system", "content": [{"type": "text", "text": "Mode changed.", "cache_control": {}}]},
                {"role": "user", "content": "go on"}]
    body = api.chat_body(req(system="Be brief.", messages=messages), "demo")
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "hello"},
                                {"role": "system", "content": "Mode changed."}, {"role": "user", "content": "go on"}]
    assert api.chat_body(req(system="Be brief.", messages=messages), "demo") == body


def test_server_tools_are_dropped_and_named():
    tools = [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
             {"name": "f", "input_schema": {"type": "object"}}, {"type": "custom", "name": "g"},
             {"type": "bash_20250124", "name": "bash"}]
    request = req(tools=tools)
    assert [t["function"]["name"] for t in api.chat_body(request, "demo")["tools"]] == ["f", "g"]
    assert api.hosted_tools(request) == ["web_search_20250305", "bash_20250124"]
    only_hosted = req(tools=tools[:1])
    assert "tools" not in api.chat_body(only_hosted, "demo") and api.hosted_tools(only_hosted) == ["web_search_20250305"]


def test_chat_body_carries_system_tools_and_sampling():
    body = api.chat_body(req(system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Really."}],
                             stop_sequences=["END"], top_k=5, stream=True,
                             tools=[{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
                             tool_choice={"type": "any", "disable_parallel_tool_use": True}), "demo")
    assert body["messages"][0] == {"role": "system", "content": "Be brief.\nReally."}
    assert body["tools"] == [{"type": "function", "function": {"name": "f", "description": "d",
                                                               "parameters": {"type": "object"}}}]
    assert list(body["tools"][0]["function"]) == ["name", "description", "parameters"]     # as chat clients order it
    assert (body["tool_choice"], body["parallel_tool_calls"], body["stop"], body["top_k"]) == \
        ("required", False, ["END"], 5)
    assert body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 16


@pytest.mark.parametrize(("fields", "param"), [
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "system", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
    ({"tools": [{"type": "custom", "description": "no name"}]}, "tools[0]"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "[1]"}]}]},
     "messages[0].content[0].input"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {}}]}]}]}, "messages[0].content[0].content[0]"),
    ({"tool_choice": {"type": "maybe"}}, "tool_choice"),
])
def test_unsupported_input_names_the_field(fields, param):
    with pytest.raises(InvalidRequestError) as caught:
        api.chat_body(req(**fields), "demo")
    assert caught.value.param == param


@pytest.mark.parametrize(("fields", "param"), [({"max_tokens": 0}, "max_tokens"), ({"messages": []}, "messages")])
def test_bad_limits_are_refused(fields, param):
    with pytest.raises(InvalidRequestError) as caught:
        req(**fields)
    assert caught.value.param == param


@pytest.mark.parametrize(("finish", "matched", "want"), [
    ("stop", None, ("end_turn", None)), ("stop", "END", ("stop_sequence", "END")), ("length", None, ("max_tokens", None)),
    ("tool_calls", None, ("tool_use", None)), (None, None, (None, None))])
def test_stop_reasons(finish, matched, want):
    assert api.stop_reason(finish, matched) == want


def test_a_completion_becomes_a_message():
    out = api.from_completion("msg_1", "demo", {"choices": [{"finish_reason": "tool_calls", "message": {
        "content": "Looking.", "tool_calls": [{"id": "t1", "function": {"name": "f", "arguments": '{"a": 1}'}}]}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 3}})
    assert out["content"] == [{"type": "text", "text": "Looking."},
                              {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]
    assert (out["stop_reason"], out["usage"]) == ("tool_use", {"input_tokens": 9, "output_tokens": 3,
                                                               "cache_creation_input_tokens": 0,
                                                               "cache_read_input_tokens": 0})


def _events(*chunks) -> list[tuple[str, dict]]:
    async def chat():
        for c in chunks:
            yield b"data: " + (c.encode() if isinstance(c, str) else json.dumps(c).encode()) + b"\n\n"

    async def run():
        out = []
        async for data in MessageEvents("msg_1", "demo", 12).relay(chat()):
            for event in data.decode().split("\n\n"):
                if event:
                    name, body = event.split("\n")
                    out.append((name.removeprefix("event: "), json.loads(body.removeprefix("data: "))))
        return out

    return asyncio.run(run())


def test_a_stream_becomes_anthropic_events():
    events = _events({"choices": [{"delta": {"content": "Hi"}}]},
                     {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "t1", "function": {"name": "f"}}]}}]},
                     {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]},
                                   "finish_reason": "tool_calls"}]},
                     {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 7}}, "[DONE]")
    assert [name for name, _ in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop", "content_block_start",
        "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert all(body["type"] == name for name, body in events)
    assert events[0][1]["message"]["usage"] == {"input_tokens": 12, "output_tokens": 0,
                                                "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    assert events[4][1]["content_block"] == {"type": "tool_use", "id": "t1", "name": "f", "input": {}}
    assert events[5][1]["delta"] == {"type": "input_json_delta", "partial_json": "{}"}
    assert events[7][1]["delta"]["stop_reason"] == "tool_use" and events[7][1]["usage"] == {"output_tokens": 7}


def test_an_engine_error_mid_stream_is_an_error_event():
    events = _events({"choices": [{"delta": {"content": "x"}}]}, {"error": {"message": "D failed"}}, "[DONE]")
    assert events[-1] == ("error", {"type": "error", "error": {"type": "api_error", "message": "D failed"}})


def _calls(*deltas) -> list[dict]:
    return [{"choices": [{"delta": {"tool_calls": [d]}}]} for d in deltas]


def test_parallel_calls_are_one_block_each_however_their_fragments_come():
    # three calls, the second's and third's fragments interleaved with the first's (OpenAI's format allows it)
    events = _events({"choices": [{"delta": {"content": "\n"}}]}, *_calls(
        {"index": 0, "id": "a", "function": {"name": "f", "arguments": ""}},
        {"index": 1, "id": "b", "function": {"name": "g", "arguments": '{"x'}},
        {"index": 0, "function": {"arguments": '{"c'}}, {"index": 2, "id": "c", "function": {"name": "h"}},
        {"index": 1, "function": {"arguments": '": 1}'}}, {"index": 0, "function": {"arguments": 'ity": "Z"}'}},
        {"index": 2, "function": {"arguments": "{}"}}),
        {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 7}}, "[DONE]")
    starts = [body for name, body in events if name == "content_block_start"]
    assert [(b["index"], b["content_block"]["id"], b["content_block"]["name"]) for b in starts] == \
        [(0, "a", "f"), (1, "b", "g"), (2, "c", "h")]
    args = {0: "", 1: "", 2: ""}
    for name, body in events:
        if name == "content_block_delta":
            args[body["index"]] += body["delta"]["partial_json"]
    assert {i: json.loads(a) for i, a in args.items()} == {0: {"city": "Z"}, 1: {"x": 1}, 2: {}}
    assert sorted(body["index"] for name, body in events if name == "content_block_stop") == [0, 1, 2]


def test_usage_reports_reuse_as_cache_reads():
    out = api.from_completion("msg_1", "demo", {"choices": [{"finish_reason": "stop", "message": {"content": "x"}}],
                                                "usage": {"prompt_tokens": 90, "completion_tokens": 3,
                                                          "prompt_tokens_details": {"cached_tokens": 64}}})
    assert out["usage"] == {"input_tokens": 26, "output_tokens": 3, "cache_creation_input_tokens": 0,
                            "cache_read_input_tokens": 64}
