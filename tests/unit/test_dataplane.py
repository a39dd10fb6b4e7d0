"""The data plane the health loop reads off each engine's /metrics, and how the gateway serves it again.

The engine page here is made the way vLLM 0.32 makes its own: prometheus_client objects with vLLM's names, label
names, buckets and types (`v1/metrics/loggers.py`, `kv_connector/v1/nixl/stats.py`), two engine cores (data
parallelism), so `_created` series, `_total` counters and label order are exactly what a real engine prints."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.engines import dataplane
from gateway.telemetry import ENGINE_FAMILIES, HistogramSnapshot, Metrics

XFER_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0]
BYTES_BUCKETS = [2 ** (10 + i) for i in range(1, 25, 2)]
DESC_BUCKETS = [10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000]


def vllm_page() -> str:
    r = CollectorRegistry()
    labels = ["model_name", "engine"]
    xfer = Histogram("vllm:nixl_xfer_time_seconds", "x", labels, buckets=XFER_BUCKETS, registry=r)
    size = Histogram("vllm:nixl_bytes_transferred", "b", labels, buckets=BYTES_BUCKETS, registry=r)
    desc = Histogram("vllm:nixl_num_descriptors", "d", labels, buckets=DESC_BUCKETS, registry=r)
    failed = Counter("vllm:nixl_num_failed_transfers", "f", labels, registry=r)
    expired = Counter("vllm:nixl_num_kv_expired_reqs", "e", labels, registry=r)
    preempt = Counter("vllm:num_preemptions", "p", labels, registry=r)
    usage = Gauge("vllm:kv_cache_usage_perc", "u", labels, registry=r)
    waiting = Gauge("vllm:num_requests_waiting", "w", labels, registry=r)
    running = Gauge("vllm:num_requests_running", "r", labels, registry=r)
    by_reason = Gauge("vllm:num_requests_waiting_by_reason", "w", [*labels, "reason"], registry=r)
    Gauge("vllm:cache_config_info", "c", ["block_size", "engine", "num_gpu_blocks"], registry=r) \
        .labels("16", "0", "1000").set(1)
    for engine, seconds in (("0", [0.004, 0.02, 0.02, 0.06]), ("1", [0.09])):
        for s in seconds:
            xfer.labels("m", engine).observe(s)
            size.labels("m", engine).observe(3 * 2 ** 20)
            desc.labels("m", engine).observe(168)
        failed.labels("m", engine).inc(1)
        preempt.labels("m", engine).inc(2)
        waiting.labels("m", engine).set(3)
        by_reason.labels("m", engine, "capacity").set(1)
        by_reason.labels("m", engine, "deferred").set(2)
        running.labels("m", engine).set(1)
    expired.labels("m", "0").inc(4)
    usage.labels("m", "0").set(0.5)
    return generate_latest(r).decode()


def test_a_vllm_page_read_whole_over_engine_cores():
    capacity, dp = dataplane.parse(vllm_page(), now=1.0)
    assert capacity.num_gpu_blocks == 1000 and dp.kv_cache_usage == 0.5
    assert (dp.requests_waiting, dp.requests_running, dp.preemptions) == (6, 2, 4)
    assert (dp.requests_deferred, dp.requests_queued) == (4, 2)    # waiting for KV is not a queue for room
    assert (dp.nixl_failed_transfers, dp.nixl_kv_expired) == (2, 4)
    assert dp.nixl_xfer_seconds.count == 5 and dp.nixl_xfer_seconds.sum == pytest.approx(0.194)
    assert dp.nixl_xfer_seconds.buckets[-1] == (math.inf, 5)
    assert dp.nixl_bytes.mean == 3 * 2 ** 20 and dp.nixl_descriptors.mean == 168
    summary = dp.summary()["nixl"]
    assert summary["transfers"] == 5 and 0.01 < summary["transfer_seconds_p50"] <= 0.025


def test_a_co_located_engine_has_no_nixl_readings():
    _, dp = dataplane.parse('vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n')
    assert dp.kv_cache_usage == 0.25 and dp.nixl_xfer_seconds is None and "nixl" not in dp.summary()
    assert dp.requests_waiting is None


@pytest.mark.parametrize(("q", "expected"), [
    (0.5, 0.0175), (0.9, 0.04), (1.0, 0.05), (0.0, 0.0),
])
def test_quantiles_interpolate_like_histogram_quantile(q, expected):
    snap = HistogramSnapshot(((0.01, 1), (0.025, 3), (0.05, 4), (math.inf, 4)), 0.1, 4)
    assert snap.quantile(q) == pytest.approx(expected)
    assert HistogramSnapshot((), 0, 0).quantile(0.5) is None
    assert HistogramSnapshot(((0.01, 0), (math.inf, 2)), 1.0, 2).quantile(0.9) == 0.01   # all in +Inf


def test_the_gateway_serves_every_family_per_engine_and_the_page_parses():
    metrics = Metrics()
    _, dp = dataplane.parse(vllm_page())
    _, colocated = dataplane.parse('vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.1\n')
    metrics.engine_data_plane.source = lambda: [("decode", "http://d0:8200", dp), ("prefill", "http://p0", colocated)]
    text = metrics.render().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for _, name, kind, _ in ENGINE_FAMILIES:
        family = families[name.removesuffix("_total")]
        assert family.type == kind
        assert {s.labels["engine"] for s in family.samples} >= {"http://d0:8200"}
    xfer = {s.name: s.value for s in families["pdgw_engine_nixl_transfer_seconds"].samples
            if s.labels.get("le") in (None, "+Inf")}
    assert xfer == {"pdgw_engine_nixl_transfer_seconds_bucket": 5, "pdgw_engine_nixl_transfer_seconds_count": 5,
                    "pdgw_engine_nixl_transfer_seconds_sum": pytest.approx(0.194)}
    assert 'pdgw_engine_kv_cache_usage_ratio{engine="http://p0",pool="prefill"} 0.1' in text
    assert 'pdgw_engine_nixl_transfer_seconds_count{engine="http://p0"' not in text      # no connector, no series
