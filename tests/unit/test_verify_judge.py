"""verify's judge: greedy equality where the baseline is deterministic, the first token's distance against its
noise floor where it is not; negative controls count only when the measure itself flags them."""

from __future__ import annotations

import pytest

from gateway.verify.judge import Observation, Output, from_chunks, from_json, judge, judge_all

TOP = {1: -0.1, 2: -2.0, 3: -3.5}
NEAR = {1: -0.12, 2: -1.97, 3: -3.5}          # rounding noise
FAR = {2: -0.2, 1: -1.9, 4: -3.0}             # another distribution


def out(ids=(1, 2, 3), top=TOP, status=200, logprobs=True) -> Output:
    return Output(status, "text", tuple(ids), "", dict(top) if top else None, logprobs)


@pytest.mark.parametrize(("got", "ref", "again", "status", "how"), [
    (out(), out(), out(), "pass", "exact"),
    (out((1, 2, 4)), out(), out(), "flagged", "exact"),                      # deterministic: any token differs
    (out(top=FAR), out(), out(), "flagged", "distance"),                     # same tokens, wrong distribution
    (out((1, 5), NEAR), out(), out((1, 2, 9), NEAR), "pass", "distance"),    # noisy engine, within its noise
    (out((7, 7), FAR), out(), out((1, 2, 9), NEAR), "flagged", "distance"),
    (out(status=500), out(), out(), "flagged", "status"),
    (out(logprobs=False, top=None), out(), out(), "flagged", "logprobs"),    # the buffer policy's old loss
    (out(), out(status=400), out(status=400), "skipped", "baseline"),        # e.g. tools the engines refuse
])
def test_verdicts(got, ref, again, status, how):
    [verdict], _ = judge_all([Observation("case", got, ref, again)])
    assert (verdict.status, verdict.how) == (status, how)


def test_the_noise_floor_is_the_baselines_largest_distance_against_itself():
    noisy = Observation("a", out(), out(), out((1, 2, 9), NEAR))
    _, noise = judge_all([noisy, Observation("b", out(), out(), out())])
    assert noise == pytest.approx(0.03)


@pytest.mark.parametrize(("got", "expected"), [
    (out((9,), FAR), True),              # flagged by the measure: the control did its job
    (out(), False),                      # wrong KV not seen: the measure has no power here
    (out(status=0), False),              # no answer proves nothing
])
def test_a_negative_control_counts_only_when_the_measure_flags_it(got, expected):
    verdict = judge(Observation("control", got, out(), out(), expect_wrong=True), 0.0)
    assert verdict.as_expected is expected


def test_streamed_and_whole_answers_read_the_same():
    lp = {"content": [{"token": "token_id:5", "logprob": -0.1, "top_logprobs": [
        {"token": "token_id:5", "logprob": -0.1}, {"token": "token_id:6", "logprob": -1.0}]}]}
    whole = from_json(200, {"choices": [{"message": {"content": "ab", "tool_calls": []}, "token_ids": [5, 7],
                                         "logprobs": lp}]}, chat=True)
    chunks = [{"choices": [{"delta": {"role": "assistant", "content": ""}, "logprobs": None}]},
              {"choices": [{"delta": {"content": "a"}, "token_ids": [5], "logprobs": lp}]},
              {"choices": [{"delta": {"content": "b"}, "token_ids": [7], "logprobs": {"content": []}}]},
              {"choices": [], "usage": {}}]
    streamed = from_chunks(200, chunks, chat=True)
    assert streamed == whole and whole.first_top == {5: -0.1, 6: -1.0}
    assert from_chunks(200, [{"error": {"message": "boom"}}], chat=True).status == 502
