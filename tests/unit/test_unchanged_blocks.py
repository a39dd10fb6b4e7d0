"""The hint a turn's finish gives the store: how many leading block hashes the new record shares with the one the
turn began on (the store then sends only the rest)."""

from __future__ import annotations

import pytest

from gateway.store import Conversation
from gateway.turns.reuse.continuity import block_hashes
from gateway.turns.state.state import _unchanged

BS = 4


def rec(ids: list[int], block_size: int = BS) -> Conversation:
    return Conversation(block_size=block_size, block_hashes=b"".join(block_hashes(ids, block_size)))


S = list(range(40))


@pytest.mark.parametrize("new, expected", [
    (S + [1, 2, 3, 4, 5], 10),            # the next turn: every old block kept
    (S[:22] + [99] * 20, 5),              # diverged inside block 5
    ([7] + S[1:], 0),                     # the first block differs
    (S[:10], 2),                          # shorter
    (S, 10),                              # the same
])
def test_the_longest_shared_prefix_of_blocks(new: list[int], expected: int) -> None:
    assert _unchanged(rec(S), rec(new)) == expected


def test_nothing_is_shared_without_a_previous_record_or_across_block_sizes() -> None:
    assert _unchanged(None, rec(S)) == 0
    assert _unchanged(rec(S, 8), rec(S)) == 0
