"""The KV block pool and its prefix cache.

Every block records what its KV *really* encodes, slot by slot, as `(token id, position)`: that is the
oracle's ground truth. Blocks are found in the prefix cache by a chained hash of the *request's* token ids
(plus cache salt), exactly like vLLM, so a block filled with wrong KV is cached, and reused, as if right.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from gateway.sim.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, removed, stored

Slot = tuple[int, int]  # (token id, position) whose KV a slot holds
GARBAGE: Slot = (-1, -1)  # uninitialised memory: what a read past a block's filled slots gets


@dataclass
class Block:
    id: int
    slots: list[Slot] = field(default_factory=list)
    hash: bytes | None = None
    refs: int = 0


def block_hashes(tokens: list[int], block_size: int, salt: str | None = None) -> list[bytes]:
    """Chained hashes of the full blocks of `tokens`; the salt seeds the chain (vLLM: first block's extra keys)."""
    parent = hashlib.sha256(f"salt:{salt or ''}".encode()).digest()
    hashes = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        chunk = ",".join(map(str, tokens[start:start + block_size])).encode()
        parent = hashlib.sha256(parent + chunk).digest()
        hashes.append(parent)
    return hashes


class EventSink(Protocol):
    def emit(self, event: BlockStored | BlockRemoved | AllBlocksCleared) -> None: ...


class PoolExhaustedError(Exception):
    """Not enough free blocks for a request."""


class BlockPool:
    """Fixed set of blocks; free blocks stay in the prefix cache until reused, evicted least recent first."""

    def __init__(self, num_blocks: int, block_size: int, *, caching: bool = True,
                 events: EventSink | None = None) -> None:
        self.block_size = block_size
        self.events = events            # KV events (kvevents.py): what the prefix cache gains and loses
        self.caching = caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        # Called after a release frees blocks: the queue of requests waiting for blocks admits its head then.
        self.on_free: Callable[[], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def in_use(self) -> int:
        return len(self.blocks) - len(self.free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise PoolExhaustedError(f"need {n} blocks, {len(self.free)} free")
        ids = []
        for _ in range(n):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            self._uncache(block)
            block.slots, block.refs = [], 1
            ids.append(block_id)
        return ids

    def can_take(self, hits: list[int], n: int) -> bool:
        """Whether `n` fresh blocks fit after touching `hits` (a hit on a free cached block takes it too)."""
        return n + sum(1 for block_id in hits if self.blocks[block_id].refs == 0) <= len(self.free)

    def match_prefix(self, hashes: list[bytes]) -> list[int]:
        """Ids of the longest cached run of `hashes`, from the start."""
        if not self.caching:
            return []
        hits = []
        for h in hashes:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def touch(self, ids: list[int]) -> None:
        for block_id in ids:
            self.blocks[block_id].refs += 1
            self.free.pop(block_id, None)

    def release(self, ids: list[int]) -> None:
        # Reversed, as vLLM: a request's tail blocks are evicted before its head blocks.
        freed = False
        for block_id in reversed(ids):
            block = self.blocks[block_id]
            block.refs -= 1
            if block.refs == 0:
                self.free[block_id] = None
                freed = True
        if freed and self.on_free is not None:
            self.on_free()

    def commit(self, block_id: int, h: bytes) -> bool:
        """Register a full block in the prefix cache; the first block cached under a hash keeps it."""
        if self.caching and h not in self.cached:
            block = self.blocks[block_id]
            self._uncache(block)
            block.hash = h
            self.cached[h] = block_id
            return True
        return False

    def commit_run(self, table: list[int], hashes: list[bytes], tokens: list[int], start: int,
                   salt: str | None = None) -> None:
        """Cache the full blocks `table[start:len(hashes)]` of a request whose token ids are `tokens`, and announce
        each run of newly cached blocks as one BlockStored with the request's token ids of those blocks and
        the hash of the block before them (vLLM's cache_full_blocks, v1/core/block_pool.py:261-346)."""
        run: list[int] = []
        for i in range(start, len(hashes)):
            if self.commit(table[i], hashes[i]):
                run.append(i)
                continue
            self._announce(run, hashes, tokens, salt)
            run = []
        self._announce(run, hashes, tokens, salt)

    def _announce(self, run: list[int], hashes: list[bytes], tokens: list[int], salt: str | None) -> None:
        if not run or self.events is None:
            return
        first, bs = run[0], self.block_size
        self.events.emit(stored([hashes[i] for i in run], hashes[first - 1] if first else None,
                                tokens[first * bs:(run[-1] + 1) * bs], bs, salt))

    def reset_cache(self) -> None:
        for block in self.blocks:
            block.hash = None
        self.cached.clear()
        if self.caching and self.events is not None:
            self.events.emit(AllBlocksCleared())       # block_pool.py:863-864

    def _uncache(self, block: Block) -> None:
        if block.hash is not None and self.cached.get(block.hash) == block.id:
            del self.cached[block.hash]
            if self.events is not None:
                self.events.emit(removed(block.hash))  # evicted: block_pool.py:611-624
        block.hash = None
