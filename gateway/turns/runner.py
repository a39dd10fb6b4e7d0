"""One turn, top to bottom: admit, claim the conversation, plan, pick D then P, run the legs, record.
Read this file to know what a request does; the legs are prefill_leg.py and decode_leg.py (in push mode both
at once: push_leg.py), the ending outcome.py.

The legs only report what happened (`LegSetback`); `plan.replan` decides what comes next. Retries only where
safe: an engine that refused the connection never saw the request, so the same leg goes to another engine
unchanged; any other failure may have consumed a handle, so P is redone without one. Nothing is retried once
the client has received a byte.
"""

from __future__ import annotations

import time
from dataclasses import replace

from gateway.config import DEFAULT_TENANT, Settings
from gateway.engines import routing
from gateway.engines.cache_index import Knowledge
from gateway.engines.client import EngineClient
from gateway.engines.engine import Engine
from gateway.engines.pool import EnginePool
from gateway.engines.transfer import Mode
from gateway.errors import EngineUnavailableError
from gateway.store import Conversation, ConversationKey, StoreUnavailableError
from gateway.telemetry import Metrics
from gateway.tracing import NO_TRACING, Tracing
from gateway.turns.run.admission import Admission
from gateway.turns.run.decode_leg import DecodeLeg
from gateway.turns.intake.request import TurnRequest
from gateway.turns.legs.calls import EngineCalls, LegSetback
from gateway.turns.legs.release import HandleReleaser
from gateway.turns.run.outcome import TurnOutcome
from gateway.turns.run.prefill_leg import PrefillLeg
from gateway.turns.run.push_leg import PushLeg
from gateway.turns.reuse import headroom
from gateway.turns.reuse import plan as plans
from gateway.turns.reuse.lookup import How
from gateway.turns.reuse.cost import TurnShape
from gateway.turns.reuse.plan import Leg, PlanKind, Reason
from gateway.turns.reuse.rates import Rates
from gateway.turns.state.ahead import ClaimAhead
from gateway.turns.state.state import ConversationState
from gateway.turns.run.turn import Turn, TurnReply


class TurnRunner:
    def __init__(self, *, client: EngineClient, prefill: EnginePool, decode: EnginePool,
                 state: ConversationState, calls: EngineCalls, releaser: HandleReleaser, metrics: Metrics,
                 settings: Settings, tracing: Tracing = NO_TRACING, transfer_mode: Mode = "pull") -> None:
        self.client, self.prefill_pool, self.decode_pool = client, prefill, decode
        self.state, self.calls, self.releaser = state, calls, releaser
        self.metrics, self.settings, self.tracing = metrics, settings, tracing
        self.admission = Admission(settings.max_concurrent_turns, settings.max_queued_prompt_tokens)
        self.rates = Rates()         # what the P legs taught of the engines' speeds, for the cost plan
        self.outcome = TurnOutcome(state, releaser, metrics)
        self.prefill_leg = PrefillLeg(client, calls, self.rates, self.outcome, settings)
        self.decode_leg = DecodeLeg(client, calls, self.outcome, self.rates, metrics, settings)
        # push mode (docs/protocol.md §8): plans are pairs, P's and D's legs sent together
        self.push = transfer_mode == "push"
        self.push_leg = PushLeg(self.prefill_leg, self.decode_leg, calls, metrics, settings, self._pick)

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
        await self.push_leg.drain()       # P legs whose WRITE frees blocks on D

    # -- planning ------------------------------------------------------------------------------------------
    async def _plan(self, turn: Turn, ahead: ClaimAhead | None) -> None:
        await self._first_plan(turn, ahead)
        if self.push:
            turn.plan = plans.in_push_mode(turn.plan)

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
        first = plans.first_push_plan if self.push else plans.first_plan
        turn.plan = first(turn.req.prompt_ids, claim)

    def _choose_path(self, turn: Turn) -> Engine | None:
        """Once D is picked: the local path when the holder D can compute the short new suffix itself, and under
        `reuse_policy: cost` the cheapest of local, P reading and P recomputing (`plan.by_path`, for the P picked
        now: returned, for the first P leg). Under `always` a turn that may go local does; the rest read."""
        record = turn.start.record if turn.start else None
        if turn.plan.push and record is not None:     # push: no handle; D alone where its cache serves
            on_holder = turn.decode is not None and turn.decode.url == record.decode_engine
            turn.plan = plans.push_path(turn.plan, len(turn.req.prompt_ids), record.block_size, on_holder,
                                        self.local_bound(turn))
            return None
        if record is None or not plans.may_go_local(turn.plan):
            self._whole_prompt_local(turn)
            return None
        shape = self._shape(turn, record)
        if self.settings.reuse_policy != "cost":
            turn.plan = plans.by_shape(turn.plan, shape)
            self._hold_back(turn)
            return None
        prefill = self._pick(turn, "prefill")
        shape = self._p_cached(shape, prefill, record)
        costs = self.rates.path_costs(prefill.url, record.decode_engine, p_queued_tokens=prefill.outstanding_tokens,
                                      p_waiting=prefill.outstanding_requests)
        turn.plan = plans.by_path(turn.plan, costs, shape)
        self._hold_back(turn)
        return None if turn.plan.local else prefill

    def _whole_prompt_local(self, turn: Turn) -> None:
        """`--local-first-turns`: a turn with nothing to reuse whose whole prompt is within D's local bound goes to
        D alone (reuse/headroom.py keeps it off a D whose streams it would slow)."""
        if not self.settings.local_first_turns or turn.decode is None or turn.plan.push:
            return
        if 0 < len(turn.req.prompt_ids) <= self.local_bound(turn):
            turn.plan = plans.whole_prompt_local(turn.plan, turn.decode.known_cache is not None)
            if turn.session is None and turn.plan.local:      # stateless: no next turn will look for it
                turn.plan = replace(turn.plan, hold=False)

    def _hold_back(self, turn: Turn) -> None:
        """The claimed handle a plan does not read goes back once D has answered; a local turn's too, since D's
        new request then holds the blocks the old handle pins (docs/protocol.md §9), never before."""
        if turn.plan.release:
            self.outcome.release_later(turn, turn.plan.release)
        if turn.plan.local and turn.plan.handle is not None:
            self.outcome.release_later(turn, turn.plan.handle)

    def local_bound(self, turn: Turn, *, else_whole_prefill: bool = False) -> int:
        """The most prompt tokens the holder D may compute itself on the local path (0: off): D's headroom
        (reuse/headroom.py) within the cap, kept on the turn for its log line."""
        if turn.decode is None:
            return 0
        s = self.settings
        turn.headroom = headroom.for_decode(turn.decode, s.local_prefill_max_tokens, s.local_itl_budget_ms,
                                            self.rates.any_prefill_rate(), else_whole_prefill=else_whole_prefill)
        return turn.headroom.bound

    def _shape(self, turn: Turn, record: Conversation) -> TurnShape:
        """The turn as the path choice sees it: local only on the holder D, for a suffix within the bound. Where
        D's KV events say what its cache holds (`plan.d_cached`), that decides the hit, handle or not; else the
        verified prefix counts, and only while the conversation's turns come sooner than a local turn's handle
        lives (D's lease: the P path's handle lives for D's decoder TTL instead): the gap before this turn is the
        guess for the next one."""
        prompt = len(turn.req.prompt_ids)
        known = turn.plan.d_cached is not None
        hit = plans.local_hit(turn.plan, prompt, record.block_size)
        if turn.plan.d_cached is not None:        # within the verified prefix already, whole blocks
            hit = min(turn.plan.d_cached, prompt - 1) // record.block_size * record.block_size
        # no handle, and D's cache holds the whole history: only the new part is D's to compute, where P would
        # prefill all of it again (a history D evicted in part stays on P: computing it would stall D's streams)
        held = record.held_tokens // record.block_size * record.block_size
        bound = self.local_bound(turn, else_whole_prefill=known and turn.plan.handle is None and hit >= held)
        fits = (0 < prompt - hit <= bound and turn.decode is not None
                and turn.decode.url == record.decode_engine
                and (hit > 0 if known else turn.plan.kind in (PlanKind.REUSE, PlanKind.PARTIAL)))
        lease_short = fits and not known and time.time() - record.updated_at > self.settings.lease_ttl_s
        return TurnShape(prompt, turn.plan.reused_tokens, hit, 0, fits and not lease_short, lease_short)

    def _p_cached(self, shape: TurnShape, prefill: Engine, record: Conversation) -> TurnShape:
        """P's own prefix-cache hits on the history: what P's KV events say where it publishes them, else the
        rates' estimate."""
        cache = prefill.known_cache
        if cache is not None:
            blocks = cache.leading(record.block_hashes, record.block_size)
            return replace(shape, p_cached_tokens=min(blocks * record.block_size, record.held_tokens),
                           p_cache_known=cache.knowledge is Knowledge.COMPLETE or blocks > 0)
        return replace(shape, p_cached_tokens=self.rates.warm_tokens(prefill.url, record.prefill_engine,
                                                                     record.held_tokens))

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
        prefill = self._choose_path(turn)      # the cost plan needs its P: picked now, used by the first P leg
        leg: Leg = turn.plan.first_leg
        while True:
            try:
                if leg == "prefill":
                    chosen, prefill = prefill or self._pick(turn, "prefill"), None
                    await self.prefill_leg.run(turn, chosen)
                    leg = "decode"
                elif leg == "pair":
                    chosen, prefill = prefill or self._pick(turn, "prefill"), None
                    return await self.push_leg.run(turn, chosen)
                else:
                    return await self.decode_leg.run(turn)
            except LegSetback as setback:
                step = plans.replan(turn.plan, setback.leg, setback.kind)
                turn.take(setback, step)
                turn.plan, leg = step.plan, step.next_leg
                turn.keep(turn.plan.handle)
                if setback.leg == "decode" and step.blame:
                    turn.decode = self._pick(turn, "decode")
