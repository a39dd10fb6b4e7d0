"""What the admin API sees: a conversation (inspect it, or delete it and free the KV its D still pins), and the
engines (each one's state; adding or removing one while serving)."""

from __future__ import annotations

from typing import Any, Literal

from gateway.engines import kv
from gateway.engines.engine import Engine
from gateway.engines.pool import EnginePool
from gateway.engines.registry import EngineRegistry
from gateway.store import ConversationKey, ConversationStore
from gateway.turns.legs.release import HandleReleaser
from gateway.turns.state.pinning import Pinning

__all__ = ["ConversationAdmin", "ConversationKey", "EngineAdmin"]   # the API names conversations through here

Role = Literal["prefill", "decode"]


class ConversationAdmin:
    def __init__(self, store: ConversationStore, releaser: HandleReleaser, pins: Pinning | None = None) -> None:
        self.store, self.releaser, self.pins = store, releaser, pins

    async def describe(self, key: ConversationKey) -> dict[str, Any] | None:
        found = await self.store.get(key)
        if found is None:
            return None
        record, handle, turn = found
        return {"session_id": key.session, "tenant": key.tenant, "turn": turn, "model": record.model,
                "decode_engine": record.decode_engine, "prefill_engine": record.prefill_engine,
                "held_tokens": record.held_tokens, "num_tokens": record.num_tokens,
                "handle_live": kv.from_store(handle) is not None, "updated_at": record.updated_at}

    async def delete(self, key: ConversationKey) -> bool:
        found = await self.store.get(key)
        handle = kv.from_store(await self.store.delete(key))
        if handle:
            self.releaser.release(handle, "deleted")
        if found is not None and self.pins is not None:
            self.pins.deleted(key, found[0].decode_engine)
        return found is not None


class EngineAdmin:
    def __init__(self, prefill: EnginePool, decode: EnginePool, registry: EngineRegistry,
                 pins: Pinning | None = None) -> None:
        self.pools, self.registry, self.pins = (prefill, decode), registry, pins

    def describe(self) -> list[dict[str, Any]]:
        return [self._one(e) for pool in self.pools for e in pool.engines.values()]

    def _one(self, e: Engine) -> dict[str, Any]:
        seen: dict[str, Any] = {"url": e.url, "role": e.role, "healthy": e.healthy,
                                "outstanding_requests": e.outstanding_requests,
                                "outstanding_prompt_tokens": e.outstanding_tokens, **e.facts.summary()}
        if e.role == "decode":
            seen["pinned_blocks"] = e.pinned_blocks
            if self.pins is not None and (share := self.pins.share(e.facts.num_gpu_blocks)) is not None:
                seen["pin_share"] = share
        if e.data_plane is not None:
            seen["data_plane"] = e.data_plane.summary()
        if self.pins is not None and (pins := self.pins.summaries.get(e.url)) is not None:
            seen["pins"] = pins
        return {**seen, **_cache(e)}

    async def add(self, role: Role, url: str) -> dict[str, Any]:
        engine = await self.registry.add(role, url)
        return {"url": engine.url, "role": engine.role, "healthy": engine.healthy}

    def remove(self, role: Role, url: str) -> bool:
        return self.registry.remove(role, url)


def _cache(engine: Engine) -> dict[str, Any]:
    """What its KV events say its prefix cache holds (docs/protocol.md §10); nothing when it publishes none."""
    cache = engine.cache
    if cache is None:
        return {}
    return {"kv_events": {"knowledge": cache.knowledge.value, "blocks": len(cache), "block_size": cache.block_size,
                          "last_seq": cache.last_seq, "gaps": cache.gaps, "unchained_blocks": cache.unchained}}
