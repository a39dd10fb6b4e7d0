"""The pin budget of a D: how much of its KV the gateway's stored handles may pin, and which to release first.

Bidirectional reuse leaves each conversation's KV pinned on its D for `decoder_kv_blocks_ttl` after every turn.
Idle conversations then fill D, and D's new requests wait for free blocks (vLLM's scheduler queues a request
whose blocks do not fit). So the gateway keeps the blocks its handles pin on each D within a budget, a fraction
(`decode_pin_budget`) of D's `num_gpu_blocks`: before storing a new handle that would push D over it, it
releases the least recently used idle handles on that D (the zero-token read of `release.py`); the later turn
that finds its handle gone is counted with reason `evicted`. A handle a turn has claimed is never released: that
turn is reading it. Pure decisions only: the caller keeps the ledger (per D, tokens and last use per handle;
per gateway process, pins.py says why) and does the releasing (state.py: out of the store first, then D).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

EVICTED = "evicted"   # label of the released counter for a handle the budget released
BUDGET_EVICTED = "budget_evicted"   # the reason code of the next turn of a conversation whose handle it released
NEVER_KEPT = "never_kept"           # ... of one whose handle it never kept (larger than the budget)
OFF = 0.0             # decode_pin_budget 0: no budget, handles live until D's TTL


@dataclass(frozen=True)
class Pin:
    """One stored handle on a D."""
    key: Hashable         # the conversation it belongs to (ordered too: it breaks ties in last use)
    tokens: int           # tokens of KV D holds behind it (R)
    last_used: float      # when a turn last stored or claimed it (any clock, one per D)
    claimed: bool = False  # a turn is reading it now


@dataclass(frozen=True)
class Decision:
    release: tuple[Hashable, ...]   # keys of idle handles to release now, least recently used first
    keep_new: bool             # False: release the new handle rather than store it (alone over the budget, or worth less)
    pinned_blocks: int         # blocks pinned on D once the decision is carried out
    budget_blocks: int | None  # None: no budget (off, or D's capacity unknown)

    @property
    def over_budget(self) -> bool:
        """Still over after releasing every idle handle: claimed ones hold the rest until their turns end."""
        return self.budget_blocks is not None and self.pinned_blocks > self.budget_blocks


def blocks(tokens: int, block_size: int) -> int:
    return -(-max(0, tokens) // block_size)


class PinBudget:
    def __init__(self, fraction: float, block_size: int) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"decode_pin_budget must be within 0..1, not {fraction}")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, not {block_size}")
        self.fraction, self.block_size = fraction, block_size
        self.replicas = 1          # gateway replicas sharing each D's budget (replicas.py): this one pins its share

    def budget_blocks(self, num_gpu_blocks: int | None) -> int | None:
        if self.fraction == OFF or not num_gpu_blocks:
            return None
        return int(num_gpu_blocks * self.fraction / max(1, self.replicas))

    def pinned_blocks(self, pins: Iterable[Pin]) -> int:
        return sum(blocks(p.tokens, self.block_size) for p in pins)

    def admit(self, pins: Iterable[Pin], key: Hashable, tokens: int, num_gpu_blocks: int | None) -> Decision:
        """Store a new handle of `tokens` for conversation `key` on a D whose stored handles are `pins`: which
        idle handles to release first. A pin of the same key is being replaced (its turn consumed it): not
        counted and not released here."""
        others = [p for p in pins if p.key != key]
        idle = sorted((p for p in others if not p.claimed), key=lambda p: (p.last_used, p.key))
        return self.admit_oldest_first(self.pinned_blocks(others), idle, tokens, num_gpu_blocks)

    def admit_oldest_first(self, pinned: int, idle: Iterable[Pin], tokens: int,
                           num_gpu_blocks: int | None) -> Decision:
        """`admit` from what a ledger keeps: the blocks the other handles pin and their idle ones, least
        recently used first, read only as far as the new handle needs (no pass over every pin per turn)."""
        need = blocks(tokens, self.block_size)
        budget = self.budget_blocks(num_gpu_blocks)
        if budget is None:
            return Decision((), True, pinned + need, None)
        if need > budget:                      # pinning it would evict everything else and still not fit
            return Decision((), False, pinned, budget)
        released: list[Hashable] = []
        for pin in idle:
            if pinned + need <= budget:
                break
            released.append(pin.key)
            pinned -= blocks(pin.tokens, self.block_size)
        return Decision(tuple(released), True, pinned + need, budget)
