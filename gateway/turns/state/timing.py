"""Every store call a turn makes, timed (`pdgw_store_seconds{op}`) and its failures counted by op."""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import TypeVar

from gateway.store import StoreUnavailableError
from gateway.telemetry import Metrics

T = TypeVar("T")


async def timed(metrics: Metrics, op: str, call: Awaitable[T]) -> T:
    began = time.perf_counter()
    try:
        return await call
    except StoreUnavailableError:
        metrics.store_errors.labels(op).inc()
        raise
    finally:
        metrics.store_seconds.labels(op).observe(time.perf_counter() - began)
