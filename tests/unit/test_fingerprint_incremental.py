"""The record's fingerprint, computed incrementally (carried-over block hashes, bytes from the renderer), must
equal the one computed from scratch."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.turns.reuse.continuity import Fingerprint, check, held_fingerprint
from gateway.turns.intake.pieces import TokenIds

IDS = st.lists(st.integers(0, 70_000), max_size=120)


@given(previous=IDS, extra=IDS, output=IDS.filter(bool), block_size=st.sampled_from([1, 4, 16]),
       edit=st.booleans())
def test_incremental_equals_from_scratch(previous, extra, output, block_size, edit):
    old = Fingerprint.of(previous, max(0, len(previous) - 1), block_size)
    prompt = previous + extra
    if edit and prompt:
        prompt[len(prompt) // 2] += 1            # a diverged history: only the verified prefix carries over
    verdict = check(prompt, old, partial_allowed=True) if old.held_tokens else None
    verified = verdict.reused_tokens if verdict else 0
    held = len(prompt) + len(output) - 1
    n, got = held_fingerprint(TokenIds(prompt), list(prompt), output, held, block_size, previous=old,
                              verified_tokens=verified)
    assert n == len(prompt) + len(output)
    assert got == Fingerprint.of(prompt + output, held, block_size)


def test_engine_prompt_differing_from_the_rendered_one_is_hashed_as_the_engine_saw_it():
    rendered, engine, output = TokenIds([1, 2, 3, 4]), [1, 2, 9, 4], [5, 6]
    old = Fingerprint.of([1, 2, 3, 4, 7], 4, 2)
    n, got = held_fingerprint(rendered, engine, output, 5, 2, previous=old, verified_tokens=4)
    assert got == Fingerprint.of(engine + output, 5, 2) and n == 6


def test_no_engine_prompt_means_only_the_output_is_known():
    n, got = held_fingerprint(TokenIds([1, 2]), None, [3, 4], 0, 2)
    assert n == 2 and got == Fingerprint.of([3, 4], 0, 2)


def test_memo_compare_rejects_a_diverged_prompt_and_hash_fallback_agrees():
    from gateway.turns.reuse import continuity

    held_seq = list(range(100, 164))
    fp = Fingerprint.of(held_seq, 63, 16)                  # memoized: this process fingerprinted it
    same, other = TokenIds(held_seq[:63] + [1, 2]), TokenIds(held_seq[:62] + [7, 1, 2])
    assert check(same, fp, partial_allowed=True).kind == "reuse"
    assert check(other, fp, partial_allowed=True).kind != "reuse"
    continuity.HELD.clear()                                  # another replica: no memo, same verdicts by hash
    assert check(same, fp, partial_allowed=True).kind == "reuse"
    assert check(other, fp, partial_allowed=True).kind != "reuse"


def test_memo_is_bounded():
    from gateway.turns.reuse.continuity import HeldPrefixes

    memo = HeldPrefixes(max_bytes=1000)
    for i in range(50):
        memo.put(bytes([i]) * 16, b"x" * 100, None)
    assert memo._bytes <= 1000 and memo.get(bytes([49]) * 16) is not None and memo.get(bytes([0]) * 16) is None
