"""Reading an engine's KV capacity from its /metrics page: vLLM's text, the simulator's, odd cases."""

from __future__ import annotations

import pytest

from gateway.engines.capacity import KVCapacity, kv_capacity, parse_samples

# As vLLM 0.11+ exports them (v1 engine): every CacheConfig field a label of the info gauge.
VLLM = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="27306",num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",swap_space="4"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.25
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-0.6B"} 3.0
"""
DATA_PARALLEL = """\
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="3000"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 1.0
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
"""


@pytest.mark.parametrize(("text", "expected"), [
    (VLLM, KVCapacity(27306, 16, 0.25, 3)),
    (DATA_PARALLEL, KVCapacity(4000, 16, 0.25, 2)),        # usage weighted by each engine core's blocks
    ('vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n', KVCapacity(None, 16, None, 0)),
    ("vllm:kv_cache_usage_perc 0.5\n", KVCapacity(None, None, 0.5, 0)),   # no labels at all
    ("", KVCapacity()),
    ("garbage line\nvllm:kv_cache_usage_perc{engine=\"0\"} not-a-number\n", KVCapacity()),
])
def test_kv_capacity(text, expected):
    assert kv_capacity(text) == expected


def test_capacity_in_tokens_and_free_blocks():
    cap = kv_capacity(VLLM)
    assert cap.capacity_tokens == 27306 * 16
    assert cap.free_blocks == round(27306 * 0.75)
    assert KVCapacity(num_gpu_blocks=10).free_blocks is None and KVCapacity(usage=0.1).capacity_tokens is None


def test_label_values_keep_escaped_quotes_commas_and_braces():
    [(name, labels, value)] = parse_samples('m{a="x\\"y, z}",b="p\\\\q"} 2 1700000000000\n')
    assert (name, labels, value) == ("m", {"a": 'x"y, z}', "b": "p\\q"}, 2.0)


def test_the_simulators_page_reads_the_same(tmp_path):
    from gateway.sim.engine_core import Engine
    from gateway.sim.metrics import render_metrics
    from gateway.sim.chat_render import Renderer
    from gateway.sim.settings import SimSettings

    engine = Engine(SimSettings(role="decode", num_blocks=100, block_size=16), Renderer("builtin:demo", None))
    engine.pool.allocate(40)
    assert kv_capacity(render_metrics(engine)) == KVCapacity(100, 16, 0.4, 0)
