"""The turn's plan: reuse (D's whole handle), partial (a truncated handle) or full (no handle), with a reason.

Pure decisions, in one place: `first_plan` from what the store returned and what the prompt rendered to, and
`replan` for every later change: the legs only report what happened (`Setback`), this module decides what the
turn does next. No I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from gateway.engines.kv import Handle
from gateway.turns.reuse.continuity import Fingerprint, check
from gateway.turns.reuse.cost import CostReason, PairCosts, choose


Leg = Literal["prefill", "decode"]


class PlanKind(StrEnum):
    REUSE = "reuse"
    PARTIAL = "partial"
    FULL = "full"


class Reason(StrEnum):
    FIRST_TURN = "first_turn"
    NO_SESSION = "no_session"
    CONTINUOUS = "continuous"
    PREFIX_DIVERGED = "prefix_diverged"
    PROMPT_SHORTER = "prompt_shorter"
    HANDLE_EXPIRED = "handle_expired"
    NO_HANDLE = "no_handle"
    CONCURRENT_TURN = "concurrent_turn"
    DECODE_UNAVAILABLE = "decode_unavailable"
    STORE_UNAVAILABLE = "store_unavailable"
    PARITY_VIOLATION = "parity_violation"
    PREFILL_FAILED = "prefill_failed"          # a P leg failed and was redone on another P without a handle
    DECODE_FAILED = "decode_failed"            # a D leg failed before its first byte; P was redone afresh
    PREVIOUS_TURN_FAILED = "previous_turn_failed"   # the last turn ended early (error, disconnect): no handle
    HANDLE_NOT_STREAMED = "handle_not_streamed"
    MODEL_CHANGED = "model_changed"
    HANDLE_SHAPE = "handle_shape"
    RECOMPUTE_FASTER = "recompute_faster"           # the cost plan: P computes the history faster than it reads it
    EVICTED = "evicted"                        # D's pin budget released the handle while the conversation idled


@dataclass(frozen=True)
class Plan:
    kind: PlanKind
    reason: Reason
    reused_tokens: int = 0
    handle: Handle | None = None        # what P reads D's KV through (None: a full prefill)
    release: Handle | None = None       # a claimed handle this turn will not use: free D's blocks

    @property
    def first_leg(self) -> Leg:
        """The leg the runner starts with: every path prefills on P first."""
        return "prefill"


def full(reason: Reason, release: Handle | None = None) -> Plan:
    return Plan(PlanKind.FULL, reason, release=release)


# -- the first plan -----------------------------------------------------------------------------------------
def plan_with_handle(prompt: list[int], held: Fingerprint, handle: Handle) -> Plan:
    """Verify continuity against D's held tokens; cut the handle for a partial reuse."""
    if handle.block_groups is None or handle.num_tokens != held.held_tokens:
        return full(Reason.HANDLE_SHAPE, release=handle)
    verdict = check(prompt, held, partial_allowed=handle.single_group)
    if verdict.kind == "reuse":
        return Plan(PlanKind.REUSE, Reason.CONTINUOUS, verdict.reused_tokens, handle)
    if verdict.kind == "partial":
        return Plan(PlanKind.PARTIAL, Reason(verdict.reason), verdict.reused_tokens,
                    handle.cut(verdict.reused_tokens, held.block_size))
    return full(Reason(verdict.reason), release=handle)


@dataclass(frozen=True)
class Claim:
    """What the planner needs to know of the conversation's state (None fields: nothing to go on)."""
    first_turn: bool
    handle: Handle | None                # claimed for this turn alone
    missing: Reason | None               # why there is no handle, when there is none
    held: Fingerprint | None
    same_model: bool
    holder_usable: bool                  # the D holding the KV is known and healthy


def first_plan(prompt: list[int], claim: Claim) -> Plan:
    if claim.first_turn:
        return full(Reason.FIRST_TURN)
    if claim.handle is None or claim.held is None:
        return full(claim.missing or Reason.NO_HANDLE)
    if not claim.holder_usable:
        return full(Reason.DECODE_UNAVAILABLE)     # nobody left to read from or to release through
    if not claim.same_model:
        return full(Reason.MODEL_CHANGED, release=claim.handle)
    return plan_with_handle(prompt, claim.held, claim.handle)


# -- whether reading pays (issue 17) ------------------------------------------------------------------------
def by_cost(plan: Plan, costs: PairCosts, p_cached_tokens: int) -> Plan:
    """The first plan, or no handle when reading D's KV would not pay (`cost.choose`): P computes the history
    faster than it reads it. The unused handle is released. Until a rate is known the handle is kept: P reads,
    and the rates are learned."""
    if plan.handle is None:
        return plan
    # P's cache expected to hold it all: P then loads nothing either way, so decide for the case where the
    # estimate is wrong (prefix caching off, evicted), in which P lacks the whole history.
    expected = p_cached_tokens if p_cached_tokens < plan.reused_tokens else 0
    decision = choose(costs, plan.reused_tokens, expected)
    if decision.handle_tokens or decision.reason is CostReason.NOTHING_TO_REUSE:
        return plan
    return full(Reason.RECOMPUTE_FASTER, release=plan.handle)


# -- every later change -------------------------------------------------------------------------------------
class Setback(StrEnum):
    """What a leg reports; the planner decides what it means."""
    REFUSED = "refused"      # the connection was refused: the engine never saw the request
    TIMEOUT = "timeout"      # the engine missed its deadline
    FAILED = "failed"        # the engine answered with an error, garbage, or went away
    PARITY = "parity"        # P answered, but ran on other tokens than the ones verified


@dataclass(frozen=True)
class Replan:
    plan: Plan
    next_leg: Leg            # the leg to run next
    blame: bool              # the engine failed: exclude it for the rest of the turn
    costs_retry: bool        # spends one of the turn's retries (a parity redo does not: no engine failed)


def replan(plan: Plan, leg: Leg, setback: Setback) -> Replan:
    """After a leg's setback. Only a refused connection keeps a handle (no engine saw it); anything else may
    have consumed it, so P is redone without one."""
    if setback is Setback.PARITY:
        # P's read of D's KV went with other tokens: its answer is garbage. Redo P without the handle.
        return Replan(full(Reason.PARITY_VIOLATION), "prefill", blame=False, costs_retry=False)
    if setback is Setback.REFUSED:
        return Replan(plan, leg, blame=True, costs_retry=True)
    if leg == "decode":
        # D may have read P's blocks: they are spent. Prefill afresh.
        return Replan(full(Reason.DECODE_FAILED), "prefill", blame=True, costs_retry=True)
    with_handle = plan.handle is not None
    after = full(Reason.PREFILL_FAILED) if with_handle else plan
    # vLLM can park a P read of D's blocks it declined (docs/protocol.md §1): a P that timed out on a handle is
    # not at fault; one that timed out without a handle is.
    blame = not (setback is Setback.TIMEOUT and with_handle)
    return Replan(after, "prefill", blame=blame, costs_retry=True)
