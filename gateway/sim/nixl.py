"""What vLLM's NIXL connector measures of each transfer it makes as the reader, kept for `/metrics`.

vLLM 0.32 (`distributed/kv_transfer/kv_connector/v1/nixl/stats.py`) observes, per finished NIXL read, its
duration (`vllm:nixl_xfer_time_seconds`), bytes (`vllm:nixl_bytes_transferred`) and descriptor count
(`vllm:nixl_num_descriptors`) into histograms with the buckets below. The simulator moves no real KV, so a
read's bytes and descriptors come from a notional model shape (NOTIONAL_*: one descriptor per block, layer and
K/V, as NIXL posts them); its duration is the read's own wall time (the HTTP read between sims plus any
`--transfer-ms-per-block`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

XFER_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
BYTES_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))          # 2 KiB .. 8 GiB
DESCRIPTOR_BUCKETS = (10.0, 20.0, 30.0, 50.0, 75.0, 100.0, 200.0, 400.0, 1000.0, 2000.0, 4000.0, 10000.0,
                      20000.0, 50000.0)
NOTIONAL_LAYERS = 28
NOTIONAL_BYTES_PER_TOKEN_LAYER_KV = 2048     # 8 KV heads x 128 dims x 2 bytes (bf16)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)    # per bucket, not cumulative; the last is +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, n in zip([*map(repr, self.buckets), "+Inf"], self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out


@dataclass
class NixlStats:
    xfer_time: Histogram = field(default_factory=lambda: Histogram(XFER_TIME_BUCKETS))
    bytes_transferred: Histogram = field(default_factory=lambda: Histogram(BYTES_BUCKETS))
    descriptors: Histogram = field(default_factory=lambda: Histogram(DESCRIPTOR_BUCKETS))

    def transfer(self, seconds: float, blocks: int, block_size: int) -> None:
        """One finished read of `blocks` KV blocks."""
        self.xfer_time.observe(seconds)
        self.bytes_transferred.observe(float(blocks * block_size * NOTIONAL_LAYERS * 2
                                             * NOTIONAL_BYTES_PER_TOKEN_LAYER_KV))
        self.descriptors.observe(float(blocks * NOTIONAL_LAYERS * 2))
