"""Engine-side guards of multi-turn reuse: D affinity, a lost D, engines that render other tokens than the
gateway verified (and ignore the pinned ids)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.e2e.chat import Chat
from tests.e2e.stack import stack

pytestmark = pytest.mark.integration

LONG_ANSWERS = ["--output-tokens", "80:120"]
THINKING_TEMPLATE = str(Path(__file__).resolve().parents[1] / "data" / "demo_chat_thinking_prompt.jinja")


def question(i: int) -> str:
    return f"Part {i}: how would you roll back a release that corrupted a cache, without downtime?"


def test_conversations_stay_on_their_d_and_survive_losing_it():
    with stack(sim=LONG_ANSWERS, decodes=2) as s:
        chats = [Chat(s, uuid.uuid4().hex) for _ in range(4)]
        for i in range(3):
            for chat in chats:
                turn = chat.say(question(i))
                assert turn.text == turn.expected and turn.plan == ("full" if i == 0 else "reuse")
        requests = [s.stats(d)["requests_total"] for d in s.decode]
        assert min(requests) >= 4           # least-loaded spread the first turns; affinity kept the rest
        s.decode[0].stop()
        s.wait_until(lambda: s.metric("pdgw_engine_healthy", pool="decode", engine="decode-0") == 0)
        for chat in chats:
            turn = chat.say(question(9))
            assert turn.text == turn.expected
            assert turn.plan == "reuse" or (turn.plan, turn.reason) == ("full", "decode_unavailable")
        assert sum(s.stats(e)["kv_reads_corrupt"] for e in [s.prefill[0], s.decode[1], s.baseline]) == 0


def test_engines_rendering_other_tokens_are_caught():
    """The engines' template opens each answer with `<think>` where the gateway's does not, and they ignore
    the pinned prompt ids (as engines before vLLM 0.32 do). The history agrees up to the last prompt, so the
    gateway plans a partial reuse; P's reported prompt shows it rendered other tokens: P is redone without."""
    engines = ["--chat-template", THINKING_TEMPLATE, "--no-prompt-token-ids", *LONG_ANSWERS]
    with stack(sim=engines) as s:
        chat = Chat(s, uuid.uuid4().hex)
        for i in range(4):
            turn = chat.say(question(i))
            assert turn.text == turn.expected
            assert (turn.plan, turn.reason) == ("full", "first_turn" if i == 0 else "parity_violation")
        assert s.total("kv_reads_corrupt") == 0
        assert s.metric("pdgw_turns_total", plan="full", reason="parity_violation") == 3
