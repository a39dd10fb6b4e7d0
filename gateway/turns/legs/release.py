"""Releasing D handles the gateway will not use: a zero-token read through any P makes P notify D, which
frees the pinned blocks now rather than at `decoder_kv_blocks_ttl` (docs/protocol.md §4). The read goes
through the same engine calls as every turn's P leg, so it counts as P's load and feeds P's breaker. A release
sent while no P can take it (every P down or refusing connections) is tried again, backing off, for
`RELEASE_RETRY_S`: a P outage otherwise leaves every handle released meanwhile pinned on D until its TTL (the
faults step of bench/gpu/load.py measured 2.65 % of D so held after a P restart)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from gateway.engines import kv
from gateway.engines.client import EngineClient
from gateway.engines.engine import Engine
from gateway.engines.pool import EnginePool
from gateway.errors import EngineConnectError, GatewayError
from gateway.telemetry import Metrics
from gateway.turns.legs.calls import EngineCalls

log = logging.getLogger(__name__)
RELEASE_TIMEOUT_S = 30.0
RELEASE_RETRY_S = 60.0           # how long a release no P could take is tried again (D's TTL frees it after)
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 8.0


class HandleReleaser:
    def __init__(self, client: EngineClient, prefill: EnginePool, calls: EngineCalls, metrics: Metrics,
                 model: str) -> None:
        self.client, self.prefill, self.calls, self.metrics, self.model = client, prefill, calls, metrics, model
        self._tasks: set[asyncio.Task] = set()
        self._closed = asyncio.Event()

    def release(self, handle: kv.Handle, why: str) -> None:
        """Fire and forget; counted by why."""
        self.metrics.handles_released.labels(why).inc()
        task = asyncio.get_running_loop().create_task(self._release(handle))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self, handle: kv.Handle) -> None:
        body = {"model": self.model, "prompt": [0], "max_tokens": 1, "stream": False,
                kv.WIRE_KEY: handle.released().wire}
        give_up, pause = time.monotonic() + RELEASE_RETRY_S, RETRY_FIRST_S
        while True:
            engine: Engine | None = None
            try:
                engine = self.prefill.pick_prefill()
                await self.calls.call(engine, self.client.post_json(
                    engine.url, "/v1/completions", body, timeout_s=RELEASE_TIMEOUT_S), prompt_tokens=1)
                return
            except GatewayError as exc:
                # Only where no P took it (none to pick, or its connection refused: nothing reached D) is it tried
                # again; one P answered, timed out on or went away with may have notified D, and D logs a second
                # notification as a read of blocks it no longer holds (docs/protocol.md §4).
                unsent = engine is None or isinstance(exc, EngineConnectError)
                again = unsent and time.monotonic() + pause <= give_up
                if not again or self._closed.is_set():
                    log.info("could not release a D handle (%s); D frees it at its TTL", exc.code)
                    return
            with contextlib.suppress(asyncio.TimeoutError):      # shutting down ends the pause, and the release
                await asyncio.wait_for(self._closed.wait(), pause)
            if self._closed.is_set():
                return
            pause = min(pause * 2, RETRY_MAX_S)

    async def drain(self) -> None:
        """At shutdown: the releases in flight finish, none is tried again."""
        self._closed.set()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
