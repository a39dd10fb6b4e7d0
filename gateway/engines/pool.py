"""Engine pools and routing, as small filter → score → pick steps.

P is chosen by fewest outstanding prompt tokens, D by fewest outstanding requests, except that a
conversation's D (the one holding its KV) is kept while it is healthy and under the load bound.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

from gateway.errors import EngineUnavailableError

Role = Literal["prefill", "decode"]


@dataclass
class Engine:
    url: str
    role: Role
    healthy: bool = True
    outstanding_requests: int = 0
    outstanding_tokens: int = 0
    info: dict = field(default_factory=dict)      # /version, block size, served models: filled at start-up

    @contextmanager
    def track(self, prompt_tokens: int = 0) -> Iterator[None]:
        self.outstanding_requests += 1
        self.outstanding_tokens += prompt_tokens
        try:
            yield
        finally:
            self.outstanding_requests -= 1
            self.outstanding_tokens -= prompt_tokens


class EnginePool:
    def __init__(self, role: Role, urls: list[str]) -> None:
        self.role = role
        self.engines: dict[str, Engine] = {u.rstrip("/"): Engine(u.rstrip("/"), role) for u in urls}
        self._rotation = itertools.count()

    def get(self, url: str | None) -> Engine | None:
        return self.engines.get(url) if url else None

    def healthy(self) -> list[Engine]:
        return [e for e in self.engines.values() if e.healthy]

    def pick_prefill(self) -> Engine:
        return min(self._candidates(), key=lambda e: (e.outstanding_tokens, e.outstanding_requests))

    def pick_decode(self, affinity: str | None = None, load_bound: int = 64) -> Engine:
        candidates = self._candidates()
        preferred = self.get(affinity)
        if preferred in candidates and preferred.outstanding_requests < load_bound:
            return preferred
        return min(candidates, key=lambda e: e.outstanding_requests)

    def _candidates(self) -> list[Engine]:
        """Healthy engines, rotated on every call so that ties in load are broken round-robin."""
        candidates = self.healthy()
        if not candidates:
            raise EngineUnavailableError(f"no healthy {self.role} engine")
        start = next(self._rotation) % len(candidates)
        return candidates[start:] + candidates[:start]
