"""The turn's plan: reuse (P reads D's whole handle), partial (a truncated handle), full (no handle), or local
(the holder D computes the new suffix itself from its own prefix cache, no P leg), with a reason. Push mode's
plans (docs/protocol.md §8: no D->P read exists) are `push_plans.py`'s.

Pure decisions, in one place: `first_plan` from what the store returned and what the prompt rendered to,
`by_cost` for which of the three paths (local on D, P reading D's KV, P recomputing) is cheapest once the engines
are picked, and `replan` for every later change: the legs only report what happened (`Setback`), this module
decides what the turn does next. No I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Literal

from gateway.engines.kv import Handle
from gateway.turns.reuse.continuity import Fingerprint, check
from gateway.turns.reuse.cost import CostReason, Path, PathCosts, TurnShape, choose_path


Leg = Literal["prefill", "decode", "pair"]      # "pair": push mode's P and D legs, sent together


class PlanKind(StrEnum):
    REUSE = "reuse"
    PARTIAL = "partial"
    FULL = "full"
    LOCAL = "local"


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
    EVICTED = "evicted"                        # D dropped the history from its prefix cache (its KV events say so)
    BUDGET_EVICTED = "budget_evicted"          # D's pin budget released the handle while the conversation idled
    NEVER_KEPT = "never_kept"                  # the handle was not kept: larger than D's pin budget
    NOT_HELD = "not_held"                      # the last turn asked D to hold nothing: its events say where it is
    P_CACHED = "p_cached"                      # P's own prefix cache holds the history (its KV events): no read
    SHORT_SUFFIX = "short_suffix"              # local: the holder D computes the short new suffix itself
    P_PATH_FASTER = "p_path_faster"            # within the local bound, but the cost plan found a P path faster
    LEASE_TOO_SHORT = "lease_too_short"        # within the local bound, but turns come further apart than D's lease
    PUSH_MODE = "push_mode"                    # push mode: no D->P read exists; P prefills (its own cache helps)


@dataclass(frozen=True)
class Plan:
    kind: PlanKind
    reason: Reason
    reused_tokens: int = 0
    handle: Handle | None = None        # what P reads D's KV through (None: a full prefill); local: kept unread
    release: Handle | None = None       # a claimed handle this turn will not use: free D's blocks
    instead: Plan | None = None         # local: the P path it replaced, for when D fails
    verified_tokens: int = 0            # push: the prompt's prefix D computed last turn (continuity-checked)
    # The verified prefix's tokens the holder D's prefix cache holds, by its KV events (whole blocks); None: not
    # known (no events, or lost), and the lease/TTL rules apply.
    d_cached: int | None = None
    hold: bool = True                   # D is asked to keep the result behind a handle (a later read may come)
    unheld: Reason = Reason.NOT_HELD    # what the next turn finds when D holds nothing behind a handle

    @property
    def local(self) -> bool:
        return self.kind is PlanKind.LOCAL


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
    d_cached_blocks: int | None = None   # leading blocks of `held` the holder's cache holds (KV events); None: unknown
    d_cache_complete: bool = False       # ... and the events say what it lacks too (none were lost)


# No pin behind the history (or none left): D's own prefix cache may still hold it, and its events say so.
_UNPINNED = frozenset({Reason.NO_HANDLE, Reason.HANDLE_EXPIRED, Reason.BUDGET_EVICTED, Reason.NEVER_KEPT,
                       Reason.HANDLE_NOT_STREAMED, Reason.NOT_HELD})


def first_plan(prompt: list[int], claim: Claim) -> Plan:
    if claim.first_turn:
        return full(Reason.FIRST_TURN)
    if claim.handle is None or claim.held is None:
        return from_cache(prompt, claim, claim.missing or Reason.NO_HANDLE)
    if not claim.holder_usable:
        return full(Reason.DECODE_UNAVAILABLE)     # nobody left to read from or to release through
    if not claim.same_model:
        return full(Reason.MODEL_CHANGED, release=claim.handle)
    plan = plan_with_handle(prompt, claim.held, claim.handle)
    if plan.handle is None or claim.d_cached_blocks is None:
        return plan
    verified = plan.reused_tokens // claim.held.block_size
    if claim.d_cached_blocks < verified and not claim.d_cache_complete:
        return plan        # events were lost: the index may lack what the handle pins; the lease rules decide
    return replace(plan, d_cached=min(verified, claim.d_cached_blocks) * claim.held.block_size)


def from_cache(prompt: list[int], claim: Claim, missing: Reason) -> Plan:
    """No handle: a full prefill, unless the holder D's KV events say its prefix cache still holds the verified
    history (pinned or not, lease or not): the plan then carries how much (`d_cached`) and the path choice may
    send the turn local. Where the events are complete and D lacks part of it, D evicted it: `evicted`."""
    held = claim.held
    if (held is None or claim.d_cached_blocks is None or missing not in _UNPINNED or not claim.holder_usable
            or not claim.same_model):
        return full(missing)
    verdict = check(prompt, held, partial_allowed=True)
    if verdict.kind == "full":
        return full(Reason(verdict.reason))
    verified = verdict.reused_tokens // held.block_size
    cached = min(verified, claim.d_cached_blocks)
    reason = Reason.EVICTED if claim.d_cache_complete and cached < verified else missing
    return replace(full(reason), d_cached=cached * held.block_size)


# -- which path pays (issues 17 and 24) ---------------------------------------------------------------------
def local_hit(plan: Plan, prompt_tokens: int, block_size: int) -> int:
    """The prompt tokens the holder D finds in its own prefix cache on the local path: the verified prefix's whole
    blocks (vLLM caches full blocks only, and always computes a prompt's last token itself)."""
    return min(plan.reused_tokens, prompt_tokens - 1) // block_size * block_size


def to_local(plan: Plan, hit_tokens: int) -> Plan:
    """The P-path plan as a local one: D alone, its cache holding `hit_tokens` of the prompt. Where D's events
    are known, D is asked to hold nothing (no producer lease): the next turn finds the KV by the events too, and
    a pin is asked for only where the plan expects P to read D's KV."""
    return Plan(PlanKind.LOCAL, Reason.SHORT_SUFFIX, hit_tokens, plan.handle, instead=plan,
                d_cached=plan.d_cached, hold=plan.hold and plan.d_cached is None, unheld=plan.unheld)


def whole_prompt_local(plan: Plan, d_events_known: bool) -> Plan:
    """A plan with nothing to reuse (a first turn, no session) as a local one: D prefills the whole prompt itself,
    as a co-located engine would, with no P leg and no KV hand-over (`--local-first-turns`, within D's local
    bound). The reason stays; `instead` is the P path, for when D fails. Where D's events are known D holds
    nothing and the next turn finds the history by them; else D keeps a producer lease, as on a later local turn."""
    if plan.kind is not PlanKind.FULL or plan.handle is not None:
        return plan
    return Plan(PlanKind.LOCAL, plan.reason, 0, None, instead=plan,
                d_cached=0 if d_events_known else None, hold=not d_events_known)


def may_go_local(plan: Plan) -> bool:
    """A plan the path choice may turn local: it holds a handle, or D's events say what D's cache holds."""
    return plan.handle is not None or plan.d_cached is not None


def by_shape(plan: Plan, shape: TurnShape) -> Plan:
    """`reuse_policy: always`: the local path wherever it is allowed, else P reads D's KV."""
    if not may_go_local(plan):
        return plan
    if plan.handle is None:
        return to_local(plan, shape.local_hit_tokens) if shape.local_allowed else plan
    if shape.local_allowed:
        return to_local(plan, shape.local_hit_tokens)
    return replace(plan, reason=Reason.LEASE_TOO_SHORT) if shape.lease_short else plan


def by_path(plan: Plan, costs: PathCosts, shape: TurnShape) -> Plan:
    """The first plan on the cheapest of the three paths (`cost.choose_path`): local (D computes what its cache
    lacks; the claimed handle is kept, unread, and released once D has answered), P reading D's KV (the plan as
    it is), or P recomputing (no handle: it is released). Until a rate is known the handle is kept: the short
    suffix goes local, a longer one to P, which reads, and the rates are learned. P's KV events saying P's own
    cache holds the history: a read saves nothing, so no handle (`p_cached`), and D holds nothing for a read."""
    if not may_go_local(plan):
        return plan
    # P's cache expected to hold it all: P then loads nothing either way, so decide for the case where the
    # estimate is wrong (prefix caching off, evicted), in which P lacks the whole history. Known from P's
    # events, it is no estimate.
    p_has_all = plan.reused_tokens > 0 and shape.p_cached_tokens >= plan.reused_tokens
    if p_has_all and not shape.p_cache_known:
        shape = replace(shape, p_cached_tokens=0)
    decision = choose_path(costs, shape)
    if decision.path is Path.LOCAL:
        return to_local(plan, shape.local_hit_tokens)
    if plan.handle is None:
        return plan
    if p_has_all and shape.p_cache_known:
        return replace(full(Reason.P_CACHED, release=plan.handle), hold=False)
    if decision.path is Path.RECOMPUTE and decision.reason is not CostReason.NOTHING_TO_REUSE:
        return full(Reason.RECOMPUTE_FASTER, release=plan.handle)
    if decision.reason is CostReason.P_PATH_FASTER:
        return replace(plan, reason=Reason.P_PATH_FASTER)
    if shape.lease_short and decision.path is Path.READ:
        return replace(plan, reason=Reason.LEASE_TOO_SHORT)
    return plan


# -- every later change -------------------------------------------------------------------------------------
class Setback(StrEnum):
    """What a leg reports; the planner decides what it means."""
    REFUSED = "refused"      # the connection was refused: the engine never saw the request
    TIMEOUT = "timeout"      # the engine missed its deadline
    FAILED = "failed"        # the engine answered with an error, garbage, or went away
    PARITY = "parity"        # P answered, but ran on other tokens than the ones verified
    STALE = "stale"          # push: P's identity changed (P restarted) while its pair ran: redo it, nobody to blame


@dataclass(frozen=True)
class Replan:
    plan: Plan
    next_leg: Leg            # the leg to run next
    blame: bool              # the engine failed: exclude it for the rest of the turn
    costs_retry: bool        # spends one of the turn's retries (a parity redo does not: no engine failed)


def replan(plan: Plan, leg: Leg, setback: Setback) -> Replan:
    """After a leg's setback. Only a refused connection keeps a handle (no engine saw it); anything else may
    have consumed it, so P is redone without one. A local turn's handle was never read (D only used its own
    prefix cache): when D fails, P reads it as on the long path, through another D if D is to blame."""
    if plan.local and plan.instead is not None:
        if setback is Setback.REFUSED:        # the holder is down: nobody can read its KV
            return Replan(full(Reason.DECODE_FAILED, release=plan.handle), "prefill", blame=True, costs_retry=True)
        p_path = plan.instead
        return Replan(Plan(p_path.kind, Reason.DECODE_FAILED, p_path.reused_tokens, p_path.handle), "prefill",
                      blame=True, costs_retry=True)
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
