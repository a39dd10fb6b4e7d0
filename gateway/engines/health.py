"""Active health checks: poll every engine's `/health`, keep `Engine.healthy` and the gauge current.
Passive ejection (consecutive request failures) is the circuit breaker in pool.py."""

from __future__ import annotations

import asyncio
import logging
import time

from gateway.engines.client import EngineClient
from gateway.engines.pool import EnginePool
from gateway.errors import GatewayError
from gateway.telemetry import Metrics

log = logging.getLogger(__name__)


class HealthChecker:
    def __init__(self, client: EngineClient, pools: list[EnginePool], metrics: Metrics, interval_s: float) -> None:
        self._client, self._pools, self._metrics, self._interval = client, pools, metrics, interval_s

    async def check_all(self) -> None:
        engines = [e for pool in self._pools for e in pool.engines.values()]
        results = await asyncio.gather(*(self._probe(e.url) for e in engines))
        now = time.monotonic()
        for engine, ok in zip(engines, results, strict=True):
            if ok != engine.healthy:
                log.warning("engine %s (%s) is now %s", engine.url, engine.role, "healthy" if ok else "unhealthy")
                if ok:
                    engine.readmit(now)      # back in rotation, but taking traffic gradually
            engine.healthy = ok
            self._metrics.engine_healthy.labels(engine.role, engine.url).set(int(ok))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self.check_all()

    async def _probe(self, url: str) -> bool:
        try:
            await self._client.get(url, "/health", timeout_s=min(2.0, self._interval))
            return True
        except GatewayError:
            return False
