"""The rates the cost plan weighs, learned from P legs' timings (gateway/turns/reuse/rates.py)."""

from __future__ import annotations

import pytest

from gateway.turns.reuse.cost import PairCosts, Path, TurnShape, choose_path
from gateway.turns.reuse.rates import (MIN_READ_TOKENS, UNTRIED_HALF_LIFE_S, DecodeTiming, Mean, PrefillTiming, Rates,
                                       split)

P, P2, D = "http://p", "http://p2", "http://d"


@pytest.mark.parametrize(("prompt", "handle", "cached", "read", "computed"), [
    (1000, 0, 0, 0, 1000),          # a full leg, P's cache cold: computes everything
    (1000, 0, 600, 0, 400),         # a full leg, P's cache holds the last prompt
    (1000, 900, 0, 900, 100),       # a reuse leg, cold P: reads the history, computes the new part
    (1000, 900, 600, 300, 100),     # warm P: vLLM takes local hits first, reads only the rest
    (1000, 900, 950, 0, 50),        # P's cache holds more than the handle: nothing read
    (1000, 1000, 0, 999, 1),        # a handle for the whole prompt: P still computes the last token
    (1000, 0, 5000, 0, 1),          # a nonsensical report is clamped
])
def test_split(prompt, handle, cached, read, computed):
    assert split(prompt, handle, cached) == (read, computed)


def leg(seconds: float, *, prompt: int = 1000, handle: int = 0, cached: int | None = 0, expected: int = 0,
        prefill: str = P) -> PrefillTiming:
    return PrefillTiming(prefill, D if handle else "", prompt, handle, cached, expected, seconds)


def test_prefill_rate_from_full_legs_then_transfer_rate_from_what_is_left():
    rates = Rates(weight=1.0)
    assert rates.costs(P, D).prefill_tokens_per_s is None
    rates.observe(leg(0.1))                                  # 1000 tokens computed in 0.1 s
    assert rates.prefill_rate(P) == pytest.approx(10_000)
    assert rates.costs(P, D).transfer_tokens_per_s is None   # no read seen on the pair: unknown, not zero
    rates.observe(leg(0.46, handle=900))                     # 100 computed (0.01 s) + 900 read in 0.45 s
    assert rates.costs(P, D).transfer_tokens_per_s == pytest.approx(2_000)
    assert rates.costs(P2, D).transfer_tokens_per_s is None  # per pair


def test_a_read_leg_before_any_prefill_rate_teaches_nothing():
    rates = Rates()
    rates.observe(leg(0.5, handle=900))
    assert rates.costs(P, D) == PairCosts(None, None)


@pytest.mark.parametrize(("read", "learned"), [(MIN_READ_TOKENS - 1, False), (MIN_READ_TOKENS, True)])
def test_reads_below_vllms_recompute_threshold_are_not_timed(read, learned):
    rates = Rates()
    rates.observe(leg(0.1))
    rates.observe(leg(0.2, handle=read))
    assert (rates.costs(P, D).transfer_tokens_per_s is not None) == learned


def test_a_read_lost_in_the_noise_counts_as_very_fast():
    rates = Rates()
    rates.observe(leg(0.1))
    rates.observe(leg(0.005, handle=900))                    # faster than the 100 computed tokens alone
    assert rates.costs(P, D).transfer_tokens_per_s > 1e6


def test_without_a_report_the_estimate_says_what_p_had_cached():
    rates = Rates(weight=1.0)
    rates.observe(leg(0.04, cached=None, expected=600))      # 400 computed: P's cache held the last prompt
    assert rates.prefill_rate(P) == pytest.approx(10_000)


def test_warm_tokens_only_for_the_previous_p_and_only_while_its_reports_bear_it_out():
    rates = Rates()
    assert rates.warm_tokens(P, P, 900) == 900 and rates.warm_tokens(P2, P, 900) == 0
    rates.observe(leg(0.1, cached=0, expected=900))          # P said its cache held nothing: off, or evicted
    assert rates.warm_tokens(P, P, 900) == 0
    assert rates.warm_tokens(P, P, 900, trusted=False) == 900
    rates.observe(leg(0.1, cached=880, expected=900))        # held again
    assert rates.warm_tokens(P, P, 900) == 900


def test_on_a_leg_that_read_the_report_is_not_taken_for_p_s_own_hits():
    """vLLM may count loaded tokens as cached: a report covering the handle must not hide the read."""
    rates = Rates(weight=1.0)
    rates.observe(leg(0.1))                                   # 10k tokens/s
    rates.observe(leg(0.46, handle=900, cached=900))          # read 900 in 0.45 s, though P "cached" 900
    assert rates.costs(P, D).transfer_tokens_per_s == pytest.approx(2_000)
    assert rates.prefill_rate(P) == pytest.approx(10_000)


def test_a_leg_expected_warm_that_took_a_read_marks_p_cold_and_times_the_read():
    rates = Rates(weight=1.0)
    rates.observe(leg(0.1))                                              # 10k tokens/s
    # P was expected to hold 900 of the 1000 tokens; computing 100 takes 0.01 s, the leg took 0.46 s: it read
    rates.observe(leg(0.46, handle=900, cached=None, expected=900))
    assert rates.costs(P, D).transfer_tokens_per_s == pytest.approx(2_000)
    assert rates.warm_tokens(P, P, 900) == 0                            # not counted on any more
    # the same leg in about the time of its new part: consistent with a warm cache, nothing read
    fresh = Rates(weight=1.0)
    fresh.observe(leg(0.1))
    fresh.observe(leg(0.012, handle=900, cached=None, expected=900))
    assert fresh.costs(P, D).transfer_tokens_per_s is None and fresh.warm_tokens(P, P, 900) == 900


def test_a_local_path_learned_under_overload_is_tried_again_once_untried():
    """The H200's lock-in: local legs timed while D queued behind 128 streams made the P path look faster, every
    later turn took it, and nothing re-learned the local leg. Aged, the local path wins again."""
    rates = Rates(weight=1.0)
    rates.observe(leg(0.02))                                         # P: 50,000 tokens/s
    rates.observe_decode(DecodeTiming(D, True, 100, 1.002, at=100.0), rates.any_prefill_rate())   # queued: 1 s
    rates.observe_decode(DecodeTiming(D, False, 0, 0.09, at=160.0), None)      # the P path's hand-over: 90 ms
    shape = TurnShape(prompt_tokens=3000, reusable_tokens=2900, local_hit_tokens=2900, p_cached_tokens=2900,
                      local_allowed=True)

    def path(now: float) -> Path:
        return choose_path(rates.path_costs(P, D, p_queued_tokens=0, p_waiting=0, now=now), shape).path

    assert path(100.0) is Path.READ                                  # right after the overload: P is faster
    assert path(100.0 + 6 * UNTRIED_HALF_LIFE_S) is Path.LOCAL       # untried since: tried again
    assert rates.path_costs(P, D, p_queued_tokens=0, p_waiting=0, now=160.0).handover_s == pytest.approx(0.09)
    rates.observe_decode(DecodeTiming(D, True, 100, 1.002, at=170.0), rates.any_prefill_rate())   # still slow
    assert path(170.0) is Path.READ                                  # re-learned: back to P


def test_a_mean_halves_for_each_half_life_unfed():
    mean = Mean(weight=0.5)
    mean.observe(0.2, at=10.0)
    assert mean.aged(10.0) == pytest.approx(0.2)
    assert mean.aged(10.0 + UNTRIED_HALF_LIFE_S) == pytest.approx(0.1)
