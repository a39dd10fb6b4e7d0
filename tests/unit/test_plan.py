"""The planner: the first plan from the claim, and every later change through `replan`, one test per
transition."""

import pytest

from gateway.engines import kv
from gateway.engines.kv import Handle
from gateway.turns.reuse.continuity import Fingerprint
from gateway.turns.reuse.cost import PairCosts, PathCosts, TurnShape
from gateway.turns.reuse.plan import (Claim, PlanKind, Reason, Setback, by_path, first_plan, full, local_hit,
                                      plan_with_handle, replan, to_local)

BS = 4
S = list(range(50, 70))


def handle(r: int, groups: int = 1) -> Handle:
    blocks = -(-r // BS)
    return Handle({"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": "d0",
                   "remote_block_ids": [list(range(10, 10 + blocks)) for _ in range(groups)],
                   "remote_request_id": "chatcmpl-x-abcd1234", "remote_host": "127.0.0.1", "remote_port": 9,
                   "remote_num_tokens": r, "remote_blocks_expiry_time": 123.0, "tp_size": 1})


def test_reuse_passes_the_handle_verbatim():
    h = handle(19)
    plan = plan_with_handle(S + [1], Fingerprint.of(S, 19, BS), h)
    assert (plan.kind, plan.reason, plan.reused_tokens) == (PlanKind.REUSE, Reason.CONTINUOUS, 19)
    assert kv.leg_params(plan.handle) == h.wire and plan.release is None


def test_partial_cuts_blocks_and_count():
    plan = plan_with_handle(S[:10] + [0] * 10, Fingerprint.of(S, 19, BS), handle(19))
    assert plan.kind == PlanKind.PARTIAL and plan.reason == Reason.PREFIX_DIVERGED
    assert plan.handle.num_tokens == 8 and plan.handle.block_groups == [[10, 11]]
    assert plan.release is None           # P's read notifies D, which frees the whole request


def test_multi_group_handles_are_never_cut():
    plan = plan_with_handle(S[:10] + [0] * 10, Fingerprint.of(S, 19, BS), handle(19, groups=2))
    assert plan.kind == PlanKind.FULL and plan.release is not None


def test_full_releases_the_claimed_handle():
    h = handle(19)
    plan = plan_with_handle([0] * 30, Fingerprint.of(S, 19, BS), h)
    assert plan.kind == PlanKind.FULL and plan.release is h
    assert plan.handle is None and kv.leg_params(plan.handle) == kv.fresh_prefill()


def test_handle_disagreeing_with_fingerprint_is_not_used():
    plan = plan_with_handle(S + [1], Fingerprint.of(S, 19, BS), handle(18))
    assert plan.kind == PlanKind.FULL and plan.reason == Reason.HANDLE_SHAPE


def test_truncate_and_release_leave_the_original_alone():
    h = handle(19)
    cut = h.cut(8, BS)
    assert h.num_tokens == 19 and cut.block_groups == [[10, 11]]
    assert h.released().num_tokens == 0 and h.num_tokens == 19


# -- the first plan from the claim ------------------------------------------------------------------------
def claim(**changes) -> Claim:
    base = dict(first_turn=False, handle=handle(19), missing=None, held=Fingerprint.of(S, 19, BS),
                same_model=True, holder_usable=True)
    return Claim(**{**base, **changes})


@pytest.mark.parametrize(("changes", "kind", "reason", "released"), [
    ({}, PlanKind.REUSE, Reason.CONTINUOUS, False),
    ({"first_turn": True}, PlanKind.FULL, Reason.FIRST_TURN, False),
    ({"handle": None, "missing": Reason.HANDLE_EXPIRED}, PlanKind.FULL, Reason.HANDLE_EXPIRED, False),
    ({"handle": None, "missing": None}, PlanKind.FULL, Reason.NO_HANDLE, False),
    ({"holder_usable": False}, PlanKind.FULL, Reason.DECODE_UNAVAILABLE, False),
    ({"same_model": False}, PlanKind.FULL, Reason.MODEL_CHANGED, True),
])
def test_first_plan(changes, kind, reason, released):
    plan = first_plan(S + [1], claim(**changes))
    assert (plan.kind, plan.reason, plan.release is not None) == (kind, reason, released)


# -- replan: one test per transition ----------------------------------------------------------------------
REUSE = plan_with_handle(S + [1], Fingerprint.of(S, 19, BS), handle(19))
FULL = full(Reason.FIRST_TURN)


@pytest.mark.parametrize(("plan", "leg", "setback", "reason", "next_leg", "blame", "costs_retry"), [
    # P refused the connection: it never saw the handle, so the same plan goes to another P
    (REUSE, "prefill", Setback.REFUSED, Reason.CONTINUOUS, "prefill", True, True),
    # P timed out on a handle: vLLM parks declined reads, P is not at fault; the handle is spent
    (REUSE, "prefill", Setback.TIMEOUT, Reason.PREFILL_FAILED, "prefill", False, True),
    (FULL, "prefill", Setback.TIMEOUT, Reason.FIRST_TURN, "prefill", True, True),
    # P failed: it may have consumed D's handle, so P is redone without one
    (REUSE, "prefill", Setback.FAILED, Reason.PREFILL_FAILED, "prefill", True, True),
    (FULL, "prefill", Setback.FAILED, Reason.FIRST_TURN, "prefill", True, True),
    # P ran on other tokens: redo P without the handle, no engine to blame, no retry spent
    (REUSE, "prefill", Setback.PARITY, Reason.PARITY_VIOLATION, "prefill", False, False),
    # D refused: P's handle is still good, another D
    (REUSE, "decode", Setback.REFUSED, Reason.CONTINUOUS, "decode", True, True),
    # D failed or timed out: it may have read P's blocks; prefill afresh
    (REUSE, "decode", Setback.FAILED, Reason.DECODE_FAILED, "prefill", True, True),
    (FULL, "decode", Setback.TIMEOUT, Reason.DECODE_FAILED, "prefill", True, True),
])
def test_replan(plan, leg, setback, reason, next_leg, blame, costs_retry):
    step = replan(plan, leg, setback)
    assert (step.plan.reason, step.next_leg, step.blame, step.costs_retry) == (reason, next_leg, blame, costs_retry)
    if step.plan.reason != plan.reason:
        assert step.plan.kind == PlanKind.FULL and step.plan.handle is None


# -- the cost plan: keep or drop the handle by what reading pays -----------------------------------------------
FAST, SLOW = 1e6, 1e3           # tokens/s when P reads D's KV
PREFILL = 1e4                   # tokens/s when P computes


def by_cost(plan, pair: PairCosts, p_cached: int, *, local_allowed: bool = False, **costs):
    shape = TurnShape(len(S) + 1, plan.reused_tokens, local_hit(plan, len(S) + 1, BS), p_cached, local_allowed)
    return by_path(plan, PathCosts(pair, **costs), shape)


@pytest.mark.parametrize(("transfer", "prefill", "p_cached", "kind", "reason"), [
    (FAST, PREFILL, 0, PlanKind.REUSE, Reason.CONTINUOUS),                  # reading 100x faster: keep it
    (SLOW, PREFILL, 0, PlanKind.FULL, Reason.RECOMPUTE_FASTER),             # reading 10x slower: drop it
    (None, PREFILL, 0, PlanKind.REUSE, Reason.CONTINUOUS),                  # no read seen yet: read, and learn
    (SLOW, None, 0, PlanKind.REUSE, Reason.CONTINUOUS),                     # no prefill timed yet: the same
    (FAST, PREFILL, 19, PlanKind.REUSE, Reason.CONTINUOUS),                 # P's cache holds it all: decided
    (SLOW, PREFILL, 19, PlanKind.FULL, Reason.RECOMPUTE_FASTER),            # ... as if it held none
    (SLOW, PREFILL, 12, PlanKind.FULL, Reason.RECOMPUTE_FASTER),            # P lacks 7: computing them is faster
    (FAST, PREFILL, 12, PlanKind.REUSE, Reason.CONTINUOUS),                 # ... reading them is faster
])
def test_by_cost(transfer, prefill, p_cached, kind, reason):
    first = plan_with_handle(S + [1], Fingerprint.of(S, 19, BS), handle(19))
    plan = by_cost(first, PairCosts(transfer_tokens_per_s=transfer, prefill_tokens_per_s=prefill), p_cached)
    assert (plan.kind, plan.reason) == (kind, reason)
    if kind is PlanKind.FULL:     # the claimed handle is freed like any other unused one
        assert plan.handle is None and plan.release == first.handle and plan.reused_tokens == 0
    else:
        assert plan == first


def test_by_cost_keeps_a_partial_plans_cut_handle_and_releases_it_when_dropped():
    first = plan_with_handle(S[:10] + [0] * 10, Fingerprint.of(S, 19, BS), handle(19))
    assert by_cost(first, PairCosts(FAST, PREFILL), 0) == first
    dropped = by_cost(first, PairCosts(SLOW, PREFILL), 0)
    assert dropped.reason == Reason.RECOMPUTE_FASTER and dropped.release == first.handle


def test_by_cost_leaves_plans_without_a_handle_alone():
    plan = full(Reason.FIRST_TURN)
    assert by_cost(plan, PairCosts(SLOW, PREFILL), 0) is plan


# -- the local path: the holder D computes the short suffix itself ---------------------------------------------
HANDOVER = {"handover_s": 0.05}


@pytest.mark.parametrize(("pair", "costs", "kind", "reason"), [
    (PairCosts(FAST, PREFILL), HANDOVER, PlanKind.LOCAL, Reason.SHORT_SUFFIX),      # no hand-over, no P leg
    (PairCosts(None, None), {}, PlanKind.LOCAL, Reason.SHORT_SUFFIX),               # nothing known: the short way
    (PairCosts(FAST, PREFILL), {}, PlanKind.LOCAL, Reason.SHORT_SUFFIX),            # no hand-over seen yet
    (PairCosts(SLOW, PREFILL), HANDOVER, PlanKind.LOCAL, Reason.SHORT_SUFFIX),
    # D's fixed part (busy with its streams) far over P's path: P reads, and says why
    (PairCosts(FAST, PREFILL), {**HANDOVER, "local_fixed_s": 1.0}, PlanKind.REUSE, Reason.P_PATH_FASTER),
    # ... unless P is busy: its queue, and what the turn would cost P's other requests
    (PairCosts(FAST, PREFILL), {**HANDOVER, "local_fixed_s": 1.0, "p_queued_tokens": 20_000}, PlanKind.LOCAL,
     Reason.SHORT_SUFFIX),
    (PairCosts(FAST, PREFILL), {**HANDOVER, "local_fixed_s": 0.07}, PlanKind.REUSE, Reason.P_PATH_FASTER),
    (PairCosts(SLOW, PREFILL), {**HANDOVER, "local_fixed_s": 1.0}, PlanKind.FULL, Reason.RECOMPUTE_FASTER),
])
def test_by_path_weighs_the_local_path(pair, costs, kind, reason):
    first = plan_with_handle(S + [1], Fingerprint.of(S, 19, BS), handle(19))
    plan = by_cost(first, pair, 0, local_allowed=True, **costs)
    assert (plan.kind, plan.reason) == (kind, reason)


def test_a_local_plan_keeps_the_handle_unread_and_counts_d_s_whole_blocks():
    first = plan_with_handle(S + [1], Fingerprint.of(S, 19, BS), handle(19))
    plan = by_cost(first, PairCosts(FAST, PREFILL), 0, local_allowed=True)
    assert plan.local and plan.handle == first.handle and plan.release is None
    assert plan.reused_tokens == 16          # D's cache holds full blocks only: 4 of them, not 19 tokens
    assert plan.instead == first


def test_a_local_turn_not_allowed_stays_on_the_p_path():
    first = plan_with_handle(S + [1], Fingerprint.of(S, 19, BS), handle(19))
    assert by_cost(first, PairCosts(FAST, PREFILL), 0, local_allowed=False) == first


@pytest.mark.parametrize(("setback", "kind", "reason", "handle_kept"), [
    # D failed or timed out: the handle was never read, so P reads it, through another D
    (Setback.FAILED, PlanKind.REUSE, Reason.DECODE_FAILED, True),
    (Setback.TIMEOUT, PlanKind.REUSE, Reason.DECODE_FAILED, True),
    # the holder refused the connection: its KV is out of reach, P prefills afresh
    (Setback.REFUSED, PlanKind.FULL, Reason.DECODE_FAILED, False),
])
def test_replan_after_a_local_turn_s_d_failed(setback, kind, reason, handle_kept):
    first = plan_with_handle(S + [1], Fingerprint.of(S, 19, BS), handle(19))
    step = replan(to_local(first, 16), "decode", setback)
    assert (step.plan.kind, step.plan.reason, step.next_leg, step.blame) == (kind, reason, "prefill", True)
    assert (step.plan.handle == first.handle) is handle_kept
    if handle_kept:
        assert step.plan.reused_tokens == 19


# -- what D holds, by its KV events (issue 36) ---------------------------------------------------------------
from dataclasses import replace as _replace  # noqa: E402

from gateway.turns.reuse.plan import by_shape, from_cache  # noqa: E402

HELD = Fingerprint.of(S, 19, BS)        # 4 whole blocks verified by a prompt extending S
PROMPT = S + [1, 2]


def d_claim(handle_: Handle | None = None, missing: Reason | None = Reason.NO_HANDLE, *, blocks: int | None = 4,
          complete: bool = True) -> Claim:
    return Claim(False, handle_, None if handle_ else missing, HELD, True, True, d_cached_blocks=blocks,
                 d_cache_complete=complete)


@pytest.mark.parametrize("missing", [Reason.NO_HANDLE, Reason.HANDLE_EXPIRED, Reason.BUDGET_EVICTED,
                                     Reason.NEVER_KEPT])
def test_no_handle_but_d_holds_the_history_may_go_local(missing):
    plan = first_plan(PROMPT, d_claim(missing=missing))
    assert (plan.kind, plan.reason, plan.d_cached, plan.handle) == (PlanKind.FULL, missing, 16, None)
    shape = TurnShape(len(PROMPT), 0, 16, 0, True)
    local = by_shape(plan, shape)
    assert local.kind is PlanKind.LOCAL and local.reused_tokens == 16 and not local.hold
    assert local.instead == plan                       # D failing: P computes it all


def test_d_dropped_the_history_is_evicted_and_never_local_from_stale_knowledge():
    plan = first_plan(PROMPT, d_claim(missing=Reason.NO_HANDLE, blocks=1))
    assert (plan.kind, plan.reason, plan.d_cached) == (PlanKind.FULL, Reason.EVICTED, 4)
    gone = first_plan(PROMPT, d_claim(missing=Reason.BUDGET_EVICTED, blocks=0))
    assert (gone.reason, gone.d_cached) == (Reason.EVICTED, 0)


def test_partial_knowledge_does_not_name_an_eviction():
    plan = first_plan(PROMPT, d_claim(missing=Reason.HANDLE_EXPIRED, blocks=1, complete=False))
    assert (plan.reason, plan.d_cached) == (Reason.HANDLE_EXPIRED, 4)


@pytest.mark.parametrize("missing", [Reason.CONCURRENT_TURN, Reason.PREVIOUS_TURN_FAILED, Reason.PUSH_MODE])
def test_other_reasons_for_no_handle_stay_full(missing):
    plan = first_plan(PROMPT, d_claim(missing=missing))
    assert (plan.kind, plan.reason, plan.d_cached) == (PlanKind.FULL, missing, None)


def test_without_events_the_old_rules_apply():
    assert first_plan(PROMPT, d_claim(blocks=None)) == full(Reason.NO_HANDLE)
    withh = first_plan(PROMPT, d_claim(handle(19), blocks=None))
    assert withh.kind is PlanKind.REUSE and withh.d_cached is None and withh.hold


def test_a_diverged_prompt_is_not_saved_by_the_cache():
    plan = from_cache([0] * 22, d_claim(), Reason.NO_HANDLE)
    assert (plan.kind, plan.reason, plan.d_cached) == (PlanKind.FULL, Reason.PREFIX_DIVERGED, None)


def test_with_a_handle_the_events_say_how_much_d_holds():
    plan = first_plan(PROMPT, d_claim(handle(19), blocks=2))
    assert plan.kind is PlanKind.REUSE and plan.d_cached == 8
    held = first_plan(PROMPT, d_claim(handle(19), blocks=4, complete=False))
    assert held.d_cached == 16                    # partial knowledge, but it holds it all: known
    lost = first_plan(PROMPT, d_claim(handle(19), blocks=1, complete=False))
    assert lost.kind is PlanKind.REUSE and lost.d_cached is None    # events lost: the handle's rules decide


def test_a_local_turn_without_events_still_asks_d_to_hold():
    first = plan_with_handle(PROMPT, HELD, handle(19))
    assert to_local(first, 16).hold and not to_local(_replace(first, d_cached=16), 16).hold


def test_p_holding_the_history_by_its_events_reads_nothing_and_pins_nothing():
    first = plan_with_handle(PROMPT, HELD, handle(19))
    pair = PairCosts(transfer_tokens_per_s=FAST, prefill_tokens_per_s=PREFILL)
    known = TurnShape(len(PROMPT), 19, 16, 19, False, p_cache_known=True)
    plan = by_path(first, PathCosts(pair), known)
    assert (plan.kind, plan.reason, plan.release, plan.hold) == (PlanKind.FULL, Reason.P_CACHED, first.handle,
                                                                  False)
    guessed = by_path(first, PathCosts(pair), _replace(known, p_cache_known=False))
    assert guessed == first                       # an estimate: decided as if P held none


def test_budget_eviction_and_never_kept_are_distinct_reasons():
    assert len({Reason.EVICTED, Reason.BUDGET_EVICTED, Reason.NEVER_KEPT}) == 3
    assert Reason.EVICTED.value == "evicted"


def test_a_turn_with_nothing_to_reuse_may_go_to_d_alone_whole():
    """`--local-first-turns`: the reason stays, nothing is reused, the P path is kept for when D fails; D holds
    nothing where its events are known, else a lease for the next turn."""
    from gateway.turns.reuse.plan import whole_prompt_local
    first = full(Reason.FIRST_TURN)
    known, unknown = whole_prompt_local(first, True), whole_prompt_local(first, False)
    assert (known.kind, known.reason, known.reused_tokens) == (PlanKind.LOCAL, Reason.FIRST_TURN, 0)
    assert (known.hold, known.d_cached, unknown.hold, unknown.d_cached) == (False, 0, True, None)
    assert replan(known, "decode", Setback.FAILED).plan.kind is PlanKind.FULL
    reading = plan_with_handle(S + [1], Fingerprint.of(S, 19, BS), handle(19))
    assert whole_prompt_local(reading, True) is reading          # a handle to read: untouched
