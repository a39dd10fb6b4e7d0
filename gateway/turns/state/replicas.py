"""This replica's share of every D's pin budget (issue 25, item 3). Each gateway replica keeps a ledger of the
handles it stored (pins.py says why per process); so that N replicas do not pin N x the budget, each beats on the
store every few seconds and pins at most D's budget divided by the replicas alive. The beat is one round trip to
one small key, off every turn's path; a tenant's keys stay in its own slot. The embedded store serves one
process, so its count is 1. A replica that stops beating drops out after three beats; while the count is
changing the replicas may disagree for a beat (the budget is then briefly over by one replica's share change).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from gateway.store import ConversationStore, StoreUnavailableError
from gateway.turns.state.budget import PinBudget

log = logging.getLogger(__name__)
BEAT_S = 2.0
ALIVE_BEATS = 3          # a replica not heard from for this many beats is gone


class ReplicaShare:
    def __init__(self, store: ConversationStore, budget: PinBudget, beat_s: float = BEAT_S,
                 replica: str | None = None) -> None:
        self.store, self.budget, self.beat_s = store, budget, beat_s
        self.replica = replica or uuid.uuid4().hex

    async def beat(self, now: float | None = None) -> int:
        """Count the replicas alive (this one included) and set this one's share; the store down: keep the last."""
        try:
            count = await self.store.replicas(self.replica, time.time() if now is None else now,
                                              ALIVE_BEATS * self.beat_s)
        except StoreUnavailableError:
            return self.budget.replicas
        if count != self.budget.replicas:
            log.info("%d gateway replicas share each D's pin budget", max(1, count))
        self.budget.replicas = max(1, count)
        return self.budget.replicas

    async def run(self) -> None:
        while True:
            await self.beat()
            await asyncio.sleep(self.beat_s)
