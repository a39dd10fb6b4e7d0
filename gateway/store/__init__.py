"""Conversation store: the contract (`base`), an embedded store and a Redis store, and migrations.
Both keep a tenant-scoped prefix index of the conversations whose D handle waits to be claimed."""

from .base import (
    Answer,
    DEFAULT_CONVERSATION_TTL_S,
    DEFAULT_INFLIGHT_TIMEOUT_S,
    DEFAULT_MAX_HOLDERS,
    Conversation,
    ConversationKey,
    ConversationStore,
    HandleState,
    Holder,
    HolderState,
    StoreUnavailableError,
    StoredResponse,
    TurnStart,
    check_response_id,
    index_hash,
)
from .factory import open_store
from .memory_store import MemoryConversationStore
from .redis_store import RedisConversationStore

__all__ = [
    "Answer",
    "DEFAULT_CONVERSATION_TTL_S",
    "DEFAULT_INFLIGHT_TIMEOUT_S",
    "DEFAULT_MAX_HOLDERS",
    "Conversation",
    "ConversationKey",
    "ConversationStore",
    "HandleState",
    "Holder",
    "HolderState",
    "MemoryConversationStore",
    "RedisConversationStore",
    "StoreUnavailableError",
    "StoredResponse",
    "TurnStart",
    "check_response_id",
    "index_hash",
    "open_store",
]
