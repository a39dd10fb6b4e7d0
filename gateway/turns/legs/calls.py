"""Engine calls, one way for every request the gateway sends an engine (turn legs and handle releases alike):
counted as load while in flight, fed to the engine's circuit breaker after, failures counted by pool and kind.
A failed call comes back as a `LegSetback`, which says what happened; what the turn does next is plan.py's.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar

from gateway.engines.engine import Engine
from gateway.errors import EngineConnectError, EngineTimeoutError, UpstreamError
from gateway.telemetry import Metrics
from gateway.turns.reuse.plan import Leg, Setback

T = TypeVar("T")


class LegSetback(Exception):
    """A leg failed on `engine`; `error` is what the client sees if the turn gives up."""

    def __init__(self, leg: Leg, kind: Setback, engine: Engine | None, error: UpstreamError) -> None:
        super().__init__(error.message)
        self.leg, self.kind, self.engine, self.error = leg, kind, engine, error


def setback_of(error: UpstreamError) -> Setback:
    if isinstance(error, EngineConnectError):
        return Setback.REFUSED        # refused: the request was never sent
    if isinstance(error, EngineTimeoutError):
        return Setback.TIMEOUT
    return Setback.FAILED


class EngineCalls:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    async def call(self, engine: Engine, call: Awaitable[T], prompt_tokens: int = 0) -> T:
        """One engine call: counted as load while it runs, fed to the engine's circuit breaker after."""
        with engine.track(prompt_tokens):
            try:
                result = await call
            except UpstreamError as exc:
                engine.failed()
                self.metrics.upstream_errors.labels(engine.role, exc.code).inc()
                raise
        engine.succeeded()
        return result

    async def leg(self, leg: Leg, engine: Engine, call: Awaitable[T], prompt_tokens: int = 0) -> T:
        """A turn's leg: the same, with a failure reported as a `LegSetback`."""
        try:
            return await self.call(engine, call, prompt_tokens)
        except UpstreamError as exc:
            raise LegSetback(leg, setback_of(exc), engine, exc) from exc
