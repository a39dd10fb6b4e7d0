"""Engine pools and routing, as small filter → score → pick steps.

Filter: healthy (active checks) and not ejected (circuit breaker on consecutive failures). Score: outstanding
prompt tokens for P, outstanding requests for D, plus a decaying penalty for a freshly re-admitted engine so
it takes traffic gradually. Pick: the lowest score; ties go round-robin. A conversation's D (the one holding
its KV) is kept while it passes the filter and stays under the load bound.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

from gateway.errors import EngineUnavailableError

Role = Literal["prefill", "decode"]

FAILURES_TO_EJECT = 3
EJECT_COOLDOWN_S = 5.0
RAMP_S = 10.0
RAMP_REQUESTS = 8            # a re-admitted engine starts as if this busy, decaying to 0 over RAMP_S
RAMP_TOKENS = 8192


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
    healthy: bool = True
    outstanding_requests: int = 0
    outstanding_tokens: int = 0
    admitted_at: float = 0.0
    breaker: Breaker = field(default_factory=Breaker)
    info: dict = field(default_factory=dict)      # /version, block size, served models: filled at start-up

    def available(self, now: float) -> bool:
        return self.healthy and self.breaker.allows(now)

    def ramp(self, now: float) -> float:
        """1.0 right after (re-)admission, 0 once RAMP_S has passed."""
        return max(0.0, 1.0 - (now - self.admitted_at) / RAMP_S) if self.admitted_at else 0.0

    def readmit(self, now: float) -> None:
        self.admitted_at = now

    def succeeded(self) -> None:
        if self.breaker.success():
            self.readmit(time.monotonic())

    def failed(self) -> None:
        self.breaker.failure(time.monotonic())

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


class EnginePool:
    def __init__(self, role: Role, urls: list[str]) -> None:
        self.role = role
        self.engines: dict[str, Engine] = {}
        self._rotation = itertools.count()
        for url in urls:
            self.add(url)

    def add(self, url: str) -> Engine:
        url = url.rstrip("/")
        return self.engines.setdefault(url, Engine(url, self.role))

    def remove(self, url: str) -> Engine | None:
        """In-flight turns keep their Engine object; only new picks stop seeing it."""
        return self.engines.pop(url.rstrip("/"), None)

    def get(self, url: str | None) -> Engine | None:
        return self.engines.get(url) if url else None

    def healthy(self) -> list[Engine]:
        return [e for e in self.engines.values() if e.healthy]

    def pick_prefill(self, affinity: str | None = None, slack_tokens: int = 0,
                     exclude: frozenset[str] = frozenset()) -> Engine:
        """Fewest outstanding prompt tokens. `affinity`: the P that prefilled the conversation's last turn (its
        prefix cache still holds that prompt, so D's handle only has to supply the rest) is kept while its
        load is within `slack_tokens` of the least loaded: a hot conversation cannot pin an overloaded P."""
        now = time.monotonic()
        candidates = self._candidates(now, exclude)

        def load(e: Engine) -> float:
            return e.outstanding_tokens + RAMP_TOKENS * e.ramp(now)

        best = min(candidates, key=load)
        preferred = self.get(affinity)
        if preferred is not None and preferred in candidates and load(preferred) <= load(best) + slack_tokens:
            return preferred
        return best

    def pick_decode(self, affinity: str | None = None, load_bound: int = 64,
                    exclude: frozenset[str] = frozenset()) -> Engine:
        now = time.monotonic()
        candidates = self._candidates(now, exclude)
        preferred = self.get(affinity)
        if preferred in candidates and preferred.outstanding_requests < load_bound:
            return preferred
        return min(candidates, key=lambda e: e.outstanding_requests + RAMP_REQUESTS * e.ramp(now))

    def _candidates(self, now: float, exclude: frozenset[str]) -> list[Engine]:
        """Engines passing the filter, rotated on every call so that ties in load are broken round-robin.
        When every healthy engine is ejected (overload makes all of them slow at once), ejection is
        ignored: a slow engine serves better than none ("panic mode")."""
        healthy = [e for e in self.engines.values() if e.url not in exclude and e.healthy]
        candidates = [e for e in healthy if e.breaker.allows(now)] or healthy
        if not candidates:
            raise EngineUnavailableError(f"no available {self.role} engine")
        start = next(self._rotation) % len(candidates)
        return candidates[start:] + candidates[:start]
