"""One turn, top to bottom: admit, claim the conversation, plan, pick D then P, run the legs, record.
Read this file to know what a request does; the legs are run/prefill_leg.py and run/decode_leg.py (in push mode
both at once: run/push_leg.py), the path run/path_choice.py, the ending run/outcome.py. What differs between pull
and push mode is the transfer protocol's (run/transfer_protocol.py), chosen when the runner is made.

The legs only report what happened (`LegSetback`); the protocol's `replan` decides what comes next. Retries only where
safe: an engine that refused the connection never saw the request, so the same leg goes to another engine
unchanged; any other failure may have consumed a handle, so P is redone without one. Nothing is retried once
the client has received a byte.
"""

from __future__ import annotations

import time

from gateway.config import DEFAULT_TENANT, Settings
from gateway.engines import routing
from gateway.engines.client import EngineClient
from gateway.engines.engine import Engine
from gateway.engines.pool import EnginePool
from gateway.engines.transfer import Mode
from gateway.errors import EngineUnavailableError
from gateway.store import ConversationKey, StoreUnavailableError
from gateway.telemetry import Metrics
from gateway.tracing import NO_TRACING, Tracing
from gateway.turns.intake.request import TurnRequest
from gateway.turns.legs.calls import EngineCalls, LegSetback
from gateway.turns.legs.release import HandleReleaser
from gateway.turns.reuse import plan as plans
from gateway.turns.reuse.lookup import How
from gateway.turns.reuse.plan import Leg, Reason
from gateway.turns.reuse.rates import Rates
from gateway.turns.run.admission import Admission
from gateway.turns.run.decode_leg import DecodeLeg
from gateway.turns.run.outcome import TurnOutcome
from gateway.turns.run.path_choice import PathChoice
from gateway.turns.run.prefill_leg import PrefillLeg
from gateway.turns.run.transfer_protocol import TransferProtocol, protocol_for
from gateway.turns.run.turn import Turn, TurnReply
from gateway.turns.state.ahead import ClaimAhead
from gateway.turns.state.state import ConversationState


class TurnRunner:
    def __init__(self, *, client: EngineClient, prefill: EnginePool, decode: EnginePool,
                 state: ConversationState, calls: EngineCalls, releaser: HandleReleaser, metrics: Metrics,
                 settings: Settings, tracing: Tracing = NO_TRACING, transfer_mode: Mode = "pull",
                 admission: Admission | None = None) -> None:
        self.client, self.prefill_pool, self.decode_pool = client, prefill, decode
        self.state, self.calls, self.releaser = state, calls, releaser
        self.metrics, self.settings, self.tracing = metrics, settings, tracing
        # the gateway's bounds: shared by every model's runner (assembly.py), else this runner's own
        self.admission = admission or Admission(settings.max_concurrent_turns, settings.max_queued_prompt_tokens)
        self.rates = Rates()         # what the P legs taught of the engines' speeds, for the cost plan
        self.outcome = TurnOutcome(state, releaser, metrics)
        self.prefill_leg = PrefillLeg(client, calls, self.rates, self.outcome, settings)
        self.decode_leg = DecodeLeg(client, calls, self.outcome, self.rates, metrics, settings)
        self.paths = PathChoice(settings, self.rates, self.outcome, self._pick)
        # how KV moves from P to D: pull, or push (docs/protocol.md §8: P's and D's legs sent together as a pair)
        self.transfer: TransferProtocol = protocol_for(transfer_mode, self.prefill_leg, self.decode_leg, calls,
                                                       metrics, settings, self._pick)

    def claim_ahead(self, session: ConversationKey | None) -> ClaimAhead:
        """`async with` it around rendering and `run`: the store's claim overlaps the rendering (state.py)."""
        return self.state.claim_ahead(session)

    async def run(self, req: TurnRequest, session: ConversationKey | None, tenant: str = DEFAULT_TENANT,
                  ahead: ClaimAhead | None = None) -> TurnReply:
        turn = Turn(req, session, self.admission.admit(len(req.prompt_ids)), time.perf_counter(),
                    retries_left=self.settings.max_retries, tenant=tenant)
        turn.trace = self.tracing.turn(req)
        try:
            await self._plan(turn, ahead)
            self.outcome.observe("plan", turn.began)
            if turn.plan.release:
                self.outcome.release_later(turn, turn.plan.release)
            return await self._legs(turn)
        except BaseException:
            self.outcome.release_held_back(turn)
            turn.ticket.close()
            await self.outcome.abandon(turn)
            raise

    async def drain(self) -> None:
        await self.state.drain()          # put-backs first: one that finds a newer turn releases its handle
        await self.releaser.drain()
        await self.transfer.drain()       # push: P legs whose WRITE frees blocks on D

    # -- planning ------------------------------------------------------------------------------------------
    async def _plan(self, turn: Turn, ahead: ClaimAhead | None) -> None:
        await self._first_plan(turn, ahead)
        turn.plan = self.transfer.adopt(turn.plan)

    async def _first_plan(self, turn: Turn, ahead: ClaimAhead | None) -> None:
        try:
            found, claim = await self.state.begin(turn.req, turn.session, turn.tenant, ahead)
        except StoreUnavailableError:
            turn.plan = plans.full(Reason.STORE_UNAVAILABLE)
            return
        turn.how = found.how if found else How.NEW
        self.metrics.conversation_lookups.labels(turn.how.value).inc()
        if found is None or claim is None:       # no session id and lookup by id only: stateless
            turn.plan = plans.full(Reason.NO_SESSION)
            return
        turn.session, turn.start = found.key, found.start    # a found or new conversation has a key now
        if found.how is How.NEW:
            turn.plan = plans.full(Reason.NO_SESSION)
            return
        turn.plan = self.transfer.first_plan(turn.req.prompt_ids, claim)

    def _pick(self, turn: Turn, leg: Leg) -> Engine:
        """D first, then P (routing.py's profiles); an engine that failed this turn is not picked again."""
        record = turn.start.record if turn.start else None
        previous = (record.decode_engine if leg == "decode" else record.prefill_engine) if record else None
        pool, profile = (self.decode_pool, routing.DECODE) if leg == "decode" else (self.prefill_pool, routing.PREFILL)
        try:
            return pool.pick(profile, routing.want(leg, self.settings, previous, frozenset(turn.failed)))
        except EngineUnavailableError:
            if turn.last_error is not None:     # none left: the last engine error, not a bare 503
                raise turn.last_error from None
            raise

    # -- the legs ------------------------------------------------------------------------------------------
    async def _legs(self, turn: Turn) -> TurnReply:
        """D is chosen first (its holder decides whether a handle is usable at all), then P runs, then D; in push
        mode P and D as one pair."""
        turn.decode = self._pick(turn, "decode")
        prefill = self.transfer.choose_path(turn, self.paths)   # the cost plan's P: picked now, for the first P leg
        leg: Leg = self.transfer.first_leg(turn.plan)
        while True:
            try:
                if leg == "decode":
                    return await self.decode_leg.run(turn, self.transfer.decode_body(turn))
                chosen, prefill = prefill or self._pick(turn, "prefill"), None
                reply = await self.transfer.from_prefill(turn, chosen)
                if reply is not None:
                    return reply
                leg = "decode"
            except LegSetback as setback:
                step = self.transfer.replan(turn.plan, setback.leg, setback.kind)
                turn.take(setback, step)
                turn.plan, leg = step.plan, step.next_leg
                turn.keep(turn.plan.handle)
                if setback.leg == "decode" and step.blame:
                    turn.decode = self._pick(turn, "decode")
