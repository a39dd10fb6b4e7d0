"""An engine's data plane, read off its Prometheus `/metrics` page by the health loop (health.py): what vLLM's NIXL
connector measured of the KV reads this engine made as the reader, and how loaded its scheduler is.

Names and types as vLLM 0.32 exports them (`v1/metrics/loggers.py`, `kv_connector/v1/nixl/stats.py`):
- `vllm:nixl_xfer_time_seconds`, `vllm:nixl_bytes_transferred`, `vllm:nixl_num_descriptors`: histograms, one
  observation per finished read. In pull mode the reader records them: D for P's KV (the wait before D's first
  token), P for D's KV (a later turn's reuse).
- `vllm:nixl_num_failed_transfers` (transfers, handshakes and notifications), `vllm:nixl_num_kv_expired_reqs`
  (held KV that expired unread on the holder, reads declined as expiring on the reader): counters.
- `vllm:kv_cache_usage_perc` (0..1), `vllm:num_requests_waiting`, `vllm:num_requests_running`: gauges;
  `vllm:num_preemptions`: a counter. `vllm:num_requests_waiting_by_reason{reason="deferred"}` (0.25 and 0.32): the
  waiting that wait for a KV transfer (WAITING_FOR_REMOTE_KVS), not for room.
A server with data parallelism exports one sample per engine core (`engine="0"`, `"1"`...): counters, gauges
of requests and histograms are summed; usage is averaged weighted by each core's blocks. The NIXL
series exist only on an engine with a KV connector: a co-located engine reports them as None.
The same page gives the engine's KV capacity (capacity.py), returned beside.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from gateway.engines.capacity import CACHE_INFO, USAGE, KVCapacity, kv_capacity, parse_samples
from gateway.telemetry import HistogramSnapshot

HISTOGRAMS = {"nixl_xfer_seconds": "vllm:nixl_xfer_time_seconds", "nixl_bytes": "vllm:nixl_bytes_transferred",
              "nixl_descriptors": "vllm:nixl_num_descriptors"}
SUMS = {"requests_waiting": "vllm:num_requests_waiting", "requests_running": "vllm:num_requests_running",
        "preemptions": "vllm:num_preemptions_total",
        "nixl_failed_transfers": "vllm:nixl_num_failed_transfers_total",
        "nixl_kv_expired": "vllm:nixl_num_kv_expired_reqs_total"}
# Of the waiting, those vLLM defers (on D: waiting for P's KV, a pull or push leg in flight), not queued for room.
BY_REASON = "vllm:num_requests_waiting_by_reason"
# Only these lines are parsed: a vLLM page is tens of KB, and the loop reads one per engine per round.
_WANTED = tuple(sorted({USAGE, CACHE_INFO, BY_REASON, *SUMS.values(), *HISTOGRAMS.values()}))


@dataclass(frozen=True)
class DataPlane:
    """One scrape of one engine. Counters and histograms run since the engine started (rate() them)."""
    kv_cache_usage: float | None = None
    requests_waiting: float | None = None
    requests_running: float | None = None
    requests_deferred: float | None = None  # of requests_waiting, waiting for a KV transfer (None: not exported)
    preemptions: float | None = None
    nixl_failed_transfers: float | None = None
    nixl_kv_expired: float | None = None
    nixl_xfer_seconds: HistogramSnapshot | None = None
    nixl_bytes: HistogramSnapshot | None = None
    nixl_descriptors: HistogramSnapshot | None = None
    scraped_at: float = 0.0                 # time.time() of the scrape

    @property
    def requests_queued(self) -> float:
        """Requests waiting for room in the engine's batch: the waiting less those waiting for a KV transfer (vLLM
        counts both as waiting; a P leg's turn waiting for its KV on D is not D's queue)."""
        return max(0.0, (self.requests_waiting or 0.0) - (self.requests_deferred or 0.0))

    def summary(self) -> dict[str, Any]:
        """The admin view (`GET /admin/engines`): the same readings, histograms as per-transfer figures."""
        out: dict[str, Any] = {"kv_cache_usage": self.kv_cache_usage, "requests_waiting": self.requests_waiting,
                               "requests_deferred": self.requests_deferred,
                               "requests_running": self.requests_running, "preemptions": self.preemptions,
                               "scraped_at": round(self.scraped_at, 3)}
        if self.nixl_xfer_seconds is not None:
            xfer = self.nixl_xfer_seconds
            out["nixl"] = {
                "transfers": xfer.count, "transfer_seconds_p50": _round(xfer.quantile(0.5)),
                "transfer_seconds_p90": _round(xfer.quantile(0.9)),
                "bytes_per_transfer": _round(self.nixl_bytes.mean if self.nixl_bytes else None),
                "descriptors_per_transfer": _round(self.nixl_descriptors.mean if self.nixl_descriptors else None),
                "failed_transfers": self.nixl_failed_transfers, "kv_expired": self.nixl_kv_expired}
        return out


def parse(text: str, now: float | None = None) -> tuple[KVCapacity, DataPlane]:
    """The engine's KV capacity and data plane from one `/metrics` page."""
    lines = "\n".join(line for line in text.splitlines() if line.startswith(_WANTED))
    capacity = kv_capacity(lines)        # usage: block-weighted over data-parallel engine cores
    sums: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    totals: dict[str, float] = defaultdict(float)
    for name, labels, value in parse_samples(lines):
        if name in (USAGE, CACHE_INFO):
            continue
        if name == BY_REASON:
            if labels.get("reason") == "deferred":
                sums[BY_REASON] = sums.get(BY_REASON, 0.0) + value
            continue
        if name.endswith("_bucket") and "le" in labels:
            buckets[name[: -len("_bucket")]][float(labels["le"])] += value
        elif name.endswith("_sum") and name[: -len("_sum")] in HISTOGRAMS.values():
            totals[name[: -len("_sum")]] += value
        else:
            sums[name] = sums.get(name, 0.0) + value
    fields: dict[str, Any] = {attr: sums.get(name) for attr, name in SUMS.items()}
    fields["requests_deferred"] = sums.get(BY_REASON)
    for attr, name in HISTOGRAMS.items():
        if name in buckets:
            series = tuple(sorted(buckets[name].items()))
            fields[attr] = HistogramSnapshot(series, totals.get(name, 0.0), series[-1][1])
    return capacity, DataPlane(kv_cache_usage=capacity.usage, scraped_at=time.time() if now is None else now,
                               **fields)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)
