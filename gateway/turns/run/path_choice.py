"""Which path a planned turn takes once D is picked (pull mode's choice, `PullTransfer.choose_path`): the local path
when the holder D can compute the new suffix itself, and under `reuse_policy: cost` the cheapest of local, P
reading D's KV and P recomputing. D's local bound (`local_bound`) serves push mode's choice too."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from gateway.config import Settings
from gateway.engines.cache_index import Knowledge
from gateway.engines.engine import Engine
from gateway.store import Conversation
from gateway.turns.reuse import headroom
from gateway.turns.reuse import plan as plans
from gateway.turns.reuse.cost import TurnShape
from gateway.turns.reuse.plan import Leg, PlanKind
from gateway.turns.reuse.rates import Rates
from gateway.turns.run.outcome import TurnOutcome
from gateway.turns.run.turn import Turn


class PathChoice:
    def __init__(self, settings: Settings, rates: Rates, outcome: TurnOutcome,
                 pick: Callable[[Turn, Leg], Engine]) -> None:
        self.settings, self.rates, self.outcome, self.pick = settings, rates, outcome, pick

    def choose(self, turn: Turn) -> Engine | None:
        """Under `always` a turn that may go local does; the rest read. Under `cost` (`plan.by_path`) the P
        picked now is returned, for the first P leg."""
        record = turn.start.record if turn.start else None
        if record is None or not plans.may_go_local(turn.plan):
            self._whole_prompt_local(turn)
            return None
        shape = self._shape(turn, record)
        if self.settings.reuse_policy != "cost":
            turn.plan = plans.by_shape(turn.plan, shape)
            self._hold_back(turn)
            return None
        prefill = self.pick(turn, "prefill")
        shape = self.p_cached(shape, prefill, record)
        costs = self.rates.path_costs(prefill.url, record.decode_engine, p_queued_tokens=prefill.outstanding_tokens,
                                      p_waiting=prefill.outstanding_requests, now=time.monotonic())
        turn.plan = plans.by_path(turn.plan, costs, shape)
        self._hold_back(turn)
        return None if turn.plan.local else prefill

    def local_bound(self, turn: Turn, *, else_whole_prefill: bool = False) -> int:
        """The most prompt tokens the holder D may compute itself on the local path (0: off): D's headroom
        (reuse/headroom.py) within the cap, kept on the turn for its log line."""
        if turn.decode is None:
            return 0
        s = self.settings
        turn.headroom = headroom.for_decode(turn.decode, s.local_prefill_max_tokens, s.local_itl_budget_ms,
                                            self.rates.any_prefill_rate(), else_whole_prefill=else_whole_prefill)
        return turn.headroom.bound

    def _whole_prompt_local(self, turn: Turn) -> None:
        """`--local-first-turns`: a turn with nothing to reuse whose whole prompt is within D's local bound goes to
        D alone (reuse/headroom.py keeps it off a D whose decoding streams it would slow; a burst of first turns,
        none decoding yet, goes to D as to a co-located engine)."""
        if not self.settings.local_first_turns or turn.decode is None:
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

    def p_cached(self, shape: TurnShape, prefill: Engine, record: Conversation) -> TurnShape:
        """P's own prefix-cache hits on the history: what P's KV events say where it publishes them, else the
        rates' estimate."""
        cache = prefill.known_cache
        if cache is not None:
            blocks = cache.leading(record.block_hashes, record.block_size)
            return replace(shape, p_cached_tokens=min(blocks * record.block_size, record.held_tokens),
                           p_cache_known=cache.knowledge is Knowledge.COMPLETE or blocks > 0)
        return replace(shape, p_cached_tokens=self.rates.warm_tokens(prefill.url, record.prefill_engine,
                                                                     record.held_tokens))
