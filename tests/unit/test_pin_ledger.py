"""The pin ledger keeps per-D totals, an insertion-ordered map and an expiry heap so that a turn's work does not
grow with the number of stored handles; any sequence of operations must decide exactly as the plain pass over
every pin does (bench/pin_ledger.py's `EveryPin`, the ledger as it was)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.pin_ledger import EveryPin
from gateway.store import ConversationKey
from gateway.turns.state.budget import PinBudget
from gateway.turns.state.pins import PinLedger

BS = 16
ENGINES = ["d0", "d1"]
TTL = 5.0

operation = st.tuples(st.sampled_from(["put", "admit", "claim", "spent", "drop"]), st.integers(0, 7),
                      st.sampled_from(ENGINES), st.integers(0, 20 * BS), st.floats(0.01, 2.0))


@settings(max_examples=300, deadline=None)
@given(st.lists(operation, max_size=60), st.sampled_from([None, 40, 100]))
def test_the_ledger_decides_as_a_pass_over_every_pin(ops, capacity):
    budget = PinBudget(0.5, BS)
    ledger, every, now = PinLedger(budget), EveryPin(budget), 0.0
    for op, n, engine, tokens, dt in ops:
        now += dt                      # distinct times: the pass breaks ties by key, the ledger by order
        key = ConversationKey("t", f"c{n}")
        if op == "put":
            for kept in (ledger, every):
                kept.put(engine, key, 1, tokens, now, now + TTL)
        elif op == "admit":
            assert ledger.admit(engine, key, tokens, capacity, now) == every.admit(engine, key, tokens, capacity, now)
        elif op == "claim":
            ledger.claim(key, now)
            every.claim(key, now)
        elif op == "spent":
            ledger.spent(key)
            every.spent(key)
        else:
            ledger.drop(key)
            every.drop(key)
        ledger._expire(now)
        every._expire(now)
        for d in ENGINES:
            assert ledger.pinned_blocks(d) == every.pinned_blocks(d)
            assert ledger.pinned_tokens(d) == every.pinned_tokens(d)
