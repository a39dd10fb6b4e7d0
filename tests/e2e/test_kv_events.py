"""What D holds, known from its KV events (issue 36): the gateway subscribes to each sim's events (a real ZMQ
socket on loopback) and plans a later turn local wherever D's cache still holds the verified history, with no
pin and no lease; when D evicts a conversation, the next turn is not sent local from stale knowledge but named
`evicted`. Every answer equals a co-located engine's, and the oracle checks every KV slot used."""

from __future__ import annotations

import json
import threading
import urllib.request
import uuid

import pytest

from tests.e2e.chat import Chat
from tests.e2e.stack import stack
from tests.e2e.test_local_path import topic, totals

pytestmark = pytest.mark.integration
BLOCK = 16
ADMIN_KEY = "events-admin"


def kv_events(pd) -> dict[str, dict]:
    request = urllib.request.Request(pd.gateway.url + "/admin/engines",
                                     headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    with urllib.request.urlopen(request, timeout=5) as resp:
        return {e["url"]: e.get("kv_events") for e in json.loads(resp.read())["engines"]}


@pytest.fixture(scope="module")
def pd():
    # D small: 48 blocks of 16 tokens; its pin budget half of them, so other conversations push a history out
    with stack(sim=["--output-tokens", "60:80"], decode=["--stream-kv-params", "--num-blocks", "48"], local=True,
               kv_events=True, gateway=["--admin-key", ADMIN_KEY]) as s:
        yield s


def test_later_turns_go_local_from_d_s_cache_with_no_pin_and_no_lease(pd):
    chat = Chat(pd, uuid.uuid4().hex)
    for i in range(4):
        turn = chat.say(topic(i), stream=i % 2 == 1)
        assert turn.text == turn.expected, f"turn {i + 1} differs from a single engine"
        if i:
            previous = chat.turns[i - 1]
            assert (turn.plan, turn.reason) == ("local", "short_suffix"), (i, turn.plan, turn.reason)
            held = previous.prompt_tokens + previous.completion_tokens - 1
            assert turn.reused == held // BLOCK * BLOCK
    # the first turn's pin goes once D's next request holds the blocks; local turns asked D to hold nothing
    pd.wait_until(lambda: totals(pd, pd.decode, "handles_pinned") + totals(pd, pd.decode, "handles_leased_now")
                  == 0)
    assert pd.total("kv_reads_corrupt") == 0
    assert pd.metric("pdgw_handles_missing_total", reason="handle_not_streamed") == 0   # none was asked for
    seen = kv_events(pd)
    for engine in pd.prefill + pd.decode:   # every engine's events decoded, none lost, blocks indexed
        assert seen[engine.url]["knowledge"] == "complete" and seen[engine.url]["blocks"] > 0, seen
        assert seen[engine.url]["block_size"] == BLOCK and seen[engine.url]["gaps"] == 0
        pool = "prefill" if engine in pd.prefill else "decode"
        assert pd.metric("pdgw_kv_events_knowledge", pool=pool, engine=engine.url, knowledge="complete") == 1
        assert pd.metric("pdgw_kv_events_cached_blocks", pool=pool, engine=engine.url) > 0


def test_sessionless_turns_are_found_by_their_tokens_with_nothing_pinned_on_d(pd):
    """A conversation found by its tokens needs no live handle where D's events say D's cache holds it: its local
    turns ask D to hold nothing (the store files the record all the same), so D pins nothing for it once its
    first turn's handle is spent. (Before the eviction test: that one leaves D's pin budget full.)"""
    messages = [{"role": "user", "content": topic(40)}]
    client = pd.client()
    plans = []
    held = lambda: totals(pd, pd.decode, "handles_pinned_total") + totals(pd, pd.decode, "handles_leased")  # noqa: E731
    held_before = held()
    for i in range(1, 5):
        raw = client.chat.completions.with_raw_response.create(model="demo", messages=messages, max_tokens=100)
        out = raw.parse()
        plans.append((raw.headers["x-pd-plan"], raw.headers["x-pd-conversation"]))
        messages += [{"role": "assistant", "content": out.choices[0].message.content},
                     {"role": "user", "content": topic(40 + i)}]
    assert plans[1:] == [("local", "prefix")] * 3, plans
    assert held() - held_before == 1, "D held only the first turn's KV (P's path), no local turn's"
    pd.wait_until(lambda: totals(pd, pd.decode, "handles_pinned") + totals(pd, pd.decode, "handles_leased_now")
                  == 0)
    assert pd.total("kv_reads_corrupt") == 0


def test_a_conversation_d_evicted_is_not_planned_local_from_stale_knowledge(pd):
    chat = Chat(pd, uuid.uuid4().hex)
    chat.say(topic(0))
    assert chat.say(topic(1)).plan == "local"           # D's cache holds it, nothing pins it now
    for i in range(8):                                  # others fill D's 48 blocks: the history is evicted
        Chat(pd, uuid.uuid4().hex).say(topic(10 + i))
    d = pd.decode[0]                                    # every batch D sent (its BlockRemoved) reached the gateway
    pd.wait_until(lambda: kv_events(pd)[d.url]["last_seq"] == pd.stats(d)["kv_event_batches"] - 1)
    turn = chat.say(topic(2))
    assert (turn.plan, turn.reason) == ("full", "evicted")
    assert turn.text == turn.expected
    assert pd.metric("pdgw_turns_total", plan="full", reason="evicted") >= 1
    assert pd.total("kv_reads_corrupt") == 0



def test_a_turn_that_holds_nothing_sends_an_engine_before_0_32_no_params():
    """vLLM before 0.32 keeps `prompt_token_ids` in the params it hands its connector, and a bidirectional D pins
    any finished request with params for its TTL (docs/protocol.md §9): where D is not proven to use the ids, a
    local turn that holds nothing sends D none, so D pins nothing. Streamed, as D's handle is not on vLLM 0.25."""
    with stack(sim=["--output-tokens", "60:80", "--no-prompt-token-ids"], local=True, kv_events=True) as s:
        held = lambda: totals(s, s.decode, "handles_pinned_total") + totals(s, s.decode, "handles_leased")  # noqa: E731
        chat = Chat(s, uuid.uuid4().hex)
        chat.say(topic(0), stream=True)
        held_after_first = held()
        for i in range(1, 4):
            turn = chat.say(topic(i), stream=True)
            assert (turn.plan, turn.reason) == ("local", "short_suffix") and turn.text == turn.expected
        assert held() == held_after_first, "a local turn left a pin on D"
        assert s.total("kv_reads_corrupt") == 0


def test_a_long_new_part_after_a_turn_that_held_nothing_is_not_held():
    """A local turn asked D to hold nothing; the next one's new part is over the local bound, so P computes it and
    what its cache lacks (no handle to read: `not_held`), exactly."""
    with stack(sim=["--output-tokens", "60:80"], local=True, kv_events=True,
               gateway=["--local-prefill-max-tokens", "256"]) as s:
        chat = Chat(s, uuid.uuid4().hex)
        chat.say(topic(0))
        assert chat.say(topic(1)).plan == "local"
        turn = chat.say(" ".join(f"word{i} and more words to read" for i in range(80)))
        assert (turn.plan, turn.reason) == ("full", "not_held") and turn.text == turn.expected
        assert s.total("kv_reads_corrupt") == 0


def test_a_long_new_part_after_a_turn_that_held_nothing_goes_local_on_a_busy_d():
    """The same turn with D busy (another conversation streams) and no ITL budget: a turn P could read for would
    get the floor, but this one has no handle, so the P path would prefill the whole history again and D read all
    of it; D's cache holds the history, so D computes the new part itself (turns/reuse/headroom.py)."""
    with stack(sim=["--output-tokens", "60:80", "--decode-ms-per-token", "40"], local=True, kv_events=True,
               gateway=["--local-itl-budget-ms", "0"]) as s:
        chat = Chat(s, uuid.uuid4().hex)
        chat.say(topic(0))
        assert chat.say(topic(1)).plan == "local"
        busy = threading.Thread(target=Chat(s, uuid.uuid4().hex).say, args=(topic(9),), kwargs={"stream": True})
        busy.start()
        s.wait_until(lambda: s.stats(s.decode[0])["running"] >= 1)
        turn = chat.say(" ".join(f"word{i} and more words to read" for i in range(80)))
        busy.join()
        assert (turn.plan, turn.reason) == ("local", "short_suffix") and turn.text == turn.expected
        assert turn.prompt_tokens - turn.reused > 256
        assert "local_bound=8192 d_streams=1" in s.gateway.log()
        assert s.total("kv_reads_corrupt") == 0
