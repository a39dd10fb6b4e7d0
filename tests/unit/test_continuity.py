"""Continuity verdicts, table-driven: the guard that stands between a prompt and someone else's KV."""

import pytest

from gateway.turns.reuse.continuity import Fingerprint, block_hashes, check

BS = 4
S = list(range(100, 122))          # D holds 22 tokens of sequence; R = 21 (the last sampled token has no KV)
R = 21


def held() -> Fingerprint:
    return Fingerprint.of(S, R, BS)


@pytest.mark.parametrize(("prompt", "kind", "reason", "reused"), [
    (S[:R] + [1, 2, 3], "reuse", "continuous", R),                     # extends S[:R]
    (S + [1, 2], "reuse", "continuous", R),                            # includes the last sampled token too
    (S[:R], "reuse", "continuous", R),                                 # exactly R tokens
    (S[:9] + [7] + S[10:] + [1], "partial", "prefix_diverged", 8),    # diverges inside block 2 → 2 blocks
    (S[:13], "partial", "prompt_shorter", 12),                         # regenerate-like: shorter than R
    (S[:12], "partial", "prompt_shorter", 8),                          # P must compute >= 1 token: 2 blocks
    (S[:3] + [0] * 30, "full", "prefix_diverged", 0),                  # diverges in the first block
    ([5] * 40, "full", "prefix_diverged", 0),
    (S[:4], "full", "prompt_shorter", 0),                              # one block, but P needs a token to compute
    ([0] + S[1:13], "full", "prefix_diverged", 0),                     # changed system prompt, shorter: diverged
    (S[:5] + [7] + S[6:13], "partial", "prefix_diverged", 4),          # shorter, but an edit came first
    (S[:9] + [7, 7, 7, 7], "partial", "prompt_shorter", 8),            # only the tail differs: truncated history
])
def test_verdicts(prompt, kind, reason, reused):
    verdict = check(prompt, held(), partial_allowed=True)
    assert (verdict.kind, verdict.reason, verdict.reused_tokens) == (kind, reason, reused)


def test_partial_needs_permission():
    assert check(S[:13], held(), partial_allowed=False).kind == "full"


@pytest.mark.parametrize(("prompt", "reason"), [(S[:13], "prompt_shorter"), ([0] + S[1:13], "prefix_diverged")])
def test_reason_names_the_first_cause_without_partial(prompt, reason):
    assert check(prompt, held(), partial_allowed=False).reason == reason


def test_partial_never_exceeds_held_tokens():
    # D holds 10 tokens' KV (R=10): the prompt agrees with S on 9 tokens, but only 2 whole blocks are held.
    fingerprint = Fingerprint.of(S, 10, BS)
    verdict = check(S[:9] + [999] + S[10:20], fingerprint, partial_allowed=True)
    assert verdict.kind == "partial" and verdict.reused_tokens == 8


def test_block_hashes_are_chained():
    a, b = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4), block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[1] != b[1]                 # same second block, different first: different chained hash
    assert len(a[0]) == 16


def test_fingerprint_is_bounded():
    tokens = list(range(1000))
    fingerprint = Fingerprint.of(tokens, 999, 16)
    assert len(fingerprint.block_hashes) + len(fingerprint.prefix_hash) == 16 * (1000 // 16) + 16
