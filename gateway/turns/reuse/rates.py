"""What the gateway has learned of its engines' speeds, for the cost plan (`cost.py`): per P its prefill rate, per
P-D pair the rate at which P reads that D's KV. Seeded, and refreshed every few minutes, by a calibration probe
per pair (`calibration.py`), so that no turn has to pay for learning; fed after every successful P leg from the
leg's own timing. In memory, per gateway process (a restart, or another replica, probes again at start-up).

A P leg takes about computed / prefill rate + read / transfer rate, plus a small fixed part (HTTP, P's one
decode step) that the rates absorb. A leg that read nothing teaches P's prefill rate; a leg that read teaches the
pair's transfer rate from what is left of its time after the computed part at the prefill rate already learned.
Rates are in tokens per second, so the KV bytes per token cancel out and need no setting.

Which tokens P computed and which it read: P's own prefix-cache hits come first (vLLM takes local hits before
loading), then the handle's tokens beyond them, then the rest. The hits are the gateway's estimate
(`warm_tokens`: the previous turn's P still holds the previous turn's prompt), checked against what P reports in
its handle (`remote_prefill_cached_tokens`, vLLM >= 0.31 and the simulator) on legs without a handle. On a leg
that read, the report is not used: vLLM may count the tokens it loaded as cached too (the request's
`num_cached_tokens` includes external ones), which would hide the read. Errors of the estimate there (a P that
still holds an older prompt) overstate the read and so the transfer rate: they lean towards reading, as
`always` does, never towards a recompute that does not pay. The fixed part of a leg leans the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.turns.reuse.cost import PairCosts, PathCosts, Rate

# vLLM's connector skips a read of fewer tokens than its recompute threshold (64 by default with bidirectional
# transfer) and computes them instead: such a leg says nothing about the transfer rate.
MIN_READ_TOKENS = 64
UNTRIED_HALF_LIFE_S = 10.0   # a path's learned time halves for every this long no turn took it (Mean.aged)
_READ_SEEN_S = 0.005    # beyond twice the expected compute time, this much more means a read happened
_SHORTEST_S = 1e-4      # a read hidden in the timing noise: "very fast", not "unknown"


@dataclass(frozen=True)
class ProbeSample:
    """What a calibration probe measured on one P-D pair: the time P takes to compute `tokens` more, and to read
    as many more from D (marginal: a leg's fixed part taken out)."""
    tokens: int
    compute_s: float
    read_s: float


@dataclass(frozen=True)
class DecodeTiming:
    """One streamed D leg, to its first token: `local` (D computed `computed` prompt tokens itself) or after a P
    leg (D waited for P's blocks: the hand-over)."""
    decode: str                  # D's URL
    local: bool
    computed: int
    seconds: float
    at: float = 0.0              # when it was timed (monotonic seconds)


@dataclass(frozen=True)
class PrefillTiming:
    """One P leg, as the gateway saw it."""
    prefill: str                 # P's URL
    holder: str                  # the D whose KV the handle named ("" without a handle)
    prompt_tokens: int
    handle_tokens: int           # tokens the handle covered (0: no handle)
    cached_tokens: int | None    # P's own prefix-cache hits as P reported them (None: not reported)
    expected_cached: int         # the gateway's untrusted estimate of them (`warm_tokens`)
    seconds: float


def split(prompt_tokens: int, handle_tokens: int, cached_tokens: int) -> tuple[int, int]:
    """(tokens P read from D, tokens P computed). P always computes the last prompt token itself."""
    cached = max(0, min(cached_tokens, prompt_tokens - 1))
    read = max(0, min(handle_tokens, prompt_tokens - 1) - cached)
    return read, max(1, prompt_tokens - cached - read)


class Rates:
    def __init__(self, weight: float = 0.2) -> None:
        self.weight = weight
        self._prefill: dict[str, Rate] = {}
        self._transfer: dict[tuple[str, str], Rate] = {}
        self._cold: set[str] = set()    # Ps whose cache last held far less than estimated (evicted, or off)
        self._calibrated: dict[tuple[str, str], PairCosts] = {}      # what the pair's last probe measured
        self._handover: dict[str, Mean] = {}      # per D: first token after P's leg (streamed legs)
        self._local_fixed: dict[str, Mean] = {}   # per D: a local leg's time beyond computing its tokens

    def observe(self, leg: PrefillTiming) -> None:
        reported = leg.cached_tokens if leg.handle_tokens == 0 else None    # see the module's docstring
        self._check_estimate(leg.prefill, reported, leg.expected_cached)
        cached = reported if reported is not None else self._trusted(leg.prefill, leg.expected_cached)
        read, computed = split(leg.prompt_tokens, leg.handle_tokens, cached)
        prefill_rate = self.prefill_rate(leg.prefill)
        if read == 0 and leg.handle_tokens and self._took_a_read(leg, computed, prefill_rate):
            self._cold.add(leg.prefill)          # P's cache did not hold the history after all: P read it
            read, computed = split(leg.prompt_tokens, leg.handle_tokens, 0)
        if read == 0:
            self._rate(self._prefill, leg.prefill).observe(computed, leg.seconds)
            return
        if read < MIN_READ_TOKENS or prefill_rate is None:
            return                       # cannot tell the read's share of the time yet
        read_s = max(_SHORTEST_S, leg.seconds - computed / prefill_rate)
        self._rate(self._transfer, (leg.prefill, leg.holder)).observe(read, read_s)

    @staticmethod
    def _took_a_read(leg: PrefillTiming, computed: int, prefill_rate: float | None) -> bool:
        """A leg with a handle, expected to read nothing (P's cache warm), that took far longer than computing
        its new part: P's cache was cold (evicted, prefix caching off) and P read the history from D. P's report
        cannot tell on such a leg (it may count loaded tokens as cached), the time can."""
        return prefill_rate is not None and leg.seconds > 2 * computed / prefill_rate + _READ_SEEN_S

    def observe_decode(self, leg: DecodeTiming, prefill_rate: float | None) -> None:
        """A streamed D leg's first token: the hand-over of the P path, or the fixed part of a local leg (what
        is left after computing its tokens at P's rate: the same model on the same kind of engine)."""
        if not leg.local:
            self._mean(self._handover, leg.decode).observe(leg.seconds, leg.at)
        elif prefill_rate:
            self._mean(self._local_fixed, leg.decode).observe(max(0.0, leg.seconds - leg.computed / prefill_rate),
                                                              leg.at)

    def path_costs(self, prefill: str, holder: str, *, p_queued_tokens: int, p_waiting: int,
                   now: float = 0.0) -> PathCosts:
        """What the three-path choice weighs for this P and the holder D (cost.choose_path), each path's time as
        of `now`: one not taken lately is aged (`Mean.aged`), so that it is tried again."""
        handover, fixed = self._handover.get(holder), self._local_fixed.get(holder)
        return PathCosts(self.costs(prefill, holder), handover_s=handover.aged(now) if handover else None,
                         local_fixed_s=fixed.aged(now) if fixed else 0.0, p_queued_tokens=p_queued_tokens,
                         p_waiting=p_waiting)

    def calibrate(self, prefill: str, holder: str, sample: ProbeSample) -> None:
        """A probe's measurement (`calibration.py`) is what the pair's costs say until the next one: marginal
        rates, where the legs' own timings carry each leg's fixed part (HTTP, scheduling, P's forward over the
        new tokens: on an H200 as long as computing 4k tokens), which makes small legs look slow."""
        self._calibrated[(prefill, holder)] = PairCosts(transfer_tokens_per_s=sample.tokens / sample.read_s,
                                                       prefill_tokens_per_s=sample.tokens / sample.compute_s)

    def forget(self, engine: str) -> None:
        """An engine came back (maybe another process, on another transport): its calibrations no longer hold."""
        for pair in [pair for pair in self._calibrated if engine in pair]:
            del self._calibrated[pair]

    def known(self) -> list[tuple[str, str, str, float]]:
        """The rates each pair's plan weighs, for the metrics: (`prefill` or `read`, P, D, tokens/s); a P's
        prefill rate learned from its legs alone has D "" (the pair has no calibration yet)."""
        rows = []
        for (p, d), costs in self._calibrated.items():
            rows += [("prefill", p, d, costs.prefill_tokens_per_s), ("read", p, d, costs.transfer_tokens_per_s)]
        rows += [("prefill", p, "", r.value) for p, r in self._prefill.items()]
        rows += [("read", p, d, r.value) for (p, d), r in self._transfer.items() if (p, d) not in self._calibrated]
        return [(kind, p, d, value) for kind, p, d, value in rows if value]

    def costs(self, prefill: str, holder: str) -> PairCosts:
        if calibrated := self._calibrated.get((prefill, holder)):
            return calibrated
        transfer = self._transfer.get((prefill, holder))
        return PairCosts(transfer_tokens_per_s=transfer.value if transfer else None,
                         prefill_tokens_per_s=self.prefill_rate(prefill))

    def prefill_rate(self, prefill: str) -> float | None:
        rate = self._prefill.get(prefill)
        return rate.value if rate else None

    def any_prefill_rate(self) -> float | None:
        """The best known P prefill rate: D runs the same model on the same kind of engine (a local leg's rate)."""
        known = [r.value for r in self._prefill.values() if r.value] + \
            [c.prefill_tokens_per_s for c in self._calibrated.values() if c.prefill_tokens_per_s]
        return max(known) if known else None

    def warm_tokens(self, prefill: str, previous_prefill: str, previous_held: int, *, trusted: bool = True) -> int:
        """How many of the conversation's held tokens P's prefix cache holds, as far as the gateway can tell: P
        served the last turn, so it holds that turn's prompt, which is all D holds but the last answer (a
        slight overestimate: that answer, P computes either way). 0 for another P, and, when `trusted`, for a P
        whose cache was last found cold (the untrusted figure is what P's next report is checked against)."""
        if prefill != previous_prefill:
            return 0
        return self._trusted(prefill, previous_held) if trusted else previous_held

    def _trusted(self, prefill: str, estimate: int) -> int:
        return 0 if prefill in self._cold else estimate

    def _check_estimate(self, prefill: str, reported: int | None, expected: int) -> None:
        """P's report against the estimate: an estimate twice too high marks P's cache as not to be counted on
        (until a report meets it again)."""
        if reported is None or expected <= 0:
            return
        if reported * 2 < expected:
            self._cold.add(prefill)
        else:
            self._cold.discard(prefill)

    def _rate(self, rates: dict, key: object) -> Rate:
        if key not in rates:
            rates[key] = Rate(self.weight)
        return rates[key]

    def _mean(self, means: dict[str, Mean], key: str) -> Mean:
        if key not in means:
            means[key] = Mean(self.weight)
        return means[key]


class Mean:
    """An exponentially weighted mean of seconds, and when it was last fed."""

    def __init__(self, weight: float) -> None:
        self.weight, self.value = weight, 0.0
        self._seen = False
        self.at = 0.0

    def observe(self, seconds: float, at: float = 0.0) -> None:
        self.value = seconds if not self._seen else self.value + self.weight * (seconds - self.value)
        self._seen = True
        self.at = max(self.at, at)

    def aged(self, now: float, half_life_s: float = UNTRIED_HALF_LIFE_S) -> float:
        """The mean, halved for every `half_life_s` since it was last fed. A path's time is learned only from
        turns that take it: one learned while D was overloaded (its local legs queued behind 128 streams) would
        keep every later turn on the other path after the load was gone, and nothing would correct it (the
        H200, chat at 128 then at 8 at once: all 18 later turns at 8 went `p_path_faster`, at 2.6x the co-located
        engine's TTFT). Aged, an untried path is tried again within a few half-lives, and its turn re-learns it."""
        return self.value * 0.5 ** (max(0.0, now - self.at) / half_life_s)
