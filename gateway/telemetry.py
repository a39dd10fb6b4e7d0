"""Prometheus metrics (prefix `pdgw_`) and log setup. One `Metrics` per app, on its own registry, so tests can
build several apps in one process."""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client import Counter as _Counter
from prometheus_client import Gauge as _Gauge
from prometheus_client import Histogram as _Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

MULTIPROCESS_DIR = "PROMETHEUS_MULTIPROC_DIR"    # set by gateway/workers.py for its workers, read by prometheus_client
WORKER_ENV = "PD_GATEWAY_WORKER"                 # a worker's index, set likewise (not PDGW_: that is settings')
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# The gateway's own time per turn is sub-millisecond when all is well: fine buckets there, coarse above.
GATEWAY_BUCKETS = (0.00005, 0.0001, 0.00015, 0.0002, 0.0003, 0.0004, 0.0005, 0.0006, 0.0008, 0.001, 0.0015,
                   0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.5)


def worker_index() -> int | None:
    """This process's index among `serve --workers N`'s, or None outside them."""
    value = os.environ.get(WORKER_ENV)
    return int(value) if value is not None else None


class _CachedLabels:
    """`labels(...)` answered from a dict of the children already made, by the values as passed: the library's own
    lookup (argument checks, a str() per value, a lock) costs about 2 us, and a turn makes some ten of them.
    Only values that are their own str() are kept (str, StrEnum), so a hit is the child the library would give;
    any removal empties the cache."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._children: dict[tuple[object, ...], Any] = {}
        super().__init__(*args, **kwargs)

    def labels(self, *values: object, **by_name: object) -> Any:
        child = self._children.get(values) if values and not by_name else None
        if child is None:
            child = super().labels(*values, **by_name)  # type: ignore[misc]
            if values and all(isinstance(v, str) and str(v) == v for v in values):
                self._children[values] = child
        return child

    def remove(self, *values: Any) -> None:
        self._children = {}
        super().remove(*values)  # type: ignore[misc]

    def remove_by_labels(self, labels: dict[str, str]) -> None:
        self._children = {}
        super().remove_by_labels(labels)  # type: ignore[misc]

    def clear(self) -> None:
        self._children = {}
        super().clear()  # type: ignore[misc]


class Counter(_CachedLabels, _Counter):
    pass


class Gauge(_CachedLabels, _Gauge):
    pass


class Histogram(_CachedLabels, _Histogram):
    pass


# The families a turn records, labelled by its model first (issue 39: several models behind one gateway).
MODEL_LABELLED = ("turns", "prompt_tokens", "turn_seconds", "local_bound_tokens", "conversation_lookups",
                  "handles_released", "handles_missing")


class ForModel:
    """A family whose first label, `model`, is given: `labels(...)` takes the others, as before it had one."""

    __slots__ = ("_family", "_model")

    def __init__(self, family: Any, model: str) -> None:
        self._family, self._model = family, model

    def labels(self, *values: object, **by_name: object) -> Any:
        if by_name:
            return self._family.labels(model=self._model, **by_name)
        return self._family.labels(self._model, *values)


class Metrics:
    def __init__(self) -> None:
        # Engines are labelled by name, never by URL: /metrics must not show hosts and ports (issue 38). The
        # health loop fills this for every engine of the pools (Engine.name).
        self.engine_names: dict[str, str] = {}
        self.registry = CollectorRegistry()
        r = self.registry
        self.turns = Counter("pdgw_turns", "Turns by plan and reason", ["model", "plan", "reason"], registry=r)
        self.prompt_tokens = Counter(
            "pdgw_prompt_tokens", "Prompt tokens read from D's KV (reused) vs prefilled on P (computed)",
            ["model", "source"], registry=r)
        self.turn_seconds = Histogram(
            "pdgw_turn_seconds", "Turn latency by phase", ["model", "phase"], buckets=LATENCY_BUCKETS, registry=r)
        self.gateway_seconds = Histogram(
            "pdgw_gateway_seconds", "The gateway's own time per turn, engine waits excluded, by span (turns/intake/clock.py)",
            ["span"], buckets=GATEWAY_BUCKETS, registry=r)
        self.upstream_errors = Counter(
            "pdgw_upstream_errors", "Engine errors by pool and kind", ["pool", "kind"], registry=r)
        self.rejected = Counter(
            "pdgw_rejected", "Requests refused as the client's fault (4xx), by API and reason (the error code)",
            ["api", "reason"], registry=r)
        self.local_bound_tokens = Histogram(
            "pdgw_local_bound_tokens", "Tokens a warm turn's D may compute itself given its headroom (the local bound)",
            ["model", "plan"], buckets=(0, 256, 512, 1024, 2048, 4096, 8192, 16384), registry=r)
        self.store_seconds = Histogram(
            "pdgw_store_seconds", "Conversation store latency by operation", ["op"],
            buckets=LATENCY_BUCKETS, registry=r)
        self.store_errors = Counter("pdgw_store_errors", "Store operations that failed", ["op"], registry=r)
        self.conversation_lookups = Counter(
            "pdgw_conversation_lookups", "How turns found their conversation: session id, token prefix or new",
            ["model", "how"], registry=r)
        self.handles_released = Counter(
            "pdgw_handles_released", "D handles released unused, by why", ["model", "reason"], registry=r)
        self.handles_missing = Counter(
            "pdgw_handles_missing", "Finished turns whose D returned no handle, by why", ["model", "reason"],
            registry=r)

        # Across workers (serve --workers): the host's pins and budget are its workers' sums; the used ratio is
        # each worker's own (a `pid` label), as no sum or maximum of ratios would mean anything.
        self.pinned_tokens = Gauge(
            "pdgw_pinned_tokens", "Tokens of KV this gateway's stored handles pin on each D", ["engine"],
            registry=r, multiprocess_mode="livesum")
        self.handles_evicted = Counter(
            "pdgw_handles_evicted", "Idle handles released to keep a D within its pin budget", ["engine"],
            registry=r)
        self.pins_used_ratio = Gauge(
            "pdgw_pins_used_ratio", "Share of the handles kept on each D that a later turn used before they were "
            "evicted or expired (decayed over about the last 50)", ["engine"], registry=r,
            multiprocess_mode="liveall")
        self.pin_saved_tokens = Counter(
            "pdgw_pin_saved_tokens", "Prompt tokens read from kept handles instead of recomputed on P, per D",
            ["engine"], registry=r)
        self.pin_budget_blocks = Gauge(
            "pdgw_pin_budget_blocks", "Each D's effective pin budget in blocks: decode_pin_budget scaled by how well "
            "pins pay and by D's pressure", ["engine"], registry=r,
            multiprocess_mode="livesum")
        self.push_decode_aborts = Counter(
            "pdgw_push_decode_aborts", "Push mode: D legs the gateway aborted while D waited for P's WRITE, by why "
            "(prefill_failed and no_write may leave D's blocks held: vLLM frees them only on a WRITE)", ["reason"],
            registry=r)
        self.learned_rates = LearnedRates(self.engine_label)
        r.register(self.learned_rates)
        self.engine_data_plane = EngineDataPlane()
        r.register(self.engine_data_plane)
        self.kv_events = KVEventsState()
        r.register(self.kv_events)
        self.engine_health = EngineHealth()
        r.register(self.engine_health)
        # What each process knows now, read at scrape time: with workers, the scraped one's view
        self._live = (self.learned_rates, self.engine_data_plane, self.kv_events, self.engine_health)
        # The turn's families carry the served model first; this object gives it as "" (tests, one model unnamed),
        # `for_model` as a model's name (assembly.py: each model's turn machinery gets its own view).
        self._per_model = {name: getattr(self, name) for name in MODEL_LABELLED}
        self._label_model("")

    def for_model(self, model: str) -> Metrics:
        """These metrics as one model's turns record them: the same registry and families, its name given."""
        view = copy.copy(self)
        view._label_model(model)
        return view

    def _label_model(self, model: str) -> None:
        for name, family in self._per_model.items():
            setattr(self, name, ForModel(family, model))

    def engine_label(self, url: str) -> str:
        return self.engine_names.get(url, "unnamed") if url else url

    def render(self) -> bytes:
        shared = os.environ.get(MULTIPROCESS_DIR)
        return generate_latest(self._across_workers(shared) if shared else self.registry)

    def _across_workers(self, path: str) -> CollectorRegistry:
        """Under `serve --workers N` (gateway/workers.py) every worker's counters, histograms and gauges are
        kept in files of one folder by prometheus_client's multiprocess mode, and whichever worker is scraped
        sums them; the collectors read at scrape time (engines' health, data plane, KV events, rates) are its own."""
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path)
        for collector in self._live:
            registry.register(collector)
        return registry


class Sources:
    """A collector's rows, from every part that has some (each model's engines, its rates), read at scrape time."""

    def __init__(self) -> None:
        self._each: list[Callable[[], Iterable[Any]]] = []

    def add(self, source: Callable[[], Iterable[Any]]) -> None:
        self._each.append(source)

    def discard(self, source: Callable[[], Iterable[Any]]) -> None:
        """A part that stopped (a model taken out by a reload): its rows no longer show."""
        self._each = [s for s in self._each if s != source]

    def __call__(self) -> list[Any]:
        return [row for source in self._each for row in source()]


class LearnedRates:
    """`pdgw_learned_rate_tokens_per_second{rate, prefill, decode}`: the cost plan's rates (P's prefill, P reading
    D's KV), read from `source` at scrape time so the turns that update them pay nothing."""

    def __init__(self, name: Callable[[str], str] = str) -> None:
        self.source = Sources()
        self._name = name            # engine URL → its label

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("pdgw_learned_rate_tokens_per_second",
                                   "The cost plan's learned rates: P's prefill, P reading D's KV",
                                   labels=["rate", "prefill", "decode"])
        for rate, prefill, decode, value in self.source():
            family.add_metric([rate, self._name(prefill), self._name(decode)], value)
        yield family


@dataclass(frozen=True)
class HistogramSnapshot:
    """A Prometheus histogram as scraped: cumulative counts per upper bound (ascending, +Inf last)."""
    buckets: tuple[tuple[float, float], ...]
    sum: float
    count: float

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    def quantile(self, q: float) -> float | None:
        """As PromQL's histogram_quantile: linear within the bucket the rank falls in (None: no observations;
        the highest finite bound when the rank falls in +Inf)."""
        if not self.count or not self.buckets:
            return None
        rank, lower, below = q * self.count, 0.0, 0.0
        for bound, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(bound):
                    return lower
                inside = cumulative - below
                return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
            lower, below = bound, cumulative
        return lower


# The engines' data plane, re-exported per engine (`pool`, `engine` = its URL) from what the health loop scraped
# off each engine's /metrics (engines/dataplane.py): attribute of the readings, name, type, help.
ENGINE_FAMILIES = (
    ("kv_cache_usage", "pdgw_engine_kv_cache_usage_ratio", "gauge",
     "Fraction of the engine's KV blocks in use (vllm:kv_cache_usage_perc)"),
    ("requests_waiting", "pdgw_engine_requests_waiting", "gauge",
     "Requests queued on the engine (vllm:num_requests_waiting; on D also those waiting for P's KV)"),
    ("requests_running", "pdgw_engine_requests_running", "gauge",
     "Requests in the engine's batches (vllm:num_requests_running)"),
    ("preemptions", "pdgw_engine_preemptions", "counter",
     "Requests the engine preempted for lack of KV blocks (vllm:num_preemptions)"),
    ("nixl_xfer_seconds", "pdgw_engine_nixl_transfer_seconds", "histogram",
     "Duration of each NIXL KV read this engine made, as the reader: on D the wait for P's KV, on P the read "
     "of D's (vllm:nixl_xfer_time_seconds)"),
    ("nixl_bytes", "pdgw_engine_nixl_transfer_bytes", "histogram",
     "Bytes per NIXL KV read this engine made (vllm:nixl_bytes_transferred)"),
    ("nixl_descriptors", "pdgw_engine_nixl_transfer_descriptors", "histogram",
     "Descriptors per NIXL KV read this engine made (vllm:nixl_num_descriptors)"),
    ("nixl_failed_transfers", "pdgw_engine_nixl_failed_transfers", "counter",
     "NIXL transfers, handshakes and notifications that failed (vllm:nixl_num_failed_transfers)"),
    ("nixl_kv_expired", "pdgw_engine_nixl_kv_expired", "counter",
     "KV held for a reader that expired unread, or a read declined as expiring (vllm:nixl_num_kv_expired_reqs)"),
)


class EngineDataPlane:
    """`pdgw_engine_*{pool, engine}`: each engine's data plane as last scraped, read from `source` at scrape time:
    (pool, engine name, readings) with the ENGINE_FAMILIES attributes (None: not reported by that engine)."""

    def __init__(self) -> None:
        self.source = Sources()

    def collect(self) -> Iterator[Metric]:
        rows = list(self.source())
        for attr, name, kind, help_text in ENGINE_FAMILIES:
            family: Any
            if kind == "histogram":
                family = HistogramMetricFamily(name, help_text, labels=["pool", "engine"])
            elif kind == "counter":
                family = CounterMetricFamily(name, help_text, labels=["pool", "engine"])
            else:
                family = GaugeMetricFamily(name, help_text, labels=["pool", "engine"])
            for pool, engine, readings in rows:
                value = getattr(readings, attr, None)
                if value is None:
                    continue
                if kind == "histogram":
                    family.add_metric([pool, engine], [(floatToGoString(b), c) for b, c in value.buckets],
                                      value.sum)
                else:
                    family.add_metric([pool, engine], float(value))
            yield family


class EngineHealth:
    """`pdgw_engine_healthy{pool, engine}`: 1 if the engine passes health checks, from `source` at scrape time:
    (pool, engine name, healthy) for each engine checked at least once; one that left its pool leaves with it."""

    def __init__(self) -> None:
        self.source = Sources()

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("pdgw_engine_healthy", "1 if the engine passes health checks",
                                   labels=["pool", "engine"])
        for pool, engine, healthy in self.source():
            family.add_metric([pool, engine], 1.0 if healthy else 0.0)
        yield family


class KVEventsState:
    """`pdgw_kv_events_*{pool, engine}`: what each engine's KV events say of its prefix cache, read from `source`
    at scrape time: (pool, engine URL, blocks indexed, knowledge, batches lost) per subscribed engine."""

    KNOWLEDGE = ("unknown", "partial", "complete")

    def __init__(self) -> None:
        self.source = Sources()

    def collect(self) -> Iterator[Metric]:
        rows = list(self.source())
        blocks = GaugeMetricFamily("pdgw_kv_events_cached_blocks", "Blocks each engine's prefix cache holds by its "
                                   "KV events (those the gateway could chain)", labels=["pool", "engine"])
        known = GaugeMetricFamily("pdgw_kv_events_knowledge", "1 for what the gateway knows of each engine's cache: "
                                  "complete, partial (events lost: positives only) or unknown",
                                  labels=["pool", "engine", "knowledge"])
        gaps = CounterMetricFamily("pdgw_kv_events_gaps", "Times a batch's sequence number showed events lost "
                                   "(a gap, or an engine restarted: its numbers from 0 again)",
                                   labels=["pool", "engine"])
        for pool, engine, count, knowledge, lost in rows:
            blocks.add_metric([pool, engine], float(count))
            for state in self.KNOWLEDGE:
                known.add_metric([pool, engine, state], 1.0 if state == knowledge else 0.0)
            gaps.add_metric([pool, engine], float(lost))
        yield from (blocks, known, gaps)


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
