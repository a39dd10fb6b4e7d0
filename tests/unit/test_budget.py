"""The pin budget's decisions, table-driven: which idle handles a new handle makes the gateway release."""

from __future__ import annotations

import pytest

from gateway.turns.state.budget import Decision, Pin, PinBudget, blocks

BS = 16


def pin(key: str, n_blocks: int, last_used: float, claimed: bool = False) -> Pin:
    return Pin(key, n_blocks * BS, last_used, claimed)


@pytest.mark.parametrize(("name", "fraction", "capacity", "pins", "new_blocks", "release", "keep", "pinned"), [
    ("under budget: nothing released", 0.5, 100, [pin("a", 10, 1), pin("b", 10, 2)], 10, (), True, 30),
    ("exactly at budget is within it", 0.5, 100, [pin("a", 40, 1)], 10, (), True, 50),
    ("one over: the least recently used goes", 0.5, 100, [pin("b", 20, 5), pin("a", 20, 1)], 11, ("a",), True, 31),
    ("as many as needed, oldest first", 0.5, 100,
     [pin("a", 20, 1), pin("b", 20, 2), pin("c", 5, 3)], 40, ("a", "b"), True, 45),
    ("a claimed handle is never released, even if oldest", 0.5, 100,
     [pin("a", 30, 1, claimed=True), pin("b", 15, 2)], 10, ("b",), True, 40),
    ("only claimed ones left: stays over until their turns end", 0.5, 100,
     [pin("a", 45, 1, claimed=True)], 10, (), True, 55),
    ("the conversation's own old handle is replaced, not counted", 0.5, 100,
     [pin("new", 40, 1), pin("a", 10, 2)], 40, (), True, 50),
    ("a handle larger than the whole budget is not kept", 0.5, 100, [pin("a", 10, 1)], 51, (), False, 10),
    ("budget off (0): TTL only", 0.0, 100, [pin("a", 90, 1)], 50, (), True, 140),
    ("capacity unknown: no budget", 0.5, None, [pin("a", 90, 1)], 50, (), True, 140),
    ("ties on last use: by key, deterministically", 0.5, 100, [pin("b", 30, 1), pin("a", 30, 1)], 20, ("a",), True, 50),
])
def test_admit(name, fraction, capacity, pins, new_blocks, release, keep, pinned):
    decision = PinBudget(fraction, BS).admit(pins, "new", new_blocks * BS, capacity)
    assert (decision.release, decision.keep_new, decision.pinned_blocks) == (release, keep, pinned), name


def test_partial_blocks_count_whole_and_over_budget_is_reported():
    assert [blocks(t, BS) for t in (0, 1, 16, 17)] == [0, 1, 1, 2]
    budget = PinBudget(0.5, BS)
    decision = budget.admit([Pin("a", 50 * BS, 1, claimed=True)], "new", 1, 100)
    assert decision == Decision((), True, 51, 50) and decision.over_budget
    assert not budget.admit([], "new", 1, 100).over_budget


@pytest.mark.parametrize(("fraction", "block_size"), [(-0.1, 16), (1.5, 16), (0.5, 0)])
def test_bad_parameters_are_refused(fraction, block_size):
    with pytest.raises(ValueError):
        PinBudget(fraction, block_size)
