"""Pins that pay (earning.py), pure: the effective budget follows how often kept handles are used and D's own
readings; handles are kept by expected saving, so a cyclic pattern does not evict each one before its turn."""

from __future__ import annotations

import pytest

from gateway.engines.dataplane import DataPlane
from gateway.store import ConversationKey
from gateway.turns.state.budget import PinBudget
from gateway.turns.state.earning import (BACK_OFF, CALM_READINGS, MIN_RETURNS, PAY_FLOOR, RESERVE, USED_GOOD, Earnings,
                                         PinEarnings, Returns,
                                         keep_by_worth, short_of_blocks)
from gateway.turns.state.pins import PinLedger

BS, LIFE, D = 16, 10.0, "d0"


@pytest.mark.parametrize(("name", "pinned", "idle", "need", "worth_new", "budget", "release", "keep", "after"), [
    ("room: nothing released", 10, [("a", 10, 0.1)], 5, 1.0, 20, (), True, 15),
    ("a handle worth less makes room", 20, [("a", 10, 0.1), ("b", 10, 2.0)], 5, 1.0, 20, ("a",), True, 15),
    ("least worth first, as many as needed", 30, [("b", 10, 0.5), ("a", 10, 0.2), ("c", 10, 0.3)], 15, 1.0, 30,
     ("a", "c"), True, 25),
    ("incumbents worth more: the new one is not kept", 20, [("a", 10, 2.0), ("b", 10, 3.0)], 5, 1.0, 20,
     (), False, 20),
    ("too little worth less: none released, not kept", 20, [("a", 2, 0.1), ("b", 18, 3.0)], 5, 1.0, 20,
     (), False, 20),
    ("equal worth: the incumbent stays", 20, [("a", 10, 1.0), ("b", 10, 1.0)], 5, 1.0, 20, (), False, 20),
    ("budget shrank: least worth shed to it, new one not kept", 40, [("a", 10, 0.5), ("b", 10, 0.1),
                                                                     ("c", 20, 2.0)], 5, 1.0, 20, ("b", "a"),
     False, 20),
    ("budget 0: every idle handle goes (stateless PD)", 30, [("a", 10, 5.0), ("b", 20, 5.0)], 1, 9.0, 0,
     ("a", "b"), False, 0),
    ("claimed ones (not idle) hold the rest", 30, [("a", 10, 0.1)], 5, 1.0, 10, ("a",), False, 20),
])
def test_keep_by_worth(name, pinned, idle, need, worth_new, budget, release, keep, after):
    decision = keep_by_worth(pinned, idle, need, worth_new, budget)
    assert (decision.release, decision.keep_new, decision.pinned_blocks) == (release, keep, after), name


def reading(t: float, usage: float = 0.3, waiting: float = 0, preemptions: float = 0) -> DataPlane:
    return DataPlane(kv_cache_usage=usage, requests_waiting=waiting, preemptions=preemptions, scraped_at=t)


@pytest.mark.parametrize(("usage", "waiting", "preempted", "short"), [
    (0.5, 0, False, False), (0.96, 0, False, True), (0.85, 2, False, True), (0.85, 0, False, False),
    (0.5, 3, False, False), (0.2, 0, True, True), (None, 5, False, False)])
def test_short_of_blocks(usage, waiting, preempted, short):
    assert short_of_blocks(DataPlane(kv_cache_usage=usage, requests_waiting=waiting), preempted) is short


def test_pressure_halves_while_d_is_short_and_recovers_only_after_calm_readings():
    d = Earnings(LIFE)
    d.observe(reading(1.0, preemptions=5))                 # first reading: the counter's base, not a rise
    assert d.pressure == 1.0
    d.observe(reading(2.0, preemptions=6))
    assert d.pressure == BACK_OFF
    d.observe(reading(2.0, preemptions=9))                 # the same scrape again: counted once
    assert d.pressure == BACK_OFF
    for t in range(3, 9):
        d.observe(reading(t, usage=0.99, preemptions=9))
    assert d.pressure == 0.0                               # down to none, not a trickle
    for t in range(9, 9 + CALM_READINGS - 1):
        d.observe(reading(t, preemptions=9))
    assert d.pressure == 0.0                               # a few calm readings between bursts: still none
    d.observe(reading(20, usage=0.85, waiting=1, preemptions=9))
    for t in range(21, 21 + CALM_READINGS + 10):
        d.observe(reading(t, preemptions=9))
    assert d.pressure == 1.0


def test_the_budget_follows_the_used_ratio_of_kept_handles():
    e = PinEarnings(0.5, LIFE)
    assert e.budget_blocks(D, 100) == 100                  # prior: half used, above USED_GOOD
    for _ in range(200):
        e.expired(D)
    assert e.of(D).used_ratio < 0.05 and e.budget_blocks(D, 100) == int(100 * PAY_FLOOR)   # a few keep measuring
    for _ in range(200):
        e.used(D, 1.0)
    assert e.of(D).used_ratio > USED_GOOD and e.budget_blocks(D, 100) == 100
    assert PinEarnings(0.5, LIFE, adaptive=False).budget_blocks(D, 100) == 100


def test_handles_not_kept_whose_conversation_came_back_say_pins_would_pay():
    e = PinEarnings(0.5, LIFE)
    for _ in range(200):
        e.expired(D)
    low = e.budget_blocks(D, 100)
    ratio = e.of(D).used_ratio
    for i in range(200):
        key = ConversationKey("t", f"c{i}")
        e.not_kept(D, key, float(i))
        e.back(key, i + 2.0)                               # came back within a handle's life
    d = e.of(D)
    assert d.counts["ghost_back"] == 200 and d.used_ratio == ratio      # the metric: kept handles only
    assert d.would_use_ratio > USED_GOOD and e.budget_blocks(D, 100) == 100 > low
    assert d.returns.rate(1.0) > d.returns.rate(0.0) > 0   # due in 2 s: at 1 s idle, sooner
    e.not_kept(D, ConversationKey("t", "late"), 0.0)
    e.back(ConversationKey("t", "late"), LIFE + 1)         # after the handle's life: not a return
    assert d.counts["ghost_back"] == 200


def test_worth_prefers_a_handle_due_soon_and_drops_one_past_every_return():
    r = Returns(LIFE)
    assert r.rate(0.0) > r.rate(5.0)                       # too few outcomes: recency
    for i in range(MIN_RETURNS * 10):
        r.back(3.0 + (i % 5) * 0.5)                        # conversations come back after 3-5 s
    assert r.rate(4.0) > r.rate(0.0)                       # idle 4 s: due sooner than a new one
    assert r.rate(6.0) == 0.0                              # past every return seen: worth nothing
    assert r.rate(LIFE + 1) == 0.0


def cyclic(ledger: PinLedger, conversations: int, rounds: int, capacity: int) -> tuple[int, int]:
    """Conversations taking turns in a fixed cycle, each handle 4 blocks: how many turns found their handle."""
    hits = misses = 0
    now = 0.0
    for _ in range(rounds):
        for c in range(conversations):
            now += 0.1
            key = ConversationKey("t", f"c{c}")
            ledger.returned(key, now)
            if ledger.entry(key) is not None:
                hits += 1
                ledger.claim(key, now)
                ledger.spent(key, 64)
            else:
                misses += 1
            decision, victims = ledger.admit(D, key, 4 * BS, capacity, now)
            if decision.keep_new:
                ledger.put(D, key, 1, 4 * BS, now, now + LIFE)
    return hits, misses


def test_a_cyclic_pattern_thrashes_lru_but_not_keeping_by_worth():
    """20 conversations, room for 10 handles (budget 0.5 of 80 blocks): LRU evicts each handle just before its
    conversation comes back (no hits at all); by worth about half the turns find theirs."""
    lru = PinLedger(PinBudget(0.5, BS))
    assert cyclic(lru, 20, 30, 80)[0] == 0
    adaptive = PinLedger(PinBudget(0.5, BS), PinEarnings(0.5, LIFE))
    hits, misses = cyclic(adaptive, 20, 30, 80)
    assert hits > 0.4 * (hits + misses)
    d = adaptive.earnings.of(D)
    assert d.saved_tokens == 64 * hits and d.counts["used"] == hits and d.used_ratio > USED_GOOD


def test_expired_handles_are_counted_and_lower_the_budget():
    ledger = PinLedger(PinBudget(0.5, BS), PinEarnings(0.5, LIFE))
    for i in range(100):
        ledger.put(D, ConversationKey("t", f"c{i}"), 1, BS, float(i), i + LIFE)
    ledger.admit(D, ConversationKey("t", "new"), BS, 1000, 200.0)
    d = ledger.earnings.of(D)
    assert d.counts["expired"] == 100 and ledger.pinned_blocks(D) == 0
    assert ledger.earnings.budget_blocks(D, 500) < 100


def test_d_s_usage_alone_below_the_marks_keeps_the_budget():
    """A long turn running beside a long idle handle (the agent loop: 0.77 of D) is not a shortage."""
    e = PinEarnings(0.5, LIFE)
    e.of(D).observe(reading(1.0, usage=0.77, waiting=0))
    assert e.budget_blocks(D, 6000) == 6000


def test_worth_resolves_short_gaps_in_a_long_handle_life():
    """An agent loop's steps come back within milliseconds while a handle lives 450 s: a handle idle for a
    second is past every return and worth nothing, a new one is worth a lot (found by the agent-loop e2e test:
    a coarse table made them equal and turned the new handle away)."""
    r = Returns(450.0)
    for i in range(MIN_RETURNS * 4):
        r.back(0.05 + 0.001 * i)
    assert r.rate(1.0) == 0.0 and r.rate(0.0) > 1.0
    assert keep_by_worth(4640, [("old", 4640, r.rate(1.0))], 556, r.rate(0.0), 4960).release == ("old",)


def test_a_handle_idle_long_past_its_conversations_own_gap_goes_first():
    """An agent loop came back every 0.5 s and has been idle 5 s: it has ended, whatever the D's return times
    say (other conversations take seconds); a new conversation's handle takes its place."""
    ledger = PinLedger(PinBudget(0.5, BS), PinEarnings(0.5, 450.0))
    loop = ConversationKey("t", "loop")
    now = 0.0
    for i in range(12):                                    # the loop: 12 steps, 0.5 s apart
        ledger.returned(loop, now)
        ledger.claim(loop, now)
        ledger.spent(loop, 16)
        ledger.admit(D, loop, 40 * BS, 100, now)
        ledger.put(D, loop, i + 1, 40 * BS, now, now + 450.0)
        now += 0.5
    for i in range(MIN_RETURNS):                           # other conversations come back after 4-8 s
        ledger.earnings.of(D).returns.back(4.0 + i * 0.5)
    now += 4.5
    decision, victims = ledger.admit(D, ConversationKey("t", "new"), 20 * BS, 100, now)
    assert decision.keep_new and [v.key for v in victims] == [loop]


def test_running_requests_come_before_pins():
    """D's share less what this gateway's running requests on it hold (their peak, RESERVE over) bounds the
    budget, whatever pins would earn: a D its running requests fill pins nothing (issue 25, bench/PRESSURE.md:
    at a tenth of the history D waited for blocks its pins held while stateless PD's did not)."""
    e = PinEarnings(0.5, LIFE)
    assert e.budget_blocks(D, 112) == 112                  # nothing measured of D's load yet
    d = e.of(D)
    d.load(224, 40)
    assert d.room == int(224 - RESERVE * 40) and e.budget_blocks(D, 112) == 112   # room to spare
    d.load(224, 150)
    assert e.budget_blocks(D, 112) == int(224 - RESERVE * 150)
    d.load(224, 200)
    assert e.budget_blocks(D, 112) == 0                    # running requests need all of it
    d.load(224, 0)                                         # a quiet moment right after a burst: still the peak
    assert e.budget_blocks(D, 112) < 20
    for _ in range(400):
        d.load(224, 0)
    assert e.budget_blocks(D, 112) == 112                  # the burst is long over
    assert PinEarnings(0.5, LIFE, adaptive=False).budget_blocks(D, 112) == 112   # lru: the fixed budget
    assert d.summary()["room_blocks"] == d.room


def test_an_engine_counts_the_kv_of_requests_running_on_it():
    from gateway.engines.engine import Engine
    d = Engine("http://d", "decode")
    with d.running(100):
        with d.running(50):
            assert d.running_kv_tokens == 150
        assert d.running_kv_tokens == 100
    with pytest.raises(RuntimeError), d.running(7):
        raise RuntimeError
    assert d.running_kv_tokens == 0
