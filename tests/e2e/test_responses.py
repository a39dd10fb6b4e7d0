"""OpenAI's Responses API with the `openai` package unchanged (`client.responses.create`, streamed and not),
through the gateway on the simulators with their KV oracle: a stored conversation's later turns continue its
exact ids and reuse D's KV; every answer equals the co-located baseline engine's given the whole history as
chat messages (so the continued prompt is what rendering the whole history gives: the sim renders it with its
own code); function-call loops; branches; tenants, unknown ids, GET, DELETE, `store: false`; a 20-step agent
loop whose later steps all reuse."""

from __future__ import annotations

import hashlib
import random
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from tests.e2e.agent import add_tool_deltas, system_prompt, tool_result, tools
from tests.e2e.stack import stack

pytestmark = pytest.mark.integration

KEYS = {"acme": "key-acme", "other": "key-other"}
SIM = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--tool-call-rate", "1.0",
       "--max-model-len", "131072", "--num-blocks", "12000"]
WEATHER = [{"type": "function", "name": "get_weather", "description": "Current weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
INSTRUCTIONS = "You are brief and kind."


@pytest.fixture(scope="module")
def pd():
    keys = [f"{t}:{hashlib.sha256(k.encode()).hexdigest()}" for t, k in KEYS.items()]
    # with keys configured /metrics needs the admin key (docs/operations.md#paths-and-who-may-call-them)
    with stack(sim=SIM, gateway=["--api-keys", *keys, "--admin-key", "responses-admin"]) as s:
        yield s


def client(pd, tenant: str = "acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=pd.gateway.url + "/v1", api_key=KEYS[tenant], max_retries=0, timeout=60)


def create(c: openai.OpenAI, stream: bool, **kwargs: Any) -> tuple[Any, dict[str, str]]:
    """One response (streamed: the SDK's events, the final one's response), and the gateway's headers."""
    raw = c.responses.with_raw_response.create(model="demo", stream=stream, **kwargs)
    if not stream:
        return raw.parse(), raw.headers
    events = list(raw.parse())
    assert events[0].type == "response.created"
    assert events[-1].type == ("response.incomplete" if events[-1].response.status == "incomplete" else "response.completed")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events[-1].response, raw.headers


def baseline(pd, messages: list[dict[str, Any]], tools_: list | None = None, stream: bool = False) -> dict[str, Any]:
    """The co-located engine's answer to the whole history, rendered by the simulator itself (streamed like the
    turn it is compared with: vLLM's hermes parser streams the text after a call as content, JSON drops it)."""
    chat_tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
                  for t in tools_ or ()]
    extra = {"tools": chat_tools} if chat_tools else {}
    if not stream:
        completion = pd.baseline_client().chat.completions.create(model="demo", messages=messages, **extra)
        return completion.choices[0].message.model_dump(exclude_none=True)
    content, calls = "", []
    for chunk in pd.baseline_client().chat.completions.create(model="demo", messages=messages, stream=True, **extra):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            add_tool_deltas(calls, [c.model_dump() for c in choice.delta.tool_calls or ()])
    return {"content": content if content.strip() or not calls else None, "tool_calls": calls}


def as_messages(response: Any) -> list[dict[str, Any]]:
    """A response's output as the chat messages a client would send back."""
    text = "".join(p.text for item in response.output if item.type == "message" for p in item.content)
    calls = [{"id": i.call_id, "type": "function", "function": {"name": i.name, "arguments": i.arguments}}
             for i in response.output if i.type == "function_call"]
    return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]


def same_answer(response: Any, expected: dict[str, Any]) -> bool:
    got = as_messages(response)[0]
    return (got["content"] or "") == (expected.get("content") or "") and \
        [(c["function"]["name"], c["function"]["arguments"]) for c in got.get("tool_calls", [])] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in expected.get("tool_calls", [])]


@pytest.mark.parametrize("stream", [False, True])
def test_text_turns_continue_the_stored_ids_and_reuse(pd, stream) -> None:
    c, previous = client(pd), None
    history: list[dict[str, Any]] = [{"role": "system", "content": INSTRUCTIONS}]
    for turn, question in enumerate(["Hello there!", "Tell me about Zürich 🙂", "And then?", "Thanks."]):
        response, headers = create(c, stream, input=question, instructions=INSTRUCTIONS,
                                   previous_response_id=previous, max_output_tokens=60)
        history.append({"role": "user", "content": question})
        assert response.status in ("completed", "incomplete") and response.output_text
        assert same_answer(response, baseline(pd, history, stream=stream)), f"turn {turn + 1} differs"
        if turn:
            assert (headers["x-pd-plan"], headers["x-pd-reason"]) == ("reuse", "continuous")
            assert response.previous_response_id == previous
        history += as_messages(response)
        previous = response.id
    assert pd.total("kv_reads_corrupt") == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_call_loop(pd, stream) -> None:
    c, previous = client(pd), None
    history: list[dict[str, Any]] = [{"role": "user", "content": "What's the weather in Paris and 東京?"}]
    new: Any = history[0]["content"]
    for step in range(4):
        response, headers = create(c, stream, input=new, tools=WEATHER, previous_response_id=previous)
        calls = [item for item in response.output if item.type == "function_call"]
        assert calls and all(call.name == "get_weather" and call.call_id for call in calls)
        assert same_answer(response, baseline(pd, history, WEATHER, stream)), f"step {step + 1} differs"
        if step:
            assert (headers["x-pd-plan"], headers["x-pd-reason"]) == ("reuse", "continuous")
        history += as_messages(response)
        new = [{"type": "function_call_output", "call_id": call.call_id, "output": f'{{"sky": "clear", "n": {step}}}'}
               for call in calls]
        history += [{"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]} for item in new]
        previous = response.id
    assert pd.total("kv_reads_corrupt") == 0


def test_two_branches_on_one_previous_response(pd) -> None:
    c = client(pd)
    root, _ = create(c, False, input="Start a story.", instructions=INSTRUCTIONS, max_output_tokens=40)
    base = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Start a story."},
            *as_messages(root)]
    questions = ["Make it sad.", "Make it happy."]
    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda q: create(c, False, input=q, instructions=INSTRUCTIONS,
                                              previous_response_id=root.id, max_output_tokens=40), questions))
    plans = sorted(h["x-pd-plan"] for _, h in both)
    assert plans.count("reuse") <= 1 and plans != ["full", "full"] or "concurrent_turn" in \
        [h["x-pd-reason"] for _, h in both]
    for question, (response, _) in zip(questions, both):
        assert same_answer(response, baseline(pd, [*base, {"role": "user", "content": question}]))
    later, headers = create(c, False, input="Make it short.", instructions=INSTRUCTIONS,
                            previous_response_id=root.id, max_output_tokens=40)      # a third branch, afterwards
    assert headers["x-pd-plan"] in ("partial", "full") and headers["x-pd-reason"] != "continuous"
    assert same_answer(later, baseline(pd, [*base, {"role": "user", "content": "Make it short."}]))
    assert pd.total("kv_reads_corrupt") == 0


def test_changed_instructions_render_the_conversation_whole(pd) -> None:
    c = client(pd)
    first, _ = create(c, False, input="Hi!", instructions=INSTRUCTIONS, max_output_tokens=30)
    second, headers = create(c, False, input="Again?", instructions="Now be formal.", previous_response_id=first.id,
                             max_output_tokens=30)
    history = [{"role": "system", "content": "Now be formal."}, {"role": "user", "content": "Hi!"},
               *as_messages(first), {"role": "user", "content": "Again?"}]
    assert same_answer(second, baseline(pd, history))
    assert headers["x-pd-plan"] in ("partial", "full")           # the prompt's head changed: not what D holds


def test_unknown_and_foreign_ids_are_404_and_never_cross_tenants(pd) -> None:
    mine, others = client(pd, "acme"), client(pd, "other")
    response, _ = create(mine, False, input="A secret: 42.", max_output_tokens=20)
    for call in (lambda: others.responses.create(model="demo", input="What was it?",
                                                 previous_response_id=response.id),
                 lambda: others.responses.retrieve(response.id),
                 lambda: others.responses.delete(response.id),
                 lambda: mine.responses.create(model="demo", input="x", previous_response_id="resp_" + "0" * 32),
                 lambda: mine.responses.retrieve("not an id")):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert caught.value.body["code"] == "not_found" and "previous_response_id" in str(caught.value.body) or \
            caught.value.status_code == 404
    assert mine.responses.retrieve(response.id).output_text == response.output_text   # still there for its owner
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=pd.gateway.url + "/v1", api_key="wrong", max_retries=0).responses.create(
            model="demo", input="hi")


def test_get_delete_and_store_false(pd) -> None:
    c = client(pd)
    response, _ = create(c, True, input="Remember me.", max_output_tokens=20)
    got = c.responses.retrieve(response.id)
    assert (got.id, got.status, got.output_text) == (response.id, response.status, response.output_text)
    c.responses.delete(response.id)
    for call in (lambda: c.responses.retrieve(response.id),
                 lambda: c.responses.create(model="demo", input="x", previous_response_id=response.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    unstored, _ = create(c, False, input="Forget me.", store=False, max_output_tokens=20)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)


def test_bad_input_is_an_openai_400(pd) -> None:
    c = client(pd)
    for kwargs, param in (({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
                          ({"input": "x", "tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
                          ({"input": "x", "max_output_tokens": 0}, "max_output_tokens")):
        with pytest.raises(openai.BadRequestError) as caught:
            c.responses.create(model="demo", **kwargs)
        assert caught.value.body["param"] == param and caught.value.body["type"] == "invalid_request_error"


def test_a_twenty_step_agent_loop_reuses_on_every_later_step(pd) -> None:
    c, rng = client(pd), random.Random(5)
    functions = [{"type": "function", **t["function"]} for t in tools()]
    reused_before = pd.metric("pdgw_turns_total", plan="reuse", reason="continuous")
    instructions, previous = system_prompt(), None
    new: Any = f"Task {uuid.uuid4().hex[:6]}: audit the river stone market."
    plans = []
    for step in range(20):
        response, headers = create(c, step % 2 == 1, input=new, instructions=instructions, tools=functions,
                                   previous_response_id=previous, max_output_tokens=200)
        plans.append((headers["x-pd-plan"], headers["x-pd-reason"], int(headers["x-pd-reused-tokens"])))
        calls = [item for item in response.output if item.type == "function_call"]
        new = [{"type": "function_call_output", "call_id": call.call_id,
                "output": tool_result(rng, {"function": {"name": call.name}}, 1 / len(calls))} for call in calls] \
            or "Go on."
        previous = response.id
    assert plans[0][:2] == ("full", "no_session")       # a new chain without a session id: looked up by prefix
    assert all(plan[:2] == ("reuse", "continuous") for plan in plans[1:]), plans
    assert all(b[2] > a[2] for a, b in zip(plans[1:], plans[2:]))             # D's KV grows with the history
    assert pd.metric("pdgw_turns_total", plan="reuse", reason="continuous") - reused_before >= 19
    assert pd.total("kv_reads_corrupt") == 0
