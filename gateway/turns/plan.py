"""The turn's plan: reuse (D's whole handle), partial (a truncated handle) or full (no handle), with a reason.
Pure decisions; the only inputs are what the store returned and what the prompt rendered to."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from gateway.turns.continuity import Fingerprint, check


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


# What P gets on a turn without a handle: "prefill this and hold it for a remote decode".
FRESH_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}


@dataclass(frozen=True)
class Plan:
    kind: PlanKind
    reason: Reason
    reused_tokens: int = 0
    handle: dict[str, Any] | None = None        # what P reads D's KV through (None: a full prefill)
    release: dict[str, Any] | None = None       # a claimed handle this turn will not use: free D's blocks

    @property
    def prefill_params(self) -> dict[str, Any]:
        return dict(self.handle) if self.handle is not None else dict(FRESH_PREFILL_PARAMS)


def full(reason: Reason, release: dict[str, Any] | None = None) -> Plan:
    return Plan(PlanKind.FULL, reason, release=release)


def plan_with_handle(prompt: list[int], held: Fingerprint, handle: dict[str, Any]) -> Plan:
    """Verify continuity against D's held tokens; cut the handle for a partial reuse."""
    groups = handle.get("remote_block_ids")
    shaped = isinstance(groups, list) and groups and all(isinstance(g, list) for g in groups)
    if not shaped or handle.get("remote_num_tokens") != held.held_tokens:
        return full(Reason.HANDLE_SHAPE, release=handle)
    # Cutting a handle is only exact for one KV-cache group of full attention (PROTOCOL.md §4).
    verdict = check(prompt, held, partial_allowed=len(groups) == 1)
    if verdict.kind == "reuse":
        return Plan(PlanKind.REUSE, Reason.CONTINUOUS, verdict.reused_tokens, handle)
    if verdict.kind == "partial":
        return Plan(PlanKind.PARTIAL, Reason(verdict.reason), verdict.reused_tokens,
                    truncate(handle, verdict.reused_tokens, held.block_size))
    return full(Reason(verdict.reason), release=handle)


def truncate(handle: dict[str, Any], tokens: int, block_size: int) -> dict[str, Any]:
    """A handle naming only the first `tokens` (a whole number of blocks) of D's KV."""
    blocks = tokens // block_size
    return {**handle, "remote_num_tokens": tokens,
            "remote_block_ids": [group[:blocks] for group in handle["remote_block_ids"]]}


def release_params(handle: dict[str, Any]) -> dict[str, Any]:
    """A zero-token read of a handle: P only notifies D, which frees the pinned blocks (PROTOCOL.md §4)."""
    return {**handle, "remote_num_tokens": 0}
