"""Conversation store: the contract (`base`), an embedded store and a Redis store, and migrations."""

from .base import (
    Answer,
    DEFAULT_CONVERSATION_TTL_S,
    DEFAULT_INFLIGHT_TIMEOUT_S,
    Conversation,
    ConversationKey,
    ConversationStore,
    HandleState,
    StoreUnavailableError,
    TurnStart,
)
from .factory import open_store
from .memory_store import MemoryConversationStore
from .redis_store import RedisConversationStore

__all__ = [
    "Answer",
    "DEFAULT_CONVERSATION_TTL_S",
    "DEFAULT_INFLIGHT_TIMEOUT_S",
    "Conversation",
    "ConversationKey",
    "ConversationStore",
    "HandleState",
    "MemoryConversationStore",
    "RedisConversationStore",
    "StoreUnavailableError",
    "TurnStart",
    "open_store",
]
