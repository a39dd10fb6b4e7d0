"""Which conversation a request without a session id continues: a pure decision over the store's prefix
lookup, no I/O (the claims are in `sessionless.py`); one process-local memo, of recent prompts' block hashes.

The store's prefix index finds candidates: conversations whose D holds tokens S that share the prompt's
leading whole blocks up to floor(R/bs), R = the tokens D's handle covers. A candidate is only a hint. This
module keeps a holder only when the prompt extends its **whole** held sequence, S[:R] (continuity's `reuse`
verdict on the exact tokens, never a partial one), its handle is live and unclaimed, and its model is the
request's. A handle is single use: a conversation that merely shares a prefix with this prompt (the same
system prompt, a branch, a regenerate of its last turn) still needs its handle for its own next turn, so it
is never taken; that shared prefix is P's own prefix cache's job. Every holder that passes holds exactly the
KV this prompt needs, so any of them will do: the first one the caller manages to claim wins.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from enum import StrEnum

from gateway.store import Conversation, Holder
from gateway.turns.reuse.continuity import HASH_BYTES, TOKEN_BYTES, Fingerprint, chain_bytes, check

DEFAULT_CHAINS_BYTES = 64 * 1024 * 1024
CHAINS_PER_START = 16      # recent prompts kept per first block (a shared system prompt puts many there)


class How(StrEnum):
    """How a turn's conversation was found: the `X-PD-Conversation` header and the lookups metric's label."""

    SESSION = "session"  # the client named it
    PREFIX = "prefix"    # its tokens did: the prompt extends a stored conversation's held tokens
    NEW = "new"          # neither: a new conversation under a generated key


def prompt_hashes(prompt_ids: list[int], block_size: int) -> list[bytes]:
    """The prompt's chained whole-block hashes, first block first: what the store's index is keyed by."""
    return CHAINS.hashes(prompt_ids, block_size)


class PromptChains:
    """The chained block hashes of the prompts this process looked up lately, so that the next turn of a
    conversation, whose prompt starts with the last one's, hashes only its new blocks instead of all of them
    (the chain is O(prompt) blake2b calls: most of a lookup's cost). Found by the first block's hash; a hit
    is proven by comparing the bytes, never assumed, so a stale or colliding entry only means more hashing.
    Least recently used first blocks go first beyond `max_bytes`."""

    def __init__(self, max_bytes: int = DEFAULT_CHAINS_BYTES) -> None:
        self.max_bytes = max_bytes
        self._by_start: OrderedDict[bytes, list[tuple[bytes, bytes]]] = OrderedDict()   # → [(tokens, chain)]
        self._bytes = 0

    def hashes(self, ids: list[int], block_size: int) -> list[bytes]:
        width = block_size * TOKEN_BYTES
        data = _whole_blocks(ids, block_size)
        if not data:
            return []
        start = chain_bytes(ids, block_size, limit=1)
        chain = chain_bytes(ids, block_size, known=self._known(start, data, width))
        self._put(start, data, chain)
        return [chain[i:i + HASH_BYTES] for i in range(0, len(chain), HASH_BYTES)]

    def _known(self, start: bytes, data: bytes, width: int) -> bytes:
        """The longest remembered chain of whole blocks this prompt's own begin with (compared as bytes)."""
        best = b""
        for tokens, chain in self._by_start.get(start, ()):
            n = min(len(tokens), len(data))
            if n // width * HASH_BYTES > len(best) and (
                    data.startswith(tokens) if len(tokens) <= len(data) else tokens.startswith(data)):
                best = chain[:n // width * HASH_BYTES]
        return best

    def _put(self, start: bytes, data: bytes, chain: bytes) -> None:
        if len(data) > self.max_bytes:
            return
        entries = self._by_start.pop(start, [])
        kept = [(t, c) for t, c in entries if not data.startswith(t)]      # earlier turns of this prompt go
        self._bytes -= sum(len(t) + len(c) for t, c in entries) - sum(len(t) + len(c) for t, c in kept)
        kept.insert(0, (data, chain))
        for t, c in kept[CHAINS_PER_START:]:
            self._bytes -= len(t) + len(c)
        self._by_start[start] = kept[:CHAINS_PER_START]
        self._bytes += len(data) + len(chain)
        while self._bytes > self.max_bytes and self._by_start:
            _, old = self._by_start.popitem(last=False)
            self._bytes -= sum(len(t) + len(c) for t, c in old)

    def clear(self) -> None:
        self._by_start.clear()
        self._bytes = 0


CHAINS = PromptChains()


def _whole_blocks(ids: list[int], block_size: int) -> bytes:
    """The ids of the prompt's whole blocks as int64 bytes (free when the renderer carried them)."""
    n = len(ids) // block_size * block_size
    cached = getattr(ids, "as_bytes", None)
    return cached[:n * TOKEN_BYTES] if cached is not None else array("q", ids[:n]).tobytes()


def claimable(prompt_ids: list[int], model: str, holders: Sequence[Holder],
              decode_ok: Callable[[str], bool] = lambda engine: True) -> list[Holder]:
    """The holders this prompt may claim, in the order to try them (the store's: longest prefix first)."""
    return [h for h in holders
            if h.state == "idle" and h.record.model == model and decode_ok(h.record.decode_engine)
            and extends(prompt_ids, h.record)]


def extends(prompt_ids: list[int], record: Conversation) -> bool:
    """prompt[:R] == S[:R] for the tokens S the record's D holds: the same check a session turn plans by."""
    if record.held_tokens <= 0 or record.block_size <= 0:
        return False
    held = Fingerprint(record.block_size, record.held_tokens, record.block_hashes, record.prefix_hash)
    return check(prompt_ids, held, partial_allowed=False).kind == "reuse"
