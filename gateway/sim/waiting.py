"""Requests waiting for free KV blocks, first come first served, as vLLM's scheduler keeps them.

vLLM's scheduler walks its waiting queue in arrival order each step and stops at the first request whose
blocks cannot be allocated (FCFS: a later, smaller request does not overtake it). A waiting request holds no
blocks: its prefix-cache hits are looked up again when it is tried. Blocks come back when a request finishes
or aborts and when a pinned or leased handle is read, released or expires; the pool then calls `wake`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from gateway.sim.blocks import BlockPool
from gateway.sim.stats import SimStats

Grant = tuple[list[int], int]  # the request's block table (cache hits first) and how many leading blocks were hits
Attempt = Callable[[], Grant | None]  # takes the blocks if they fit now, else takes nothing and returns None


@dataclass
class _Waiter:
    attempt: Attempt
    granted: asyncio.Future[Grant]


class BlockQueue:
    def __init__(self, pool: BlockPool, stats: SimStats) -> None:
        self.pool = pool
        self.stats = stats
        self._waiters: deque[_Waiter] = deque()
        pool.on_free = self.wake

    def __len__(self) -> int:
        return len(self._waiters)

    def try_now(self, attempt: Attempt) -> Grant | None:
        """Blocks at once, only if nobody is queued ahead (FCFS) and they fit."""
        return attempt() if not self._waiters else None

    async def wait(self, attempt: Attempt, *, first: bool = False, giving_back: list[int] | None = None) -> Grant:
        """Queue until the blocks are granted; a cancelled waiter leaves the queue (or gives its grant back).
        `first`: a preempted running request, served before every waiting one; `giving_back`: the blocks it
        frees as it queues (released once it is queued, so that they wait for it, not for the ones behind)."""
        waiter = _Waiter(attempt, asyncio.get_running_loop().create_future())
        if first:
            self._waiters.appendleft(waiter)
        else:
            self._waiters.append(waiter)
        if giving_back:
            self.pool.release(giving_back)
        self.stats.requests_waited_for_blocks += 1
        began = time.monotonic()
        try:
            return await waiter.granted
        except asyncio.CancelledError:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self.pool.release(waiter.granted.result()[0])  # granted, then cancelled before it ran
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
                self.wake()  # the one behind it may fit
            raise
        finally:
            waited = time.monotonic() - began
            self.stats.block_wait_seconds_total += waited
            self.stats.block_wait_seconds_max = max(self.stats.block_wait_seconds_max, waited)

    def wake(self) -> None:
        """Admit from the head while the head's blocks fit; stop at the first that does not (FCFS)."""
        while self._waiters:
            head = self._waiters[0]
            if head.granted.done():  # cancelled while queued: its task removes it, skip it meanwhile
                self._waiters.popleft()
                continue
            grant = head.attempt()
            if grant is None:
                return
            self._waiters.popleft()
            head.granted.set_result(grant)
