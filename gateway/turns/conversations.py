"""Admin view of conversations: inspect one, or delete it and free the KV its D still pins."""

from __future__ import annotations

from typing import Any

from gateway.engines import kv
from gateway.store import ConversationKey, ConversationStore
from gateway.turns.release import HandleReleaser

__all__ = ["ConversationAdmin", "ConversationKey"]     # the API names conversations through this module


class ConversationAdmin:
    def __init__(self, store: ConversationStore, releaser: HandleReleaser) -> None:
        self.store, self.releaser = store, releaser

    async def describe(self, key: ConversationKey) -> dict[str, Any] | None:
        found = await self.store.get(key)
        if found is None:
            return None
        record, handle, turn = found
        return {"session_id": key.session, "tenant": key.tenant, "turn": turn, "model": record.model,
                "decode_engine": record.decode_engine, "prefill_engine": record.prefill_engine,
                "held_tokens": record.held_tokens, "num_tokens": record.num_tokens,
                "handle_live": handle is not None, "updated_at": record.updated_at}

    async def delete(self, key: ConversationKey) -> bool:
        found = await self.store.get(key)
        handle = kv.from_store(await self.store.delete(key))
        if handle:
            self.releaser.release(handle, "deleted")
        return found is not None
