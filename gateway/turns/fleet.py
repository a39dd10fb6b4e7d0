"""The engines as the admin API sees them: each one's state, and adding or removing one while serving."""

from __future__ import annotations

from typing import Any, Literal

from gateway.engines.pool import EnginePool
from gateway.engines.registry import EngineRegistry

Role = Literal["prefill", "decode"]


class EngineAdmin:
    def __init__(self, prefill: EnginePool, decode: EnginePool, registry: EngineRegistry) -> None:
        self.pools, self.registry = (prefill, decode), registry

    def describe(self) -> list[dict[str, Any]]:
        return [{"url": e.url, "role": e.role, "healthy": e.healthy, "outstanding_requests": e.outstanding_requests,
                 "outstanding_prompt_tokens": e.outstanding_tokens, **e.info}
                for pool in self.pools for e in pool.engines.values()]

    async def add(self, role: Role, url: str) -> dict[str, Any]:
        engine = await self.registry.add(role, url)
        return {"url": engine.url, "role": engine.role, "healthy": engine.healthy}

    def remove(self, role: Role, url: str) -> bool:
        return self.registry.remove(role, url)
