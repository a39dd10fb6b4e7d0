"""Push mode's plans (issue 26, docs/protocol.md §8): D returns no handle, so no D->P read exists. A later turn is
local where D's own prefix cache serves it, else full (`push_mode`), P's and D's legs sent together as one pair.
Every push plan asks D to hold nothing (`hold` false): the next turn finds `push_mode`, never a handle. Pure
decisions; the same-id redos inside one pair are `pairing.py`'s. Used by `turns/run/push_transfer.py` only."""

from __future__ import annotations

from dataclasses import replace

from gateway.turns.reuse.continuity import check
from gateway.turns.reuse.plan import Claim, Leg, Plan, PlanKind, Reason, Replan, Setback, to_local


def pair(reason: Reason, verified_tokens: int = 0) -> Plan:
    return Plan(PlanKind.FULL, reason, verified_tokens=verified_tokens, hold=False, unheld=Reason.PUSH_MODE)


def adopt(plan: Plan) -> Plan:
    """A plan made before anything was known of the conversation (no session, store down): the same, as a pair."""
    return replace(plan, handle=None, release=None, d_cached=None, hold=False, unheld=Reason.PUSH_MODE)


def first_plan(prompt: list[int], claim: Claim) -> Plan:
    """Nothing to read or release; what a later turn can still use is D's own prefix cache. The continuity check
    says how much of the prompt D computed last turn (what its cache may still hold: nothing pins it, so it is a
    bet, never a correctness risk, the cache being keyed by the tokens themselves); `path` decides whether D
    alone serves the turn."""
    if claim.first_turn:
        return pair(Reason.FIRST_TURN)
    if claim.missing is not None and claim.missing is not Reason.PUSH_MODE:
        return pair(claim.missing)        # a concurrent turn, a failed one, ...
    if claim.held is None or not claim.holder_usable or not claim.same_model:
        reason = Reason.NO_HANDLE if claim.held is None else (
            Reason.DECODE_UNAVAILABLE if not claim.holder_usable else Reason.MODEL_CHANGED)
        return pair(reason)
    verdict = check(prompt, claim.held, partial_allowed=True)
    if verdict.kind == "full":
        return pair(Reason(verdict.reason))
    return pair(Reason.PUSH_MODE, verdict.reused_tokens)


def path(plan: Plan, prompt_tokens: int, block_size: int, on_holder: bool, max_local_tokens: int) -> Plan:
    """Local (D alone) when the picked D is the one that computed the verified prefix and would compute at most
    `max_local_tokens` itself; else the pair, P prefilling (`push_mode`), D registering only what its cache
    lacks. The cost plan's rates are pull mode's (P reading D's KV) and are not used here."""
    if not plan.verified_tokens or not on_holder or block_size <= 0:
        return plan
    hit = min(plan.verified_tokens, prompt_tokens - 1) // block_size * block_size
    if hit > 0 and prompt_tokens - hit <= max_local_tokens:
        return to_local(plan, hit)
    return plan


def replan(plan: Plan, leg: Leg, setback: Setback) -> Replan:
    """Once a pair is given up: a new pair, with a new request id. D failing on a local turn: the pair, on
    another D."""
    if setback is Setback.STALE:
        return Replan(plan, "pair", blame=False, costs_retry=True)
    if leg == "decode" and setback is not Setback.REFUSED or plan.local:
        return Replan(pair(Reason.DECODE_FAILED), "pair", blame=True, costs_retry=True)
    return Replan(plan, "pair", blame=True, costs_retry=True)
