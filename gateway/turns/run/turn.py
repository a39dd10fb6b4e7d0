"""What one turn carries from planning to recording (`Turn`), and what it gives the client (`TurnReply`)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from gateway.config import DEFAULT_TENANT
from gateway.engines import kv
from gateway.engines.engine import Engine
from gateway.errors import GatewayError
from gateway.store import ConversationKey, TurnStart
from gateway.tracing import NO_TURN, TurnTrace
from gateway.turns.run.admission import Slot, Ticket
from gateway.turns.intake.request import TurnRequest
from gateway.turns.legs.calls import LegSetback
from gateway.turns.legs.pair import PushPair
from gateway.turns.reuse import plan as plans
from gateway.turns.reuse.headroom import Headroom
from gateway.turns.reuse.lookup import How
from gateway.turns.reuse.plan import Leg, Plan, Reason, Replan
from gateway.turns.state.state import Served


@dataclass
class TurnReply:
    headers: dict[str, str]
    body: bytes | None = None                       # non-streaming JSON
    stream: AsyncGenerator[bytes, None] | None = None   # SSE frames
    cached_tokens: int = 0                          # prompt tokens not computed (`Turn.cached_tokens`)
    session: ConversationKey | None = None          # the conversation it was recorded in (found by prefix too)


@dataclass
class Turn:
    """Everything one turn carries from planning to recording."""
    req: TurnRequest
    session: ConversationKey | None
    ticket: Ticket
    began: float
    retries_left: int = 0
    start: TurnStart | None = None
    plan: Plan = field(default_factory=lambda: plans.full(Reason.NO_SESSION))
    prefill: Engine | None = None
    decode: Engine | None = None
    prefill_handle: kv.Handle | None = None
    failed: set[str] = field(default_factory=set)     # engines that failed this turn: not picked again
    last_error: GatewayError | None = None
    trace: TurnTrace = NO_TURN                         # its spans, when tracing is on
    tenant: str = DEFAULT_TENANT
    how: How = How.NEW                                 # how its conversation was found (X-PD-Conversation)
    held_back: list[tuple[kv.Handle, str]] = field(default_factory=list)   # releases sent once D has answered
    pair: PushPair | None = None                       # push mode: the pair its legs belong to now
    headroom: Headroom | None = None                   # the local bound and what D's load made it (logged)
    local_prefill: tuple[Engine, int] | None = None    # a local leg's tokens counted on its D until its first token
    local_ahead: int = 0                               # ... and the local tokens D was prefilling when it was sent
    handover: Slot | None = None                       # a P-path D leg's slot on its D until its first token

    def take(self, setback: LegSetback, step: Replan) -> None:
        """Apply the planner's answer to a setback: exclude the engine, spend a retry (or give up)."""
        if not step.costs_retry:
            return
        self.trace.leg_failed(setback.error)
        if step.blame and setback.engine is not None:
            self.failed.add(setback.engine.url)
        self.last_error = setback.error
        if self.retries_left <= 0:
            raise setback.error
        self.retries_left -= 1

    def keep(self, handle: kv.Handle | None) -> None:
        """A held-back handle the plan now reads (a local turn whose D failed): no longer to be released."""
        self.held_back = [(h, why) for h, why in self.held_back if h is not handle]

    @property
    def served(self) -> Served:
        return Served(self.prefill.url if self.prefill else "", self.decode.url if self.decode else "")

    @property
    def reused_tokens(self) -> int:
        return min(self.plan.reused_tokens, len(self.req.prompt_ids))

    @property
    def cached_tokens(self) -> int:
        """The prompt tokens this turn did not compute: read from D's KV (the plan's reuse, or D's own on a local
        turn), or hits in P's prefix cache as P reported them in its handle; the larger, since they overlap (the
        same prefix). What the APIs' usage reports as cached (`prompt_tokens_details.cached_tokens`)."""
        reported = self.prefill_handle.producer_cached_tokens if self.prefill_handle is not None else None
        return min(max(self.reused_tokens, reported or 0), len(self.req.prompt_ids))

    def leg_headers(self, leg: Leg) -> dict[str, str]:
        """X-Request-Id for correlation (in push mode the pair's, which is what pairs the legs on P); opens the
        leg's span, whose traceparent goes along when tracing is on."""
        engine = self.prefill if leg == "prefill" else self.decode
        request_id = self.pair.request_id if self.pair else self.req.request_id
        return {"X-Request-Id": request_id, **self.trace.leg(leg, engine.url, self.plan).headers}

    def reply_headers(self, pd_headers: bool) -> dict[str, str]:
        headers = {"X-Request-Id": self.req.request_id}
        if pd_headers:
            headers.update({"X-PD-Plan": self.plan.kind.value, "X-PD-Reason": self.plan.reason.value,
                            "X-PD-Reused-Tokens": str(self.reused_tokens), "X-PD-Conversation": self.how.value})
        return headers
