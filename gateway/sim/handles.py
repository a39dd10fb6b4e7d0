"""Holder side of KV handles: P's leases and D's pins, and what a read or notification does to them.

A handle is single use: the first read or notification frees its blocks (back to the prefix cache). A later
read of the same ids gets whatever the blocks hold by then, silently, as NIXL does; it is only counted.

vLLM's holder cannot tell why a request id is no longer tracked: a read's completion notification or a
notification alone (a release, an abort) for one it does not know is logged ("Potentially invalid KV blocks for
unrecognized request"), counted in `vllm:nixl_num_notifications_after_expiry` and ignored, the read's bytes
already copied (vLLM 0.32 `nixl/pull_worker.py:662-673`). The simulator remembers what it issued, so it counts
each by what arrived and why (docs/protocol.md §4): only a read is harmful.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from gateway.sim.blocks import BlockPool
from gateway.sim.stats import SimStats

HoldKind = Literal["lease", "pin"]
Claim = Literal["active", "consumed", "expired", "unknown"]
Arrival = Literal["read", "notify"]  # blocks' data moved (a read, push mode's write) or a notification alone
MAX_REMEMBERED = 100_000  # ids of spent handles kept to tell a double read from an unknown one


@dataclass
class Held:
    block_ids: list[int]
    expires_at: float  # time.monotonic()
    kind: HoldKind


class HandleTable:
    def __init__(self, pool: BlockPool, stats: SimStats) -> None:
        self.pool = pool
        self.stats = stats
        self.held: dict[str, Held] = {}
        self.spent: dict[str, Claim] = {}  # request id -> "consumed" | "expired"

    def hold(self, request_id: str, block_ids: list[int], ttl_s: float, kind: HoldKind) -> float:
        expires_at = time.monotonic() + ttl_s
        self.held[request_id] = Held(list(block_ids), expires_at, kind)
        return expires_at

    def heartbeat(self, request_id: str, lease_s: float) -> bool:
        """A reader announced itself: extend a lease (pins are never renewed)."""
        self.expire()
        held = self.held.get(request_id)
        if held is None or held.kind != "lease":
            return False
        held.expires_at = max(held.expires_at, time.monotonic() + lease_s)
        return True

    def claim(self, request_id: str, arrived: Arrival) -> Claim:
        """A read or a notification arrived: free an active handle, count any other."""
        self.expire()
        held = self.held.pop(request_id, None)
        if held is not None:
            self.pool.release(held.block_ids)
            self._remember(request_id, "consumed")
            self.stats.handles_consumed += 1
            return "active"
        state = self.spent.get(request_id, "unknown")
        if state == "expired":
            self.stats.handles_read_after_expiry += 1
        else:
            self._count_double(arrived, spent=state == "consumed")
        return state

    def _count_double(self, arrived: Arrival, *, spent: bool) -> None:
        """`spent`: consumed on this instance; else it never issued the id (issued before a restart under the same
        engine id, or before `/sim/reset`). Another engine id is refused before this, at the handshake."""
        s = self.stats
        s.handles_double_read += 1
        if arrived == "read" and spent:
            s.handles_reread += 1
        elif arrived == "read":
            s.handles_read_unknown += 1
        elif spent:
            s.handles_renotified += 1
        else:
            s.handles_notified_unknown += 1

    def expire(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        gone = [rid for rid, held in self.held.items() if held.expires_at <= now]
        for rid in gone:
            self.pool.release(self.held.pop(rid).block_ids)
            self._remember(rid, "expired")
        self.stats.handles_expired += len(gone)
        return len(gone)

    def count(self, kind: HoldKind) -> int:
        return sum(1 for held in self.held.values() if held.kind == kind)

    def clear(self) -> None:
        for held in self.held.values():
            self.pool.release(held.block_ids)
        self.held.clear()
        self.spent.clear()

    def _remember(self, request_id: str, state: Claim) -> None:
        if len(self.spent) >= MAX_REMEMBERED:
            self.spent.pop(next(iter(self.spent)))
        self.spent[request_id] = state
