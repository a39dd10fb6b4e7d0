"""How a turn ends: counted, its outcome recorded in the store (or its failure marked), and the handles it
claimed but will not read released once D has answered."""

from __future__ import annotations

import logging
import time

from gateway.engines import kv
from gateway.telemetry import Metrics, log_turn
from gateway.turns.intake.clock import TurnClock
from gateway.turns.legs.capture import DecodeCapture
from gateway.turns.legs.release import HandleReleaser
from gateway.turns.state.state import ConversationState
from gateway.turns.run.turn import Turn

log = logging.getLogger("gateway.turn")


class TurnOutcome:
    def __init__(self, state: ConversationState, releaser: HandleReleaser, metrics: Metrics) -> None:
        self.state, self.releaser, self.metrics = state, releaser, metrics

    async def record(self, turn: Turn, capture: DecodeCapture) -> None:
        self._count(turn)
        await self.state.record(turn.req, turn.session, turn.start, turn.plan, turn.served, capture)
        if turn.req.on_recorded is not None:
            turn.req.on_recorded(capture)

    async def abandon(self, turn: Turn) -> None:
        turn.trace.fail(turn.plan)
        log_turn(log, request_id=turn.req.request_id, plan=turn.plan.kind.value, reason=turn.plan.reason.value,
                 outcome="failed")
        await self.state.abandon(turn.req, turn.session, turn.start, turn.plan)

    def _count(self, turn: Turn) -> None:
        plan, prompt, reused = turn.plan, len(turn.req.prompt_ids), turn.reused_tokens
        self.metrics.turns.labels(plan.kind.value, plan.reason.value).inc()
        self.metrics.prompt_tokens.labels("reused").inc(reused)
        self.metrics.prompt_tokens.labels("computed").inc(prompt - reused)
        self.observe("total", turn.began)
        turn.trace.finish(plan, reused, prompt - reused)
        room = turn.headroom.fields() if turn.headroom is not None else {}
        if room:
            self.metrics.local_bound_tokens.labels(plan.kind.value).observe(room["local_bound"])
        log_turn(log, request_id=turn.req.request_id, plan=plan.kind.value, reason=plan.reason.value,
                 reused=reused, computed=prompt - reused, seconds=round(time.perf_counter() - turn.began, 4), **room,
                 **_legs_ms(turn.req.clock))

    def observe(self, phase: str, began: float) -> None:
        self.metrics.turn_seconds.labels(phase).observe(time.perf_counter() - began)

    @staticmethod
    def release_later(turn: Turn, handle: kv.Handle) -> None:
        """A claimed handle the plan will not read goes back once D has answered (or the turn ended): its
        release is a request to P and a notification to D, and sent at planning time it landed in the engines'
        steps while this turn's legs ran (+20-25 ms on D's first token at 4k tokens on an H200)."""
        turn.held_back.append((handle, turn.plan.reason.value))

    def release_held_back(self, turn: Turn) -> None:
        for handle, why in turn.held_back:
            self.releaser.release(handle, why)
        turn.held_back.clear()


def _legs_ms(clock: TurnClock) -> dict[str, float]:
    """Where the turn's first token waited, for its log line: P's leg, D's first token after its request was
    sent, and the gateway's own time (`pdgw_gateway_seconds`' `internal`); a leg not run is left out."""
    out = {}
    if clock.prefill_sent and clock.prefill_answered:
        out["p_ms"] = round((clock.prefill_answered - clock.prefill_sent) * 1e3, 1)
    if clock.decode_sent and clock.decode_first:
        out["d_first_ms"] = round((clock.decode_first - clock.decode_sent) * 1e3, 1)
    if "internal" in (spans := clock.spans()):
        out["own_ms"] = round(spans["internal"] * 1e3, 1)
    return out
