"""vLLM's Prometheus metrics, the subset a gateway reads (names, types, labels and buckets as vLLM 0.32 exports
them: `v1/metrics/loggers.py`, and the NIXL connector's `kv_connector/v1/nixl/stats.py`, registered only on an
engine with a KV connector). Labels sorted, as prometheus_client prints them; counters end in `_total`."""

from __future__ import annotations

from gateway.sim.engine_core import Engine
from gateway.sim.nixl import Histogram

Row = tuple[str, str, str, dict[str, str], float]


def _labels(**labels: str) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def render_metrics(engine: Engine) -> str:
    s, st = engine.settings, engine.stats
    base = {"engine": "0", "model_name": s.model}
    cache_info = {"block_size": str(s.block_size), "cache_dtype": "auto", "calculate_kv_scales": "False",
                  "enable_prefix_caching": str(s.prefix_caching), "gpu_memory_utilization": "0.9",
                  "num_cpu_blocks": "None", "num_gpu_blocks": str(s.num_blocks),
                  "num_gpu_blocks_override": "None", "prefix_caching_hash_algo": "sha256",
                  "swap_space": "0", "engine": "0"}
    rows: list[Row] = [
        ("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig", cache_info, 1.0),
        ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", base,
         engine.running),
        ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", base,
         engine.waiting),
        ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", base,
         engine.pool.in_use / max(1, s.num_blocks)),
        ("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.", base,
         st.requests_preempted),
        ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", base,
         st.prompt_tokens_computed + st.prompt_tokens_cached + st.prompt_tokens_loaded),
        ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", base,
         st.generation_tokens),
    ]
    if s.has_connector:
        rows += [
            ("vllm:nixl_num_failed_transfers_total", "counter",
             "Number of failed NIXL KV Cache transfers, including handshake and notification failures. NOTE: "
             "KV expiry is tracked separately in vllm:nixl_num_kv_expired_reqs.", base, st.kv_load_failures),
            # the holder's leases and pins that ran out unread, and the reads this engine declined as expiring
            ("vllm:nixl_num_kv_expired_reqs_total", "counter",
             "Number of requests that had their KV expire. NOTE: This metric is tracked on the P instance.", base,
             st.handles_expired + st.kv_reads_declined),
        ]
    by_source = {"local_compute": st.prompt_tokens_computed, "local_cache_hit": st.prompt_tokens_cached,
                 "external_kv_transfer": st.prompt_tokens_loaded}
    lines: list[str] = []
    for name, kind, help_text, labels, value in rows:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{_labels(**labels)} {float(value)}"]
    name = "vllm:num_requests_waiting_by_reason"      # the two sum to vllm:num_requests_waiting
    lines += [f"# HELP {name} Number of waiting requests by reason.", f"# TYPE {name} gauge",
              f"{name}{_labels(**base, reason='capacity')} {float(engine.waiting - engine.deferred)}",
              f"{name}{_labels(**base, reason='deferred')} {float(engine.deferred)}"]
    name = "vllm:prompt_tokens_by_source_total"
    lines += [f"# HELP {name} Number of prompt tokens by source.", f"# TYPE {name} counter"]
    lines += [f"{name}{_labels(**base, source=src)} {float(v)}" for src, v in by_source.items()]
    if s.has_connector:
        nixl = engine.nixl
        lines += _histogram("vllm:nixl_xfer_time_seconds",
                            "Histogram of transfer duration for NIXL KV Cache transfers.", base, nixl.xfer_time)
        lines += _histogram("vllm:nixl_bytes_transferred",
                            "Histogram of bytes transferred per NIXL KV Cache transfers.", base,
                            nixl.bytes_transferred)
        lines += _histogram("vllm:nixl_num_descriptors",
                            "Histogram of number of descriptors per NIXL  KV Cache transfers.", base,
                            nixl.descriptors)
    return "\n".join(lines) + "\n"


def _histogram(name: str, help_text: str, labels: dict[str, str], histogram: Histogram) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
    lines += [f"{name}_bucket{_labels(**labels, le=bound)} {float(n)}" for bound, n in histogram.cumulative()]
    lines += [f"{name}_count{_labels(**labels)} {float(histogram.count)}",
              f"{name}_sum{_labels(**labels)} {float(histogram.total)}"]
    return lines
