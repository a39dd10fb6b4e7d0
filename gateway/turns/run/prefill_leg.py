"""The P leg: P prefills the prompt (reading D's KV through the plan's handle, if any) and hands back its own
handle for D. P's timing teaches the rates the cost plan weighs."""

from __future__ import annotations

import logging
import time

from gateway.config import Settings
from gateway.engines import kv
from gateway.engines.client import EngineClient
from gateway.engines.engine import Engine
from gateway.engines.probe import pinned_ids_proven
from gateway.errors import UpstreamError
from gateway.turns.legs.bodies import prefill_body, prompt_ids_of
from gateway.turns.legs.calls import EngineCalls, LegSetback
from gateway.turns.run.outcome import TurnOutcome
from gateway.turns.reuse.plan import Setback
from gateway.turns.reuse.rates import PrefillTiming, Rates
from gateway.turns.run.turn import Turn

log = logging.getLogger("gateway.turn")


class PrefillLeg:
    def __init__(self, client: EngineClient, calls: EngineCalls, rates: Rates, outcome: TurnOutcome,
                 settings: Settings) -> None:
        self.client, self.calls, self.rates, self.outcome, self.settings = client, calls, rates, outcome, settings

    async def run(self, turn: Turn, engine: Engine) -> None:
        began = time.perf_counter()
        turn.prefill = engine
        handle = turn.plan.handle
        # P reading D's KV must prefill the verified ids: shown by P's echo, unless P is proven to use them
        proven = pinned_ids_proven(engine)
        confirm = handle is not None and not proven
        body = prefill_body(turn.req, handle, confirm_ids=confirm, stub=proven)   # proven: the ids carry the history
        # vLLM can park a P request whose read of D's blocks it declined (docs/protocol.md §1): a leg that
        # carries a handle gets a short deadline, then P is redone without it, on any P.
        timeout = self.settings.prefill_handle_timeout_s if handle else self.settings.prefill_timeout_s
        sent = time.perf_counter()
        clock = turn.req.clock
        response = await self.calls.leg("prefill", engine, self.client.post_json(
            engine.url, turn.req.endpoint, body, timeout_s=timeout, headers=turn.leg_headers("prefill"),
            decode=turn.req.decode_answer, on_sent=clock.prefill_out, on_answer=clock.prefill_in),
            len(turn.req.prompt_ids))
        if confirm and prompt_ids_of(response) not in (None, turn.req.prompt_ids):
            log.warning("parity violation on %s: P's prompt differs from the rendered one", turn.req.request_id)
            raise LegSetback("prefill", Setback.PARITY, engine, UpstreamError("prefill parity"))
        turn.prefill_handle = kv.peek(response)
        self._learn(turn, handle, time.perf_counter() - sent)
        turn.ticket.prefilled()
        self.outcome.observe("prefill", began)

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
