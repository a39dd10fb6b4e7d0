"""How far apart two next-token distributions are, from the top-k log-probabilities an engine returns.

Greedy tokens cannot judge KV with a random-weight bf16 model: one engine alone picks other tokens with and
without its own prefix cache (rounding differs with the batch shape), so an exact-match test fails right KV
and cannot tell it from wrong KV. The distribution of the first generated token can: it depends on every
position's KV, rounding moves it by a little, and KV of the wrong positions or tokens moves it by a lot.

An engine reports only its top k (vLLM: `logprobs`/`top_logprobs` up to 20). A token in one list but not the
other has, on the other side, a log-prob at most that side's smallest reported one (its floor). So:
- `max_abs` is max |Δ logprob| over the union of both lists; for a token missing on one side it counts
  max(0, known - floor), a lower bound of the true difference, so the measure never overstates a distance.
- `kl` is KL(ref ‖ test) over the union with each missing value set to its side's floor and both sides
  renormalised over the union: an approximation that is 0 for equal lists and grows with disagreement.

Pure (no I/O): parse an engine's answer with `from_chat` / `from_completion`, compare with `distance`,
judge with `flagged` against the noise floor measured on one engine alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

TopLogprobs = Mapping[int, float]          # token id -> log-prob, the k most likely tokens
TOKEN_ID_PREFIX = "token_id:"              # vLLM's key with return_tokens_as_token_ids


@dataclass(frozen=True)
class Distance:
    max_abs: float          # max |Δ logprob| over the union (lower bounds for one-sided tokens)
    kl: float               # KL(ref ‖ test) over the union, floors filled in, renormalised
    top1_equal: bool        # both put the same token first
    overlap: int            # tokens in both lists
    k: int                  # the shorter list's length

    def as_dict(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def distance(ref: TopLogprobs, test: TopLogprobs) -> Distance:
    if not ref or not test:
        raise ValueError("both top-k lists must be non-empty")
    ref_floor, test_floor = min(ref.values()), min(test.values())
    union = set(ref) | set(test)
    worst = 0.0
    for token in union:
        a, b = ref.get(token), test.get(token)
        if a is not None and b is not None:
            gap = abs(a - b)
        elif a is not None:                      # test's value is <= test_floor
            gap = max(0.0, a - test_floor)
        else:                                    # ref's value is <= ref_floor
            gap = max(0.0, b - ref_floor)
        worst = max(worst, gap)
    p = _renormalised({t: ref.get(t, ref_floor) for t in union})
    q = _renormalised({t: test.get(t, test_floor) for t in union})
    kl = sum(p[t] * (math.log(p[t]) - math.log(q[t])) for t in union if p[t] > 0)
    return Distance(max_abs=worst, kl=max(0.0, kl), top1_equal=_top1(ref) == _top1(test),
                    overlap=len(set(ref) & set(test)), k=min(len(ref), len(test)))


def flagged(d: Distance, noise_floor: float, *, factor: float = 4.0, minimum: float = 0.05) -> bool:
    """Wrong KV: the distance is well above what one engine alone shows between its own runs (`noise_floor`,
    the largest max_abs seen there). `minimum` keeps a perfectly deterministic engine (floor 0) from flagging
    a last-bit difference."""
    return d.max_abs > max(minimum, factor * noise_floor)


def flagged_kl(d: Distance, kl_floor: float, *, factor: float = 4.0, minimum: float = 0.01) -> bool:
    """The same verdict on KL, which weighs the likely tokens: the tail of a top-k list moves most with rounding
    (a token near the cut-off shifts by a nat or more), so KL separates right from wrong KV by a wider margin."""
    return d.kl > max(minimum, factor * kl_floor)


def summary(values: Iterable[float]) -> dict[str, float]:
    xs = sorted(values)
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "min": round(xs[0], 6), "median": round(xs[len(xs) // 2], 6), "max": round(xs[-1], 6)}


# -- parsing vLLM's answers ---------------------------------------------------------------------------------
def token_key(key: str) -> int:
    """`token_id:123` (return_tokens_as_token_ids) -> 123."""
    if not key.startswith(TOKEN_ID_PREFIX):
        raise ValueError(f"not a token-id key: {key!r} (ask with return_tokens_as_token_ids)")
    return int(key[len(TOKEN_ID_PREFIX):])


def from_chat(response: Mapping[str, Any], position: int = 0) -> dict[int, float]:
    """The top-k at generated position `position` of a chat completion asked with logprobs, top_logprobs and
    return_tokens_as_token_ids."""
    content = response["choices"][0]["logprobs"]["content"]
    return {token_key(entry["token"]): float(entry["logprob"]) for entry in content[position]["top_logprobs"]}


def from_completion(response: Mapping[str, Any], position: int = 0) -> dict[int, float]:
    """The same for a text completion asked with `logprobs: k` and return_tokens_as_token_ids."""
    tops = response["choices"][0]["logprobs"]["top_logprobs"]
    return {token_key(key): float(value) for key, value in tops[position].items()}


def _renormalised(logprobs: Mapping[int, float]) -> dict[int, float]:
    top = max(logprobs.values())
    weights = {t: math.exp(v - top) for t, v in logprobs.items()}
    total = sum(weights.values())
    return {t: max(w / total, 1e-300) for t, w in weights.items()}   # log() of an underflowed weight


def _top1(logprobs: TopLogprobs) -> int:
    return max(logprobs.items(), key=lambda item: (item[1], -item[0]))[0]
