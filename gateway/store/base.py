"""The conversation store's contract: keys, the opaque record, the turn protocol, the prefix index, the one error.

The store keeps, per (tenant, session), one opaque `Conversation` record, at most one engine handle, and two
turn counters. It never interprets engines or tokens: callers compute everything in the record. The one
thing it reads from a record is where its fingerprint's chain of block hashes reaches D's held tokens
(`index_hash`), to keep a per-tenant prefix index of the conversations whose handle is waiting to be claimed.

Errors:
    StoreUnavailableError   the backing store cannot answer (down, timeout, undecodable data): the gateway
                            serves the turn stateless instead of failing it. A write whose answer was lost
                            may have happened: a handle it carried is then not released (it may be claimed).
    ValueError              a key that breaks the rules below (a caller bug, never retried).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from hashlib import blake2b
from typing import Any, Literal, NamedTuple, Protocol

import msgspec

DEFAULT_CONVERSATION_TTL_S = 86_400.0
DEFAULT_INFLIGHT_TIMEOUT_S = 600.0
MAX_SESSION_CHARS = 256
INDEX_HASH_BYTES = 16  # one chained block hash in `Conversation.block_hashes`
DEFAULT_MAX_HOLDERS = 8  # holders one prefix lookup returns at most

MAX_RESPONSE_ID_CHARS = 128

# 64 an API key's tenant may have, and a model's scope (config.model_scope) where several models are served
_TENANT_RE = re.compile(r"[A-Za-z0-9_.-]{1,80}")
_RESPONSE_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,%d}" % MAX_RESPONSE_ID_CHARS)


class StoreUnavailableError(Exception):
    """The store did not answer; the caller should fall back to stateless PD."""


class ConversationKey(NamedTuple):
    tenant: str  # 1..80 chars of [A-Za-z0-9_.-]
    session: str  # any string up to 256 chars


def check_key(key: ConversationKey) -> None:
    """Raise ValueError for a key the store refuses (checked by every store before any I/O)."""
    check_tenant(key.tenant)
    if not isinstance(key.session, str) or len(key.session) > MAX_SESSION_CHARS:
        raise ValueError(f"session must be a str of at most {MAX_SESSION_CHARS} chars")


def check_tenant(tenant: object) -> None:
    if not isinstance(tenant, str) or not _TENANT_RE.fullmatch(tenant):
        raise ValueError(f"tenant must be 1..80 chars of [A-Za-z0-9_.-], got {tenant!r}")


def session_digest(session: str) -> str:
    """The session id as the stores name it: 32 hex chars for any id (':', '{', '*', surrogates, any length)."""
    return blake2b(session.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


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
    block_hashes: bytes = b""  # 16 bytes per full block, by the caller, chained (the i-th fixes those before)
    prefix_hash: bytes = b""
    handle_note: str = ""  # why the last turn stored no handle (a reason code), if it had none
    answers: list[Answer] = []  # bounded by the caller; empty unless history_tokens is "generated"
    created_at: float = 0.0
    updated_at: float = 0.0


class StoredResponse(msgspec.Struct, kw_only=True):
    """A Responses API response kept for `previous_response_id` and `GET /v1/responses/{id}`, per tenant, for
    the conversation TTL; opaque to the store, immutable once put (a later turn puts a response of its own)."""

    session: str  # the conversation (the response chain) it belongs to, within its tenant
    model: str = ""
    ids: bytes = b""  # D's exact tokens after this response, prompt + output, uint32 little-endian; b"": unknown
    messages: bytes = b""  # the conversation so far as chat messages (a JSON array), this answer included
    context: bytes = b""  # a digest of the rendering's other inputs (tools, instructions)
    body: bytes = b""  # the response object as its client got it (JSON)
    created_at: float = 0.0


def response_meta(response: StoredResponse) -> StoredResponse:
    """The response without its bulk: what `get_response(bulk=False)` returns."""
    return msgspec.structs.replace(response, ids=b"", messages=b"", body=b"")


def check_response_id(response_id: object) -> None:
    if not isinstance(response_id, str) or not _RESPONSE_ID_RE.fullmatch(response_id):
        raise ValueError(f"response id must be 1..{MAX_RESPONSE_ID_CHARS} chars of [A-Za-z0-9_-]")


HandleState = Literal["claimed", "none", "expired", "in_flight", "evicted"]
HolderState = Literal["idle", "none", "expired", "in_flight"]  # idle: a live handle, no turn begun since


def index_hash(record: Conversation) -> bytes | None:
    """The record's prefix-index entry: the chained hash of D's held tokens S at floor(R / bs) whole blocks
    (R = held_tokens), which equals a later prompt's own hash there exactly when both share those blocks.
    None when R is under one block or the record carries no such hash."""
    if record.block_size <= 0:
        return None
    blocks = record.held_tokens // record.block_size
    end = blocks * INDEX_HASH_BYTES
    if blocks < 1 or len(record.block_hashes) < end:
        return None
    return record.block_hashes[end - INDEX_HASH_BYTES:end]


class TurnStart(msgspec.Struct):
    turn: int  # this turn's number (1 for a new conversation)
    record: Conversation | None  # None: new conversation
    handle: dict[str, Any] | None  # D's handle, now owned by this turn alone (only when claimed)
    handle_state: HandleState  # in_flight: an earlier turn started and has not finished; evicted: see evict_handle
    handle_expires_at: float = 0.0  # when the claimed handle dies (0.0 unless claimed): what put_back restores


class Holder(msgspec.Struct):
    """A conversation found by a prefix lookup: a candidate only, until the caller verifies and claims it."""

    key: ConversationKey
    turn: int  # the turn that wrote `record`; claim with begin_found_turn(key, turn, now)
    blocks: int  # the indexed prefix it was found at, in whole blocks of the prompt
    record: Conversation
    state: HolderState  # at lookup time; the claim re-checks it


class ConversationStore(Protocol):
    kind: str  # "memory" | "redis"

    async def begin_turn(self, key: ConversationKey, now: float) -> TurnStart:
        """Start a turn: bump the started counter and claim the handle if one is live (single use)."""
        ...

    async def begin_found_turn(self, key: ConversationKey, turn: int, now: float) -> TurnStart | None:
        """Start a turn on a conversation a prefix lookup found, only if it is still as found: its record is the
        one turn `turn` wrote, no turn began since, and its handle is live. Then claim the handle exactly as
        `begin_turn` does; otherwise change nothing and return None (try another holder, or start anew)."""
        ...

    async def find_by_prefix(
        self, tenant: str, block_hashes: Sequence[bytes], prompt_tokens: int, now: float,
        limit: int = DEFAULT_MAX_HOLDERS,
    ) -> list[Holder]:
        """Conversations of `tenant` whose index entry is one of `block_hashes` (a prompt's chained block
        hashes, first block first), longest prefix first, in one round trip, claiming nothing. Within one
        prefix, the handle that expires soonest comes first; holders of more than `prompt_tokens` tokens (no
        prompt that short can extend them) are skipped; at most `limit` holders."""
        ...

    async def find_or_begin(
        self, tenant: str, block_hashes: Sequence[bytes], prompt_tokens: int, now: float, new: ConversationKey,
        limit: int = DEFAULT_MAX_HOLDERS,
    ) -> tuple[list[Holder], TurnStart | None]:
        """`find_by_prefix`, and when it finds no holder at all, `begin_turn(new, now)` too, in one round trip
        (a sessionless turn's new conversation; `new` is a key of `tenant`): (holders, None) or ([], its start)."""
        ...

    async def finish_turn(
        self,
        key: ConversationKey,
        turn: int,
        record: Conversation,
        handle: dict[str, Any] | None,
        handle_expires_at: float,
        now: float,
        unchanged_blocks: int = 0,
    ) -> bool:
        """Store the turn's outcome only if no newer turn began; False: nothing changed, release `handle`.

        `unchanged_blocks`: a hint that the record's first block hashes are those of the record the turn began
        with (its fingerprint verified them), so a store may send only the rest; the stored record is `record`
        exactly either way: a store that sends the rest checks that the hashes it holds end the unchanged ones
        with the record's (chained hashes: then all of them are the record's), else it sends every hash.

        With a handle, the record's `index_hash` is indexed for `key.tenant` in the same atomic step, live as
        long as the handle; the conversation's previous entry goes (a claim or a delete removes it too)."""
        ...

    async def put_back(self, key: ConversationKey, start: TurnStart, now: float) -> bool:
        """Undo the begin that returned `start`, for a turn that then did not run (refused, or its client gone
        before it began), only if no other turn began since: the counter goes back, a claimed handle returns
        with its expiry and (while live) its prefix-index entry, an eviction is reported again, as if the turn
        had never begun. False: nothing changed (a later turn began, or this one finished or was deleted); the
        caller then releases the claimed handle. Not restored: a dead handle the begin dropped (the next turn
        sees no handle rather than an expired one) and the in-flight clock of an earlier turn still running."""
        ...

    async def evict_handle(self, key: ConversationKey, turn: int) -> dict[str, Any] | None:
        """Take the live unclaimed handle away only if it is still the one `turn` stored (no later turn began),
        so D's blocks can be freed without a turn reading them; the next turn then begins with handle_state
        "evicted". Returns the handle (the caller releases D's blocks), else None: nothing changed."""
        ...

    async def get(self, key: ConversationKey) -> tuple[Conversation, dict[str, Any] | None, int] | None:
        """(record, live handle left unclaimed, turn that wrote the record), or None without a record."""
        ...

    async def delete(self, key: ConversationKey) -> dict[str, Any] | None:
        """Remove everything; return the live unclaimed handle so the caller can release D's blocks."""
        ...

    async def put_response(self, tenant: str, response_id: str, response: StoredResponse) -> None:
        """Keep `response` under (tenant, response_id) for the conversation TTL, replacing nothing else. Ids are
        the caller's (random, unguessable); a tenant never reads or deletes another tenant's responses."""
        ...

    async def get_response(self, tenant: str, response_id: str, bulk: bool = True) -> StoredResponse | None:
        """The response `put_response` kept under (tenant, response_id), None when unknown or expired.
        `bulk=False`: without its ids, messages and body (b""), read at the cost of its small fields alone (a
        caller that holds the bulk already only needs to know the response still exists)."""
        ...

    async def delete_response(self, tenant: str, response_id: str) -> bool:
        """Forget the response; False when there was none. The conversation it belongs to is left alone."""
        ...

    async def replicas(self, replica: str, now: float, ttl_s: float) -> int:
        """Say gateway replica `replica` is alive until `now + ttl_s` and count the replicas alive at `now`,
        itself included, in one round trip. Each replica pins at most D's pin budget divided by this count, so
        the budget holds across replicas without a key that spans tenants on a turn's path (a tenant's keys stay
        in its slot). The embedded store is one process's: it counts the replicas that beat on it."""
        ...

    async def ping(self) -> bool: ...

    async def close(self) -> None: ...
