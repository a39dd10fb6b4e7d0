"""Whether reading a conversation's KV from D pays, against P computing it: the cost model for "reuse only where
it pays" (issue 17). Pure; `plan.by_cost` calls `choose` after continuity has said which handle it may send, with
the rates `rates.py` learns.

What a turn with D's handle costs, on vLLM (measured on an H200, bench/GPU-RESULTS.md):
- P takes its own prefix-cache hits first and loads only the rest of the handle's tokens from D; so with a handle
  for R tokens of which P's cache holds `p_cached`, P reads R - p_cached tokens over NIXL, and without a handle P
  computes those same tokens itself. The new suffix is computed in both cases and cancels out.
- Reading costs 1 / transfer rate per token (NIXL's bytes/s over the KV bytes per token; plus a fixed per-read
  cost: handshake, notification); computing costs 1 / prefill rate per token. Both are about linear in the
  tokens, so the cheaper one is best for all of them: reading only a prefix of the missing part (a truncated
  handle) never beats both ends, and the choices are read (the whole handle: `read_all` when P's cache is cold,
  `read_missing` when it holds part) or no handle (`recompute`).
- For that 2.8 B model (36 KiB per token, 63k tokens/s prefill) reading pays above about 2.3 GB/s: it did at
  10.8 GB/s (CUDA IPC, blocks of 128) and did not at 1.6 GB/s (CUDA IPC, blocks of 16) or 0.28 GB/s (TCP).

Rates are learned per P-D pair from the P legs' timings (`rates.py`, with `Rate`), in tokens per second, so the
KV bytes per token cancel out; vLLM's `vllm:nixl_bytes_transferred` / `vllm:nixl_xfer_time_seconds` give the same
in bytes (divide by the bytes per token).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Choice(StrEnum):
    READ_ALL = "read_all"            # send D's handle; P's cache holds none of it
    READ_MISSING = "read_missing"    # send D's handle; P reads only the part its own cache lacks
    RECOMPUTE = "recompute"          # send no handle; P computes what it lacks


class CostReason(StrEnum):
    READ_FASTER = "read_faster"
    RECOMPUTE_FASTER = "recompute_faster"
    P_CACHE_HOLDS_HISTORY = "p_cache_holds_history"   # nothing to read, expected: the handle goes along anyway
    RATE_UNKNOWN = "rate_unknown"                     # no transfer seen on this pair yet: read, and learn
    NOTHING_TO_REUSE = "nothing_to_reuse"


# Read only when it is at least 20% faster: rates are estimates (a probe's at a few thousand tokens, a leg's with
# its fixed part), and near the crossover recomputing, which is what stateless PD does, is the safe side.
DEFAULT_MARGIN = 0.2


@dataclass(frozen=True)
class PairCosts:
    """What is known about one P-D pair and P."""
    transfer_tokens_per_s: float | None     # tokens/s when P reads D's KV; None before the first transfer
    prefill_tokens_per_s: float | None      # P's prefill rate; None before P's first prefill was timed
    read_overhead_s: float = 0.0            # fixed cost of a read (handshake, notification), if measured


@dataclass(frozen=True)
class Decision:
    choice: Choice
    reason: CostReason
    handle_tokens: int                      # tokens the handle sent to P covers (0: no handle)
    read_tokens: int                        # tokens P is expected to load from D
    read_s: float | None                    # expected time to read them (None: rate unknown)
    compute_s: float                        # expected time for P to compute them instead


def choose(costs: PairCosts, reusable_tokens: int, p_cached_tokens: int, *,
           margin: float = DEFAULT_MARGIN) -> Decision:
    """`reusable_tokens`: what D's handle would supply (continuity's verdict); `p_cached_tokens`: the gateway's
    estimate of how many of them P's prefix cache holds (e.g. the last prompt P served for this conversation)."""
    if reusable_tokens <= 0:
        return Decision(Choice.RECOMPUTE, CostReason.NOTHING_TO_REUSE, 0, 0, 0.0, 0.0)
    missing = max(0, reusable_tokens - max(0, p_cached_tokens))
    read_choice = Choice.READ_MISSING if missing < reusable_tokens else Choice.READ_ALL
    if missing == 0:
        # Keep the handle all the same: vLLM loads nothing P's cache holds, and if the estimate is wrong (P's
        # cache evicted the history, or has prefix caching off) the handle saves a whole recompute.
        return Decision(Choice.READ_MISSING, CostReason.P_CACHE_HOLDS_HISTORY, reusable_tokens, 0, 0.0, 0.0)
    if not costs.transfer_tokens_per_s or not costs.prefill_tokens_per_s:
        compute = missing / costs.prefill_tokens_per_s if costs.prefill_tokens_per_s else 0.0
        return Decision(read_choice, CostReason.RATE_UNKNOWN, reusable_tokens, missing, None, compute)
    compute_s = missing / costs.prefill_tokens_per_s
    read_s = missing / costs.transfer_tokens_per_s + costs.read_overhead_s
    if read_s * (1 + margin) < compute_s:
        return Decision(read_choice, CostReason.READ_FASTER, reusable_tokens, missing, read_s, compute_s)
    return Decision(Choice.RECOMPUTE, CostReason.RECOMPUTE_FASTER, 0, 0, read_s, compute_s)


class Rate:
    """A rate (bytes/s, tokens/s) learned from (amount, seconds) observations: an exponentially weighted mean of
    amounts over one of seconds, so large transfers weigh more than tiny ones whose time is mostly overhead."""

    def __init__(self, weight: float = 0.2, min_seconds: float = 1e-4):
        if not 0 < weight <= 1:
            raise ValueError("weight must be in (0, 1]")
        self.weight, self.min_seconds = weight, min_seconds
        self._amount = self._seconds = 0.0

    def observe(self, amount: float, seconds: float) -> None:
        """One transfer or prefill; too-short or empty ones say nothing about the rate and are skipped."""
        if amount <= 0 or seconds < self.min_seconds:
            return
        if self._seconds == 0:
            self._amount, self._seconds = amount, seconds
            return
        self._amount += self.weight * (amount - self._amount)
        self._seconds += self.weight * (seconds - self._seconds)

    @property
    def value(self) -> float | None:
        return self._amount / self._seconds if self._seconds else None
