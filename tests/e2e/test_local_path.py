"""The local path (issue 24): a warm turn whose new suffix is short goes to the D that holds the conversation's
KV, alone; D finds the history in its own prefix cache and computes only what it lacks. Every answer is compared
with a co-located engine given the same conversation, and the simulator's oracle checks every KV slot used."""

from __future__ import annotations

import uuid

import pytest

from tests.e2e.chat import Chat
from tests.e2e.stack import stack

pytestmark = pytest.mark.integration

BLOCK = 16
LONG_ANSWERS = ["--output-tokens", "80:120"]


def topic(i: int) -> str:
    return f"Question {i}: what should a careful engineer check before shipping change number {i} to users?"


CAP = 512       # the local path's cap here: a ~1000-token question is over it whatever D's headroom


@pytest.fixture(scope="module")
def pd():
    with stack(sim=LONG_ANSWERS, local=True, decodes=2, gateway=["--local-prefill-max-tokens", str(CAP)]) as s:
        yield s


def totals(pd, engines, key: str) -> int:
    return sum(pd.stats(e)[key] for e in engines)


def test_short_suffixes_are_computed_by_the_holder_alone(pd):
    chat = Chat(pd, uuid.uuid4().hex)
    for i in range(8):
        p_before = totals(pd, pd.prefill, "prompt_tokens_computed")
        d_cached, d_computed = totals(pd, pd.decode, "prompt_tokens_cached"), totals(pd, pd.decode,
                                                                                     "prompt_tokens_computed")
        turn = chat.say(topic(i), stream=i % 2 == 1)
        assert turn.text == turn.expected, f"turn {i + 1} differs from a single engine"
        if i == 0:
            assert (turn.plan, turn.reason) == ("full", "first_turn")
            continue
        previous = chat.turns[i - 1]
        held = previous.prompt_tokens + previous.completion_tokens - 1
        assert (turn.plan, turn.reason) == ("local", "short_suffix")
        assert turn.reused == held // BLOCK * BLOCK            # D's cache holds whole blocks only
        # no P leg: P computes only the old handle's release, a zero-token read with a one-token prompt
        assert totals(pd, pd.prefill, "prompt_tokens_computed") - p_before <= 1
        assert totals(pd, pd.decode, "prompt_tokens_cached") - d_cached == turn.reused
        assert totals(pd, pd.decode, "prompt_tokens_computed") - d_computed == turn.prompt_tokens - turn.reused
    assert pd.total("kv_reads_corrupt") == 0
    assert pd.metric("pdgw_turns_total", plan="local", reason="short_suffix") >= 7
    # the old handle goes once D's new request holds its blocks: only the last turn's stays pinned
    pd.wait_until(lambda: totals(pd, pd.decode, "handles_pinned") + totals(pd, pd.decode, "handles_leased_now")
                  <= 1)


def test_a_suffix_over_the_bound_takes_the_p_path(pd):
    chat = Chat(pd, uuid.uuid4().hex)
    chat.say(topic(0))
    long_question = " ".join(f"word{i} and more words to read" for i in range(120))   # far over the cap
    turn = chat.say(long_question)
    assert (turn.plan, turn.reason) == ("reuse", "continuous") and turn.text == turn.expected
    turn = chat.say(topic(2))          # and the turn after reads what that P path left on D
    assert turn.plan == "local" and turn.text == turn.expected
    assert pd.total("kv_reads_corrupt") == 0


def test_an_idle_d_computes_a_long_suffix_itself():
    """With the defaults the bound is D's headroom (turns/reuse/headroom.py): a D running nothing gets the whole
    cap, so a ~1000-token question goes local, not through P; the turn's log line says why."""
    with stack(sim=LONG_ANSWERS, local=True) as s:
        chat = Chat(s, uuid.uuid4().hex)
        chat.say(topic(0))
        turn = chat.say(" ".join(f"word{i} and more words to read" for i in range(120)))
        assert (turn.plan, turn.reason) == ("local", "short_suffix") and turn.text == turn.expected
        assert turn.prompt_tokens - turn.reused > 512
        assert "local_bound=8192 d_streams=0" in s.gateway.log()
        assert s.total("kv_reads_corrupt") == 0


def test_sessionless_turns_go_local_too(pd):
    messages = [{"role": "user", "content": topic(0)}]
    client = pd.client()
    plans = []
    for i in range(1, 4):
        raw = client.chat.completions.with_raw_response.create(model="demo", messages=messages, max_tokens=200)
        out = raw.parse()
        plans.append((raw.headers["x-pd-plan"], raw.headers["x-pd-conversation"]))
        expected = pd.baseline_client().chat.completions.create(model="demo", messages=messages, max_tokens=200)
        assert out.choices[0].message.content == expected.choices[0].message.content
        messages += [{"role": "assistant", "content": out.choices[0].message.content},
                     {"role": "user", "content": topic(i)}]
    assert plans[0] == ("full", "new") and plans[1:] == [("local", "prefix")] * 2
    assert pd.total("kv_reads_corrupt") == 0


def test_an_edited_history_goes_local_on_the_common_blocks(pd):
    chat = Chat(pd, uuid.uuid4().hex)
    for i in range(3):
        chat.say(topic(i))
    chat.messages[-2]["content"] = chat.messages[-2]["content"].rsplit(" ", 3)[0]     # the last answer, cut
    turn = chat.ask()
    assert turn.plan == "local" and turn.text == turn.expected
    assert pd.total("kv_reads_corrupt") == 0


def test_local_first_turns_go_to_d_alone_within_the_bound():
    """`--local-first-turns`: a first turn whose whole prompt is within D's bound is prefilled by D itself, as a
    co-located engine would (P computes nothing, the answer is the same), and the next turn finds the history on
    D; a first prompt over the bound still goes through P."""
    with stack(sim=LONG_ANSWERS, local=True,
               gateway=["--local-first-turns", "--local-prefill-max-tokens", str(CAP)]) as s:
        chat = Chat(s, uuid.uuid4().hex)
        p_before = totals(s, s.prefill, "prompt_tokens_computed")
        turn = chat.say(topic(0))
        assert (turn.plan, turn.reason, turn.reused) == ("local", "first_turn", 0) and turn.text == turn.expected
        assert totals(s, s.prefill, "prompt_tokens_computed") == p_before
        turn = chat.say(topic(1), stream=True)
        assert (turn.plan, turn.reason) == ("local", "short_suffix") and turn.reused > 0
        assert turn.text == turn.expected
        long = Chat(s, uuid.uuid4().hex).say(" ".join(f"word{i} and more words to read" for i in range(120)))
        assert (long.plan, long.reason) == ("full", "first_turn") and long.text == long.expected
        assert s.total("kv_reads_corrupt") == 0
        assert s.metric("pdgw_turns_total", plan="local", reason="first_turn") == 1
