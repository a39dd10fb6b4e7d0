"""Real vLLM P and D through the gateway, with the official openai client: every turn token-identical to a
co-located engine, and reuse visible in vLLM's own counters and the gateway's `pdgw_turns_total`."""

from __future__ import annotations

import pytest

from tests.vllm.chat import Chat, gateway_metric
from tests.vllm.engines import BLOCK_SIZE, KV_BYTES_PER_TOKEN

pytestmark = pytest.mark.vllm

QUESTIONS = [
    "Hello there, how does a paged key value cache work in a serving engine?",
    "Why are the blocks a fixed number of tokens?",
    "What happens when the cache is full?",
    "And how does prefix caching share blocks between requests?",
    "Could you summarise all of that in one short paragraph?",
    "Thank you, one last question: what is disaggregated prefill?",
]


def chat(engines, gateway, **kw) -> Chat:
    """Turns are compared with the baseline in `compare()`: between turns it could outlast D's short pin TTL."""
    return Chat(gateway, engines.prefill, engines.decode, engines.baseline, compare_later=True, **kw)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_single_turn_matches_a_co_located_engine(engines, gateway, stream):
    before = gateway_metric(gateway, "pdgw_turns_total", plan="full", reason="no_session")
    c = chat(engines, gateway, session=None)
    turn = c.say(QUESTIONS[0] + f" (stream={stream})", stream=stream)
    c.compare()
    assert turn.exact, "PD output differs from the co-located engine"
    assert turn.text == turn.expected_text
    assert (turn.plan, turn.reason) == ("full", "no_session")
    assert turn.decode_loaded == len(turn.prompt_ids)       # D took the whole prompt's KV from P
    assert gateway_metric(gateway, "pdgw_turns_total", plan="full", reason="no_session") == before + 1


def converse(c: Chat, stream: bool, first: str, first_reason: str) -> None:
    """Six turns; from turn 2 on P reads D's KV of the whole previous exchange and computes only the rest."""
    for i, question in enumerate(QUESTIONS):
        c.say(first if i == 0 else question, stream=stream)
    c.compare()
    for i, turn in enumerate(c.turns):
        assert turn.exact, f"turn {i + 1} differs from the co-located engine"
        if i == 0:
            assert (turn.plan, turn.reason) == ("full", first_reason)
            continue
        previous = c.turns[i - 1]
        held = len(previous.prompt_ids) + len(previous.token_ids) - 1
        assert (turn.plan, turn.reason, turn.reused) == ("reuse", "continuous", held)
        cached_on_p = len(previous.prompt_ids) // BLOCK_SIZE * BLOCK_SIZE    # P's own prefix cache
        assert turn.prefill_loaded == held - cached_on_p > 0, f"turn {i + 1}: P did not read D's KV"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_conversation_reuses_d_kv_on_every_turn(engines, gateway, stream):
    """Streamed turns hand D's handle back through the plugin (plugins/vllm-pdgw-stream)."""
    before = gateway_metric(gateway, "pdgw_turns_total", plan="reuse", reason="continuous")
    bytes_before = engines.prefill.nixl_bytes()
    c = chat(engines, gateway)
    converse(c, stream, QUESTIONS[0], "first_turn")
    assert gateway_metric(gateway, "pdgw_turns_total", plan="reuse", reason="continuous") == before + 5
    read = sum(turn.prefill_loaded for turn in c.turns)
    assert engines.prefill.nixl_bytes() - bytes_before >= read * KV_BYTES_PER_TOKEN     # NIXL moved them


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_conversation_without_session_id_is_found_by_its_tokens(engines, gateway, stream):
    """No session id anywhere: from turn 2 on the gateway finds the conversation by its tokens (prefix lookup)."""
    converse(chat(engines, gateway, session=None), stream, f"(sessionless, stream={stream}) {QUESTIONS[0]}",
             "no_session")


def test_edited_history_falls_back_and_stays_exact(engines, gateway):
    c = chat(engines, gateway)
    for question in QUESTIONS[:3]:
        c.say(question)
    c.messages[1]["content"] = "An edited first question about something else entirely."
    turn = c.say(QUESTIONS[3])
    follow = c.say(QUESTIONS[4])
    c.compare()
    assert all(t.exact for t in c.turns)
    assert turn.reason == "prefix_diverged" and turn.plan in ("partial", "full")
    assert (follow.plan, follow.reason) == ("reuse", "continuous")


def test_regenerate_is_exact(engines, gateway):
    c = chat(engines, gateway)
    for question in QUESTIONS[:3]:
        c.say(question)
    c.messages.pop()                      # drop the last answer and ask again
    turn = c.send()
    c.compare()
    assert all(t.exact for t in c.turns)
    assert (turn.plan, turn.reason) == ("partial", "prompt_shorter")
    assert turn.reused == (len(turn.prompt_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
