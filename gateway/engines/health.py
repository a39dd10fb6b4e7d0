"""Active health checks: poll every engine's `/health`, keep `Engine.healthy` and the gauge current.
Passive ejection (consecutive request failures) is the circuit breaker in engine.py. The same round reads each
healthy engine's `/metrics` once: its data plane (`Engine.data_plane`, served as `pdgw_engine_*` and in
`/admin/engines`: dataplane.py) and, for a D that has not reported it yet, its KV capacity.

A probe that times out is not a miss by itself: an engine busy with prompts answers `/health` late, and on a
loaded machine every engine of a pool does at once; marking them down turned overload into 503s for everyone
and moved conversations off the D that holds their KV (`decode_unavailable`). A refused or failed probe is a
miss; a slow one only once the engine has not answered at all for SLOW_GRACE_S (a hung engine)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from gateway.engines import dataplane
from gateway.engines.client import EngineClient
from gateway.engines.engine import Engine
from gateway.engines.pool import EnginePool
from gateway.errors import EngineTimeoutError, GatewayError
from gateway.telemetry import Metrics

log = logging.getLogger(__name__)


PROBE_TIMEOUT_S = 2.0
METRICS_TIMEOUT_S = 2.0
MISSES_TO_MARK_DOWN = 2     # one failed probe is not an outage
SLOW_GRACE_S = 15.0         # probes that only time out mark an engine down after this long without an answer


class HealthChecker:
    def __init__(self, client: EngineClient, pools: list[EnginePool], metrics: Metrics, interval_s: float) -> None:
        self._client, self._pools, self._metrics, self._interval = client, pools, metrics, interval_s
        self._misses: dict[str, int] = {}
        self._answered_at: dict[str, float] = {}
        # Called (synchronously) when an engine comes back healthy: what was proven about it may have changed
        self.on_readmit: list[Callable[[Engine], None]] = []
        metrics.engine_data_plane.source.add(self._readings)
        metrics.engine_health.source.add(self._health)

    def close(self) -> None:
        """Its engines leave /metrics (their model was taken out)."""
        self._metrics.engine_data_plane.source.discard(self._readings)
        self._metrics.engine_health.source.discard(self._health)

    async def check_all(self) -> None:
        engines = [e for pool in self._pools for e in pool.engines.values()]
        results = await asyncio.gather(*(self._probe(e.url) for e in engines))
        now = time.monotonic()
        for engine, result in zip(engines, results, strict=True):
            answered = self._answered(engine.url, result, now)
            first_check = engine.url not in self._misses
            misses = 0 if answered else self._misses.get(engine.url, 0) + 1
            self._misses[engine.url] = misses
            ok = misses < MISSES_TO_MARK_DOWN if engine.healthy and not first_check else answered
            if ok != engine.healthy:
                log.warning("engine %s (%s) is now %s", engine.url, engine.role, "healthy" if ok else "unhealthy")
                if ok:
                    engine.readmit(now)      # back in rotation, but taking traffic gradually
                    engine.facts.num_gpu_blocks = None    # maybe restarted with another KV size
                    for hook in self.on_readmit:
                        hook(engine)
            engine.healthy = ok
            self._metrics.engine_names[engine.url] = engine.name
        await self._scrape(engines)

    async def _scrape(self, engines: list[Engine]) -> None:
        """Each healthy engine's /metrics: its data plane, and D's KV capacity (its pin budget's base) when it
        has not reported one yet (still profiling its memory at start-up, or re-admitted after an outage)."""
        healthy = [e for e in engines if e.healthy]
        pages = await asyncio.gather(*(self._metrics_page(e.url) for e in healthy))
        for engine in (e for e in engines if not e.healthy):
            engine.observe(None)
        for engine, page in zip(healthy, pages, strict=True):
            if page is None:
                engine.observe(None)
                continue
            capacity, readings = dataplane.parse(page)
            engine.observe(readings)
            if engine.role == "decode" and not engine.facts.num_gpu_blocks and capacity.num_gpu_blocks:
                engine.facts.num_gpu_blocks = capacity.num_gpu_blocks

    async def _metrics_page(self, url: str) -> str | None:
        try:
            return (await self._client.get(url, "/metrics", timeout_s=METRICS_TIMEOUT_S)).decode("utf-8", "replace")
        except GatewayError:
            return None

    def _health(self) -> list[tuple[str, str, bool]]:
        """For `pdgw_engine_healthy` at scrape time: the engines of the pools now, once checked."""
        return [(e.role, e.name, e.healthy) for pool in self._pools for e in pool.engines.values()
                if e.url in self._misses]

    def _readings(self) -> list[tuple[str, str, dataplane.DataPlane]]:
        """For `pdgw_engine_*` at scrape time: the engines of the pools now, with their last readings."""
        return [(e.role, e.name, e.data_plane) for pool in self._pools for e in pool.engines.values()
                if e.data_plane is not None]

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self.check_all()

    def _answered(self, url: str, result: bool | None, now: float) -> bool:
        """A slow probe (None) counts as an answer while the engine answered within SLOW_GRACE_S."""
        if result:
            self._answered_at[url] = now
            return True
        return result is None and now - self._answered_at.setdefault(url, now) < SLOW_GRACE_S

    async def _probe(self, url: str) -> bool | None:
        """True: answered; False: refused or failed; None: no answer within the probe's timeout."""
        try:
            await self._client.get(url, "/health", timeout_s=PROBE_TIMEOUT_S)
            return True
        except EngineTimeoutError:
            return None
        except GatewayError:
            return False
