"""Whether a D's pins pay, and so how many it keeps and which (issue 25). Pure: the ledger (pins.py) reports what
becomes of the handles it keeps (used by their conversation's next turn, evicted, expired), when conversations
come back, also those whose handle was not kept (a "ghost", so a D that pins nothing still learns), and D's own
readings (dataplane.py: KV usage, requests waiting, preemptions). From them, per D:

- how often a kept handle is used before it is evicted or expires (`used_ratio`), and the prompt tokens the
  used ones saved P from recomputing, per block kept;
- an effective budget in [0, decode_pin_budget]: lower when few handles would be used if kept (kept ones used,
  and those not kept whose conversation came back in time: the budget lost those, not the conversation; never
  below PAY_FLOOR of it, so that some pins keep measuring), and while D is short of blocks (preempting, queueing with its KV nearly full, or full): at 0 the
  gateway pins nothing, stateless PD's behaviour, and D's blocks go to running requests;
- never more than D's room left by its running requests: the KV this gateway's requests on D hold (their
  prompts, at their recent peak, RESERVE over for answers and the handles they read) is taken from D's share
  before pins get any. A D whose running requests need its blocks pins nothing, whatever pins would earn (the
  readings above come a health interval late; this bound is the gateway's own, at every admit);
- which handles to keep: by expected saving per block and second held, from how long this D's conversations
  take to come back and how long each handle has been idle. Recency alone (LRU) under a cyclic pattern evicts
  every handle just before its conversation returns; by expected saving the handles due soon stay and a new
  one that would only push them out is released instead.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from gateway.engines.dataplane import DataPlane
from gateway.turns.state.budget import Decision

USED_GOOD = 0.3       # kept handles used at least this often: the whole budget; below, proportionally less
PAY_FLOOR = 0.05      # ...but not below this: a few pins keep measuring (D's pressure alone takes it to none)
PRIOR_USED, PRIOR_OUTCOMES = 1.0, 2.0   # a D not seen yet: half its pins believed to pay
DECAY = 0.98          # per outcome: the ratio follows about the last 50 handles
FULL_USAGE = 0.95     # D's KV this full is short of blocks by itself...
BUSY_USAGE = 0.80     # ...or this full with requests waiting
BACK_OFF = 0.5        # per reading that shows D short: the pressure factor halves (to 0 below MIN_FACTOR)
CALM_READINGS = 5     # readings in a row with room before it grows back...
RECOVER = 0.1         # ...by this much per reading
MIN_FACTOR = 0.05
RETURNS = 256         # outcomes kept per D for the return-time distribution
MIN_RETURNS = 8       # fewer: worth falls back to recency
REFRESH = 16          # new outcomes before the sorted gaps are recomputed
MIN_WAIT_S = 0.001    # a handle due "now" is not worth infinitely much
GHOSTS = 100_000      # conversations remembered without a kept handle, per process
RESERVE = 1.25        # running requests' KV: their prompts' blocks and this much over (answers, template)
PEAK_DECAY = 0.98     # per admit: the running requests' peak follows about the last 50 turns' bursts


class Returns:
    """How long this D's conversations take to come back after a turn: the last RETURNS outcomes, each the gap
    of one that came back within a handle's life or None for one that did not."""

    def __init__(self, life_s: float) -> None:
        self.life_s = max(life_s, 1e-6)
        self.outcomes: deque[float | None] = deque(maxlen=RETURNS)
        self._table: tuple[list[float], list[float], int] | None = None
        self._fresh = 0

    def back(self, gap: float) -> None:
        self._add(gap if 0.0 <= gap < self.life_s else None)

    def gone(self) -> None:
        self._add(None)

    def rate(self, age: float) -> float:
        """Expected returns per second of a handle idle for `age`: P(back | idle so far) / E[wait left | back],
        exact over the outcomes kept (sorted gaps and their suffix sums: a bisection per handle). With too few
        outcomes, recency: 1 / (1 + age)."""
        if len(self.outcomes) < MIN_RETURNS:
            return 1.0 / (1.0 + max(0.0, age))
        if self._table is None or self._fresh >= REFRESH:
            self._table, self._fresh = self._compute(), 0
        gaps, suffix, never = self._table
        i = bisect.bisect_right(gaps, age)
        later = len(gaps) - i
        if later == 0:
            return 0.0                          # idle past every return seen
        wait = max((suffix[i] - age * later) / later, MIN_WAIT_S)
        return later / (later + never) / wait

    def _add(self, outcome: float | None) -> None:
        self.outcomes.append(outcome)
        self._fresh += 1

    def _compute(self) -> tuple[list[float], list[float], int]:
        gaps = sorted(g for g in self.outcomes if g is not None)
        suffix = [0.0] * (len(gaps) + 1)
        for i in range(len(gaps) - 1, -1, -1):
            suffix[i] = suffix[i + 1] + gaps[i]
        return gaps, suffix, len(self.outcomes) - len(gaps)


@dataclass
class Earnings:
    """One D: what its kept handles earned, and D's own pressure."""
    life_s: float
    used: float = PRIOR_USED             # decayed outcomes of kept handles: used / (used + evicted + expired)
    outcomes: float = PRIOR_OUTCOMES
    would: float = PRIOR_USED            # decayed: handles used, or not kept (evicted, turned away) and their
    chances: float = PRIOR_OUTCOMES      # conversation came back in time / every handle whose fate is known
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("kept", "used", "evicted", "expired", "not_kept", "ghost_back"), 0))
    saved_tokens: int = 0
    kept_blocks: int = 0
    pressure: float = 1.0
    calm: int = 0                        # readings in a row that showed room
    last_scrape: float = 0.0
    last_preemptions: float | None = None
    room: int | None = None              # blocks of D's share its running requests leave (None: not measured)
    running_peak: float = 0.0            # decayed peak of the blocks this gateway's requests on D hold
    returns: Returns = field(init=False)

    def __post_init__(self) -> None:
        self.returns = Returns(self.life_s)

    @property
    def used_ratio(self) -> float:
        return self.used / self.outcomes if self.outcomes else 0.0

    @property
    def would_use_ratio(self) -> float:
        """Pins would be used if kept: an evicted or turned-away handle whose conversation came back within the
        handle's life counts as used (the budget, not the conversation, lost it)."""
        return self.would / self.chances if self.chances else 0.0

    @property
    def pay(self) -> float:
        return max(PAY_FLOOR, min(1.0, self.would_use_ratio / USED_GOOD))

    def outcome(self, used: bool) -> None:
        """A kept handle's fate: used by its conversation's next turn, or not (evicted, expired)."""
        self.used = self.used * DECAY + (1.0 if used else 0.0)
        self.outcomes = self.outcomes * DECAY + 1.0

    def chance(self, used: bool) -> None:
        """Whether a handle, kept or not, would have been used: known when its conversation is back or the
        handle's life is over."""
        self.would = self.would * DECAY + (1.0 if used else 0.0)
        self.chances = self.chances * DECAY + 1.0

    def observe(self, reading: DataPlane | None) -> None:
        """One reading of D's /metrics (each counted once): short of blocks halves the pressure factor; after
        CALM_READINGS readings in a row with room it grows back (D's shortage comes in bursts between readings:
        one calm reading says little)."""
        if reading is None or reading.scraped_at <= self.last_scrape:
            return
        self.last_scrape = reading.scraped_at
        preempted = (reading.preemptions is not None and self.last_preemptions is not None
                     and reading.preemptions > self.last_preemptions)
        if reading.preemptions is not None:
            self.last_preemptions = reading.preemptions
        if short_of_blocks(reading, preempted):
            self.pressure = 0.0 if self.pressure * BACK_OFF < MIN_FACTOR else self.pressure * BACK_OFF
            self.calm = 0
        else:
            self.calm += 1
            if self.calm >= CALM_READINGS:
                self.pressure = min(1.0, self.pressure + RECOVER)

    def load(self, share_blocks: int, running_blocks: int) -> None:
        """At an admit: D's share of blocks (its KV over the replicas pinning it) and the blocks this gateway's
        running requests on D hold now. Their recent peak, not the instant: an admit comes as a turn ends, when
        the burst it was part of may be over for a moment."""
        self.running_peak = max(float(running_blocks), self.running_peak * PEAK_DECAY)
        self.room = max(0, int(share_blocks - RESERVE * self.running_peak))

    def summary(self) -> dict[str, Any]:
        return {"room_blocks": self.room, "running_peak_blocks": round(self.running_peak, 1), "used_ratio": round(self.used_ratio, 3), "would_use_ratio": round(self.would_use_ratio, 3),
                "pay_factor": round(self.pay, 3),
                "pressure_factor": round(self.pressure, 3), "saved_tokens": self.saved_tokens,
                "saved_tokens_per_kept_block": round(self.saved_tokens / self.kept_blocks, 2) if self.kept_blocks
                else None, **self.counts}


def short_of_blocks(reading: DataPlane, preempted: bool) -> bool:
    usage = reading.kv_cache_usage
    waiting = reading.requests_queued
    return preempted or (usage is not None and (usage >= FULL_USAGE or (waiting > 0 and usage >= BUSY_USAGE)))


def keep_by_worth(pinned: int, idle: Iterable[tuple[Hashable, int, float]], need: int, worth_new: float,
                  budget: int) -> Decision:
    """Make room for a new handle of `need` blocks (worth `worth_new` per block) on a D pinning `pinned` blocks
    of which `idle` (key, blocks, worth per block) may be released: only handles worth less than the new one
    make room for it, least worth first; when they cannot, the new one is not kept. Either way a D over a budget
    that shrank sheds its least worth idle handles down to it."""
    ranked = sorted(idle, key=lambda p: p[2])
    over = pinned + need - budget
    if need <= budget and over > 0:
        freed, release = 0, []
        for key, n, worth in ranked:
            if freed >= over or worth >= worth_new:
                break
            release.append(key)
            freed += n
        if freed >= over:
            return Decision(tuple(release), True, pinned - freed + need, budget)
    elif need <= budget:
        return Decision((), True, pinned + need, budget)
    release, left = [], pinned
    for key, n, _ in ranked:
        if left <= budget:
            break
        release.append(key)
        left -= n
    return Decision(tuple(release), False, left, budget)


@dataclass
class _Ghost:
    engine: str
    since: float
    expires_at: float


class PinEarnings:
    """Every D's Earnings, and the conversations remembered without a kept handle (ghosts) with their expiry.
    `adaptive` False: measured only, the budget stays fixed and eviction by recency (the ledger's LRU)."""

    def __init__(self, fraction: float, life_s: float, adaptive: bool = True) -> None:
        self.fraction, self.life_s, self.adaptive = fraction, life_s, adaptive
        self.engines: dict[str, Earnings] = {}
        self._ghosts: dict[Hashable, _Ghost] = {}
        self._expiries: list[tuple[float, int, Hashable]] = []
        self._seq = 0

    def of(self, engine: str) -> Earnings:
        if (found := self.engines.get(engine)) is None:
            found = self.engines[engine] = Earnings(self.life_s)
        return found

    def budget_blocks(self, engine: str, configured: int) -> int:
        """The effective budget: the configured one scaled by how well pins pay and by D's pressure. (Not by
        D's free blocks at its last reading: a reading taken while a long turn ran, or before a read handle was
        freed, counts blocks that are free by now, and turned a long agent loop's new handles away.)"""
        if not self.adaptive:
            return configured
        d = self.of(engine)
        earned = int(configured * d.pay * d.pressure)
        return earned if d.room is None else min(earned, d.room)

    def worth(self, engine: str, age: float, tokens: int, blocks: int) -> float:
        """Expected tokens saved per block and second of holding a handle idle for `age`."""
        return self.of(engine).returns.rate(age) * tokens / max(1, blocks)

    # -- what happened to handles ------------------------------------------------------------------------------
    def kept(self, engine: str, blocks: int) -> None:
        d = self.of(engine)
        d.counts["kept"] += 1
        d.kept_blocks += blocks

    def used(self, engine: str, gap: float) -> None:
        d = self.of(engine)
        d.counts["used"] += 1
        d.outcome(True)
        d.chance(True)
        d.returns.back(gap)

    def saved(self, engine: str, tokens: int) -> None:
        self.of(engine).saved_tokens += max(0, tokens)

    def evicted(self, engine: str, key: Hashable, since: float, now: float) -> None:
        d = self.of(engine)
        d.counts["evicted"] += 1
        d.outcome(False)
        self._ghost(engine, key, since, since + self.life_s, now)

    def expired(self, engine: str) -> None:
        d = self.of(engine)
        d.counts["expired"] += 1
        d.outcome(False)
        d.chance(False)
        d.returns.gone()

    def not_kept(self, engine: str, key: Hashable, now: float) -> None:
        self.of(engine).counts["not_kept"] += 1
        self._ghost(engine, key, now, now + self.life_s, now)

    def back(self, key: Hashable, now: float) -> None:
        """A conversation's turn began: if its handle was not kept, when it came back (the return times that
        rank handles; the used ratio counts kept handles only)."""
        ghost = self._ghosts.pop(key, None)
        if ghost is None or ghost.expires_at <= now:
            return
        d = self.of(ghost.engine)
        d.counts["ghost_back"] += 1
        d.chance(True)
        d.returns.back(now - ghost.since)

    def forget(self, key: Hashable) -> None:
        self._ghosts.pop(key, None)

    def expire(self, now: float) -> None:
        while self._expiries and self._expiries[0][0] <= now:
            _, seq, key = heapq.heappop(self._expiries)
            ghost = self._ghosts.get(key)
            if ghost is not None and ghost.expires_at <= now:
                del self._ghosts[key]
                d = self.of(ghost.engine)
                d.chance(False)
                d.returns.gone()

    def _ghost(self, engine: str, key: Hashable, since: float, expires_at: float, now: float) -> None:
        if expires_at <= now:
            return
        if len(self._ghosts) >= GHOSTS:               # bounded: the oldest remembered goes first
            self._ghosts.pop(next(iter(self._ghosts)))
        self._ghosts.pop(key, None)
        self._ghosts[key] = _Ghost(engine, since, expires_at)
        self._seq += 1
        heapq.heappush(self._expiries, (expires_at, self._seq, key))
