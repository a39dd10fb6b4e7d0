"""Which conversation a request without a session id continues: a pure decision over the store's prefix
lookup, no I/O (the claims are in `sessionless.py`).

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

from collections.abc import Callable, Sequence
from enum import StrEnum

from gateway.store import Conversation, Holder
from gateway.turns.continuity import Fingerprint, block_hashes, check


class How(StrEnum):
    """How a turn's conversation was found: the `X-PD-Conversation` header and the lookups metric's label."""

    SESSION = "session"  # the client named it
    PREFIX = "prefix"    # its tokens did: the prompt extends a stored conversation's held tokens
    NEW = "new"          # neither: a new conversation under a generated key


def prompt_hashes(prompt_ids: list[int], block_size: int) -> list[bytes]:
    """The prompt's chained whole-block hashes, first block first: what the store's index is keyed by."""
    return block_hashes(prompt_ids, block_size)


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
