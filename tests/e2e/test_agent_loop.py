"""Agent loops through the gateway on the simulator oracle: an ~8k-token system prompt with tool definitions,
then steps of a tool call and 1-4k-token tool results. Every step's answer equals the co-located engine's
given the same prompt ids, and no KV read is ever corrupt. With `--history-tokens generated` every later step
reuses all D holds and P computes only the step's new tokens (+ one block, + the recompute threshold, under
which P recomputes D's short answer instead of pulling it); `rendered` is measured beside it."""

from __future__ import annotations

import uuid

import pytest

from tests.e2e.agent import AGENT_SIM, AgentLoop, Step
from tests.e2e.stack import stack

pytestmark = pytest.mark.integration

BLOCK = 16
RECOMPUTE_THRESHOLD = 64        # the sims' default kv_recompute_threshold
STEPS = 30
RENDERED_STEPS = 16


def _new_tokens(steps: list[Step], i: int) -> int:
    held = steps[i - 1].prompt_tokens + steps[i - 1].completion_tokens - 1
    return steps[i].prompt_tokens - held


def _report(label: str, steps: list[Step]) -> str:
    computed = sum(s.computed for s in steps[1:])
    ideal = sum(_new_tokens(steps, i) for i in range(1, len(steps)))
    plans = sorted({(s.plan, s.reason) for s in steps[1:]})
    return (f"{label}: {len(steps)} steps, last prompt {steps[-1].prompt_tokens} tokens, P computed {computed} "
            f"on later steps (new tokens {ideal}), plans {plans}")


@pytest.fixture(scope="module")
def generated():
    with stack(sim=AGENT_SIM, gateway=["--history-tokens", "generated"]) as s:
        yield s


def _exact_and_sound(s, steps: list[Step]) -> None:
    assert 7000 <= steps[0].prompt_tokens <= 10000, "the system prompt with tools is ~8k tokens"
    assert sum(s_.called for s_ in steps) >= len(steps) * 2 // 3
    assert all(s_.exact for s_ in steps), [i for i, s_ in enumerate(steps) if not s_.exact]
    assert s.total("kv_reads_corrupt") == 0 and s.total("requests_corrupt") == 0


@pytest.mark.parametrize("stream", [False, True], ids=["json", "streamed"])
def test_agent_loop_with_generated_history_computes_only_new_tokens(generated, stream: bool, capsys) -> None:
    steps = AgentLoop(generated, uuid.uuid4().hex, stream=stream, seed=int(stream)).run(STEPS)
    _exact_and_sound(generated, steps)
    for i in range(1, len(steps)):
        step, held = steps[i], steps[i - 1].prompt_tokens + steps[i - 1].completion_tokens - 1
        assert (step.plan, step.reason, step.reused) == ("reuse", "continuous", held), i
        assert step.computed <= _new_tokens(steps, i) + BLOCK + RECOMPUTE_THRESHOLD, i
    with capsys.disabled():
        print("\n" + _report(f"generated/{'streamed' if stream else 'json'}", steps))


def test_agent_loop_with_rendered_history_diverges_inside_re_rendered_calls(capsys) -> None:
    """The figure beside it: JSON and streamed steps alternating, fewer of them (the suite's time)."""
    with stack(sim=AGENT_SIM, gateway=["--history-tokens", "rendered"]) as s:
        steps = AgentLoop(s, uuid.uuid4().hex, stream=None, seed=2).run(RENDERED_STEPS)
        _exact_and_sound(s, steps)
    assert any(step.plan == "partial" for step in steps[1:]), "re-rendered tool calls diverge from D's tokens"
    with capsys.disabled():
        print("\n" + _report("rendered/alternating", steps))
