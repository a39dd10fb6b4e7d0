"""An engine's KV capacity and how full it is, read from its Prometheus `/metrics` (vLLM and the simulator alike).

vLLM exports its cache configuration as an info gauge, `vllm:cache_config_info{...,num_gpu_blocks="N",
block_size="B",...} 1.0` (every CacheConfig field a label, plus `engine`), and its fill as
`vllm:kv_cache_usage_perc{engine,model_name}` in 0..1 (1 = every block in use; blocks freed into the prefix cache
count as free). With data parallelism one server exports one sample per engine core (`engine="0"`, `"1"`...):
the server's capacity is their sum and its usage their block-weighted mean.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


CACHE_INFO = "vllm:cache_config_info"
USAGE = "vllm:kv_cache_usage_perc"
WAITING = "vllm:num_requests_waiting"

# name{labels} value [timestamp]; label values are quoted with \\, \" and \n escapes (exposition format 0.0.4).
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?\s*$')
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}

Sample = tuple[str, dict[str, str], float]


@dataclass(frozen=True)
class KVCapacity:
    num_gpu_blocks: int | None = None     # None: not reported (yet): an engine still profiling says "None"
    block_size: int | None = None
    usage: float | None = None            # fraction of blocks in use, 0..1
    waiting: int = 0                      # requests queued, e.g. for free blocks

    @property
    def capacity_tokens(self) -> int | None:
        if self.num_gpu_blocks is None or self.block_size is None:
            return None
        return self.num_gpu_blocks * self.block_size

    @property
    def free_blocks(self) -> int | None:
        if self.num_gpu_blocks is None or self.usage is None:
            return None
        return max(0, round(self.num_gpu_blocks * (1.0 - self.usage)))


def parse_samples(text: str) -> list[Sample]:
    """Every sample of a Prometheus text page; comments and lines that do not parse are skipped."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        try:
            out.append((name, _labels(labels or ""), float(value)))
        except ValueError:
            continue
    return out


def _labels(text: str) -> dict[str, str]:
    return {m.group(1): re.sub(r'\\[\\"n]', lambda e: _UNESCAPE[e.group(0)], m.group(2))
            for m in _LABEL.finditer(text)}


def kv_capacity(text: str) -> KVCapacity:
    """The KV capacity a `/metrics` page reports (fields it lacks stay None)."""
    blocks: dict[str, int] = {}
    block_size = None
    usage: dict[str, float] = {}
    waiting = 0
    for name, labels, value in parse_samples(text):
        engine = labels.get("engine", "0")
        if name == CACHE_INFO:
            if (n := _int(labels.get("num_gpu_blocks"))) is not None:
                blocks[engine] = n
            block_size = _int(labels.get("block_size")) or block_size
        elif name == USAGE:
            usage[engine] = value
        elif name == WAITING:
            waiting += int(value)
    total = sum(blocks.values()) if blocks else None
    return KVCapacity(total, block_size, _weighted(usage, blocks), waiting)


def _weighted(usage: dict[str, float], blocks: dict[str, int]) -> float | None:
    if not usage:
        return None
    weights = {engine: blocks.get(engine, 1) for engine in usage}
    return sum(usage[e] * weights[e] for e in usage) / max(1, sum(weights.values()))


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None          # "None" before the engine has profiled its memory
