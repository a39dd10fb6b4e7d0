"""Token-prefix continuity: does the new prompt extend the tokens whose KV D holds? Pure functions, no I/O.

D's held sequence S (prompt + output ids) is kept as a fingerprint: a 128-bit chained hash per full block
(to find the longest common prefix at block granularity) and a 128-bit hash of exactly S[:R], where
R = the handle's `remote_num_tokens`. vLLM never checks tokens, only counts, so this is the only guard.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from hashlib import blake2b
from typing import Literal

HASH_BYTES = 16
VerdictKind = Literal["reuse", "partial", "full"]


def _tokens_bytes(ids: list[int]) -> bytes:
    return array("q", ids).tobytes()


def prefix_hash(ids: list[int], n: int) -> bytes:
    return blake2b(_tokens_bytes(ids[:n]), digest_size=HASH_BYTES).digest()


def block_hashes(ids: list[int], block_size: int, limit: int | None = None) -> list[bytes]:
    """Chained hashes of the leading full blocks: equal i-th hashes mean equal first (i+1)*block_size tokens."""
    count = len(ids) // block_size if limit is None else min(limit, len(ids) // block_size)
    out, previous = [], b""
    data = _tokens_bytes(ids[:count * block_size])
    width = block_size * 8
    for i in range(count):
        previous = blake2b(previous + data[i * width:(i + 1) * width], digest_size=HASH_BYTES).digest()
        out.append(previous)
    return out


@dataclass(frozen=True)
class Fingerprint:
    block_size: int
    held_tokens: int          # R
    block_hashes: bytes       # HASH_BYTES per full block of S
    prefix_hash: bytes        # hash of S[:R]

    @classmethod
    def of(cls, tokens: list[int], held_tokens: int, block_size: int) -> Fingerprint:
        held = min(held_tokens, len(tokens))
        return cls(block_size, held, b"".join(block_hashes(tokens, block_size)), prefix_hash(tokens, held))

    def common_blocks(self, ids: list[int], limit: int) -> int:
        """How many leading full blocks of `ids` equal those of S (at most `limit`)."""
        stored, computed = self.block_hashes, block_hashes(ids, self.block_size, limit)
        for i, digest in enumerate(computed):
            if stored[i * HASH_BYTES:(i + 1) * HASH_BYTES] != digest:
                return i
        return len(computed)


@dataclass(frozen=True)
class Verdict:
    kind: VerdictKind
    reason: str
    reused_tokens: int


def check(prompt: list[int], held: Fingerprint, *, partial_allowed: bool) -> Verdict:
    """reuse when prompt[:R] == S[:R]; else partial on the longest common whole-block prefix; else full."""
    r = held.held_tokens
    if r > 0 and len(prompt) >= r and prefix_hash(prompt, r) == held.prefix_hash:
        return Verdict("reuse", "continuous", r)
    reason = "prompt_shorter" if len(prompt) < r else "prefix_diverged"
    # The cut handle must lie inside D's KV (<= R) and leave P at least one prompt token to compute.
    limit = min(r, len(prompt) - 1) // held.block_size
    blocks = held.common_blocks(prompt, limit) if partial_allowed and limit > 0 else 0
    if blocks:
        return Verdict("partial", reason, blocks * held.block_size)
    return Verdict("full", reason, 0)
