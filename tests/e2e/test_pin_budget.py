"""D's pin budget end to end: a D with few KV blocks and more conversations than its budget holds. Idle
conversations' handles are evicted (out of the store, then D's blocks freed), their next turns say `evicted` and
are still exact, and no KV read is ever corrupt."""

from __future__ import annotations

import uuid

import pytest

from tests.e2e.chat import Chat
from tests.e2e.stack import stack

pytestmark = pytest.mark.integration

D_BLOCKS = 64                   # 1,024 tokens of KV on D; budget 0.5: 512 tokens of pinned handles
CONVERSATIONS = 8


def topic(i: int) -> str:
    return f"Conversation {i}: what should a careful engineer check before shipping change number {i}?"


@pytest.fixture(scope="module")
def small_d():
    with stack(sim=["--output-tokens", "80:120"], decode=["--stream-kv-params", "--num-blocks", str(D_BLOCKS)],
               gateway=["--decode-pin-budget", "0.5"]) as s:
        yield s


def test_idle_handles_are_evicted_and_their_next_turns_say_so(small_d):
    chats = [Chat(small_d, uuid.uuid4().hex, max_tokens=100) for _ in range(CONVERSATIONS)]
    for i, chat in enumerate(chats):                # each leaves ~140 tokens pinned: 8 of them exceed 512
        assert chat.say(topic(i)).reason == "first_turn"
    d = "decode-0"             # engines are labelled by name (--engine-names; default role-order)
    assert small_d.metric("pdgw_handles_evicted_total", engine=d) >= 1
    assert small_d.metric("pdgw_pinned_tokens", engine=d) <= D_BLOCKS * 16 * 0.5
    seconds = [chat.say("And then?") for chat in reversed(chats)]     # newest first: LRU kept those
    reasons = [t.reason for t in seconds]
    assert reasons[0] == "continuous", reasons      # the most recently used was kept
    assert reasons[-1] == "budget_evicted", reasons        # the least recently used went first
    assert all(t.text == t.expected for t in seconds), "an evicted conversation's turn differs from one engine"
    assert small_d.total("kv_reads_corrupt") == 0 and small_d.total("requests_corrupt") == 0
    assert small_d.metric("pdgw_handles_released_total", reason="evicted") >= reasons.count("budget_evicted")
