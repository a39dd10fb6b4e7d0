"""api/responses.py and api/response_events.py: Responses items and tools to chat, chat answers and streams to
response objects and typed events, table-driven."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from gateway.api import responses as api
from gateway.api.response_events import ResponseEvents
from gateway.errors import InvalidRequestError


def req(**fields) -> api.ResponsesRequest:
    return api.parse_request(msgspec.json.encode({"input": "hi", **fields}))


@pytest.mark.parametrize(("items", "want"), [
    ("Hello", [{"role": "user", "content": "Hello"}]),
    ([{"role": "developer", "content": "Be brief."}], [{"role": "system", "content": "Be brief."}]),
    ([{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                       {"type": "input_text", "text": "b"}]}],
     [{"role": "user", "content": "a\nb"}]),
    ([{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
      {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
      {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x":1}'},
      {"type": "function_call_output", "call_id": "c1", "output": "one"},
      {"type": "reasoning", "summary": []}],
     [{"role": "assistant", "content": "Let me look.", "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
         {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"x":1}'}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "one"}]),
    ([{"type": "function_call", "call_id": "c1", "name": "f", "arguments": ""}],
     [{"role": "assistant", "content": None, "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}}]}]),
    # Codex 0.171's goal: an output answering no call, named instead (the harness tier's 400 in 2 runs of 3)
    ([{"type": "function_call_output", "id": "fco_1", "name": "goal_objective", "namespace": "agent",
       "output": "echo"}],
     [{"role": "user", "content": "echo"}]),
])
def test_input_items_become_chat_messages(items, want):
    assert api.messages(items) == want


@pytest.mark.parametrize(("fields", "param"), [
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": []}, "input"),
    ({"tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
    ({"tools": [{"type": "namespace", "name": "ns", "tools": [{"name": "f"}]}]}, "tools[0].tools[0]"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"background": True}, "background"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
])
def test_unsupported_or_malformed_requests_name_the_field(fields, param):
    with pytest.raises(InvalidRequestError) as caught:
        api.chat_body(req(**fields), "demo")
    assert caught.value.param == param


def test_namespaces_are_flattened_and_hosted_tools_dropped():
    # Codex CLI: its MCP tools grouped in a namespace, and web_search beside them
    tools = [{"type": "function", "name": "shell", "parameters": {"type": "object"}},
             {"type": "namespace", "name": "mcp__fs", "description": "files", "tools": [
                 {"type": "function", "name": "read", "parameters": {"type": "object"}},
                 {"type": "web_search"},
                 {"type": "function", "name": "write", "parameters": {"type": "object"}}]},
             {"type": "web_search", "search_context_size": "low"}, {"type": "custom", "name": "apply_patch"},
             {"type": "file_search", "vector_store_ids": ["v"]}]
    request = req(tools=tools)
    body = api.chat_body(request, "demo")
    assert [t["function"]["name"] for t in body["tools"]] == ["shell", "read", "write"]
    assert api.hosted_tools(request.tools) == ["web_search", "web_search", "custom", "file_search"]
    assert "tools" not in api.chat_body(req(tools=[{"type": "web_search"}]), "demo")


def test_chat_body_carries_instructions_tools_and_sampling():
    body = api.chat_body(req(instructions="Be brief.", max_output_tokens=7, temperature=0.5, stream=True,
                             tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                             tool_choice={"type": "function", "name": "f"},
                             text={"format": {"type": "json_object"}}), "demo")
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert body["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert (body["max_tokens"], body["temperature"], body["stream_options"]) == (7, 0.5, {"include_usage": True})
    assert body["response_format"] == {"type": "json_object"}


def test_a_completion_becomes_a_response_object():
    completion = {"choices": [{"finish_reason": "tool_calls", "message": {
        "content": "Looking.", "tool_calls": [{"id": "c9", "function": {"name": "f", "arguments": '{"a":1}'}}]}}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 4}}
    out = api.from_completion("resp_1", req(), "demo", completion, 123)
    assert (out["id"], out["object"], out["status"], out["created_at"]) == ("resp_1", "response", "completed", 123)
    assert [i["type"] for i in out["output"]] == ["message", "function_call"]
    assert out["output"][0]["content"][0] == {"type": "output_text", "text": "Looking.", "annotations": [],
                                              "logprobs": []}
    assert (out["output"][1]["call_id"], out["output"][1]["arguments"]) == ("c9", '{"a":1}')
    assert out["usage"]["total_tokens"] == 14
    cut = api.from_completion("resp_2", req(), "demo", {"choices": [{"finish_reason": "length",
                                                                     "message": {"content": "x"}}]}, 1)
    assert (cut["status"], cut["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})


def _frames(*chunks) -> list[bytes]:
    return [b"".join(b"data: " + (c.encode() if isinstance(c, str) else json.dumps(c).encode()) + b"\n\n" for c in group) for group in chunks]


def _events(frames: list[bytes]) -> tuple[list[dict], list]:
    stored = []

    async def finish(status, output, usage, finish_reason, error):
        final = api.response("resp_1", req(), "demo", status=status, output=output, usage_=usage,
                             finish_reason=finish_reason, error=error)
        stored.append(final)
        return final

    async def chat():
        for f in frames:
            yield f

    async def run():
        out = []
        async for data in ResponseEvents(api.response("resp_1", req(), "demo", status="in_progress", output=[]),
                                         finish).relay(chat()):
            out += [json.loads(line[6:]) for line in data.decode().split("\n") if line.startswith("data: ")]
        return out

    return asyncio.run(run()), stored


def test_a_stream_becomes_typed_events_in_order():
    events, stored = _events(_frames(
        [{"choices": [{"delta": {"role": "assistant", "content": "Hel"}}]}, {"choices": [{"delta": {"content": "lo"}}]}],
        [{"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": ""}}]}}]},
         {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]}}]},
         {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]},
                       "finish_reason": "tool_calls"}]}],
        [{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}, "[DONE]"]))
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert (final["output"][1]["arguments"], final["output"][1]["call_id"]) == ('{"a":1}', "c1")
    assert final["usage"]["output_tokens"] == 5 and stored == [final]


def test_an_engine_error_mid_stream_fails_the_response():
    events, stored = _events(_frames([{"choices": [{"delta": {"content": "x"}}]}],
                                     [{"error": {"message": "D failed", "code": "upstream_error"}}, "[DONE]"]))
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"] == {"code": "upstream_error", "message": "D failed"}


def test_parallel_calls_are_one_item_each_however_their_fragments_come():
    calls = [{"index": 0, "id": "a", "function": {"name": "f", "arguments": ""}},
             {"index": 1, "id": "b", "function": {"name": "g", "arguments": '{"x'}},
             {"index": 0, "function": {"arguments": '{"c'}}, {"index": 2, "id": "c", "function": {"name": "h"}},
             {"index": 1, "function": {"arguments": '": 1}'}}, {"index": 0, "function": {"arguments": 'ity": "Z"}'}},
             {"index": 2, "function": {"arguments": "{}"}}]
    events, stored = _events(_frames(
        [{"choices": [{"delta": {"content": "Two. "}}]}],
        [{"choices": [{"delta": {"tool_calls": [c]}}]} for c in calls],
        [{"choices": [{"delta": {}, "finish_reason": "tool_calls"}]},
         {"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 5,
                                   "prompt_tokens_details": {"cached_tokens": 16}}}, "[DONE]"]))
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [(e["output_index"], e["item"]["type"], e["item"].get("name")) for e in added] == \
        [(0, "message", None), (1, "function_call", "f"), (2, "function_call", "g"), (3, "function_call", "h")]
    args = {1: "", 2: "", 3: ""}
    for e in events:
        if e["type"] == "response.function_call_arguments.delta":
            args[e["output_index"]] += e["delta"]
    final = events[-1]["response"]
    assert [(i["call_id"], i["arguments"]) for i in final["output"][1:]] == \
        [("a", '{"city": "Z"}'), ("b", '{"x": 1}'), ("c", "{}")] == [(i["call_id"], args[n + 1]) for n, i in
                                                                   enumerate(final["output"][1:])]
    assert sorted(e["output_index"] for e in events if e["type"] == "response.output_item.done") == [0, 1, 2, 3]
    assert final["usage"]["input_tokens_details"] == {"cached_tokens": 16} and stored == [final]
