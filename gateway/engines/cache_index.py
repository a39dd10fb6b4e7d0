"""What one engine's prefix cache holds, as its KV events tell it (docs/protocol.md §10). Pure, no I/O.

vLLM's block hashes are seeded per process, so they are never compared with anything the gateway computes:
each stored block is given the gateway's own chained fingerprint (the same chain as
`turns/reuse/continuity.py`'s: blake2b-128 of the previous block's fingerprint and the block's token ids as
int64 little-endian), rebuilt from the event's token ids and its parent's fingerprint. A query then asks for a
conversation's own fingerprints, block by block.

What the index knows (`Knowledge`):
- COMPLETE: every event since the engine's start (seq 0) or its last cache reset was seen: a block absent is
  a block the engine does not hold.
- PARTIAL: events were lost (a gap in the sequence numbers, a late join, an engine restart seen after its first
  batch): the index was cleared then, so what it holds was stored since and not removed (a positive is good),
  but what it lacks may still be in the engine (a negative says nothing).
- UNKNOWN: nothing heard yet, or the connection dropped: until the next batch says whether anything was
  missed, nothing is trusted and the lease/TTL rules apply.
Events only say where KV may be: the token fingerprint still decides what may be reused, and a block the index
wrongly believes held costs a local turn time (the engine computes what it lacks), never correctness.
"""

from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass
from enum import StrEnum
from hashlib import blake2b

FINGERPRINT_BYTES = 16        # continuity.HASH_BYTES: the same chain (tests/unit/test_cache_index.py checks)
_ROOT = b""


class Knowledge(StrEnum):
    UNKNOWN = "unknown"
    PARTIAL = "partial"
    COMPLETE = "complete"


@dataclass(frozen=True)
class Stored:
    block_hashes: list[int | bytes]
    parent: int | bytes | None
    token_ids: list[int]
    block_size: int
    plain: bool = True            # no salt, no LoRA, the full-attention group: comparable with the gateway's chain


@dataclass(frozen=True)
class Removed:
    block_hashes: list[int | bytes]


@dataclass(frozen=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


def chain_step(parent: bytes, token_ids: list[int]) -> bytes:
    """One block's fingerprint after `parent`'s (b"" for the first block)."""
    return blake2b(parent + array("q", token_ids).tobytes(), digest_size=FINGERPRINT_BYTES).digest()


class CacheIndex:
    """The blocks one engine holds, by the gateway's fingerprints, fed in sequence-numbered batches."""

    def __init__(self) -> None:
        self.knowledge = Knowledge.UNKNOWN
        self.block_size: int | None = None
        self.last_seq: int | None = None
        self.gaps = 0                     # batches found missing (or an engine restart seen late)
        self.unchained = 0                # stored blocks whose parent was unknown: not indexed
        self._ours: dict[int | bytes, bytes] = {}        # vLLM's hash -> our fingerprint
        self._refs: Counter[int | bytes] = Counter()     # a hash stored twice (two copies) is removed twice
        self._held: Counter[bytes] = Counter()
        self._before_loss: Knowledge | None = None

    def __len__(self) -> int:
        return len(self._held)

    # -- feeding ------------------------------------------------------------------------------------------
    def apply(self, seq: int, events: list[Event]) -> None:
        """One batch. Its sequence number says whether anything was missed since the last one."""
        last, self.last_seq = self.last_seq, seq
        if last is None:
            self._reset(Knowledge.COMPLETE if seq == 0 else Knowledge.PARTIAL)
        elif seq == last + 1:
            if self.knowledge is Knowledge.UNKNOWN and self._before_loss is not None:
                self.knowledge = self._before_loss          # reconnected, nothing missed
        else:
            # A gap, or a number at or below the last (the engine restarted, its counter from 0; or a batch out
            # of order): what was missed may have removed anything. Start again from what comes next.
            self.gaps += 1
            self._reset(Knowledge.COMPLETE if seq == 0 else Knowledge.PARTIAL)
        self._before_loss = None
        for event in events:
            self._one(event)

    def lost(self) -> None:
        """The connection dropped: trust nothing until the next batch's number says what was missed."""
        if self.knowledge is not Knowledge.UNKNOWN:
            self._before_loss = self.knowledge
        self.knowledge = Knowledge.UNKNOWN

    def _one(self, event: Event) -> None:
        if isinstance(event, Stored):
            self._stored(event)
        elif isinstance(event, Removed):
            for h in event.block_hashes:
                self._removed(h)
        else:
            self._reset(Knowledge.COMPLETE)      # the engine's cache was reset: empty, and known to be

    def _stored(self, event: Stored) -> None:
        bs = event.block_size
        parent = _ROOT if event.parent is None else self._ours.get(event.parent)
        if not event.plain or parent is None or bs <= 0 or len(event.token_ids) != bs * len(event.block_hashes):
            self.unchained += len(event.block_hashes)
            return
        self.block_size = bs
        for i, h in enumerate(event.block_hashes):
            parent = chain_step(parent, event.token_ids[i * bs:(i + 1) * bs])
            old = self._ours.get(h)
            if old is not None and old != parent:        # a hash reused for other tokens: the old one is gone
                self._drop(h, old)
            self._ours[h] = parent
            self._refs[h] += 1
            self._held[parent] += 1

    def _removed(self, h: int | bytes) -> None:
        fp = self._ours.get(h)
        if fp is None:
            return
        self._refs[h] -= 1
        self._held[fp] -= 1
        if self._held[fp] <= 0:
            del self._held[fp]
        if self._refs[h] <= 0:
            del self._refs[h], self._ours[h]

    def _drop(self, h: int | bytes, fp: bytes) -> None:
        self._held[fp] -= self._refs.pop(h, 0)
        if self._held[fp] <= 0:
            del self._held[fp]
        del self._ours[h]

    def _reset(self, knowledge: Knowledge) -> None:
        self._ours.clear()
        self._refs.clear()
        self._held.clear()
        self.knowledge = knowledge

    # -- asking ------------------------------------------------------------------------------------------
    def leading(self, chain: bytes, block_size: int) -> int:
        """How many leading blocks of a conversation, given as its chained fingerprints (concatenated), the engine
        holds by what the events said (0 where the block sizes differ). Say nothing of `knowledge`."""
        if block_size != self.block_size:
            return 0
        n = len(chain) // FINGERPRINT_BYTES
        for i in range(n):
            if chain[i * FINGERPRINT_BYTES:(i + 1) * FINGERPRINT_BYTES] not in self._held:
                return i
        return n
