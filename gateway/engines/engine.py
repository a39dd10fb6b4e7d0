"""One engine as the gateway sees it: health, load in flight and its circuit breaker."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from typing import Literal

from gateway.engines.cache_index import CacheIndex, Knowledge
from gateway.engines.dataplane import DataPlane
from gateway.engines.facts import EngineFacts

Role = Literal["prefill", "decode"]

FAILURES_TO_EJECT = 3
EJECT_COOLDOWN_S = 5.0
RAMP_S = 10.0                # a re-admitted engine takes traffic gradually over this long (routing.RAMP_*)


@dataclass
class Breaker:
    """Open after consecutive failures; half-open (one trial at a time) after a cooldown; closed on success."""
    failures: int = 0
    opened_at: float | None = None
    trial_in_flight: bool = False

    def allows(self, now: float) -> bool:
        if self.opened_at is None:
            return True
        return now - self.opened_at >= EJECT_COOLDOWN_S and not self.trial_in_flight

    def success(self) -> bool:
        """Record a success; True when this closed an open breaker (a re-admission)."""
        reopened = self.opened_at is not None
        self.failures, self.opened_at, self.trial_in_flight = 0, None, False
        return reopened

    def failure(self, now: float) -> None:
        self.failures += 1
        self.trial_in_flight = False
        if self.failures >= FAILURES_TO_EJECT:
            self.opened_at = now


@dataclass
class Engine:
    url: str
    role: Role
    name: str = ""                  # its label in metrics: configured, else role-index (never its URL)
    healthy: bool = True
    outstanding_requests: int = 0
    outstanding_tokens: int = 0
    running_kv_tokens: int = 0      # a D: prompt tokens of this gateway's requests running on it (the KV they hold)
    local_prefill_tokens: int = 0   # a D: tokens of this gateway's local turns it is prefilling (no first token yet)
    local_prefills: int = 0         # ... and how many turns they are
    decoding_streams: int = 0       # a D: this gateway's legs past their first token (a JSON leg: all its life)
    admitted_at: float = 0.0
    breaker: Breaker = field(default_factory=Breaker)
    facts: EngineFacts = field(default_factory=EngineFacts)    # what it says of itself, what was proven of it
    pinned_blocks: int = 0          # a D: the blocks this gateway's stored handles pin there (state/pinning.py)
    # The last scrape of its /metrics (health loop): KV usage, queue, preemptions, NIXL reads. None: no answer.
    data_plane: DataPlane | None = None
    # What its prefix cache holds, from its KV events (kv_events.py); None: it publishes none (--kv-events)
    cache: CacheIndex | None = None

    @property
    def known_cache(self) -> CacheIndex | None:
        """Its prefix cache as its KV events tell it, where they tell anything now (not before the first batch nor
        after a lost connection); None otherwise: the lease and TTL rules apply."""
        return self.cache if self.cache is not None and self.cache.knowledge is not Knowledge.UNKNOWN else None

    def available(self, now: float) -> bool:
        return self.healthy and self.breaker.allows(now)

    def ramp(self, now: float) -> float:
        """1.0 right after (re-)admission, 0 once RAMP_S has passed."""
        return max(0.0, 1.0 - (now - self.admitted_at) / RAMP_S) if self.admitted_at else 0.0

    def readmit(self, now: float) -> None:
        self.admitted_at = now

    def observe(self, data_plane: DataPlane | None) -> None:
        """A scrape's readings (None: it did not answer, so nothing stale is shown)."""
        self.data_plane = data_plane

    def succeeded(self) -> None:
        if self.breaker.success():
            self.readmit(time.monotonic())

    def failed(self) -> None:
        self.breaker.failure(time.monotonic())

    @contextmanager
    def running(self, prompt_tokens: int) -> Iterator[None]:
        """A request on D from its start to its last byte (a stream outlives its call): the KV it holds there,
        which the pin budget leaves room for (earning.py)."""
        self.running_kv_tokens += prompt_tokens
        try:
            yield
        finally:
            self.running_kv_tokens -= prompt_tokens

    @contextmanager
    def track(self, prompt_tokens: int = 0) -> Iterator[None]:
        self.outstanding_requests += 1
        self.outstanding_tokens += prompt_tokens
        if self.breaker.opened_at is not None:
            self.breaker.trial_in_flight = True       # half-open: this request is the trial
        try:
            yield
        finally:
            self.outstanding_requests -= 1
            self.outstanding_tokens -= prompt_tokens
