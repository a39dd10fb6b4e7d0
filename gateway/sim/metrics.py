"""vLLM's Prometheus metrics, the subset a gateway reads (names and labels as vLLM 0.32 exports them)."""

from __future__ import annotations

from gateway.sim.engine import Engine


def _labels(**labels: str) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def render_metrics(engine: Engine) -> str:
    s, st = engine.settings, engine.stats
    base = {"engine": "0", "model_name": s.model}
    cache_info = {"block_size": str(s.block_size), "cache_dtype": "auto", "calculate_kv_scales": "False",
                  "enable_prefix_caching": str(s.prefix_caching), "gpu_memory_utilization": "0.9",
                  "num_cpu_blocks": "None", "num_gpu_blocks": str(s.num_blocks),
                  "num_gpu_blocks_override": "None", "prefix_caching_hash_algo": "sha256",
                  "swap_space": "0", "engine": "0"}
    rows: list[tuple[str, str, str, dict[str, str], float]] = [
        ("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig", cache_info, 1.0),
        ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", base,
         engine.running),
        ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", base,
         engine.waiting),
        ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", base,
         engine.pool.in_use / max(1, s.num_blocks)),
        ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", base,
         st.prompt_tokens_computed + st.prompt_tokens_cached + st.prompt_tokens_loaded),
        ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", base,
         st.generation_tokens),
    ]
    by_source = {"local_compute": st.prompt_tokens_computed, "local_cache_hit": st.prompt_tokens_cached,
                 "external_kv_transfer": st.prompt_tokens_loaded}
    lines: list[str] = []
    for name, kind, help_text, labels, value in rows:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{_labels(**labels)} {float(value)}"]
    name = "vllm:prompt_tokens_by_source_total"
    lines += [f"# HELP {name} Number of prompt tokens by source.", f"# TYPE {name} counter"]
    lines += [f"{name}{_labels(**base, source=src)} {float(v)}" for src, v in by_source.items()]
    return "\n".join(lines) + "\n"
