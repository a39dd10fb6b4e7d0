"""The store a gateway's settings ask for: Redis (shared by replicas) when a URL is given, else embedded."""

from __future__ import annotations

from .base import DEFAULT_CONVERSATION_TTL_S, ConversationStore
from .memory_store import MemoryConversationStore
from .redis_store import RedisConversationStore


def open_store(redis_url: str | None, conversation_ttl_s: float = DEFAULT_CONVERSATION_TTL_S) -> ConversationStore:
    if redis_url:
        return RedisConversationStore.from_url(redis_url, conversation_ttl_s=conversation_ttl_s)
    return MemoryConversationStore(conversation_ttl_s=conversation_ttl_s)
