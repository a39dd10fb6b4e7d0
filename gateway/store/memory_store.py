"""The embedded store: one process, one event loop, same semantics as Redis.

No method awaits between reading and writing an entry, so every operation is atomic on its loop, which
is what makes the single-use claim hold here. Records and handles are kept msgpack-encoded, exactly as in
Redis, so both stores hand back equal (and unaliased) values.

The prefix index lives beside the entries (memory_index.py); each entry remembers the hash it is filed under.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .base import (
    DEFAULT_CONVERSATION_TTL_S,
    DEFAULT_INFLIGHT_TIMEOUT_S,
    DEFAULT_MAX_HOLDERS,
    Conversation,
    ConversationKey,
    HandleState,
    Holder,
    HolderState,
    TurnStart,
    check_key,
    check_tenant,
    index_hash,
)
from .codec import decode_handle, decode_record, encode_handle, encode_record
from .memory_index import PrefixIndex
from .memory_responses import MemoryResponses, ResponseMethods

DEFAULT_MAX_CONVERSATIONS = 100_000


@dataclass
class _Entry:
    record: bytes | None = None
    handle: bytes | None = None
    handle_expires_at: float = 0.0
    started: int = 0
    finished: int = 0
    started_at: float = 0.0
    expires_at: float = 0.0  # the whole conversation's TTL, on the store's clock
    held: int = 0  # the record's held_tokens, for lookups
    indexed: bytes | None = None  # this conversation's prefix-index entry, if it has one
    evicted: int = 0  # the finished turn whose handle evict_handle took (0: none); reported once


class _ReplicaBeats:
    """`ConversationStore.replicas` on one process's store: the replicas that beat on this very object."""

    async def replicas(self, replica: str, now: float, ttl_s: float) -> int:
        beats: dict[str, float] = self.__dict__.setdefault("_replica_beats", {})   # replica -> alive until
        beats[replica] = now + ttl_s
        for gone in [r for r, until in beats.items() if until < now]:
            del beats[gone]
        return len(beats)


class _FindOrBegin:
    """The lookup and a new conversation's begin: one step here as in the Redis store's one round trip."""

    async def find_or_begin(
        self, tenant: str, block_hashes: Sequence[bytes], prompt_tokens: int, now: float, new: ConversationKey,
        limit: int = DEFAULT_MAX_HOLDERS,
    ) -> tuple[list[Holder], TurnStart | None]:
        if new.tenant != tenant:
            raise ValueError("find_or_begin: the new conversation must be the tenant's")
        holders = await self.find_by_prefix(tenant, block_hashes, prompt_tokens, now, limit)  # type: ignore[attr-defined]
        return holders, None if holders else await self.begin_turn(new, now)  # type: ignore[attr-defined]


class _Filing:
    """Each live handle's conversation filed in the prefix index (`self._index`) under its record's hash."""

    def _file(self, key: ConversationKey, entry: _Entry, record: Conversation, expires_at: float,
              now: float) -> None:
        """File the conversation in the prefix index under its record's hash, while its handle is live."""
        digest = index_hash(record) if expires_at > now else None
        if digest is None:
            return
        entry.indexed = digest
        self._index.file(key, digest, expires_at, now)  # type: ignore[attr-defined]

    def _unindex(self, key: ConversationKey, entry: _Entry) -> None:
        if entry.indexed is None:
            return
        self._index.unfile(key, entry.indexed)  # type: ignore[attr-defined]
        entry.indexed = None


class MemoryConversationStore(ResponseMethods, _ReplicaBeats, _FindOrBegin, _Filing):
    kind = "memory"

    def __init__(
        self,
        conversation_ttl_s: float = DEFAULT_CONVERSATION_TTL_S,
        max_conversations: int = DEFAULT_MAX_CONVERSATIONS,
        *,
        inflight_timeout_s: float = DEFAULT_INFLIGHT_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.conversation_ttl_s = conversation_ttl_s
        self.max_conversations = max_conversations
        self.inflight_timeout_s = inflight_timeout_s
        self._clock = clock
        # Ordered by last write; with one TTL for all, the front is also the first to expire.
        self._entries: OrderedDict[ConversationKey, _Entry] = OrderedDict()
        self._index = PrefixIndex()
        self._responses = MemoryResponses(conversation_ttl_s, clock)

    async def begin_turn(self, key: ConversationKey, now: float) -> TurnStart:
        check_key(key)
        entry = self._live(key) or _Entry()
        handle, expires_at = None, 0.0
        state: HandleState
        if entry.handle is not None:
            state = "claimed" if entry.handle_expires_at > now else "expired"
            if state == "claimed":
                handle, expires_at = entry.handle, entry.handle_expires_at
            entry.handle, entry.handle_expires_at = None, 0.0
            self._unindex(key, entry)  # claimed or dead: nothing left for a lookup to find
        elif entry.started > entry.finished and now - entry.started_at < self.inflight_timeout_s:
            state = "in_flight"
        elif entry.evicted and entry.evicted == entry.finished == entry.started:
            state = "evicted"
        else:
            state = "none"
        entry.started += 1
        entry.started_at = now
        entry.evicted = 0
        self._write(key, entry)
        return TurnStart(
            turn=entry.started,
            record=decode_record(entry.record) if entry.record is not None else None,
            handle=decode_handle(handle) if handle is not None else None,
            handle_state=state,
            handle_expires_at=expires_at,
        )

    async def begin_found_turn(self, key: ConversationKey, turn: int, now: float) -> TurnStart | None:
        check_key(key)
        entry = self._live(key)
        if (entry is None or entry.record is None or entry.finished != turn or entry.started != turn
                or entry.handle is None or entry.handle_expires_at <= now):
            return None  # moved on, claimed, in flight or expired since the lookup: leave it alone
        handle, record, expires_at = entry.handle, entry.record, entry.handle_expires_at
        entry.handle, entry.handle_expires_at = None, 0.0
        self._unindex(key, entry)
        entry.started += 1
        entry.started_at = now
        self._write(key, entry)
        return TurnStart(turn=entry.started, record=decode_record(record), handle=decode_handle(handle),
                         handle_state="claimed", handle_expires_at=expires_at)

    async def find_by_prefix(
        self, tenant: str, block_hashes: Sequence[bytes], prompt_tokens: int, now: float,
        limit: int = DEFAULT_MAX_HOLDERS,
    ) -> list[Holder]:
        check_tenant(tenant)
        holders: list[Holder] = []
        for blocks in range(len(block_hashes), 0, -1):
            for key in self._index.live(tenant, block_hashes[blocks - 1], now, limit):
                entry = self._live(key)
                if entry is None or entry.record is None or entry.held > prompt_tokens:
                    continue
                holders.append(Holder(key, entry.finished, blocks, decode_record(entry.record), _state(entry, now)))
                if len(holders) >= limit:
                    return holders
        return holders

    async def finish_turn(
        self,
        key: ConversationKey,
        turn: int,
        record: Conversation,
        handle: dict[str, Any] | None,
        handle_expires_at: float,
        now: float,
        unchanged_blocks: int = 0,   # a hint for stores that send hashes over a wire: the whole record is kept here
    ) -> bool:
        check_key(key)
        record_blob = encode_record(record)
        handle_blob = encode_handle(handle) if handle is not None else None
        entry = self._live(key)
        if entry is None or entry.started != turn or entry.finished >= turn:
            return False
        entry.record, entry.finished, entry.held, entry.evicted = record_blob, turn, record.held_tokens, 0
        entry.handle = handle_blob
        entry.handle_expires_at = handle_expires_at if handle_blob is not None else 0.0
        # Same step as the record: the old entry goes, the new one (if a live handle waits) comes.
        self._unindex(key, entry)
        if handle_blob is not None:
            self._file(key, entry, record, handle_expires_at, now)
        self._write(key, entry)
        return True

    async def put_back(self, key: ConversationKey, start: TurnStart, now: float) -> bool:
        check_key(key)
        handle_blob = encode_handle(start.handle) if start.handle is not None else None
        entry = self._live(key)
        if entry is None or entry.started != start.turn or entry.finished >= start.turn:
            return False
        entry.started -= 1
        if handle_blob is not None and start.record is not None:
            entry.handle, entry.handle_expires_at = handle_blob, start.handle_expires_at
            self._file(key, entry, start.record, start.handle_expires_at, now)
        if start.handle_state == "evicted":
            entry.evicted = entry.finished
        return True

    async def evict_handle(self, key: ConversationKey, turn: int) -> dict[str, Any] | None:
        check_key(key)
        entry = self._live(key)
        if entry is None or entry.handle is None or not entry.started == entry.finished == turn:
            return None
        handle, live = entry.handle, entry.handle_expires_at > self._clock()
        entry.handle, entry.handle_expires_at, entry.evicted = None, 0.0, turn
        self._unindex(key, entry)  # no handle left for a prefix lookup to offer
        return decode_handle(handle) if live else None

    async def get(self, key: ConversationKey) -> tuple[Conversation, dict[str, Any] | None, int] | None:
        check_key(key)
        entry = self._live(key)
        if entry is None or entry.record is None:
            return None
        handle = None
        if entry.handle is not None and entry.handle_expires_at > self._clock():
            handle = decode_handle(entry.handle)
        return decode_record(entry.record), handle, entry.finished

    async def delete(self, key: ConversationKey) -> dict[str, Any] | None:
        check_key(key)
        entry = self._live(key)
        self._entries.pop(key, None)
        if entry is not None:
            self._unindex(key, entry)
        if entry is None or entry.handle is None or entry.handle_expires_at <= self._clock():
            return None
        return decode_handle(entry.handle)

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        self._entries.clear()
        self._index.clear()
        self._responses.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def _live(self, key: ConversationKey) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is not None and entry.expires_at <= self._clock():
            del self._entries[key]
            self._unindex(key, entry)
            return None
        return entry

    def _write(self, key: ConversationKey, entry: _Entry) -> None:
        now = self._clock()
        entry.expires_at = now + self.conversation_ttl_s
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.expires_at > now and len(self._entries) <= self.max_conversations:
                break
            # Evicting a live handle leaves D's blocks pinned until its own TTL: bounded, not unsafe.
            evicted, gone = self._entries.popitem(last=False)
            self._unindex(evicted, gone)


def _state(entry: _Entry, now: float) -> HolderState:
    if entry.started > entry.finished:
        return "in_flight"
    if entry.handle is None:
        return "none"
    return "idle" if entry.handle_expires_at > now else "expired"
