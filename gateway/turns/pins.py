"""This gateway process's ledger of the D handles it stored: per D, which conversation pins how many tokens,
since when, and whether a turn has claimed it. PinBudget (budget.py) decides from it which idle handles to
release; ConversationState keeps it current and does the releasing.

Why per process and not in the store: one tenant's keys share a Redis Cluster hash slot, while a per-D set
spans tenants, so it could not be updated inside the per-tenant Lua round trips of begin/finish. With several
replicas each keeps the handles it stored within the budget (so together they stay within budget x replicas
unless the setting is divided among them; docs/operations.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.store import ConversationKey
from gateway.turns.budget import Decision, Pin, PinBudget


@dataclass
class _Entry:
    engine: str
    turn: int               # the turn that stored the handle: evict_handle takes it only from that turn
    tokens: int
    last_used: float
    expires_at: float       # D frees the blocks itself then
    claimed: bool = False


@dataclass(frozen=True)
class Victim:
    key: ConversationKey
    turn: int
    engine: str


class PinLedger:
    def __init__(self, budget: PinBudget) -> None:
        self.budget = budget
        self._pins: dict[ConversationKey, _Entry] = {}

    def claim(self, key: ConversationKey, now: float) -> None:
        """A turn took the conversation's handle: it pins D until the turn ends, but may not be released."""
        if (entry := self._pins.get(key)) is not None:
            entry.claimed, entry.last_used = True, now

    def drop(self, key: ConversationKey) -> None:
        self._pins.pop(key, None)

    def spent(self, key: ConversationKey) -> None:
        """The turn that claimed the conversation's handle is over: the handle was read or released. (An
        unclaimed pin is left: a concurrent later turn may have stored it.)"""
        if (entry := self._pins.get(key)) is not None and entry.claimed:
            del self._pins[key]

    def admit(self, engine: str, key: ConversationKey, tokens: int, num_gpu_blocks: int | None,
              now: float) -> tuple[Decision, list[Victim]]:
        """Which idle handles on `engine` to release so a new handle of `tokens` fits; they leave the ledger
        now, so a concurrent admit does not pick them again."""
        self._expire(now)
        on_engine = {k: e for k, e in self._pins.items() if e.engine == engine}
        pins = [Pin(k, e.tokens, e.last_used, e.claimed) for k, e in on_engine.items()]
        decision = self.budget.admit(pins, key, tokens, num_gpu_blocks)
        victims = [Victim(k, on_engine[k].turn, engine) for k in decision.release]
        for victim in victims:
            self.drop(victim.key)
        return decision, victims

    def put(self, engine: str, key: ConversationKey, turn: int, tokens: int, now: float,
            expires_at: float) -> None:
        self._pins[key] = _Entry(engine, turn, tokens, now, expires_at)

    def pinned_tokens(self, engine: str) -> int:
        return sum(e.tokens for e in self._pins.values() if e.engine == engine)

    def pinned_blocks(self, engine: str) -> int:
        return self.budget.pinned_blocks(
            Pin(k, e.tokens, e.last_used) for k, e in self._pins.items() if e.engine == engine)

    def _expire(self, now: float) -> None:
        # Past D's TTL the blocks are free, claimed or not (a claim whose turn never ended goes too).
        for key in [k for k, e in self._pins.items() if e.expires_at <= now]:
            del self._pins[key]
