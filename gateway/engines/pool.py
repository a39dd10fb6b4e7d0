"""Engine pools: each engine's health, load and circuit breaker. Which engine a turn gets is routing.py's."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

from gateway.engines import routing
from gateway.engines.dataplane import DataPlane

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
    healthy: bool = True
    outstanding_requests: int = 0
    outstanding_tokens: int = 0
    admitted_at: float = 0.0
    breaker: Breaker = field(default_factory=Breaker)
    info: dict = field(default_factory=dict)      # /version, block size, served models: filled at start-up
    # The last scrape of its /metrics (health loop): KV usage, queue, preemptions, NIXL reads. None: no answer.
    data_plane: DataPlane | None = None

    def available(self, now: float) -> bool:
        return self.healthy and self.breaker.allows(now)

    def ramp(self, now: float) -> float:
        """1.0 right after (re-)admission, 0 once RAMP_S has passed."""
        return max(0.0, 1.0 - (now - self.admitted_at) / RAMP_S) if self.admitted_at else 0.0

    def readmit(self, now: float) -> None:
        self.admitted_at = now

    def observe(self, data_plane: DataPlane | None) -> None:
        """A scrape's readings (None: it did not answer, so nothing stale is shown); `info` carries the admin
        view of them (`GET /admin/engines`)."""
        self.data_plane = data_plane
        if data_plane is None:
            self.info.pop("data_plane", None)
        else:
            self.info["data_plane"] = data_plane.summary()

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
        self._picker = routing.Picker(role)
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

    def pick(self, profile: routing.Profile, want: routing.Want) -> Engine:
        return self._picker.pick(list(self.engines.values()), profile, want)

    def pick_prefill(self, affinity: str | None = None, slack_tokens: int = 0,
                     exclude: frozenset[str] = frozenset()) -> Engine:
        """Fewest queued prompt tokens; the previous P (`affinity`) while within `slack_tokens` of that."""
        want = routing.Want(time.monotonic(), exclude, affinity, slack_tokens=slack_tokens)
        return self._picker.pick(list(self.engines.values()), routing.PREFILL, want)

    def pick_decode(self, affinity: str | None = None, load_bound: int = 64,
                    exclude: frozenset[str] = frozenset()) -> Engine:
        """The holder of the conversation's KV (`affinity`) while under `load_bound`; else the least busy."""
        want = routing.Want(time.monotonic(), exclude, affinity, load_bound=load_bound)
        return self._picker.pick(list(self.engines.values()), routing.DECODE, want)
