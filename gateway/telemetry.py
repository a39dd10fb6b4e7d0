"""Prometheus metrics (prefix `pdgw_`) and log setup. One `Metrics` per app, on its own registry, so tests can
build several apps in one process."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# The gateway's own time per turn is sub-millisecond when all is well: fine buckets there, coarse above.
GATEWAY_BUCKETS = (0.00005, 0.0001, 0.00015, 0.0002, 0.0003, 0.0004, 0.0005, 0.0006, 0.0008, 0.001, 0.0015,
                   0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.5)


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
        self.gateway_seconds = Histogram(
            "pdgw_gateway_seconds", "The gateway's own time per turn, engine waits excluded, by span (turns/intake/clock.py)",
            ["span"], buckets=GATEWAY_BUCKETS, registry=r)
        self.upstream_errors = Counter(
            "pdgw_upstream_errors", "Engine errors by pool and kind", ["pool", "kind"], registry=r)
        self.engine_healthy = Gauge("pdgw_engine_healthy", "1 if the engine passes health checks",
                                    ["pool", "engine"], registry=r)
        self.store_seconds = Histogram(
            "pdgw_store_seconds", "Conversation store latency by operation", ["op"],
            buckets=LATENCY_BUCKETS, registry=r)
        self.store_errors = Counter("pdgw_store_errors", "Store operations that failed", ["op"], registry=r)
        self.conversation_lookups = Counter(
            "pdgw_conversation_lookups", "How turns found their conversation: session id, token prefix or new",
            ["how"], registry=r)
        self.handles_released = Counter(
            "pdgw_handles_released", "D handles released unused, by why", ["reason"], registry=r)
        self.handles_missing = Counter(
            "pdgw_handles_missing", "Finished turns whose D returned no handle, by why", ["reason"], registry=r)

        self.pinned_tokens = Gauge(
            "pdgw_pinned_tokens", "Tokens of KV this gateway's stored handles pin on each D", ["engine"],
            registry=r)
        self.handles_evicted = Counter(
            "pdgw_handles_evicted", "Idle handles released to keep a D within its pin budget", ["engine"],
            registry=r)
        self.learned_rates = LearnedRates()
        r.register(self.learned_rates)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class LearnedRates:
    """`pdgw_learned_rate_tokens_per_second{rate, prefill, decode}`: the cost plan's rates (P's prefill, P reading
    D's KV), read from `source` at scrape time so the turns that update them pay nothing."""

    def __init__(self) -> None:
        self.source: Callable[[], list[tuple[str, str, str, float]]] = list

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("pdgw_learned_rate_tokens_per_second",
                                   "The cost plan's learned rates: P's prefill, P reading D's KV",
                                   labels=["rate", "prefill", "decode"])
        for rate, prefill, decode, value in self.source():
            family.add_metric([rate, prefill, decode], value)
        yield family


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, plus the record's `fields` (see `log_turn`)."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
                "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        line.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    """Root handler for everything, uvicorn included (serving.py leaves its loggers unconfigured)."""
    handler = logging.StreamHandler()
    if fmt == "json":
        formatter: logging.Formatter = JsonFormatter()
        formatter.converter = time.gmtime
    else:
        formatter = logging.Formatter(TEXT_FORMAT)
    handler.setFormatter(formatter)
    handler.pdgw = True  # type: ignore[attr-defined]  (replaced by the next call; others' handlers stay)
    root = logging.getLogger()
    root.handlers[:] = [h for h in root.handlers if not getattr(h, "pdgw", False)] + [handler]
    root.setLevel(level.upper())


def log_turn(logger: logging.Logger, **fields: object) -> None:
    """The one info line per turn: `turn plan=reuse reason=continuous ...`; in JSON, each field a key."""
    logger.info("turn " + " ".join(f"{k}={v}" for k, v in fields.items()), extra={"fields": fields})
