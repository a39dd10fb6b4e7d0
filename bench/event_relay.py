"""A ZMQ relay between an engine's KV events and the gateways that mangles them on the way, for the chaos run:
batches dropped, delayed (and so overtaken: out of order) or held back in bursts. The engine's publisher
connects to the relay (an endpoint without `*` is connected to, as vLLM does: docs/protocol.md §10), so an engine
restarted on the same flags finds it again; the gateways subscribe to the relay's own PUB socket."""

from __future__ import annotations

import asyncio
import contextlib
import random

import zmq
import zmq.asyncio

from gateway.processes import free_port


class EventRelay:
    def __init__(self, ctx: zmq.asyncio.Context, *, drop: float = 0.1, delay: float = 0.2, max_delay_s: float = 0.6,
                 rng: random.Random | None = None) -> None:
        self.inlet_port, self.outlet_port = free_port(), free_port()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.bind(f"tcp://127.0.0.1:{self.inlet_port}")
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{self.outlet_port}")
        self.drop, self.delay, self.max_delay_s = drop, delay, max_delay_s
        self.rng = rng or random.Random(0)
        self.counts = {"passed": 0, "dropped": 0, "delayed": 0}
        self._task: asyncio.Task | None = None

    @property
    def inlet(self) -> str:
        """What the engine's --kv-events-config names (it connects there)."""
        return f"tcp://127.0.0.1:{self.inlet_port}"

    @property
    def outlet(self) -> str:
        """What the gateway's --kv-events names."""
        return f"tcp://127.0.0.1:{self.outlet_port}"

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            parts = await self.sub.recv_multipart()
            luck = self.rng.random()
            if luck < self.drop:
                self.counts["dropped"] += 1
            elif luck < self.drop + self.delay:
                self.counts["delayed"] += 1
                loop.call_later(self.rng.uniform(0.05, self.max_delay_s), self._send, parts)
            else:
                self._send(parts)

    def _send(self, parts: list[bytes]) -> None:
        self.counts["passed"] += 1
        with contextlib.suppress(zmq.ZMQError):
            self.pub.send_multipart(parts, flags=zmq.NOBLOCK)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.sub.close(linger=0)
        self.pub.close(linger=0)
