"""The pin budget applied to the store: each stored handle entered in this process's ledger (pins.py), room
made on D for a new one by evicting idle handles (out of the store first, then D's blocks freed), and D's
pinned blocks reported where routing reads them. Without a ledger (no budget) every method does nothing. With
the ledger's earnings (earning.py) also D's own readings fed in, and what pins earn reported: the metrics and
`/admin/engines` (each D's `pins`)."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.engines import kv
from gateway.engines.pool import EnginePool
from gateway.store import ConversationKey, ConversationStore, StoreUnavailableError
from gateway.telemetry import Metrics
from gateway.turns.legs.release import HandleReleaser
from gateway.turns.state.budget import EVICTED, blocks
from gateway.turns.state.pins import PinLedger, Victim
from gateway.turns.state.timing import timed


class Pinning:
    def __init__(self, pins: PinLedger | None, store: ConversationStore, decode: EnginePool,
                 releaser: HandleReleaser, metrics: Metrics) -> None:
        self.pins, self.store, self.decode_pool = pins, store, decode
        self.releaser, self.metrics = releaser, metrics
        self.summaries: dict[str, dict[str, Any]] = {}     # each D's pins as `/admin/engines` shows them

    def begun(self, key: ConversationKey, claimed: bool, now: float) -> None:
        """A turn of the conversation began; `claimed`: its handle is being read, never a budget victim."""
        if self.pins is None:
            return
        self.pins.returned(key, now)
        if claimed:
            self.pins.claim(key, now)

    def spent(self, key: ConversationKey, reused_tokens: int = 0) -> None:
        """The claimed handle, if any, was read (`reused_tokens` of it not recomputed) or released."""
        if self.pins is None:
            return
        entry = self.pins.entry(key)
        self.pins.spent(key, reused_tokens)
        if entry is not None and entry.claimed and reused_tokens > 0 and self.pins.earnings is not None:
            self.metrics.pin_saved_tokens.labels(self.metrics.engine_label(entry.engine)).inc(reused_tokens)

    def admit(self, session: ConversationKey, engine: str, handle: kv.Handle | None,
              now: float) -> tuple[kv.Handle | None, list[Victim], bool]:
        """Make room on D for the new handle: (the handle to store, the idle handles to evict, whether the new one
        was turned away: released at once, its conversation's next turn says `evicted`). It is turned away when it
        alone exceeds the budget or, adaptive, is worth less than what it would push out; victims may come with it
        (a budget that shrank sheds idle handles)."""
        if handle is None or self.pins is None:
            return handle, [], False
        holder = self.decode_pool.get(engine)
        capacity = holder.facts.num_gpu_blocks if holder is not None else None
        if self.pins.earnings is not None and holder is not None:
            d = self.pins.earnings.of(engine)
            d.observe(holder.data_plane)     # D short of blocks: fewer pins
            if capacity:                     # what D's running requests need comes first
                budget = self.pins.budget
                d.load(capacity // max(1, budget.replicas), blocks(holder.running_kv_tokens, budget.block_size))
        decision, victims = self.pins.admit(engine, session, handle.num_tokens or 0, capacity, now)
        if not decision.keep_new:
            self._release_evicted(handle, engine)
            return None, victims, True
        return handle, victims, False

    def deleted(self, key: ConversationKey, engine: str) -> None:
        """The conversation was deleted (its handle released): its blocks no longer count against D's budget."""
        if self.pins is not None:
            self.pins.drop(key)
            self.report(engine)

    def stored(self, engine: str, session: ConversationKey, turn: int, handle: kv.Handle, now: float,
               expires_at: float) -> None:
        if self.pins is not None:
            self.pins.put(engine, session, turn, handle.num_tokens or 0, now, expires_at)

    async def evict(self, victims: list[Victim]) -> None:
        """Take each victim's handle out of the store first, then free D's blocks: a turn that began in
        between has claimed it, and evict_handle then leaves it alone (it is being read)."""
        async def one(victim: Victim) -> None:
            try:
                wire = await timed(self.metrics, "evict_handle", self.store.evict_handle(victim.key, victim.turn))
            except StoreUnavailableError:
                return                                 # still in the store: D frees it at its TTL
            if (handle := kv.from_store(wire)) is not None:
                self._release_evicted(handle, victim.engine)
        await asyncio.gather(*(one(v) for v in victims))

    def report(self, engine: str) -> None:
        """The gauge, and the D's pinned blocks where routing's used_kv reads them."""
        if self.pins is None:
            return
        self.metrics.pinned_tokens.labels(self.metrics.engine_label(engine)).set(self.pins.pinned_tokens(engine))
        holder = self.decode_pool.get(engine)
        if holder is not None:
            holder.pinned_blocks = self.pins.pinned_blocks(engine)
        if (earnings := self.pins.earnings) is not None:
            d = earnings.of(engine)
            self.metrics.pins_used_ratio.labels(self.metrics.engine_label(engine)).set(d.used_ratio)
            configured = self.pins.budget.budget_blocks(holder.facts.num_gpu_blocks if holder else None)
            budget = None if configured is None else earnings.budget_blocks(engine, configured)
            if budget is not None:
                self.metrics.pin_budget_blocks.labels(self.metrics.engine_label(engine)).set(budget)
            self.summaries[engine] = {**d.summary(), "budget_blocks": budget, "configured_budget_blocks": configured,
                                      "policy": "adaptive" if earnings.adaptive else "lru"}

    def share(self, num_gpu_blocks: int | None) -> dict[str, Any] | None:
        """This replica's share of a D's configured budget as of its last heartbeat (replicas.py): the replicas
        alive and D's budget over them. Read now, unlike `summaries`, which a stored handle refreshes."""
        if self.pins is None:
            return None
        budget = self.pins.budget
        return {"replicas": budget.replicas, "budget_blocks": budget.budget_blocks(num_gpu_blocks)}

    def _release_evicted(self, handle: kv.Handle, engine: str) -> None:
        self.releaser.release(handle, EVICTED)
        self.metrics.handles_evicted.labels(self.metrics.engine_label(engine)).inc()
