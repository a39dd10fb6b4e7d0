"""Push mode: which leg of a pair may be redone after a setback, and with which request id (docs/protocol.md §8.4).
Pure decisions; `turns/run/push_leg.py` carries them out.

The two legs meet on P by their shared request id: D registers its blocks with P, P writes once it has both its
finished prefill and the registration, in either order. So:
- only the P that D registered with can rescue D's request: P again, **same id, same P**;
- a D that never registered (refused) or failed before P answered leaves P's blocks staged for that id: D
  again, **same id**, any D, while P's lease lasts;
- anything else may have used the id up (P wrote into a D that failed after, or into one the gateway gave up
  on while it waited): the **pair** is redone, with a new id (`plan.replan`).
An id is never reused across P's restart (a new engine identity): the pair is redone, nobody blamed.
"""

from __future__ import annotations

from enum import StrEnum

from gateway.turns.reuse.plan import Setback

SAME_P_REDOS = 1       # P redone in place at most this often per pair; then the pair goes to another P


class PairStep(StrEnum):
    REDO_P = "redo_p"          # P again, same id, same P: it holds D's registration
    REDO_D = "redo_d"          # D again, same id, another D: P's blocks wait staged for that id
    WAIT_P = "wait_p"          # D failed while P runs: P's answer says whether D may be redone (its identity)
    WAIT_D = "wait_d"          # P refused: D cannot reach it either; it fails (or recomputes) by itself
    REDO_PAIR = "redo_pair"    # a new id: the runner's replan


def after_prefill(setback: Setback, redone: int, decode_waiting: bool) -> PairStep:
    """P's leg failed; `redone`: how often this pair's P was already redone in place."""
    if setback is Setback.REFUSED:
        return PairStep.WAIT_D
    if decode_waiting and redone < SAME_P_REDOS:
        return PairStep.REDO_P
    return PairStep.REDO_PAIR


def after_decode(setback: Setback, *, before_p_answered: bool, p_running: bool, p_ok: bool,
                 identity_changed: bool, within_lease: bool) -> PairStep:
    """D's leg failed (or the gateway gave up waiting: TIMEOUT, D aborted while it may hold a registration).
    `before_p_answered`: D's failure came while P was still running; `p_ok`: P answered normally."""
    if identity_changed:
        return PairStep.REDO_PAIR
    if setback is Setback.REFUSED:      # D never saw it, never registered: P's blocks are still for this id
        return PairStep.REDO_D if within_lease and (p_running or p_ok) else PairStep.REDO_PAIR
    if setback is Setback.FAILED and before_p_answered:
        if p_running:
            return PairStep.WAIT_P
        return PairStep.REDO_D if p_ok and within_lease else PairStep.REDO_PAIR
    return PairStep.REDO_PAIR
