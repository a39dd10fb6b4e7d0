"""The simulator's tool calls, after vLLM's hermes parser and chat serving: what the model writes, the
non-streamed `tool_calls`, the streamed deltas, tool_choice, and D holding the tokens it generated."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from gateway.sim.chat_render import Renderer
from gateway.sim.hermes_tools import (Call, ToolRequestError, ToolSpec, ToolStream, compose, extract, parse_hermes,
                               tool_rounds, tool_spec)
from tests.sim.conftest import Fleet, Sims, user
from tests.sim.test_http import _frames

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"},
                                         "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["query"]}}},
]
SPEC = tool_spec(TOOLS, None, auto_enabled=True)


# -- in process --------------------------------------------------------------------------------------------
def test_tool_choice_is_checked_as_vllm_does() -> None:
    assert tool_spec(None, None, auto_enabled=False) is None
    assert tool_spec(TOOLS, "none", auto_enabled=False) is None
    assert tool_spec(TOOLS, "required", auto_enabled=False).mode == "required"
    named = tool_spec(TOOLS, {"type": "function", "function": {"name": "search"}}, auto_enabled=False)
    assert named.mode == "named" and named.named == "search"
    for tools, choice, auto in ((TOOLS, None, False), (TOOLS, "auto", False), (None, "required", True),
                                (TOOLS, {"type": "function", "function": {"name": "nope"}}, True),
                                ([{"type": "function"}], "auto", True)):
        with pytest.raises(ToolRequestError):
            tool_spec(tools, choice, auto_enabled=auto)


def test_hermes_parse_content_before_calls_and_bad_json() -> None:
    text = 'let me look\n<tool_call>\n{"name": "search", "arguments": {"query": "Zürich"}}\n</tool_call>\n' \
           '<tool_call>\n{"arguments":{"city":"\\u00c9vian"},"name":"get_weather"}\n</tool_call>\ntrailing'
    parsed = parse_hermes(text)
    assert parsed.content == "let me look\n"
    assert parsed.calls == [Call("search", '{"query": "Zürich"}'), Call("get_weather", '{"city": "Évian"}')]
    assert parse_hermes('<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>').content is None
    assert parse_hermes("no calls").calls == [] and parse_hermes("no calls").content == "no calls"
    broken = '<tool_call>\n{"name": "search", "arguments": {"query": \n</tool_call>'
    assert parse_hermes(broken).calls == [] and parse_hermes(broken).content == broken
    assert parse_hermes('<tool_call>\n{"name": "search", "arguments": {"q": 1}}').calls == [Call("search", '{"q": 1}')]


def test_compose_is_deterministic_and_varied_json_parses_to_the_same_calls() -> None:
    texts = [compose(random.Random(i), SPEC, rate=1.0, style="varied") for i in range(200)]
    assert texts == [compose(random.Random(i), SPEC, rate=1.0, style="varied") for i in range(200)]
    parsed = [parse_hermes(t or "") for t in texts]
    assert all(p.called for p in parsed)
    assert any(len(p.calls) > 1 for p in parsed) and any(p.content for p in parsed)
    assert any('"arguments"' in t.split("\n")[1 if t.startswith("<") else 2][:14] for t in texts if t)
    assert any("\\u" in t for t in texts if t) and any('":"' in t for t in texts if t)
    assert all(json.loads(c.arguments) is not None for p in parsed for c in p.calls)
    assert compose(random.Random(1), SPEC, rate=0.0, style="template") is None


def _replay(spec: ToolSpec, text: str, step: int = 3) -> list[dict[str, Any]]:
    stream = ToolStream(spec, text)
    deltas = [stream.delta(text[:n]) for n in [*range(0, len(text), step), len(text)]]
    return [d for d in deltas if d]


def _assemble(deltas: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    content, calls = "", []
    for d in deltas:
        content += d.get("content") or ""
        for tc in d.get("tool_calls") or ():
            if tc["index"] == len(calls):
                assert tc["id"].startswith("chatcmpl-tool-") and tc["type"] == "function"
                calls.append({"name": tc["function"]["name"], "arguments": ""})
            calls[tc["index"]]["arguments"] += tc.get("function", {}).get("arguments", "")
    return content, calls


@pytest.mark.parametrize("seed", range(40))
def test_streamed_deltas_assemble_to_the_non_streamed_calls(seed: int) -> None:
    text = compose(random.Random(seed), SPEC, rate=1.0, style="varied") or ""
    content, calls = _assemble(_replay(SPEC, text, step=1 + seed % 7))
    whole = extract(SPEC, text)
    assert [Call(c["name"], c["arguments"]) for c in calls] == whole.calls
    assert content.startswith(whole.content or "")       # streamed content also has the text between/after calls


def test_named_and_required_choices() -> None:
    named = tool_spec(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, auto_enabled=False)
    text = compose(random.Random(3), named, rate=0.0, style="template")
    assert "city" in json.loads(text) and extract(named, text).calls == [Call("get_weather", text)]
    assert _assemble(_replay(named, text))[1] == [{"name": "get_weather", "arguments": text}]
    required = tool_spec(TOOLS, "required", auto_enabled=False)
    text = compose(random.Random(4), required, rate=0.0, style="template")
    calls = extract(required, text).calls
    assert calls and [c.name for c in calls] == [i["name"] for i in json.loads(text)]
    assert [Call(c["name"], c["arguments"]) for c in _assemble(_replay(required, text))[1]] == calls


def test_tool_rounds_count_calls_since_the_user_spoke() -> None:
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
                                                                  "function": {"name": "f", "arguments": "{}"}}]}
    result = {"role": "tool", "tool_call_id": "1", "content": "ok"}
    assert tool_rounds([user("a")]) == 0
    assert tool_rounds([user("a"), call, result]) == 1
    assert tool_rounds([user("a"), call, result, call, result, call, result]) == 3
    assert tool_rounds([user("a"), call, result, {"role": "assistant", "content": "done"}, user("b")]) == 0
    assert tool_rounds([{"role": "system", "content": "s"}, call, result]) == 1


# -- over HTTP ---------------------------------------------------------------------------------------------
def _first_call(sims: Sims, server: Any, **body: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Messages whose answer (seeded by the prompt) calls a tool, and that answer."""
    for i in range(40):
        messages = [user(f"what is the weather {i}?")]
        resp = sims.chat(server, messages, tools=TOOLS, return_token_ids=True, **body)
        if resp["choices"][0]["finish_reason"] == "tool_calls":
            return messages, resp
    raise AssertionError("the model never called a tool")


@pytest.mark.integration
def test_non_streamed_tool_calls_shape_and_ids(sims: Sims, fleet: Fleet) -> None:
    [c] = fleet("c_tools")
    messages, resp = _first_call(sims, c)
    choice0 = resp["choices"][0]
    msg = choice0["message"]
    assert msg["tool_calls"] and all(tc["type"] == "function" and tc["id"].startswith("chatcmpl-tool-")
                                     for tc in msg["tool_calls"])
    for tc in msg["tool_calls"]:
        assert tc["function"]["name"] in ("get_weather", "search") and json.loads(tc["function"]["arguments"])
    text = Renderer("builtin:demo").decode(choice0["token_ids"])
    assert "<tool_call>" in text and parse_hermes(text).calls == [
        Call(tc["function"]["name"], tc["function"]["arguments"]) for tc in msg["tool_calls"]]
    again = sims.chat(c, messages, tools=TOOLS, return_token_ids=True)
    assert again["choices"][0]["token_ids"] == choice0["token_ids"]          # deterministic per prompt
    streamed = sims.raw_chat(c, {"messages": messages, "tools": TOOLS, "stream": True, "return_token_ids": True})
    frames = [f for f in _frames(streamed.text)[1:] if f != "[DONE]"]
    assert [t for f in frames for t in f["choices"][0]["token_ids"]] == choice0["token_ids"]
    assert frames[-1]["choices"][0]["finish_reason"] == "tool_calls"
    content, calls = _assemble([f["choices"][0]["delta"] for f in frames])
    assert [(c_["name"], c_["arguments"]) for c_ in calls] == [
        (tc["function"]["name"], tc["function"]["arguments"]) for tc in msg["tool_calls"]]


@pytest.mark.integration
def test_tool_choice_errors_and_none(sims: Sims, fleet: Fleet) -> None:
    [c, plain] = fleet("c_tools", "c")
    resp = sims.raw_chat(plain, {"messages": [user("x")], "tools": TOOLS})
    assert resp.status_code == 400 and "--enable-auto-tool-choice" in resp.json()["error"]["message"]
    resp = sims.raw_chat(c, {"messages": [user("x")], "tools": TOOLS,
                             "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert resp.status_code == 400
    for i in range(10):
        none = sims.chat(c, [user(f"q{i}")], tools=TOOLS, tool_choice="none")["choices"][0]
        assert none["finish_reason"] == "stop" and not none["message"]["tool_calls"]
    named = sims.chat(c, [user("q")], tools=TOOLS, tool_choice={"type": "function", "function": {"name": "search"}})
    assert named["choices"][0]["finish_reason"] == "stop"
    assert named["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "search"
    required = sims.chat(c, [user("q")], tools=TOOLS, tool_choice="required")["choices"][0]
    assert required["finish_reason"] == "tool_calls" and required["message"]["tool_calls"]


@pytest.mark.integration
def test_decode_holds_the_tool_call_tokens_it_generated(sims: Sims, fleet: Fleet) -> None:
    p, d = fleet("p_tools", "d_tools")
    sims.reset(p, d)
    messages, _ = _first_call(sims, fleet("c_tools")[0])
    resp = sims.turn(p, d, messages, tools=TOOLS)
    choice = resp["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    handle = resp["kv_transfer_params"]
    assert handle["remote_num_tokens"] == len(resp["prompt_token_ids"]) + len(choice["token_ids"]) - 1
    assert sims.stats(d)["requests_corrupt"] == 0


@pytest.mark.integration
def test_tool_call_arguments_that_are_not_json_are_a_400(sims: Sims, fleet: Fleet) -> None:
    [c] = fleet("c_tools")
    messages = [user("q"), {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "search", "arguments": "{nope"}}]},
        {"role": "tool", "tool_call_id": "a", "content": "x"}]
    resp = sims.raw_chat(c, {"messages": messages, "tools": TOOLS})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == 400
    resp = sims.post(c, "/tokenize", {"model": "demo", "messages": messages, "tools": TOOLS})
    assert resp.status_code == 400


@pytest.mark.integration
def test_an_agent_loop_ends_after_the_rounds_limit(sims: Sims, fleet: Fleet) -> None:
    """--tool-call-rounds 2: the user's question gets a call, so does the first tool result; the second tool
    result gets text (finish_reason "stop"), streamed or not; a new user message starts over."""
    [c] = fleet("c_agent")
    messages = [user("find the weather, then search")]
    finishes = []
    for _ in range(3):
        resp = sims.chat(c, messages, tools=TOOLS)
        choice = resp["choices"][0]
        finishes.append(choice["finish_reason"])
        messages.append(choice["message"] | {"role": "assistant"})
        messages += [{"role": "tool", "tool_call_id": tc["id"], "content": "{\"ok\": true}"}
                     for tc in choice["message"].get("tool_calls") or ()]
    assert finishes == ["tool_calls", "tool_calls", "stop"]
    assert messages[-1]["content"] and not messages[-1].get("tool_calls")
    streamed = sims.raw_chat(c, {"messages": messages[:-1], "tools": TOOLS, "stream": True})
    frames = [f for f in _frames(streamed.text)[1:] if f != "[DONE]"]
    assert frames[-1]["choices"][0]["finish_reason"] == "stop"
    messages.append(user("and now?"))
    assert sims.chat(c, messages, tools=TOOLS)["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.integration
def test_the_rounds_are_counted_in_the_pinned_prompt(sims: Sims, fleet: Fleet) -> None:
    """A gateway sends only the last message beside vLLM 0.32's pinned prompt ids: the model answers what the
    ids hold, so the rounds limit counts the calls there (counted in the one message sent, the loop never
    ended: Claude Code's harness run, 9 requests of calls)."""
    [c] = fleet("c_agent")
    messages = [user("find the weather, then search")]
    for _ in range(2):
        answer = sims.chat(c, messages, tools=TOOLS)["choices"][0]["message"]
        messages += [answer | {"role": "assistant"}, *({"role": "tool", "tool_call_id": tc["id"], "content": "{}"}
                                                       for tc in answer["tool_calls"])]
    ids = sims.post(c, "/tokenize", {"model": "demo", "messages": messages, "tools": TOOLS}).json()["tokens"]
    stub = {"messages": messages[-1:], "tools": TOOLS, "kv_transfer_params": {"prompt_token_ids": ids}}
    assert sims.raw_chat(c, stub).json()["choices"][0]["finish_reason"] == "stop"
    fresh = messages + [{"role": "assistant", "content": "done"}, user("and now?")]
    ids = sims.post(c, "/tokenize", {"model": "demo", "messages": fresh, "tools": TOOLS}).json()["tokens"]
    stub = {"messages": fresh[-1:], "tools": TOOLS, "kv_transfer_params": {"prompt_token_ids": ids}}
    assert sims.raw_chat(c, stub).json()["choices"][0]["finish_reason"] == "tool_calls"
