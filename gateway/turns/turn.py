"""One turn, top to bottom: admit, claim the conversation, plan, pick D then P, run the legs, relay, record.
Read this file to know what a request does.

The legs only report what happened (`LegSetback`); `plan.replan` decides what comes next. Retries only where
safe: an engine that refused the connection never saw the request, so the same leg goes to another engine
unchanged; any other failure may have consumed a handle, so P is redone without one. Nothing is retried once
the client has received a byte.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import dataclass, field

import msgspec

from gateway.config import DEFAULT_TENANT, Settings
from gateway.engines import kv, routing, sse
from gateway.engines.client import EngineClient, EngineStream
from gateway.engines.pool import Engine, EnginePool
from gateway.engines.probe import pinned_ids_proven
from gateway.errors import EngineUnavailableError, GatewayError, UpstreamError
from gateway.store import ConversationKey, StoreUnavailableError, TurnStart
from gateway.telemetry import Metrics, log_turn
from gateway.tracing import NO_TRACING, NO_TURN, Tracing, TurnTrace
from gateway.turns import plan as plans
from gateway.turns.admission import Admission, Ticket
from gateway.turns.calls import EngineCalls, LegSetback
from gateway.turns.capture import DecodeCapture
from gateway.turns.legs import decode_body, prefill_body, prompt_ids_of
from gateway.turns.lookup import How
from gateway.turns.plan import Leg, Plan, Reason, Replan, Setback
from gateway.turns.rates import PrefillTiming, Rates
from gateway.turns.release import HandleReleaser
from gateway.turns.request import TurnRequest
from gateway.turns.restream import restream
from gateway.turns.state import ClaimAhead, ConversationState, Served

log = logging.getLogger("gateway.turn")
_encode = msgspec.json.Encoder().encode


@dataclass
class TurnReply:
    headers: dict[str, str]
    body: bytes | None = None                       # non-streaming JSON
    stream: AsyncGenerator[bytes, None] | None = None   # SSE frames


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

    @property
    def served(self) -> Served:
        return Served(self.prefill.url if self.prefill else "", self.decode.url if self.decode else "")


class TurnRunner:
    def __init__(self, *, client: EngineClient, prefill: EnginePool, decode: EnginePool,
                 state: ConversationState, calls: EngineCalls, releaser: HandleReleaser, metrics: Metrics,
                 settings: Settings, tracing: Tracing = NO_TRACING) -> None:
        self.client, self.prefill_pool, self.decode_pool = client, prefill, decode
        self.state, self.calls, self.releaser = state, calls, releaser
        self.metrics, self.settings, self.tracing = metrics, settings, tracing
        self.admission = Admission(settings.max_concurrent_turns, settings.max_queued_prompt_tokens)
        self.rates = Rates()         # what the P legs taught of the engines' speeds, for the cost plan

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
            self._observe("plan", turn.began)
            if turn.plan.release:
                self._release_later(turn, turn.plan.release)
            return await self._legs(turn)
        except BaseException:
            self._release_held_back(turn)
            turn.ticket.close()
            await self._abandon(turn)
            raise

    # -- planning ------------------------------------------------------------------------------------------
    async def _plan(self, turn: Turn, ahead: ClaimAhead | None) -> None:
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
        turn.plan = plans.first_plan(turn.req.prompt_ids, claim)

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
        """D is chosen first (its holder decides whether a handle is usable at all), then P runs, then D."""
        turn.decode = self._pick(turn, "decode")
        prefill = self._weigh(turn)      # the cost plan needs its P: picked now, used by the first P leg
        leg: Leg = "prefill"
        while True:
            try:
                if leg == "prefill":
                    chosen, prefill = prefill, None
                    await self._prefill_leg(turn, chosen)
                    leg = "decode"
                else:
                    return await self._decode_leg(turn)
            except LegSetback as setback:
                step = plans.replan(turn.plan, setback.leg, setback.kind)
                turn.take(setback, step)
                turn.plan, leg = step.plan, step.next_leg
                if setback.leg == "decode" and step.blame:
                    turn.decode = self._pick(turn, "decode")

    async def _prefill_leg(self, turn: Turn, chosen: Engine | None = None) -> None:
        began = time.perf_counter()
        turn.prefill = chosen or self._pick(turn, "prefill")
        handle = turn.plan.handle
        # P reading D's KV must prefill the verified ids: shown by P's echo, unless P is proven to use them
        confirm = handle is not None and not pinned_ids_proven(turn.prefill)
        body = prefill_body(turn.req, handle, confirm_ids=confirm)
        # vLLM can park a P request whose read of D's blocks it declined (docs/protocol.md §1): a leg that
        # carries a handle gets a short deadline, then P is redone without it, on any P.
        timeout = self.settings.prefill_handle_timeout_s if handle else self.settings.prefill_timeout_s
        sent = time.perf_counter()
        response = await self.calls.leg("prefill", turn.prefill, self.client.post_json(
            turn.prefill.url, turn.req.endpoint, body, timeout_s=timeout, headers=self._headers(turn, "prefill"),
            decode=turn.req.decode_answer, on_sent=turn.req.clock.prefill_out, on_answer=turn.req.clock.prefill_in),
            len(turn.req.prompt_ids))
        if confirm and prompt_ids_of(response) not in (None, turn.req.prompt_ids):
            log.warning("parity violation on %s: P's prompt differs from the rendered one", turn.req.request_id)
            raise LegSetback("prefill", Setback.PARITY, turn.prefill, UpstreamError("prefill parity"))
        turn.prefill_handle = kv.peek(response)
        self._learn(turn, handle, time.perf_counter() - sent)
        turn.ticket.prefilled()
        self._observe("prefill", began)

    async def _decode_leg(self, turn: Turn) -> TurnReply:
        if turn.req.stream and self.settings.stream_handle_policy == "miss":
            return await self._stream_decode(turn)
        return await self._json_decode(turn)

    async def _json_decode(self, turn: Turn) -> TurnReply:
        began = time.perf_counter()
        body = decode_body(turn.req, turn.prefill_handle)
        body["stream"] = False
        body.pop("stream_options", None)
        response = await self.calls.leg("decode", turn.decode, self.client.post_json(
            turn.decode.url, turn.req.endpoint, body, timeout_s=self.settings.decode_first_byte_timeout_s,
            headers=self._headers(turn, "decode"), on_sent=turn.req.clock.decode_out,
            on_answer=turn.req.clock.decode_in))
        self._release_held_back(turn)
        self._observe("decode_ttft", began)
        capture = DecodeCapture()
        view = capture.take(response, turn.req.want_token_ids)
        try:
            await self._record(turn, capture)
        finally:
            turn.ticket.close()
        if turn.req.stream:      # policy "buffer": the client asked for a stream; re-stream the whole answer
            return TurnReply(self._reply_headers(turn), stream=restream(view, turn.req))
        return TurnReply(self._reply_headers(turn), body=_encode(view))

    async def _stream_decode(self, turn: Turn) -> TurnReply:
        body = decode_body(turn.req, turn.prefill_handle)
        stream = await self.calls.leg("decode", turn.decode, self.client.open_stream(
            turn.decode.url, turn.req.endpoint, body,
            first_byte_timeout_s=self.settings.decode_first_byte_timeout_s,
            idle_timeout_s=self.settings.decode_idle_timeout_s, headers=self._headers(turn, "decode"),
            on_sent=turn.req.clock.decode_out))
        return TurnReply(self._reply_headers(turn), stream=self._relay(turn, stream))

    async def _relay(self, turn: Turn, stream: EngineStream) -> AsyncGenerator[bytes, None]:
        """Pass D's SSE events through as they come, minus engine internals; record before `[DONE]`."""
        capture, began, first, recorded = DecodeCapture(), time.perf_counter(), True, False
        turn.decode.outstanding_requests += 1
        try:
            done = False
            while not done and (events := await stream.next_events()) is not None:
                if first:
                    turn.req.clock.decode_in()
                    self._release_held_back(turn)
                    self._observe("decode_ttft", began)
                    first = False
                frames = []                  # the events of one read go out in one write
                for event in events:
                    if event == sse.DONE:
                        done = True
                        break
                    frames.append(sse.frame(_encode(capture.take(turn.req.decode_answer(event),
                                                                 turn.req.want_token_ids))))
                if frames:
                    yield b"".join(frames)
            if not capture.handle and capture.finished:
                self.metrics.handles_missing.labels(Reason.HANDLE_NOT_STREAMED.value).inc()
            await self._record(turn, capture)
            recorded = True
            yield sse.frame(sse.DONE)
        except GatewayError as exc:
            # After the first byte nothing is retried: an OpenAI-shaped error event, then [DONE].
            self.metrics.upstream_errors.labels("decode", exc.code).inc()
            turn.decode.failed()
            yield sse.frame(_encode(exc.body()))
            yield sse.frame(sse.DONE)
        finally:
            stream.close()           # on client disconnect too: closing the connection aborts the request on D
            self._release_held_back(turn)
            turn.decode.outstanding_requests -= 1
            turn.ticket.close()
            if not recorded:
                await _shielded(self._abandon(turn))

    # -- the cost plan (issue 17): read D's KV only where it pays -----------------------------------------------
    def _weigh(self, turn: Turn) -> Engine | None:
        """Under `reuse_policy: cost`, pick P now and let `plan.by_cost` keep or drop the handle for that P."""
        record = turn.start.record if turn.start else None
        if turn.plan.handle is None or record is None or self.settings.reuse_policy != "cost":
            return None
        prefill = self._pick(turn, "prefill")
        warm = self.rates.warm_tokens(prefill.url, record.prefill_engine, record.held_tokens)
        turn.plan = plans.by_cost(turn.plan, self.rates.costs(prefill.url, record.decode_engine), warm)
        if turn.plan.release:
            self._release_later(turn, turn.plan.release)
        return prefill

    def _learn(self, turn: Turn, handle: kv.Handle | None, seconds: float) -> None:
        """One P leg's timing, for the rates the cost plan weighs."""
        record = turn.start.record if turn.start else None
        previous, held, holder = (record.prefill_engine, record.held_tokens, record.decode_engine) if record \
            else ("", 0, "")
        reported = turn.prefill_handle.producer_cached_tokens if turn.prefill_handle else None
        self.rates.observe(PrefillTiming(
            turn.prefill.url, holder if handle else "", len(turn.req.prompt_ids),
            (handle.num_tokens or 0) if handle else 0, reported,
            self.rates.warm_tokens(turn.prefill.url, previous, held, trusted=False), seconds))

    # -- outcome -------------------------------------------------------------------------------------------
    async def _record(self, turn: Turn, capture: DecodeCapture) -> None:
        self._count(turn)
        await self.state.record(turn.req, turn.session, turn.start, turn.plan, turn.served, capture)

    async def _abandon(self, turn: Turn) -> None:
        turn.trace.fail(turn.plan)
        log_turn(log, request_id=turn.req.request_id, plan=turn.plan.kind.value, reason=turn.plan.reason.value,
                 outcome="failed")
        await self.state.abandon(turn.req, turn.session, turn.start, turn.plan)

    def _count(self, turn: Turn) -> None:
        plan, prompt = turn.plan, len(turn.req.prompt_ids)
        self.metrics.turns.labels(plan.kind.value, plan.reason.value).inc()
        reused = min(plan.reused_tokens, prompt)
        self.metrics.prompt_tokens.labels("reused").inc(reused)
        self.metrics.prompt_tokens.labels("computed").inc(prompt - reused)
        self._observe("total", turn.began)
        turn.trace.finish(plan, reused, prompt - reused)
        log_turn(log, request_id=turn.req.request_id, plan=plan.kind.value, reason=plan.reason.value,
                 reused=reused, computed=prompt - reused, seconds=round(time.perf_counter() - turn.began, 4))

    async def drain(self) -> None:
        await self.state.drain()          # put-backs first: one that finds a newer turn releases its handle
        await self.releaser.drain()

    # -- handles this turn will not use -----------------------------------------------------------------------
    @staticmethod
    def _release_later(turn: Turn, handle: kv.Handle) -> None:
        """A claimed handle the plan will not read goes back once D has answered (or the turn ended): its
        release is a request to P and a notification to D, and sent at planning time it landed in the engines'
        steps while this turn's legs ran (+20-25 ms on D's first token at 4k tokens on an H200)."""
        turn.held_back.append((handle, turn.plan.reason.value))

    def _release_held_back(self, turn: Turn) -> None:
        for handle, why in turn.held_back:
            self.releaser.release(handle, why)
        turn.held_back.clear()

    # -- small things --------------------------------------------------------------------------------------
    def _headers(self, turn: Turn, leg: Leg) -> dict[str, str]:
        """X-Request-Id for correlation; opens the leg's span, whose traceparent goes along when tracing is on."""
        engine = turn.prefill if leg == "prefill" else turn.decode
        return {"X-Request-Id": turn.req.request_id, **turn.trace.leg(leg, engine.url, turn.plan).headers}

    def _reply_headers(self, turn: Turn) -> dict[str, str]:
        headers = {"X-Request-Id": turn.req.request_id}
        if self.settings.pd_headers:
            headers.update({"X-PD-Plan": turn.plan.kind.value, "X-PD-Reason": turn.plan.reason.value,
                            "X-PD-Reused-Tokens": str(min(turn.plan.reused_tokens, len(turn.req.prompt_ids))),
                            "X-PD-Conversation": turn.how.value})
        return headers

    def _observe(self, phase: str, began: float) -> None:
        self.metrics.turn_seconds.labels(phase).observe(time.perf_counter() - began)


async def _shielded(coro: Awaitable[None]) -> None:
    try:
        await asyncio.shield(coro)
    except (asyncio.CancelledError, Exception):  # a dying stream must not raise from its cleanup
        pass
