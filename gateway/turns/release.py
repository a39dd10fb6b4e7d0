"""Releasing D handles the gateway will not use: a zero-token read through any P makes P notify D, which
frees the pinned blocks now rather than at `decoder_kv_blocks_ttl` (PROTOCOL.md §4)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from gateway.engines.client import EngineClient
from gateway.engines.pool import EnginePool
from gateway.errors import GatewayError
from gateway.telemetry import Metrics
from gateway.turns.plan import release_params

log = logging.getLogger(__name__)
RELEASE_TIMEOUT_S = 30.0


class HandleReleaser:
    def __init__(self, client: EngineClient, prefill: EnginePool, metrics: Metrics, model: str) -> None:
        self.client, self.prefill, self.metrics, self.model = client, prefill, metrics, model
        self._tasks: set[asyncio.Task] = set()

    def release(self, handle: dict[str, Any], why: str) -> None:
        """Fire and forget; counted by why."""
        self.metrics.handles_released.labels(why).inc()
        task = asyncio.get_running_loop().create_task(self._release(handle))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self, handle: dict[str, Any]) -> None:
        body = {"model": self.model, "prompt": [0], "max_tokens": 1, "stream": False,
                "kv_transfer_params": release_params(handle)}
        try:
            engine = self.prefill.pick_prefill()
            await self.client.post_json(engine.url, "/v1/completions", body, timeout_s=RELEASE_TIMEOUT_S)
        except GatewayError as exc:
            log.info("could not release a D handle (%s); D frees it at its TTL", exc.code)

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
