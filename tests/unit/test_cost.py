"""The cost model: read D's KV or let P recompute it, with the rates measured on an H200 (bench/GPU-RESULTS.md)."""

from __future__ import annotations

import pytest

from gateway.turns.reuse.cost import Choice, CostReason, PairCosts, Rate, choose

KV_BYTES = 36 * 1024          # the bench's 2.8 B model: 36 KiB of KV per token
PREFILL = 63_000              # tokens/s, vLLM's prefill time on the co-located engine
GBPS = 1e9


def costs(rate: float | None, overhead: float = 0.0) -> PairCosts:
    return PairCosts(transfer_tokens_per_s=rate / KV_BYTES if rate else None, prefill_tokens_per_s=PREFILL,
                     read_overhead_s=overhead)


@pytest.mark.parametrize(("rate", "reusable", "p_cached", "overhead", "choice", "reason", "read"), [
    # CUDA IPC with blocks of 128 (10.8 GB/s): reading 32k tokens takes 0.11 s against 0.51 s of prefill
    (10.8 * GBPS, 32_000, 0, 0.0, Choice.READ_ALL, CostReason.READ_FASTER, 32_000),
    # CUDA IPC with blocks of 16 (1.6 GB/s) and TCP (0.28 GB/s): P recomputes faster than it reads
    (1.6 * GBPS, 32_000, 0, 0.0, Choice.RECOMPUTE, CostReason.RECOMPUTE_FASTER, 0),
    (0.28 * GBPS, 32_000, 0, 0.0, Choice.RECOMPUTE, CostReason.RECOMPUTE_FASTER, 0),
    # at the break-even rate (36 KiB x 63k tokens/s = 2.32 GB/s) the margin keeps the handle away
    (2.32 * GBPS, 32_000, 0, 0.0, Choice.RECOMPUTE, CostReason.RECOMPUTE_FASTER, 0),
    # P's cache holds the whole history: the handle reads nothing (vLLM takes local hits first) and goes along,
    # so that a wrong estimate costs no recompute
    (10.8 * GBPS, 32_000, 32_000, 0.0, Choice.READ_MISSING, CostReason.P_CACHE_HOLDS_HISTORY, 0),
    (0.28 * GBPS, 32_000, 40_000, 0.0, Choice.READ_MISSING, CostReason.P_CACHE_HOLDS_HISTORY, 0),
    # P's cache holds the last prompt, not the last answer: the handle reads only the missing 2k tokens
    (10.8 * GBPS, 32_000, 30_000, 0.0, Choice.READ_MISSING, CostReason.READ_FASTER, 2_000),
    # a few missing tokens: a fixed cost per read outweighs computing them
    (10.8 * GBPS, 32_000, 31_900, 0.005, Choice.RECOMPUTE, CostReason.RECOMPUTE_FASTER, 0),
    # no transfer seen on this pair yet: read, so that the rate gets learned
    (None, 32_000, 0, 0.0, Choice.READ_ALL, CostReason.RATE_UNKNOWN, 32_000),
    (None, 32_000, 1_000, 0.0, Choice.READ_MISSING, CostReason.RATE_UNKNOWN, 31_000),
    # nothing reusable (continuity found no common prefix)
    (10.8 * GBPS, 0, 0, 0.0, Choice.RECOMPUTE, CostReason.NOTHING_TO_REUSE, 0),
])
def test_choose(rate, reusable, p_cached, overhead, choice, reason, read):
    d = choose(costs(rate, overhead), reusable, p_cached)
    assert (d.choice, d.reason, d.read_tokens) == (choice, reason, read)
    assert d.handle_tokens == (reusable if choice is not Choice.RECOMPUTE else 0)


def test_expected_times_are_reported_for_the_plan_to_log():
    d = choose(costs(10.8 * GBPS), 32_000, 0)
    assert d.read_s == pytest.approx(32_000 * KV_BYTES / (10.8 * GBPS))
    assert d.compute_s == pytest.approx(32_000 / PREFILL)


def test_the_margin_is_adjustable():
    near = costs(2.0 * GBPS)            # reading 0.59 s against 0.51 s of prefill: recompute either way
    fast = costs(2.6 * GBPS)            # reading 0.45 s against 0.51 s: 12% faster
    assert choose(near, 32_000, 0, margin=0.0).choice is Choice.RECOMPUTE
    assert choose(fast, 32_000, 0, margin=0.0).choice is Choice.READ_ALL
    assert choose(fast, 32_000, 0, margin=0.2).choice is Choice.RECOMPUTE


def test_rate_is_learned_from_amounts_and_seconds():
    rate = Rate(weight=0.5)
    assert rate.value is None
    rate.observe(1.2e9, 0.5)                       # 2.4 GB/s
    assert rate.value == pytest.approx(2.4e9)
    rate.observe(1.2e9, 0.1)                       # 12 GB/s: the mean moves halfway in amount and in time
    assert rate.value == pytest.approx(1.2e9 / 0.3)
    rate.observe(0, 1.0)                           # empty transfers and too-short timings say nothing
    rate.observe(1e6, 0.0)
    assert rate.value == pytest.approx(1.2e9 / 0.3)


def test_a_large_transfer_weighs_more_than_a_tiny_one():
    rate = Rate(weight=0.5)
    rate.observe(2.4e9, 1.0)                       # 2.4 GB/s on a large read
    rate.observe(1e6, 0.01)                        # 0.1 GB/s on a tiny one, mostly overhead
    assert rate.value > 2e9


def test_rate_weight_is_checked():
    with pytest.raises(ValueError):
        Rate(weight=0)


def test_unknown_prefill_rate_reads_and_learns():
    d = choose(PairCosts(transfer_tokens_per_s=1e6, prefill_tokens_per_s=None), 32_000, 0)
    assert (d.choice, d.reason) == (Choice.READ_ALL, CostReason.RATE_UNKNOWN)
