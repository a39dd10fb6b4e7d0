"""Releasing D handles the gateway will not use: a zero-token read through any P makes P notify D, which
frees the pinned blocks now rather than at `decoder_kv_blocks_ttl` (docs/protocol.md §4). The read goes
through the same engine calls as every turn's P leg, so it counts as P's load and feeds P's breaker."""

from __future__ import annotations

import asyncio
import logging

from gateway.engines import kv
from gateway.engines.client import EngineClient
from gateway.engines.pool import EnginePool
from gateway.errors import GatewayError
from gateway.telemetry import Metrics
from gateway.turns.legs.calls import EngineCalls

log = logging.getLogger(__name__)
RELEASE_TIMEOUT_S = 30.0


class HandleReleaser:
    def __init__(self, client: EngineClient, prefill: EnginePool, calls: EngineCalls, metrics: Metrics,
                 model: str) -> None:
        self.client, self.prefill, self.calls, self.metrics, self.model = client, prefill, calls, metrics, model
        self._tasks: set[asyncio.Task] = set()

    def release(self, handle: kv.Handle, why: str) -> None:
        """Fire and forget; counted by why."""
        self.metrics.handles_released.labels(why).inc()
        task = asyncio.get_running_loop().create_task(self._release(handle))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self, handle: kv.Handle) -> None:
        body = {"model": self.model, "prompt": [0], "max_tokens": 1, "stream": False,
                kv.WIRE_KEY: handle.released().wire}
        try:
            engine = self.prefill.pick_prefill()
            await self.calls.call(engine, self.client.post_json(
                engine.url, "/v1/completions", body, timeout_s=RELEASE_TIMEOUT_S), prompt_tokens=1)
        except GatewayError as exc:
            log.info("could not release a D handle (%s); D frees it at its TTL", exc.code)

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
