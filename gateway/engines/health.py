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


PROBE_TIMEOUT_S = 2.0
MISSES_TO_MARK_DOWN = 2     # one slow answer from a busy engine is not an outage


class HealthChecker:
    def __init__(self, client: EngineClient, pools: list[EnginePool], metrics: Metrics, interval_s: float) -> None:
        self._client, self._pools, self._metrics, self._interval = client, pools, metrics, interval_s
        self._misses: dict[str, int] = {}

    async def check_all(self) -> None:
        engines = [e for pool in self._pools for e in pool.engines.values()]
        results = await asyncio.gather(*(self._probe(e.url) for e in engines))
        now = time.monotonic()
        for engine, answered in zip(engines, results, strict=True):
            first_check = engine.url not in self._misses
            misses = 0 if answered else self._misses.get(engine.url, 0) + 1
            self._misses[engine.url] = misses
            ok = misses < MISSES_TO_MARK_DOWN if engine.healthy and not first_check else answered
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
            await self._client.get(url, "/health", timeout_s=PROBE_TIMEOUT_S)
            return True
        except GatewayError:
            return False
