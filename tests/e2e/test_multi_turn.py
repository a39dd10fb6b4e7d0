"""Multi-turn conversations through the gateway: verified suffix-only reuse, partial reuse, safe fallback.
Every answer is compared with a co-located engine given the same conversation: wrong KV gives other text."""

from __future__ import annotations

import concurrent.futures
import uuid

import httpx
import pytest

from tests.e2e.chat import Chat
from tests.e2e.stack import stack

pytestmark = pytest.mark.integration

BLOCK = 16
# Answers longer than kv_recompute_threshold (64), so P really reads D's blocks rather than recomputing them.
LONG_ANSWERS = ["--output-tokens", "80:120"]


def topic(i: int) -> str:
    return f"Question {i}: what should a careful engineer check before shipping change number {i} to users?"


@pytest.fixture(scope="module")
def pd():
    with stack(sim=LONG_ANSWERS) as s:
        yield s


def test_ten_turns_reuse_and_compute_only_the_new_tokens(pd):
    chat = Chat(pd, uuid.uuid4().hex)
    for i in range(10):
        turn = chat.say(topic(i), stream=i % 2 == 1)
        assert turn.text == turn.expected, f"turn {i + 1} differs from a single engine"
        if i == 0:
            assert (turn.plan, turn.reason) == ("full", "first_turn")
            continue
        previous = chat.turns[i - 1]
        held = previous.prompt_tokens + previous.completion_tokens - 1
        assert (turn.plan, turn.reason, turn.reused) == ("reuse", "continuous", held)
        assert turn.computed <= turn.prompt_tokens - held + BLOCK
    assert pd.total("kv_reads_corrupt") == 0
    assert pd.metric("pdgw_turns_total", plan="reuse", reason="continuous") >= 9
    for phase in ("intake", "plan", "prefill", "decode_ttft", "total"):     # where a turn's time went
        assert pd.metric("pdgw_turn_seconds_count", phase=phase) >= 10, phase
    for span in ("to_prefill", "prefill_to_decode", "to_client", "internal"):   # the gateway's own time, JSON
        assert pd.metric("pdgw_gateway_seconds_count", span=span) >= 10, span     # and streamed turns alike
    assert 0 < pd.metric("pdgw_gateway_seconds_sum", span="internal") < pd.metric(
        "pdgw_turn_seconds_sum", phase="total")


@pytest.mark.parametrize("edit", ["edited", "truncated", "regenerated"])
def test_changed_histories_fall_back_exactly(pd, edit):
    chat = Chat(pd, uuid.uuid4().hex)
    for i in range(3):
        chat.say(topic(i))
    if edit == "edited":
        chat.messages[2]["content"] = "An edited question, entirely different from before."
        turn = chat.say(topic(9))
        assert turn.reason == "prefix_diverged" and turn.plan in ("partial", "full")
    elif edit == "truncated":
        del chat.messages[-4:]
        turn = chat.send()
        assert (turn.plan, turn.reason) == ("partial", "prompt_shorter")
    else:
        chat.messages.pop()              # drop the last answer and ask again: a regenerate
        turn = chat.send()
        assert (turn.plan, turn.reason) == ("partial", "prompt_shorter")
        assert turn.reused >= (turn.prompt_tokens - 1) // BLOCK * BLOCK - BLOCK
    assert turn.text == turn.expected
    follow = chat.say("And after that?")
    assert follow.plan == "reuse" and follow.text == follow.expected
    assert pd.total("kv_reads_corrupt") == 0


def test_concurrent_turns_of_one_session_never_both_reuse(pd):
    chat = Chat(pd, uuid.uuid4().hex)
    chat.say(topic(1))
    chat.messages.append({"role": "user", "content": topic(2)})
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        turns = list(pool.map(lambda _: chat.ask(), range(4)))
    assert sum(t.plan == "reuse" for t in turns) <= 1
    assert all(t.text == t.expected for t in turns)
    # A request that starts after another one finished sees that one's answer as held: a regenerate.
    assert {t.reason for t in turns if t.plan != "reuse"} <= {"concurrent_turn", "no_handle", "prompt_shorter"}
    assert pd.total("kv_reads_corrupt") == 0


def test_reasoning_conversations_reuse_the_previous_prompt():
    with stack(tokenizer="builtin:demo-reasoning", sim=["--reasoning", *LONG_ANSWERS]) as s:
        chat = Chat(s, uuid.uuid4().hex)
        for i in range(4):
            turn = chat.say(topic(i), stream=i == 2)
            assert turn.text == turn.expected
            if i:
                previous_prompt = chat.turns[i - 1].prompt_tokens
                assert (turn.plan, turn.reason) == ("partial", "prefix_diverged")
                assert turn.reused >= previous_prompt // BLOCK * BLOCK
        assert s.total("kv_reads_corrupt") == 0


def test_unstreamed_handles_are_counted_misses():
    with stack(sim=LONG_ANSWERS, decode=[]) as s:
        chat = Chat(s, uuid.uuid4().hex)
        chat.say(topic(1), stream=True)
        turn = chat.say(topic(2))
        assert (turn.plan, turn.reason) == ("full", "handle_not_streamed")
        assert chat.say(topic(3)).plan == "reuse"          # a non-streamed D leg hands its handle back
        assert s.metric("pdgw_handles_missing_total", reason="handle_not_streamed") == 1


def test_buffer_policy_reuses_with_streaming_clients():
    with stack(sim=LONG_ANSWERS, decode=[], gateway=["--stream-handle-policy", "buffer"]) as s:
        chat = Chat(s, uuid.uuid4().hex)
        for i in range(3):
            turn = chat.say(topic(i), stream=True)
            assert turn.text == turn.expected
        assert [t.plan for t in chat.turns] == ["full", "reuse", "reuse"]


def test_unreachable_store_serves_stateless():
    with stack(gateway=["--redis-url", "redis://127.0.0.1:9"]) as s:
        chat = Chat(s, uuid.uuid4().hex)
        turn = chat.say(topic(1))
        assert (turn.plan, turn.reason) == ("full", "store_unavailable") and turn.text == turn.expected
        ready = httpx.get(s.gateway.url + "/ready").json()
        assert ready["store_ok"] is False and ready["degraded"]


@pytest.mark.parametrize("history", ["rendered", "generated"])
def test_non_canonical_answers_keep_reuse_only_with_generated_history(history):
    """The engine emits words as token splits that re-encode differently. Rendered history diverges inside
    every previous answer; `--history-tokens generated` sends D's own ids for them and keeps full reuse."""
    engines = ["--non-canonical", *LONG_ANSWERS]
    with stack(sim=engines, gateway=["--history-tokens", history]) as s:
        session, messages = uuid.uuid4().hex, []
        for i in range(4):
            messages.append({"role": "user", "content": topic(i)})
            raw = s.client().chat.completions.with_raw_response.create(
                model="demo", messages=messages, max_tokens=200, extra_headers={"X-Session-Id": session},
                extra_body={"return_token_ids": True})
            out = raw.parse().model_dump()
            text = out["choices"][0]["message"]["content"]
            # The baseline engine is given exactly the ids the gateway sent: same tokens, same answer.
            expected = s.baseline_client().completions.create(model="demo", prompt=out["prompt_token_ids"],
                                                              max_tokens=200).choices[0].text
            assert text == expected
            if i and history == "generated":
                assert (raw.headers["x-pd-plan"], raw.headers["x-pd-reason"]) == ("reuse", "continuous")
            elif i:     # the re-encoded answer differs from D's ids (often it is shorter, too)
                assert raw.headers["x-pd-plan"] == "partial"
                assert raw.headers["x-pd-reason"] in ("prefix_diverged", "prompt_shorter")
            messages.append({"role": "assistant", "content": text})
        assert s.total("kv_reads_corrupt") == 0
