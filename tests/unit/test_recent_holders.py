"""RecentHolders looks only where its entries are filed: the same holders, in the same order, as a walk over
every block hash of the prompt, with its bookkeeping exact through replacements, drops and evictions."""

from __future__ import annotations

import random

from gateway.store import Conversation, ConversationKey
from gateway.turns.reuse.continuity import block_hashes
from gateway.turns.state.sessionless import RecentHolders

BS = 4


def record(ids: list[int], held: int) -> Conversation:
    return Conversation(model="m", block_size=BS, held_tokens=held, num_tokens=len(ids),
                        block_hashes=b"".join(block_hashes(ids, BS)), prefix_hash=b"p" * 16)


def walk(recent: RecentHolders, tenant: str, hashes: list[bytes], tokens: int) -> list:
    """Every block hash, longest first: what `holders` answered before it kept its positions."""
    out = []
    for blocks in range(len(hashes), 0, -1):
        entry = recent._by_hash.get((tenant, hashes[blocks - 1]))
        if entry is not None and entry[2].held_tokens <= tokens:
            out.append((entry[0], blocks))
    return out


def test_the_same_holders_as_a_walk_over_every_block() -> None:
    rng = random.Random(7)
    base = [rng.randrange(1000) for _ in range(400)]
    recent = RecentHolders(max_entries=12)
    for i in range(60):
        held = rng.randrange(5, 399)
        ids = base[:held + 1] if rng.random() < 0.7 else [rng.randrange(1000) for _ in range(held + 1)]
        key = ConversationKey(rng.choice(["t", "u"]), f"s{rng.randrange(20)}")
        if rng.random() < 0.2:
            recent.drop(key)
        else:
            recent.stored(key, i, record(ids, held))
        for tenant in ("t", "u"):
            for length in (3, 50, 400):
                prompt = block_hashes(base[:length], BS)
                got = [(h.key, h.blocks) for h in recent.holders(tenant, prompt, length)]
                assert got == walk(recent, tenant, prompt, length)
        filed = sum(sum(c.values()) for c in recent._at.values())
        assert filed == len(recent._by_hash) <= 12
