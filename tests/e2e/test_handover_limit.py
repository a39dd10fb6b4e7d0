"""`--decode-handover-limit 1`: a burst of conversations through P and D, each D leg of the P path sent only once
the one before it on that D has its first token. Every turn still ends with the co-located engine's answer, the
later ones reading D's KV, and the simulator's oracle finds no wrong KV read (the limit's order and bound:
tests/unit/test_handovers.py)."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.chat import Chat
from tests.e2e.stack import stack

pytestmark = pytest.mark.integration


def conversation(s, i: int) -> list[tuple[str, bool]]:
    chat = Chat(s, uuid.uuid4().hex, max_tokens=60)
    first = chat.say(f"Conversation {i}: list what a careful engineer checks before shipping a change.", stream=True)
    second = chat.say("And which of those checks is the one most often skipped?", stream=True)
    return [(t.plan, t.text == t.expected) for t in (first, second)]


def test_a_burst_with_one_hand_over_at_a_time_on_d():
    with stack(gateway=["--decode-handover-limit", "1", "--local-prefill-max-tokens", "0"]) as s:
        with ThreadPoolExecutor(6) as pool:
            turns = [t for conv in pool.map(lambda i: conversation(s, i), range(6)) for t in conv]
        assert all(same for _, same in turns)
        assert [plan for plan, _ in turns].count("reuse") == 6
        assert s.total("kv_reads_corrupt") == 0
