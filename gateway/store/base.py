"""The conversation store's contract: keys, the opaque record, the turn protocol, the one error.

The store keeps, per (tenant, session), one opaque `Conversation` record, at most one engine handle, and two
turn counters. It never interprets engines or tokens: callers compute everything in the record.

Errors:
    StoreUnavailableError   the backing store cannot answer (down, timeout, undecodable data): the gateway
                            serves the turn stateless instead of failing it.
    ValueError              a key that breaks the rules below (a caller bug, never retried).
"""

from __future__ import annotations

import re
from typing import Any, Literal, NamedTuple, Protocol

import msgspec

DEFAULT_CONVERSATION_TTL_S = 86_400.0
DEFAULT_INFLIGHT_TIMEOUT_S = 600.0
MAX_SESSION_CHARS = 256

_TENANT_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class StoreUnavailableError(Exception):
    """The store did not answer; the caller should fall back to stateless PD."""


class ConversationKey(NamedTuple):
    tenant: str  # 1..64 chars of [A-Za-z0-9_.-]
    session: str  # any string up to 256 chars


def check_key(key: ConversationKey) -> None:
    """Raise ValueError for a key the store refuses (checked by every store before any I/O)."""
    if not isinstance(key.tenant, str) or not _TENANT_RE.fullmatch(key.tenant):
        raise ValueError(f"tenant must be 1..64 chars of [A-Za-z0-9_.-], got {key.tenant!r}")
    if not isinstance(key.session, str) or len(key.session) > MAX_SESSION_CHARS:
        raise ValueError(f"session must be a str of at most {MAX_SESSION_CHARS} chars")


class Answer(msgspec.Struct, array_like=True):
    """One past answer as D generated it (for `history_tokens: generated`); opaque to the store."""

    chars: int  # length of the answer's text
    text_hash: bytes
    ids: list[int]


class Conversation(msgspec.Struct, kw_only=True):
    """Everything the store keeps about a conversation except the handle; opaque to the store."""

    decode_engine: str = ""  # which D holds the KV
    prefill_engine: str = ""  # which P served the last turn
    model: str = ""
    block_size: int = 0
    num_tokens: int = 0  # len(S)
    held_tokens: int = 0  # R
    block_hashes: bytes = b""  # 16 bytes per full block, computed by the caller
    prefix_hash: bytes = b""
    output_ids: list[int] = []  # bounded by the caller
    output_text_hash: bytes = b""
    handle_note: str = ""  # why the last turn stored no handle (a reason code), if it had none
    answers: list[Answer] = []  # bounded by the caller; empty unless history_tokens is "generated"
    created_at: float = 0.0
    updated_at: float = 0.0


HandleState = Literal["claimed", "none", "expired", "in_flight"]


class TurnStart(msgspec.Struct):
    turn: int  # this turn's number (1 for a new conversation)
    record: Conversation | None  # None: new conversation
    handle: dict[str, Any] | None  # D's handle, now owned by this turn alone (only when claimed)
    handle_state: HandleState  # in_flight: an earlier turn started and has not finished


class ConversationStore(Protocol):
    kind: str  # "memory" | "redis"

    async def begin_turn(self, key: ConversationKey, now: float) -> TurnStart:
        """Start a turn: bump the started counter and claim the handle if one is live (single use)."""
        ...

    async def finish_turn(
        self,
        key: ConversationKey,
        turn: int,
        record: Conversation,
        handle: dict[str, Any] | None,
        handle_expires_at: float,
        now: float,
    ) -> bool:
        """Store the turn's outcome only if no newer turn began; False: nothing changed, release `handle`."""
        ...

    async def get(self, key: ConversationKey) -> tuple[Conversation, dict[str, Any] | None, int] | None:
        """(record, live handle left unclaimed, turn that wrote the record), or None without a record."""
        ...

    async def delete(self, key: ConversationKey) -> dict[str, Any] | None:
        """Remove everything; return the live unclaimed handle so the caller can release D's blocks."""
        ...

    async def ping(self) -> bool: ...

    async def close(self) -> None: ...
