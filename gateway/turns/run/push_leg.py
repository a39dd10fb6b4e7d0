"""Push mode's legs (docs/protocol.md §8): P's and D's legs of one pair sent at the same time, paired by one fresh
X-Request-Id. D allocates the prompt's blocks, registers them with P and waits for P's WRITE, so D's first token
follows P's prefill and the write, with no hand-over between P's answer and D's read.

A pair is P's leg (prefill_leg.py as on a first turn; P's handle is not needed) and D's (decode_leg.py, naming
P's identity instead of P's blocks). Which leg may be redone after a setback, and with which id, is
`reuse/pairing.py`'s decision, carried out here; a pair given up goes to the runner as a `LegSetback`, and
`push_plans.replan` starts the next pair, with a new id. `PushTransfer` (at the end) is push mode as the runner
sees it (`transfer_protocol.py`).

Deadlines: each P attempt has `prefill_timeout_s`. D has the pair's own (`PushPair.decode_wait_s`: P's attempts
plus D's first byte) and, once P has answered, `decode_first_byte_timeout_s`: vLLM never ends a D that waits for
a WRITE (`push_registration_timeout` only logs), so the gateway must. Nothing is retried once the client has a
byte: a streamed D leg is handed to the client only after its first token, which comes after P's WRITE.

The client leaving aborts D and leaves P's leg in flight to finish within its deadline: its WRITE is what frees
the blocks a waiting D keeps after an abort (vLLM frees them only on a WRITE, §8.4), and P's lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from gateway.config import Settings
from gateway.engines import kv, transfer
from gateway.engines.engine import Engine
from gateway.engines.probe import pinned_ids_proven
from gateway.errors import EngineTimeoutError, UpstreamError
from gateway.telemetry import Metrics
from gateway.turns.legs.bodies import push_decode_body
from gateway.turns.legs.calls import EngineCalls, LegSetback
from gateway.turns.legs.pair import PushPair
from gateway.turns.reuse import pairing, push_plans
from gateway.turns.reuse.pairing import PairStep
from gateway.turns.reuse.plan import Leg, Plan, Replan, Setback
from gateway.turns.run.decode_leg import DecodeLeg
from gateway.turns.run.path_choice import PathChoice
from gateway.turns.run.prefill_leg import PrefillLeg
from gateway.turns.run.turn import Turn, TurnReply

log = logging.getLogger("gateway.turn")
LEASE_MARGIN_S = 5.0                # a D redone this late might register after P's blocks are gone


class _Attempt:
    """One pair as it runs: its id and P, P's side, and what has happened so far."""

    def __init__(self, pair: PushPair, prefill: Engine) -> None:
        self.pair, self.prefill = pair, prefill
        self.p_task: asyncio.Task[None] | None = None
        self.p_done_at: float | None = None       # monotonic: P answered (or refused); D's own timer starts
        self.d_sent_at = 0.0                      # monotonic: the current D leg went out
        self.p_ok = False                         # P answered normally
        self.p_refused: LegSetback | None = None  # P refused: D ends by itself, and the pair is P's to redo
        self.identity_changed = False             # P's answer named another identity than D was sent
        self.decode_waiting = True                # a D leg of this pair may still need P's WRITE
        self.p_redone = 0

    @property
    def p_running(self) -> bool:
        return self.p_task is not None and not self.p_task.done()

    def lease_left(self, now: float) -> bool:
        """Whether a D redone now still finds P's staged blocks (P's kv_lease_duration after P answered)."""
        if self.p_done_at is None:
            return True
        return now - self.p_done_at < self.prefill.facts.lease_s - LEASE_MARGIN_S


class PushLeg:
    def __init__(self, prefill_leg: PrefillLeg, decode_leg: DecodeLeg, calls: EngineCalls, metrics: Metrics,
                 settings: Settings, pick: Callable[[Turn, Leg], Engine]) -> None:
        self.prefill_leg, self.decode_leg, self.calls = prefill_leg, decode_leg, calls
        self.metrics, self.settings, self.pick = metrics, settings, pick
        self._background: set[asyncio.Task[None]] = set()     # P legs left to finish after their turn

    async def run(self, turn: Turn, prefill: Engine) -> TurnReply:
        """One pair on `prefill` and `turn.decode`; a LegSetback when the pair must be redone (a new id)."""
        attempt = _Attempt(PushPair.new(turn.req.request_id, transfer.push_target(prefill), self._decode_wait_s()),
                           prefill)
        turn.pair = attempt.pair
        try:
            if attempt.pair.target is None:
                await self._serial_prefill(turn, attempt)
            else:
                attempt.p_task = self._spawn(self._prefill_side(turn, attempt))
            return await self._decode_side(turn, attempt)
        finally:
            attempt.decode_waiting = False

    async def drain(self) -> None:
        """P legs still in flight (their WRITEs free D's held blocks): waited for on shutdown."""
        await asyncio.gather(*self._background, return_exceptions=True)

    # -- P's side ------------------------------------------------------------------------------------------
    async def _serial_prefill(self, turn: Turn, attempt: _Attempt) -> None:
        """P's identity not known yet (P was down at start-up, or just came back): P first, then D with what
        P's handle says, as vLLM's toy push proxy does. A setback here goes to the runner: no D was sent."""
        await self.prefill_leg.run(turn, attempt.prefill)
        target = self._learned(turn, attempt)
        attempt.pair = turn.pair = replace(attempt.pair, target=target)

    async def _prefill_side(self, turn: Turn, attempt: _Attempt) -> None:
        """P's leg while D waits, redone in place (same id, same P: only it holds D's registration)."""
        while True:
            try:
                await self.prefill_leg.run(turn, attempt.prefill)
                break
            except LegSetback as setback:
                step = pairing.after_prefill(setback.kind, attempt.p_redone, attempt.decode_waiting)
                if step is not PairStep.REDO_P:
                    raise
                turn.take(setback, Replan(turn.plan, "prefill", blame=False, costs_retry=True))
                attempt.p_redone += 1
                log.info("push pair %s: P failed (%s); P again, same id", attempt.pair.request_id, setback.kind)
        known = attempt.pair.target
        attempt.identity_changed = self._learned(turn, attempt) != known

    def _learned(self, turn: Turn, attempt: _Attempt) -> kv.PushTarget:
        """What P's answer says of P: a pull handle means P is no push engine (its pair cannot work)."""
        attempt.p_done_at, attempt.p_ok = time.monotonic(), True
        target = transfer.remember(attempt.prefill, turn.prefill_handle)
        if target is None or kv.transfer_mode_of(turn.prefill_handle) == "pull":
            attempt.p_ok = False
            raise LegSetback("prefill", Setback.FAILED, attempt.prefill,
                             UpstreamError("prefill engine did not answer as a push-mode engine"))
        return target

    # -- D's side ------------------------------------------------------------------------------------------
    async def _decode_side(self, turn: Turn, attempt: _Attempt) -> TurnReply:
        """D's leg, redone with the same id (another D) where pairing.py allows; else the setback goes up."""
        while True:
            try:
                return await self._decode_once(turn, attempt)
            except LegSetback as setback:
                if setback.leg != "decode":
                    raise                           # P gave up: the runner redoes the pair elsewhere
                step = await self._after_decode(attempt, setback)
                if step is PairStep.REDO_D:
                    turn.take(setback, Replan(turn.plan, "decode", blame=True, costs_retry=True))
                    turn.decode = self.pick(turn, "decode")
                    log.info("push pair %s: D failed (%s); D again on %s, same id", attempt.pair.request_id,
                             setback.kind, turn.decode.url)
                    continue
                if attempt.identity_changed:        # P restarted: D was sent an identity P no longer has
                    raise LegSetback("prefill", Setback.STALE, attempt.prefill, setback.error) from None
                if attempt.p_refused is not None:   # D failed for want of P: another P, the same D
                    raise attempt.p_refused from None
                raise

    async def _after_decode(self, attempt: _Attempt, setback: LegSetback) -> PairStep:
        before = attempt.p_done_at is None
        step = self._decode_step(attempt, setback, before)
        if step is PairStep.WAIT_P and attempt.p_task is not None:
            await asyncio.wait({attempt.p_task})   # bounded by P's deadline; the client leaving leaves P running
            error = attempt.p_task.exception()
            if isinstance(error, LegSetback) and error.kind is Setback.REFUSED:
                attempt.p_refused = error          # D failed for want of P: P's to blame
            step = self._decode_step(attempt, setback, before)
        return step

    @staticmethod
    def _decode_step(attempt: _Attempt, setback: LegSetback, before: bool) -> PairStep:
        return pairing.after_decode(setback.kind, before_p_answered=before, p_running=attempt.p_running,
                                    p_ok=attempt.p_ok, identity_changed=attempt.identity_changed,
                                    within_lease=attempt.lease_left(time.monotonic()))

    async def _decode_once(self, turn: Turn, attempt: _Attempt) -> TurnReply:
        """One D leg, watched together with P's side: D is aborted when P gives up, when P answered and D still
        has nothing after decode_first_byte_timeout_s (blamed on P, whose WRITE did not come: the pair goes to
        another P), or when the client leaves."""
        attempt.d_sent_at = time.monotonic()
        d_task = asyncio.ensure_future(self._decode(turn))
        waiting: set[asyncio.Future] = {d_task}
        if attempt.p_running:
            waiting.add(attempt.p_task)      # type: ignore[arg-type]
        why = "client_gone"
        try:
            while True:
                done, _ = await asyncio.wait(waiting, timeout=self._timer(attempt),
                                             return_when=asyncio.FIRST_COMPLETED)
                if d_task in done:
                    return d_task.result()
                if not done:     # P answered, D got nothing: P's WRITE never came (handshake, submission)
                    why = "no_write"
                    raise LegSetback("prefill", Setback.TIMEOUT, attempt.prefill, EngineTimeoutError(
                        "decode engine got no KV from the prefill engine in time"))
                waiting = {d_task}
                try:
                    self._prefill_ended(turn, attempt)
                except BaseException:
                    why = "prefill_failed"
                    raise
        finally:
            if not d_task.done():
                d_task.cancel()                  # closing D's connection aborts its request
                self.metrics.push_decode_aborts.labels(why).inc()
                if why != "client_gone":         # closed before the turn goes on (or its error goes out)
                    await asyncio.wait({d_task})

    def _prefill_ended(self, turn: Turn, attempt: _Attempt) -> None:
        """P's side ended while D waits: answered (D's timer starts), refused (D cannot reach P either and ends
        by itself: its verdict is awaited), or given up (raised: D is aborted, the pair redone)."""
        task = attempt.p_task
        error = task.exception() if task is not None else None
        if error is None:
            return
        attempt.p_done_at = time.monotonic()
        if isinstance(error, LegSetback) and pairing.after_prefill(
                error.kind, attempt.p_redone, attempt.decode_waiting) is PairStep.WAIT_D:
            attempt.p_refused = error
            return
        raise error

    def _timer(self, attempt: _Attempt) -> float | None:
        """How long D may still take: unbounded here while P runs (D's own leg deadline holds), then
        decode_first_byte_timeout_s from P's answer (or from a redone D's sending, if later)."""
        if attempt.p_done_at is None:
            return None
        began = max(attempt.p_done_at, attempt.d_sent_at)
        return max(0.0, began + self.settings.decode_first_byte_timeout_s - time.monotonic())

    async def _decode(self, turn: Turn) -> TurnReply:
        """D's leg; a streamed one is handed over only once its first token is in (after P's WRITE), since its
        headers come at once and a failed load shows as an error event that can still be redone."""
        if not self.decode_leg.streams(turn):
            return await self.decode_leg.run(turn, decode_body(turn))
        stream, sent = await self.decode_leg.open_stream(turn, decode_body(turn))
        wait_s = turn.pair.decode_wait_s if turn.pair else self.settings.decode_first_byte_timeout_s
        try:
            await self.calls.leg("decode", turn.decode, stream.first_events(wait_s))
        except BaseException:
            stream.close()
            raise
        return self.decode_leg.relayed(turn, stream, sent)

    def _decode_wait_s(self) -> float:
        s = self.settings
        return (1 + pairing.SAME_P_REDOS) * s.prefill_timeout_s + s.decode_first_byte_timeout_s

    def _spawn(self, coro) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._settled)
        return task

    def _settled(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None and not isinstance(error, LegSetback):
            log.debug("push P leg ended: %s", error)


def decode_body(turn: Turn) -> dict[str, Any]:
    """D's leg of a pair, or D alone on a local turn (no pair): naming P's identity, never P's blocks."""
    return push_decode_body(turn.req, turn.pair, local=turn.plan.local, stub=pinned_ids_proven(turn.decode))


class PushTransfer:
    """Push mode as the runner sees it (`run/transfer_protocol.py`'s interface): push plans, pairs, D's body."""

    mode = "push"
    reads_d_kv = False          # no D->P read exists: nothing to calibrate, no cost plan
    first_plan = staticmethod(push_plans.first_plan)
    adopt = staticmethod(push_plans.adopt)
    replan = staticmethod(push_plans.replan)
    decode_body = staticmethod(decode_body)

    def __init__(self, push_leg: PushLeg) -> None:
        self.push_leg = push_leg

    def choose_path(self, turn: Turn, paths: PathChoice) -> Engine | None:
        """D alone where its cache serves the turn (`push_plans.path`); the pair otherwise. No P is picked now."""
        record = turn.start.record if turn.start else None
        if record is not None:
            on_holder = turn.decode is not None and turn.decode.url == record.decode_engine
            turn.plan = push_plans.path(turn.plan, len(turn.req.prompt_ids), record.block_size, on_holder,
                                        paths.local_bound(turn))
        return None

    @staticmethod
    def first_leg(plan: Plan) -> Leg:
        return "decode" if plan.local else "pair"

    async def from_prefill(self, turn: Turn, prefill: Engine) -> TurnReply | None:
        return await self.push_leg.run(turn, prefill)

    async def drain(self) -> None:
        await self.push_leg.drain()
