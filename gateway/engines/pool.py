"""Engine pools: the engines of one role, by URL. Which engine a turn gets is routing.py's."""

from __future__ import annotations

import time

from gateway.engines import routing
from gateway.engines.engine import Engine, Role


class EnginePool:
    def __init__(self, role: Role, urls: list[str], names: dict[str, str] | None = None, prefix: str = "") -> None:
        self.role, self.prefix = role, prefix       # prefix: the model's, where several are served
        self.engines: dict[str, Engine] = {}
        self._picker = routing.Picker(role)
        self.names, self._added = dict(names or {}), 0      # URL → configured name (a reload may add some)
        for url in urls:
            self.add(url)

    def add(self, url: str) -> Engine:
        """An engine's metrics name: the configured one, else role and the order it joined in (a number never
        given twice), so labels carry no host or port and stay the same for the engine's life."""
        url = url.rstrip("/")
        if url not in self.engines:
            name = self.names.get(url) or f"{self.prefix}{self.role}-{self._added}"
            self.engines[url] = Engine(url, self.role, name)
            self._added += 1
        return self.engines[url]

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
