"""This gateway process's ledger of the D handles it stored: per D, which conversation pins how many tokens,
since when, and whether a turn has claimed it. PinBudget (budget.py) decides from it which idle handles to
release; ConversationState keeps it current and does the releasing.

Why per process and not in the store: one tenant's keys share a Redis Cluster hash slot, while a per-D set
spans tenants, so it could not be updated inside the per-tenant Lua round trips of begin/finish. With several
replicas each keeps the handles it stored within its share of the budget: D's budget divided by the replicas
alive (replicas.py), so together they stay within it (docs/operations.md).

With `earnings` (earning.py) the ledger reports what becomes of each handle, and decides by it: the budget is
the effective one (how well pins pay, D's pressure) and handles are kept by expected saving, not recency.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from gateway.store import ConversationKey
from gateway.turns.state.budget import Decision, Pin, PinBudget, blocks
from gateway.turns.state.earning import PinEarnings, keep_by_worth

WORTH_SCAN = 512     # idle handles ranked per admit at most, oldest first: a turn's work stays bounded
OVERDUE = 4.0        # a handle idle this many times its conversation's last gap: that conversation has ended
GAPS_KEPT = 100_000  # conversations whose last gap is remembered between their claim and their next handle


@dataclass
class _Entry:
    engine: str
    turn: int               # the turn that stored the handle: evict_handle takes it only from that turn
    tokens: int
    last_used: float
    expires_at: float       # D frees the blocks itself then
    seq: int                # tells this entry from a later one of the same conversation in the expiry heap
    claimed: bool = False
    gap: float | None = None  # how long its conversation took to come back last time (earnings only)


@dataclass
class _OnEngine:
    """One D's pins, least recently stored first (insertion order), and their totals."""
    pins: dict[ConversationKey, _Entry] = field(default_factory=dict)
    tokens: int = 0
    blocks: int = 0


@dataclass(frozen=True)
class Victim:
    key: ConversationKey
    turn: int
    engine: str


class PinLedger:
    """Kept so that a turn's work is independent of how many handles are stored: per D an insertion-ordered map
    and running totals, expiries in a heap (a pass over every pin per turn took 5 ms at 1,000 pins)."""

    def __init__(self, budget: PinBudget, earnings: PinEarnings | None = None) -> None:
        self.budget, self.earnings = budget, earnings
        self._gaps: dict[ConversationKey, float] = {}
        self._pins: dict[ConversationKey, _Entry] = {}
        self._engines: dict[str, _OnEngine] = {}
        self._expiries: list[tuple[float, int, ConversationKey]] = []
        self._seq = itertools.count()

    def claim(self, key: ConversationKey, now: float) -> None:
        """A turn took the conversation's handle: it pins D until the turn ends, but may not be released."""
        if (entry := self._pins.get(key)) is not None:
            if self.earnings is not None and not entry.claimed:
                self.earnings.used(entry.engine, now - entry.last_used)
                if len(self._gaps) >= GAPS_KEPT:
                    self._gaps.pop(next(iter(self._gaps)))
                self._gaps[key] = now - entry.last_used
            entry.claimed, entry.last_used = True, now

    def returned(self, key: ConversationKey, now: float) -> None:
        """A turn of the conversation began: a handle not kept for it would have been used (earning.py)."""
        if self.earnings is not None and key not in self._pins:
            self.earnings.back(key, now)

    def drop(self, key: ConversationKey) -> None:
        if (entry := self._pins.pop(key, None)) is not None:
            on = self._engines[entry.engine]
            del on.pins[key]
            on.tokens -= entry.tokens
            on.blocks -= blocks(entry.tokens, self.budget.block_size)

    def spent(self, key: ConversationKey, reused_tokens: int = 0) -> None:
        """The turn that claimed the conversation's handle is over: the handle was read (`reused_tokens` of it)
        or released. (An unclaimed pin is left: a concurrent later turn may have stored it.)"""
        if (entry := self._pins.get(key)) is not None and entry.claimed:
            if self.earnings is not None:
                self.earnings.saved(entry.engine, reused_tokens)
            self.drop(key)

    def admit(self, engine: str, key: ConversationKey, tokens: int, num_gpu_blocks: int | None,
              now: float) -> tuple[Decision, list[Victim]]:
        """Which idle handles on `engine` to release so a new handle of `tokens` fits; they leave the ledger
        now, so a concurrent admit does not pick them again."""
        self._expire(now)
        on = self._engines.get(engine, _OnEngine())
        own = on.pins.get(key)            # being replaced: its turn consumed it
        others = on.blocks - (blocks(own.tokens, self.budget.block_size) if own else 0)
        budget = self.budget.budget_blocks(num_gpu_blocks)
        if self.earnings is None or not self.earnings.adaptive or budget is None:
            decision = self.budget.admit_oldest_first(others, self._idle(on, key), tokens, num_gpu_blocks)
        else:
            decision = self._by_worth(engine, on, key, others, tokens, self.earnings.budget_blocks(engine, budget),
                                      now)
        victims = [Victim(k, on.pins[k].turn, engine) for k in decision.release]
        for victim in victims:
            if self.earnings is not None:
                self.earnings.evicted(engine, victim.key, on.pins[victim.key].last_used, now)
            self.drop(victim.key)
        if self.earnings is not None and not decision.keep_new:
            self.earnings.not_kept(engine, key, now)
        return decision, victims

    def _by_worth(self, engine: str, on: _OnEngine, key: ConversationKey, others: int, tokens: int, budget: int,
                  now: float) -> Decision:
        assert self.earnings is not None
        need, bs = blocks(tokens, self.budget.block_size), self.budget.block_size
        if others + need <= budget:
            return Decision((), True, others + need, budget)
        worth = self.earnings.worth
        idle = []
        for k, e in itertools.islice(((k, e) for k, e in on.pins.items() if k != key and not e.claimed), WORTH_SCAN):
            age, n = now - e.last_used, blocks(e.tokens, bs)
            overdue = e.gap is not None and age > OVERDUE * max(e.gap, 1e-3)    # its conversation has ended
            idle.append((k, n, 0.0 if overdue else worth(engine, age, e.tokens, n)))
        return keep_by_worth(others, idle, need, worth(engine, 0.0, tokens, need), budget)

    def put(self, engine: str, key: ConversationKey, turn: int, tokens: int, now: float,
            expires_at: float) -> None:
        self.drop(key)
        entry = _Entry(engine, turn, tokens, now, expires_at, next(self._seq), gap=self._gaps.pop(key, None))
        self._pins[key] = entry
        on = self._engines.setdefault(engine, _OnEngine())
        on.pins[key] = entry
        on.tokens += tokens
        on.blocks += blocks(tokens, self.budget.block_size)
        if self.earnings is not None:
            self.earnings.forget(key)
            self.earnings.kept(engine, blocks(tokens, self.budget.block_size))
        heapq.heappush(self._expiries, (expires_at, entry.seq, key))

    def entry(self, key: ConversationKey) -> _Entry | None:
        return self._pins.get(key)

    def pinned_tokens(self, engine: str) -> int:
        return on.tokens if (on := self._engines.get(engine)) else 0

    def pinned_blocks(self, engine: str) -> int:
        return on.blocks if (on := self._engines.get(engine)) else 0

    @staticmethod
    def _idle(on: _OnEngine, key: ConversationKey) -> Iterator[Pin]:
        return (Pin(k, e.tokens, e.last_used) for k, e in on.pins.items() if k != key and not e.claimed)

    def _expire(self, now: float) -> None:
        # Past D's TTL the blocks are free, claimed or not (a claim whose turn never ended goes too).
        while self._expiries and self._expiries[0][0] <= now:
            _, seq, key = heapq.heappop(self._expiries)
            if (entry := self._pins.get(key)) is not None and entry.seq == seq:
                if self.earnings is not None and not entry.claimed:
                    self.earnings.expired(entry.engine)
                self.drop(key)
        if self.earnings is not None:
            self.earnings.expire(now)
