"""Which path a warm turn takes: the cost model for "reuse only where it pays" (issues 17 and 24). Pure;
`plan.by_path` calls `choose_path` after continuity has said which handle it may send, with the rates `rates.py`
learns. Three paths: the holder D computes the new suffix itself from its own prefix cache (`local`, no P leg and
no hand-over); P reads D's KV and computes the suffix (`read`); P computes everything (`recompute`).

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

Local against the P paths (issue 24): on an H200 D alone answered as fast as one engine with its prefix cache,
2.1-3.8x faster than the P path, whose D leg alone waits 70-160 ms for the hand-over (docs/protocol.md §9). The
local path is only offered while what D computes stays within `--local-prefill-max-tokens` (D's running streams
share its steps); within it the choice weighs this turn's time to first token and what the turn costs P's other
requests: each second P spends on it delays every request P holds (`p_waiting`), so a busy P tips the choice
towards paths that spend less of P, and at equal time the one that spends less P compute wins.

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
    LOCAL_FASTER = "local_faster"                     # D computes the suffix itself sooner (or as soon)
    P_PATH_FASTER = "p_path_faster"                   # local was allowed, a P path is faster
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


def choose(costs: PairCosts, reusable_tokens: int, p_cached_tokens: int, *, margin: float = DEFAULT_MARGIN,
           p_waiting: int = 0) -> Decision:
    """`reusable_tokens`: what D's handle would supply (continuity's verdict); `p_cached_tokens`: the gateway's
    estimate of how many of them P's prefix cache holds (e.g. the last prompt P served for this conversation);
    `p_waiting`: other requests P holds, each delayed by what recomputing spends of P (a read spends none)."""
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
    if read_s * (1 + margin) < compute_s * (1 + p_waiting):
        return Decision(read_choice, CostReason.READ_FASTER, reusable_tokens, missing, read_s, compute_s)
    return Decision(Choice.RECOMPUTE, CostReason.RECOMPUTE_FASTER, 0, 0, read_s, compute_s)


class Path(StrEnum):
    LOCAL = "local"
    READ = "read"
    RECOMPUTE = "recompute"


@dataclass(frozen=True)
class TurnShape:
    """A warm turn, as the path choice sees it."""
    prompt_tokens: int
    reusable_tokens: int            # what D's handle supplies to P (continuity's verdict)
    local_hit_tokens: int           # what the holder D finds in its own prefix cache on the local path
    p_cached_tokens: int            # the gateway's estimate of P's own prefix-cache hits
    local_allowed: bool             # this turn's D is the holder, and what it would compute is within the bound
    lease_short: bool = False       # ... but the conversation's turns come further apart than D's lease
    p_cache_known: bool = False     # p_cached_tokens is what P's KV events say P holds, not an estimate


@dataclass(frozen=True)
class PathCosts:
    """What is known about the engines a warm turn may use."""
    pair: PairCosts                         # P's prefill rate and the P-D transfer rate
    decode_prefill_tokens_per_s: float | None = None    # D's own compute rate (None: taken as P's)
    local_fixed_s: float = 0.0              # a local D leg's fixed part (D's step with its running streams)
    handover_s: float | None = None         # the P path's D leg: D waiting for P's blocks, to its first token
    p_queued_tokens: int = 0                # prompt tokens P holds ahead of this turn
    p_waiting: int = 0                      # requests P holds


@dataclass(frozen=True)
class PathDecision:
    path: Path
    reason: CostReason
    local_s: float | None                   # expected time to first token on each path (None: not estimated)
    p_path_s: float | None


def choose_path(costs: PathCosts, shape: TurnShape, *, margin: float = DEFAULT_MARGIN) -> PathDecision:
    """Local when it is allowed and at least as cheap as the better P path (within `margin`: at equal time the
    path that spends no P compute wins); else read or recompute as `choose` decides with P's queue weighed."""
    p_rate = costs.pair.prefill_tokens_per_s
    read = choose(costs.pair, shape.reusable_tokens, shape.p_cached_tokens, margin=margin, p_waiting=costs.p_waiting)
    p_path = Path.READ if read.handle_tokens else Path.RECOMPUTE
    if not shape.local_allowed:
        return PathDecision(p_path, read.reason, None, None)
    if not p_rate or costs.handover_s is None:
        # Nothing measured of the P path's hand-over (or P's rate): the short suffix goes the short way, as
        # vLLM's own router does below its bypass threshold; streamed turns teach both.
        return PathDecision(Path.LOCAL, CostReason.RATE_UNKNOWN, None, None)
    new_s = (shape.prompt_tokens - shape.reusable_tokens) / p_rate
    p_seconds = new_s + (read.compute_s if p_path is Path.RECOMPUTE else 0.0)
    history_s = read.read_s if p_path is Path.READ and read.read_s is not None else read.compute_s
    p_path_s = costs.p_queued_tokens / p_rate + history_s + new_s + costs.handover_s
    local_s = costs.local_fixed_s + (shape.prompt_tokens - shape.local_hit_tokens) / (
        costs.decode_prefill_tokens_per_s or p_rate)
    if local_s <= (p_path_s + p_seconds * costs.p_waiting) * (1 + margin):
        return PathDecision(Path.LOCAL, CostReason.LOCAL_FASTER, local_s, p_path_s)
    return PathDecision(p_path, CostReason.P_PATH_FASTER if p_path is Path.READ else read.reason, local_s, p_path_s)


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
