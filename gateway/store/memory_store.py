"""The embedded store: one process, one event loop, same semantics as Redis.

No method awaits between reading and writing an entry, so every operation is atomic on its loop, which
is what makes the single-use claim hold here. Records and handles are kept msgpack-encoded, exactly as in
Redis, so both stores hand back equal (and unaliased) values.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .base import (
    DEFAULT_CONVERSATION_TTL_S,
    DEFAULT_INFLIGHT_TIMEOUT_S,
    Conversation,
    ConversationKey,
    HandleState,
    TurnStart,
    check_key,
)
from .codec import decode_handle, decode_record, encode_handle, encode_record

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


class MemoryConversationStore:
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

    async def begin_turn(self, key: ConversationKey, now: float) -> TurnStart:
        check_key(key)
        entry = self._live(key) or _Entry()
        handle = None
        state: HandleState
        if entry.handle is not None:
            state = "claimed" if entry.handle_expires_at > now else "expired"
            if state == "claimed":
                handle = entry.handle
            entry.handle, entry.handle_expires_at = None, 0.0
        elif entry.started > entry.finished and now - entry.started_at < self.inflight_timeout_s:
            state = "in_flight"
        else:
            state = "none"
        entry.started += 1
        entry.started_at = now
        self._write(key, entry)
        return TurnStart(
            turn=entry.started,
            record=decode_record(entry.record) if entry.record is not None else None,
            handle=decode_handle(handle) if handle is not None else None,
            handle_state=state,
        )

    async def finish_turn(
        self,
        key: ConversationKey,
        turn: int,
        record: Conversation,
        handle: dict[str, Any] | None,
        handle_expires_at: float,
        now: float,
    ) -> bool:
        check_key(key)
        record_blob = encode_record(record)
        handle_blob = encode_handle(handle) if handle is not None else None
        entry = self._live(key)
        if entry is None or entry.started != turn or entry.finished >= turn:
            return False
        entry.record, entry.finished = record_blob, turn
        entry.handle = handle_blob
        entry.handle_expires_at = handle_expires_at if handle_blob is not None else 0.0
        self._write(key, entry)
        return True

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
        if entry is None or entry.handle is None or entry.handle_expires_at <= self._clock():
            return None
        return decode_handle(entry.handle)

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def _live(self, key: ConversationKey) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is not None and entry.expires_at <= self._clock():
            del self._entries[key]
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
            self._entries.popitem(last=False)
