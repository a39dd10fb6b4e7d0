"""The KV blocks a request gets: its prompt's at admission (prefix-cache hits, then fresh blocks; when they do
not fit, it waits, counted as waiting as in vLLM's waiting queue) and its answer's before decoding (none free:
preempted by recompute, as vLLM does). Works on its engine's current pool and counters (a reset swaps them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from gateway.sim.blocks import BlockPool, PoolExhaustedError
from gateway.sim.engine_request import EngineRequest
from gateway.sim.settings import SimSettings
from gateway.sim.stats import SimStats
from gateway.sim.steps import Steps
from gateway.sim.waiting import BlockQueue, Grant


class Allocates(Protocol):
    settings: SimSettings
    steps: Steps
    pool: BlockPool
    block_queue: BlockQueue
    stats: SimStats
    bs: int
    running: int
    waiting: int


class Allocator:
    def __init__(self, engine: Allocates) -> None:
        self.engine = engine

    async def with_answer_blocks(self, req: EngineRequest, table: list[int], num_hits: int, hashes: list[bytes],
                                  answer_len: int) -> Grant:
        """Blocks for the answer's KV too, taken before decoding (vLLM takes them step by step, running requests
        before waiting ones). None free: the request is preempted as vLLM does it, by recompute: its blocks go
        back (its prompt's stay in the prefix cache), it waits at the head of the queue for prompt and answer
        blocks together, and recomputes locally whatever the cache lost meanwhile. Owns `table`: on any
        failure it releases what it holds."""
        prompt, bs = req.prompt, self.engine.bs
        total = -(-(len(prompt) + answer_len - 1) // bs)
        extra = total - len(table)
        if extra <= 0 or total > len(self.engine.pool.blocks):
            return table, num_hits                  # nothing to add, or never fits: no handle at the finish
        if extra <= self.engine.pool.num_free:
            return table + self.engine.pool.allocate(extra), num_hits
        self.engine.stats.requests_preempted += 1
        table, num_hits = await self._queued(self._attempt(prompt, hashes, total), first=True, giving_back=table)
        try:
            recomputed = 0
            for i in range(num_hits, -(-len(prompt) // bs)):
                block = self.engine.pool.blocks[table[i]]
                block.slots = [(prompt[p], p) for p in range(i * bs, min((i + 1) * bs, len(prompt)))]
                recomputed += len(block.slots)
            self.engine.pool.commit_run(table, hashes, prompt, num_hits, req.cache_salt)
            self.engine.stats.prompt_tokens_computed += recomputed
            await self.engine.steps.compute(recomputed)
        except BaseException:
            self.engine.pool.release(table)
            raise
        return table, num_hits

    def _attempt(self, prompt: list[int], hashes: list[bytes], total: int) -> Callable[[], Grant | None]:
        """Take `total` blocks for the request, its prefix-cache hits first, if they fit now; else take nothing."""
        def attempt() -> Grant | None:
            hits = self.engine.pool.match_prefix(hashes)[: (len(prompt) - 1) // self.engine.bs]  # the last token is computed
            fresh = total - len(hits)
            if not self.engine.pool.can_take(hits, fresh):
                return None
            self.engine.pool.touch(hits)
            return hits + self.engine.pool.allocate(fresh), len(hits)
        return attempt

    async def allocate(self, prompt: list[int], hashes: list[bytes]) -> Grant:
        """The prompt's blocks (prefix-cache hits, then fresh ones). When they do not fit the request waits."""
        total = -(-len(prompt) // self.engine.bs)
        if total > len(self.engine.pool.blocks):
            raise PoolExhaustedError(f"the prompt needs {total} KV blocks, the engine has {len(self.engine.pool.blocks)}")
        attempt = self._attempt(prompt, hashes, total)
        return self.engine.block_queue.try_now(attempt) or await self._queued(attempt)

    async def _queued(self, attempt: Callable[[], Grant | None], *, first: bool = False,
                      giving_back: list[int] | None = None) -> Grant:
        """Wait in the queue, counted as waiting, not running, as vLLM's scheduler keeps it in its waiting queue."""
        with self.engine.waiting_meanwhile():
            return await self.engine.block_queue.wait(attempt, first=first, giving_back=giving_back)
