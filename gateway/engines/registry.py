"""Engines added and removed while serving (admin API, SIGHUP config reload, DNS discovery). A removed engine
only stops being picked: turns already running on it keep their Engine object and finish normally. Its KV-event
feed (kv_feeds.py) follows it: one that joins is subscribed where the mapping covers it, one that leaves is not."""

from __future__ import annotations

import logging

from gateway.engines.health import HealthChecker
from gateway.engines.engine import Engine, Role
from gateway.engines.kv_feeds import KVEventFeeds
from gateway.engines.pool import EnginePool
from gateway.telemetry import Metrics

log = logging.getLogger(__name__)


class EngineRegistry:
    def __init__(self, prefill: EnginePool, decode: EnginePool, health: HealthChecker, metrics: Metrics,
                 feeds: KVEventFeeds | None = None) -> None:
        self.pools: dict[str, EnginePool] = {"prefill": prefill, "decode": decode}
        self.health, self.metrics, self.feeds = health, metrics, feeds

    async def add(self, role: Role, url: str) -> Engine:
        pool = self.pools[role]
        known = pool.get(url.rstrip("/"))
        if known is not None:
            return known
        engine = pool.add(url)
        engine.healthy = False             # not picked before its first health check answers
        if self.feeds is not None:         # subscribed first: its first batch may come with its first turn
            self.feeds.subscribe(engine)
        await self.health.check_all()
        log.warning("engine %s added to the %s pool (%s)", engine.url, role,
                    "healthy" if engine.healthy else "not answering yet")
        return engine

    def remove(self, role: Role, url: str) -> bool:
        engine = self.pools[role].remove(url)
        if engine is None:
            return False
        if self.feeds is not None:
            self.feeds.unsubscribe(engine)
        log.warning("engine %s removed from the %s pool; its turns in flight finish", engine.url, role)
        return True

    async def sync(self, prefill: list[str], decode: list[str]) -> dict[str, list[str]]:
        """Make the pools match a reloaded configuration."""
        changes: dict[str, list[str]] = {"added": [], "removed": []}
        for role, urls in (("prefill", prefill), ("decode", decode)):
            pool = self.pools[role]
            wanted = {u.rstrip("/") for u in urls}
            for url in [u for u in pool.engines if u not in wanted]:
                self.remove(role, url)
                changes["removed"].append(url)
            for url in sorted(wanted - set(pool.engines)):
                await self.add(role, url)
                changes["added"].append(url)
        return changes
