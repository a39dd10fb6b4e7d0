"""The KV-correctness measure: distances between top-k next-token distributions, and its parsing."""

from __future__ import annotations

import math

import pytest

from gateway.verify.distance import (Distance, distance, flagged, flagged_kl, from_chat, from_completion, summary,
                                        token_key)

BASE = {10: -0.2, 11: -1.9, 12: -3.0, 13: -4.5}


@pytest.mark.parametrize(("test", "max_abs", "top1", "overlap"), [
    (BASE, 0.0, True, 4),                                               # the same list
    ({10: -0.21, 11: -1.88, 12: -3.0, 13: -4.52}, 0.02, True, 4),       # rounding noise
    ({11: -0.3, 10: -1.5, 12: -3.1, 13: -4.4}, 1.6, False, 4),          # the order changed
    ({10: -0.2, 11: -1.9, 12: -3.0, 14: -4.0}, 0.5, True, 3),           # 14 new: ref has it <= -4.5, so >= 0.5
    ({20: -0.1, 21: -2.0, 22: -3.0, 23: -5.0}, 4.8, False, 0),          # disjoint: 10 is >= 4.8 apart
])
def test_max_abs_is_the_largest_gap_and_a_lower_bound_for_one_sided_tokens(test, max_abs, top1, overlap):
    d = distance(BASE, test)
    assert d.max_abs == pytest.approx(max_abs, abs=1e-9)
    assert d.top1_equal is top1 and d.overlap == overlap and d.k == 4


def test_a_token_one_side_lacks_counts_zero_when_the_floor_allows_equality():
    # ref has 13 at -4.5; test's smallest is -4.0, so test's value for 13 may also be -4.5: no evidence of a gap
    d = distance(BASE, {10: -0.2, 11: -1.9, 12: -3.0, 14: -4.0})
    gaps_without_14 = distance({10: -0.2, 11: -1.9, 12: -3.0}, {10: -0.2, 11: -1.9, 12: -3.0})
    assert gaps_without_14.max_abs == 0.0 and d.max_abs == pytest.approx(0.5)


def test_kl_is_zero_for_equal_lists_and_grows_with_disagreement():
    near = distance(BASE, {10: -0.21, 11: -1.88, 12: -3.0, 13: -4.52}).kl
    far = distance(BASE, {11: -0.3, 10: -1.5, 12: -3.1, 13: -4.4}).kl
    assert distance(BASE, BASE).kl == 0.0
    assert 0 < near < 1e-3 < far


def test_kl_survives_minus_infinity_and_huge_gaps():
    d = distance({1: 0.0, 2: -math.inf}, {1: -800.0, 2: 0.0})
    assert math.isfinite(d.kl) and d.kl > 100


def test_empty_lists_are_refused():
    with pytest.raises(ValueError):
        distance({}, BASE)


@pytest.mark.parametrize(("max_abs", "floor", "expected"), [
    (0.01, 0.0, False),        # deterministic engine, last-bit difference: under the minimum
    (0.3, 0.0, True),
    (0.3, 0.1, False),         # noisy engine: 0.3 is within 4x its own noise
    (0.5, 0.1, True),
])
def test_flagged_compares_with_the_engines_own_noise(max_abs, floor, expected):
    assert flagged(Distance(max_abs, 0.0, True, 20, 20), floor) is expected


def test_parsing_chat_and_completion_answers_with_token_ids():
    chat = {"choices": [{"logprobs": {"content": [
        {"token": "token_id:7", "logprob": -0.1, "top_logprobs": [
            {"token": "token_id:7", "logprob": -0.1}, {"token": "token_id:9", "logprob": -2.5}]},
        {"token": "token_id:3", "logprob": -0.4, "top_logprobs": [{"token": "token_id:3", "logprob": -0.4}]}]}}]}
    completion = {"choices": [{"logprobs": {"top_logprobs": [{"token_id:7": -0.1, "token_id:9": -2.5}]}}]}
    assert from_chat(chat) == from_completion(completion) == {7: -0.1, 9: -2.5}
    assert from_chat(chat, position=1) == {3: -0.4}
    with pytest.raises(ValueError):
        token_key(" word")


def test_summary():
    assert summary([3.0, 1.0, 2.0]) == {"n": 3, "min": 1.0, "median": 2.0, "max": 3.0}
    assert summary([]) == {"n": 0}


@pytest.mark.parametrize(("kl", "floor", "expected"), [
    (0.005, 0.0, False),       # under the minimum
    (0.2, 0.15, False),        # within 4x the engine's own KL
    (5.0, 0.15, True),         # wrong KV: the likely tokens moved
])
def test_flagged_kl_compares_with_the_engines_own_kl(kl, floor, expected):
    assert flagged_kl(Distance(0.0, kl, True, 20, 20), floor) is expected
