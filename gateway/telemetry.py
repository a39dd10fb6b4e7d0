"""Prometheus metrics (prefix `pdgw_`) and log setup. One `Metrics` per app, on its own registry, so tests can
build several apps in one process."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.turns = Counter("pdgw_turns", "Turns by plan and reason", ["plan", "reason"], registry=r)
        self.prompt_tokens = Counter(
            "pdgw_prompt_tokens", "Prompt tokens read from D's KV (reused) vs prefilled on P (computed)",
            ["source"], registry=r)
        self.turn_seconds = Histogram(
            "pdgw_turn_seconds", "Turn latency by phase", ["phase"], buckets=LATENCY_BUCKETS, registry=r)
        self.upstream_errors = Counter(
            "pdgw_upstream_errors", "Engine errors by pool and kind", ["pool", "kind"], registry=r)
        self.engine_healthy = Gauge("pdgw_engine_healthy", "1 if the engine passes health checks",
                                    ["pool", "engine"], registry=r)
        self.store_seconds = Histogram(
            "pdgw_store_seconds", "Conversation store latency by operation", ["op"],
            buckets=LATENCY_BUCKETS, registry=r)
        self.store_errors = Counter("pdgw_store_errors", "Store operations that failed", ["op"], registry=r)
        self.handles_released = Counter(
            "pdgw_handles_released", "D handles released unused, by why", ["reason"], registry=r)
        self.handles_missing = Counter(
            "pdgw_handles_missing", "Finished turns whose D returned no handle, by why", ["reason"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def setup_logging(level: str = "info") -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
