"""The simulated model's agent-loop rounds counted in the rendered prompt (what it sees) agree with the count over
the request's messages, whatever the loop's shape: mid-loop system entries, parallel calls, tool results longer
than the window the count first decodes, a first question with no turn before it."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway.sim.chat_render import Renderer
from gateway.sim.hermes_tools import tool_rounds


@pytest.fixture(scope="module", params=["builtin:demo", "builtin:demo-reasoning"])
def renderer(request: pytest.FixtureRequest) -> Renderer:
    return Renderer(request.param)


def _step(kind: str, n: int, size: int) -> list[dict[str, Any]]:
    if kind == "calls":
        calls = [{"id": f"c{n}{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                 for i in range(size % 3 + 1)]         # 1, 5, 3000 words: 2, 3, 1 calls side by side
        return [{"role": "assistant", "content": None, "tool_calls": calls},
                *({"role": "tool", "tool_call_id": c["id"], "content": "word " * size} for c in calls)]
    if kind == "text":
        return [{"role": "assistant", "content": "an answer"}]
    return [{"role": kind, "content": f"{kind} {n}"}]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(system=st.booleans(), steps=st.lists(st.tuples(st.sampled_from(["calls", "calls", "text", "user", "system"]),
                                                      st.sampled_from([1, 5, 3000])), max_size=8))
@example(system=True, steps=[("calls", 3000)] * 3)          # the question beyond the first window
def test_prompt_and_messages_agree(renderer: Renderer, system: bool, steps: list[tuple[str, int]]) -> None:
    messages = [{"role": "system", "content": "You are an agent."}] if system else []
    messages.append({"role": "user", "content": "Weather in Zürich?"})
    for n, (kind, size) in enumerate(steps):
        messages += _step(kind, n, size)
    assert renderer.tool_rounds(renderer.render_chat(messages)) == tool_rounds(messages)
