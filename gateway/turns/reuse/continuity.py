"""Token-prefix continuity: does the new prompt extend the tokens whose KV D holds? Pure functions, no I/O.

D's held sequence S (prompt + output ids) is kept as a fingerprint: a 128-bit chained hash per full block
(to find the longest common prefix at block granularity) and a 128-bit hash of exactly S[:R], where
R = how many tokens the handle covers. vLLM never checks tokens, only counts, so this is the only guard.

No I/O; one process-local memo (`HeldPrefixes`): the bytes of S[:R] and the hash state after them, for the
sequences this process fingerprinted. A continuous turn then compares bytes instead of hashing its history,
and extends the hash instead of recomputing it. A miss (another replica, a restart) only means hashing.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any, Literal

from gateway.turns.intake.pieces import TokenIds

HASH_BYTES = 16
TOKEN_BYTES = 8               # ids are hashed as int64 little-endian
VerdictKind = Literal["reuse", "partial", "full"]


def _tokens_bytes(ids: list[int], n: int | None = None) -> bytes:
    """The first n ids as int64 bytes; free when the renderer already carried them (`TokenIds`)."""
    cached = getattr(ids, "as_bytes", None)
    if cached is not None:
        return cached if n is None or n >= len(ids) else cached[:n * TOKEN_BYTES]
    return array("q", ids if n is None else ids[:n]).tobytes()


def prefix_hash(ids: list[int], n: int) -> bytes:
    return blake2b(_tokens_bytes(ids, n), digest_size=HASH_BYTES).digest()


DEFAULT_MEMO_BYTES = 128 * 1024 * 1024


class HeldPrefixes:
    """prefix_hash(S, R) → (the bytes of S[:R], the blake2b state after them), least recently used out first."""

    def __init__(self, max_bytes: int = DEFAULT_MEMO_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, tuple[bytes, Any]] = OrderedDict()
        self._bytes = 0

    def get(self, digest: bytes) -> tuple[bytes, Any] | None:
        entry = self._entries.get(digest)
        if entry is not None:
            self._entries.move_to_end(digest)
        return entry

    def put(self, digest: bytes, data: bytes, state: Any) -> None:
        if digest in self._entries or len(data) > self.max_bytes:
            return
        self._entries[digest] = (data, state)
        self._bytes += len(data)
        while self._bytes > self.max_bytes:
            _, (old, _) = self._entries.popitem(last=False)
            self._bytes -= len(old)

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0


HELD = HeldPrefixes()


def _extends(prompt: list[int], r: int, digest: bytes) -> bool:
    """prompt[:r] == S[:r] for the S whose prefix hash is `digest`: a byte compare when this process holds S's
    bytes (equal bytes under that digest: the hash check's own assumption), else the hash."""
    data = _tokens_bytes(prompt, r)
    entry = HELD.get(digest)
    if entry is not None and len(entry[0]) == len(data):
        return data == entry[0]
    return blake2b(data, digest_size=HASH_BYTES).digest() == digest


def _held_hash(tokens: list[int], held: int, previous: Fingerprint | None, verified_tokens: int) -> bytes:
    """prefix_hash(tokens, held), extending `previous`'s hash state when its S[:R] is verified equal to ours."""
    data = _tokens_bytes(tokens, held)
    state = None
    if previous is not None and 0 < previous.held_tokens <= min(verified_tokens, held):
        entry = HELD.get(previous.prefix_hash)
        if entry is not None and len(entry[0]) == previous.held_tokens * TOKEN_BYTES:
            state = entry[1].copy()
            state.update(data[len(entry[0]):])
    if state is None:
        state = blake2b(data, digest_size=HASH_BYTES)
    digest = state.digest()
    HELD.put(digest, data, state)
    return digest


def block_hashes(ids: list[int], block_size: int, limit: int | None = None) -> list[bytes]:
    """Chained hashes of the leading full blocks: equal i-th hashes mean equal first (i+1)*block_size tokens."""
    chain = _chain(ids, block_size, limit)
    return [chain[i:i + HASH_BYTES] for i in range(0, len(chain), HASH_BYTES)]


def chain_bytes(ids: list[int], block_size: int, limit: int | None = None, known: bytes = b"") -> bytes:
    """`_chain`, for the prefix lookup's memo of recent prompts (turns/reuse/lookup.py)."""
    return _chain(ids, block_size, limit, known)


def _chain(ids: list[int], block_size: int, limit: int | None = None, known: bytes = b"") -> bytes:
    """block_hashes, concatenated. `known`: the hashes of leading blocks already established equal to these
    ids' own; the chain continues from there, so a turn hashes only its new blocks."""
    count = len(ids) // block_size if limit is None else min(limit, len(ids) // block_size)
    start = min(len(known) // HASH_BYTES, count)
    out = [known[:start * HASH_BYTES]]
    previous = known[(start - 1) * HASH_BYTES:start * HASH_BYTES] if start else b""
    width = block_size * TOKEN_BYTES
    data = _tokens_bytes(ids, count * block_size)
    for i in range(start, count):
        previous = blake2b(previous + data[i * width:(i + 1) * width], digest_size=HASH_BYTES).digest()
        out.append(previous)
    return b"".join(out)


def held_fingerprint(rendered: list[int], engine_prompt: list[int] | None, output: list[int], held_tokens: int,
                     block_size: int, *, previous: Fingerprint | None = None,
                     verified_tokens: int = 0) -> tuple[int, Fingerprint]:
    """(len(S), fingerprint of S) for D's held tokens S = D's prompt ids + its output ids.

    When D's prompt is the rendered one (the usual case) S reuses the rendered ids' bytes, and the blocks the
    continuity check verified against `previous` (the first `verified_tokens`) keep their hashes: the cost is
    the new blocks, not the conversation."""
    if engine_prompt is None:
        tokens: list[int] = list(output)
    elif isinstance(rendered, TokenIds) and (engine_prompt is rendered or engine_prompt == rendered):
        held = _Bytes(rendered.as_bytes + array("q", output).tobytes())     # S as bytes only: no list copy
        return len(held), Fingerprint.of(held, held_tokens, block_size, previous=previous,  # type: ignore[arg-type]
                                         verified_tokens=verified_tokens)
    else:
        tokens = engine_prompt + output
    return len(tokens), Fingerprint.of(tokens, held_tokens, block_size)


class _Bytes:
    """A token sequence known only as its int64 bytes: what hashing needs, without a list of ints."""
    __slots__ = ("as_bytes",)

    def __init__(self, as_bytes: bytes) -> None:
        self.as_bytes = as_bytes

    def __len__(self) -> int:
        return len(self.as_bytes) // TOKEN_BYTES


@dataclass(frozen=True)
class Fingerprint:
    block_size: int
    held_tokens: int          # R
    block_hashes: bytes       # HASH_BYTES per full block of S
    prefix_hash: bytes        # hash of S[:R]

    @classmethod
    def of(cls, tokens: list[int], held_tokens: int, block_size: int, *,
           previous: Fingerprint | None = None, verified_tokens: int = 0) -> Fingerprint:
        """`previous` and `verified_tokens`: an earlier fingerprint whose sequence is known to equal `tokens` on
        the first `verified_tokens` (a reuse the continuity check proved): its block hashes are carried over."""
        held = min(held_tokens, len(tokens))
        known = b""
        if previous is not None and previous.block_size == block_size:
            known = previous.block_hashes[:(verified_tokens // block_size) * HASH_BYTES]
        return cls(block_size, held, _chain(tokens, block_size, known=known),
                   _held_hash(tokens, held, previous, verified_tokens))

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
    if r > 0 and len(prompt) >= r and _extends(prompt, r, held.prefix_hash):
        return Verdict("reuse", "continuous", r)
    # The cut handle must lie inside D's KV (<= R) and leave P at least one prompt token to compute.
    limit = min(r, len(prompt) - 1) // held.block_size if partial_allowed else 0
    # The reason names the first cause: a shorter prompt is `prompt_shorter` only while it agrees with S up
    # to its last whole block (a regenerate, a truncated history; the generation prompt at its end may differ
    # from what S holds there); one that differs earlier (a changed system prompt, an edit) diverged first.
    whole = len(prompt) // held.block_size if len(prompt) < r else 0
    common = held.common_blocks(prompt, max(limit, whole)) if max(limit, whole) > 0 else 0
    reason = "prompt_shorter" if len(prompt) < r and common >= whole - 1 else "prefix_diverged"
    blocks = min(common, limit)
    if blocks:
        return Verdict("partial", reason, blocks * held.block_size)
    return Verdict("full", reason, 0)
