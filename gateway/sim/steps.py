"""An engine's compute as time. Two models:
- independent (the default): each request's prefill and decode tokens take their own time, as if it had the
  GPU to itself: what the timing benchmarks before issue 24 assume;
- batched steps (`--batched-steps`): vLLM's engine loop, where each step decodes one token of every running
  request and prefills up to `max_num_batched_tokens` of waiting prompts (chunked prefill, scheduled after the
  running decodes: vllm/v1/core/sched/scheduler.py), and a step lasts the decode step plus its prefill tokens.
  A prefill arriving on a D therefore lengthens the steps its running streams wait on: what the local path
  costs D's inter-token latency (bench/local.py).
Works on its engine's current settings (the benchmarks change timings at run time)."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Protocol

from gateway.sim.settings import SimSettings


class Timed(Protocol):
    settings: SimSettings


class Steps:
    def __init__(self, engine: Timed) -> None:
        self.engine = engine
        self._prefills: deque[list] = deque()            # [tokens left, future], first come first served
        self._decodes: list[asyncio.Future[None]] = []
        self._loop: asyncio.Task[None] | None = None

    async def compute(self, tokens: int) -> None:
        """Prefill `tokens` prompt tokens (also a preempted request's recompute)."""
        s = self.engine.settings
        if tokens <= 0 or not s.prefill_ms_per_token:
            return
        if not s.batched_steps:
            await asyncio.sleep(tokens * s.prefill_ms_per_token / 1000)
            return
        future = asyncio.get_running_loop().create_future()
        self._prefills.append([tokens, future])
        self._start()
        await future

    async def token(self) -> None:
        """Decode one output token."""
        s = self.engine.settings
        if not s.decode_ms_per_token:
            return
        if not s.batched_steps:
            await asyncio.sleep(s.decode_ms_per_token / 1000)
            return
        future = asyncio.get_running_loop().create_future()
        self._decodes.append(future)
        self._start()
        await future

    def _start(self) -> None:
        if self._loop is None or self._loop.done():
            self._loop = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while self._prefills or self._decodes:
            s = self.engine.settings
            decodes, self._decodes = [f for f in self._decodes if not f.done()], []
            budget, chunk, finished = max(0, s.max_num_batched_tokens - len(decodes)), 0, []
            while budget and self._prefills:
                item = self._prefills[0]
                if item[1].done():                      # its request went away
                    self._prefills.popleft()
                    continue
                take = min(item[0], budget)
                item[0], budget, chunk = item[0] - take, budget - take, chunk + take
                if item[0] == 0:
                    finished.append(self._prefills.popleft()[1])
            step_ms = (s.decode_ms_per_token if decodes else 0.0) + chunk * s.prefill_ms_per_token
            await asyncio.sleep(step_ms / 1000)
            for future in decodes + finished:
                if not future.done():
                    future.set_result(None)
