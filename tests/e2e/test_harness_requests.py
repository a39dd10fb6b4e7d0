"""The requests real agent harnesses send (issue 37), with the `openai` and `anthropic` packages unchanged, through
the gateway on the simulators: Claude Code's system entries inside `messages` and Anthropic server tools, Codex
CLI's `namespace` and hosted tools, OpenCode's title request on its main loop's `X-Session-Id`, openai-agents'
default Runner (store true, the whole input resent, no `previous_response_id`); streamed answers with two and
three parallel tool calls, accumulated by the SDKs' own stream helpers and compared with the co-located
baseline's calls; reuse reported in each API's usage."""

from __future__ import annotations

import json
import uuid
from typing import Any

import anthropic
import openai
import pytest

from gateway.api.messages import chat_messages
from tests.e2e.stack import stack
from tests.e2e.test_messages import client as anthropic_client

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


# -- harness requests, their sessions and the reuse their usage reports -------------------------------------
def _tool_results(uses: list[Any], step: int) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": f"ok {step}"}
                                        for u in uses]}


def test_claude_code_session_with_system_entries_server_tools_and_a_title_request(pd) -> None:
    """Claude Code: `system` entries inside `messages`, a server tool beside its own, and a title request (its own
    system prompt, no tools) on the same session id between main-loop turns."""
    c, headers = anthropic_client(pd), {"X-Claude-Code-Session-Id": uuid.uuid4().hex}
    tools = [{"type": "web_search_20250305", "name": "web_search", "max_uses": 3}, *CLAUDE_TOOLS]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Zürich?"}]
    for step in range(4):
        raw = c.messages.with_raw_response.create(model="demo", max_tokens=200, system="You are Claude Code.",
                                                  tools=tools, messages=messages, extra_headers=headers)
        message = raw.parse()
        assert raw.headers["x-pd-dropped-tools"] == "web_search_20250305"
        reused = int(raw.headers["x-pd-reused-tokens"])
        usage = message.usage
        # cached: D's KV read, or more where P's prefix cache held more (the tools and system prompt of earlier tests)
        assert usage.cache_read_input_tokens >= reused and usage.input_tokens + usage.cache_read_input_tokens == \
            anthropic_client(pd).messages.count_tokens(model="demo", system="You are Claude Code.", tools=tools,
                                                       messages=messages).input_tokens
        if step:
            assert (raw.headers["x-pd-plan"], raw.headers["x-pd-reason"]) == ("reuse", "continuous") and reused > 0
        uses = [b for b in message.content if b.type == "tool_use"]
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
                     _tool_results(uses, step)]
        if step == 1:       # a mid-conversation system entry, as Claude Code sends them
            messages.append({"role": "system", "content": [{"type": "text", "text": "The user changed mode."}]})
            messages.append({"role": "user", "content": "Go on."})
        title = c.messages.with_raw_response.create(
            model="demo", max_tokens=20, system="Write a 5-word title.", extra_headers=headers,
            messages=[{"role": "user", "content": "Weather in Zürich?"}])
        assert title.headers["x-pd-reason"] in ("first_turn", "prompt_shorter")     # the same title request again
        assert title.headers["x-pd-session"] != raw.headers["x-pd-session"]
    assert pd.total("kv_reads_corrupt") == 0


@pytest.mark.parametrize("stream", [False, True])
def test_opencode_main_loop_keeps_its_reuse_past_its_title_request(pd, stream) -> None:
    """OpenCode's main loop and its title request share `X-Session-Id`: one conversation each (head-scoped)."""
    client, headers = pd.client(), {"X-Session-Id": f"ses_{uuid.uuid4().hex}"}
    messages: list[Any] = [{"role": "system", "content": "You are opencode."},
                           {"role": "user", "content": "Weather in Lyon?"}]
    for step in range(4):
        raw = client.chat.completions.with_raw_response.create(
            model="demo", messages=messages, tools=CHAT_TOOLS, max_tokens=200, extra_headers=headers, stream=stream,
            **({"stream_options": {"include_usage": True}} if stream else {}))
        if stream:
            chunks = list(raw.parse())
            usage = next(c.usage for c in chunks if c.usage)
            calls: dict[int, dict] = {}
            text = "".join(choice.delta.content or "" for chunk in chunks for choice in chunk.choices)
            for chunk in chunks:
                for choice in chunk.choices:
                    for d in choice.delta.tool_calls or ():
                        call = calls.setdefault(d.index, {"id": d.id, "type": "function",
                                                          "function": {"name": "", "arguments": ""}})
                        call["function"]["name"] += d.function.name or ""
                        call["function"]["arguments"] += d.function.arguments or ""
            answer = {"role": "assistant", "content": text if text.strip() else None,
                      "tool_calls": [calls[i] for i in sorted(calls)]}
        else:
            completion = raw.parse()
            usage, answer = completion.usage, completion.choices[0].message
        if step:
            assert (raw.headers["x-pd-plan"], raw.headers["x-pd-reason"]) == ("reuse", "continuous")
        assert usage.prompt_tokens_details.cached_tokens >= int(raw.headers["x-pd-reused-tokens"])
        messages.append(answer)
        ids = [c["id"] for c in answer["tool_calls"]] if stream else [c.id for c in answer.tool_calls]
        messages += [{"role": "tool", "tool_call_id": i, "content": "sunny"} for i in ids]
        title = client.chat.completions.with_raw_response.create(model="demo", max_tokens=20, extra_headers=headers,
                                                                 messages=[{"role": "system", "content": "You are a title generator."},
                                                                           {"role": "user", "content": "Weather in Lyon?"}])
        assert title.headers["x-pd-session"] != raw.headers["x-pd-session"]
    assert pd.total("kv_reads_corrupt") == 0


@pytest.mark.parametrize("stream", [False, True])
def test_codex_namespace_and_hosted_tools_with_its_session_header(pd, stream) -> None:
    client, headers = pd.client(), {"session_id": uuid.uuid4().hex}
    tools = [{"type": "namespace", "name": "mcp__weather", "description": "weather server",
              "tools": RESPONSES_TOOLS}, {"type": "web_search"}]
    items: list[Any] = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Paris?"}]}]
    for step in range(3):
        raw = client.responses.with_raw_response.create(model="demo", instructions="You are Codex.", input=items,
                                                        tools=tools, store=False, stream=stream, extra_headers=headers)
        response = list(raw.parse())[-1].response if stream else raw.parse()
        assert raw.headers["x-pd-dropped-tools"] == "web_search"
        assert response.usage.input_tokens_details.cached_tokens >= int(raw.headers["x-pd-reused-tokens"])
        if step:
            assert (raw.headers["x-pd-plan"], raw.headers["x-pd-reason"]) == ("reuse", "continuous")
        calls = [i for i in response.output if i.type == "function_call"]
        assert calls and {c.name for c in calls} <= set(NAMES)
        items += [i.model_dump(exclude_none=True) for i in response.output]
        items += [{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"} for c in calls]
    assert pd.total("kv_reads_corrupt") == 0


def test_openai_agents_default_runner_reuses_without_previous_response_id(pd) -> None:
    """openai-agents' Runner: `store` left true, the whole input resent each turn, no header: found by prefix (after
    an answer that mixed text and calls the prefix lookup misses: docs/operations.md, a session header keeps it)."""
    client, mixed, reused = pd.client(), False, 0
    items: list[Any] = [{"role": "user", "content": "Plan a trip to Oslo."}]
    for step in range(5):
        raw = client.responses.with_raw_response.create(model="demo", instructions="You are an agent.",
                                                        input=items, tools=RESPONSES_TOOLS)
        response = raw.parse()
        if step and not mixed:
            assert (raw.headers["x-pd-plan"], raw.headers["x-pd-reason"], raw.headers["x-pd-conversation"]) == \
                ("reuse", "continuous", "prefix")
            assert response.usage.input_tokens_details.cached_tokens >= int(raw.headers["x-pd-reused-tokens"]) > 0
            reused += 1
        calls = [i for i in response.output if i.type == "function_call"]
        mixed = any(i.type == "message" for i in response.output) and bool(calls)
        items += [i.model_dump(exclude_none=True) for i in response.output]
        items += [{"type": "function_call_output", "call_id": c.call_id, "output": "done"} for c in calls]
    assert reused >= 2
    # the stored response continues, too
    follow = client.responses.with_raw_response.create(model="demo", previous_response_id=response.id,
                                                       instructions="You are an agent.",
                                                       input="Thanks.", tools=RESPONSES_TOOLS)
    assert follow.headers["x-pd-plan"] in ("reuse", "partial") and follow.parse().status == "completed", \
        (follow.headers["x-pd-reason"], follow.headers["x-pd-conversation"])
    assert pd.total("kv_reads_corrupt") == 0


def test_count_tokens_is_the_prompt_the_turn_sends(pd) -> None:
    c = anthropic_client(pd)
    kwargs: dict[str, Any] = {"model": "demo", "system": "Count me.", "tools": CLAUDE_TOOLS,
                              "messages": [{"role": "user", "content": f"How many tokens? {uuid.uuid4().hex}"}]}
    counted = c.messages.count_tokens(**kwargs).input_tokens
    usage = c.messages.create(max_tokens=5, **kwargs).usage
    assert counted == usage.input_tokens + usage.cache_read_input_tokens > 0
    assert c.messages.count_tokens(**{**kwargs, "tools": []}).input_tokens < counted      # tools rendered too
    with pytest.raises(anthropic.NotFoundError) as caught:
        c.messages.count_tokens(**{**kwargs, "model": "nope"})
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "not_found_error"


# -- refusals: upstream-matching checks, each API's shape, logged and counted ------------------------------------
def _post(pd, path: str, body: bytes | dict, method: str = "POST") -> tuple[int, dict]:
    import httpx

    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.request(method, pd.gateway.url + path, content=content, headers={"content-type": "application/json"})
    return r.status_code, r.json()


def _openai_param(answer: tuple[int, dict]) -> tuple[int, str | None]:
    status, body = answer
    assert set(body) == {"error"} and body["error"]["type"] == "invalid_request_error", body
    return status, body["error"]["param"]


def test_refusals_match_the_upstream_apis_and_are_counted(pd) -> None:
    before = pd.metric("pdgw_rejected_total", api="chat", reason="invalid_request_error")
    user = {"role": "user", "content": "hi"}
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    for fields, param in (({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
                          ({"messages": [user], "temperature": -0.5}, "temperature"),
                          ({"messages": [user], "stop": ["a", "b", "c", "d", "e"]}, "stop"),
                          ({"messages": [{"role": "user", "content": [{"type": "text", "text": "see"}, image]}]},
                           "messages[0].content[1]"),
                          ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
                           "messages[0].content[0]")):
        assert _openai_param(_post(pd, "/v1/chat/completions", {"model": "demo", **fields})) == (400, param)
    assert pd.metric("pdgw_rejected_total", api="chat", reason="invalid_request_error") - before == 5
    status, body = _post(pd, "/v1/chat/completions", {"model": "demo", "messages": [
        {"role": "user", "content": [image]}]})
    assert "text-only" in body["error"]["message"]
    picture = [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]
    assert _openai_param(_post(pd, "/v1/responses", {"model": "demo", "input": picture})) == \
        (400, "input[0].content[0]")
    assert _openai_param(_post(pd, "/v1/responses", {"model": "demo", "input": "x", "temperature": -1})) == \
        (400, "temperature")


def _anthropic(answer: tuple[int, dict]) -> tuple[int, str, str]:
    status, body = answer
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    return status, body["error"]["type"], body["error"]["message"]


def test_every_messages_path_answers_in_anthropic_shape(pd) -> None:
    ask = {"model": "demo", "max_tokens": 5}
    bad_input = [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "[1]"}]}]
    image = [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "AAAA"}}]}]
    assert _anthropic(_post(pd, "/v1/messages", {**ask, "messages": bad_input}))[:2] == \
        (400, "invalid_request_error")
    status, _, message = _anthropic(_post(pd, "/v1/messages", {**ask, "messages": image}))
    assert status == 400 and "image" in message and "text-only" in message
    assert _anthropic(_post(pd, "/v1/messages", {**ask, "temperature": -1, "messages": [
        {"role": "user", "content": "x"}]}))[:2] == (400, "invalid_request_error")
    assert _anthropic(_post(pd, "/v1/messages", b"", method="GET"))[:2] == (405, "invalid_request_error")
    assert _anthropic(_post(pd, "/v1/messages/batches", {}))[:2] == (404, "not_found_error")
    assert _anthropic(_post(pd, "/v1/messages/count_tokens", b"{"))[:2] == (400, "invalid_request_error")
    assert pd.metric("pdgw_rejected_total", api="messages", reason="method_not_allowed") >= 1


def test_a_lone_surrogate_is_refused_in_the_same_words_on_every_api(pd) -> None:
    text = b'"a\\ud800b"'
    bodies = {"/v1/chat/completions": b'{"model":"demo","messages":[{"role":"user","content":' + text + b"}]}",
              "/v1/responses": b'{"model":"demo","input":' + text + b"}",
              "/v1/messages": b'{"model":"demo","max_tokens":5,"messages":[{"role":"user","content":' + text + b"}]}"}
    messages = []
    for path, body in bodies.items():
        status, answer = _post(pd, path, body)
        assert status == 400
        messages.append((answer["error"]["message"]))
    strip = [m.replace("`messages[0].content`", "`X`").replace("`input`", "`X`") for m in messages]
    assert len(set(strip)) == 1 and "surrogate" in strip[0], messages


def test_anthropic_stop_sequences_have_no_openai_limit(pd) -> None:
    message = anthropic_client(pd).messages.create(model="demo", max_tokens=5, messages=[
        {"role": "user", "content": "x"}], stop_sequences=["a1", "b2", "c3", "d4", "e5", "f6"])
    assert message.stop_reason in ("end_turn", "max_tokens", "stop_sequence")
