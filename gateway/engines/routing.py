"""Routing as declared steps, after llm-d's endpoint picker: filters drop engines, scorers rate the rest (lower
is better, summed), the picker takes the lowest; ties go round-robin. A turn picks D first (the D holding the
conversation's KV decides whether its handle is usable at all), then P.

A new policy is a filter or scorer here plus its place in a profile (`PREFILL` / `DECODE`); a setting it needs
goes into config.py and reaches it through `Want` (built from the settings in `want`, below).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from gateway.config import Settings
from gateway.engines.engine import Engine
from gateway.errors import EngineUnavailableError

RAMP_REQUESTS = 8            # a re-admitted engine scores as if this busy, decaying to 0 over engine.RAMP_S
RAMP_TOKENS = 8192
FULL_KV_REQUESTS = 8         # a D with no free KV scores as if this many more requests were outstanding


@dataclass(frozen=True)
class Want:
    """One pick's inputs: the time, engines this turn saw fail, and the conversation's previous engine."""
    now: float
    exclude: frozenset[str] = frozenset()
    previous: str | None = None          # P: the last turn's P (its prefix cache); D: the holder of the KV
    slack_tokens: int = 0                # P: how much busier than the least loaded the previous P may be
    load_bound: int = 64                 # D: outstanding requests above which the holder is left


def want(role: Literal["prefill", "decode"], settings: Settings, previous: str | None,
         exclude: frozenset[str] = frozenset()) -> Want:
    """What one turn's pick of a P or a D needs, from the gateway's settings."""
    if role == "prefill":
        return Want(time.monotonic(), exclude, previous if settings.prefill_affinity else None,
                    slack_tokens=settings.prefill_affinity_slack_tokens)
    return Want(time.monotonic(), exclude, previous, load_bound=settings.decode_load_bound)


@dataclass(frozen=True)
class Filter:
    keep: Callable[[Engine, Want], bool]
    soft: bool = False       # skipped when it would leave nothing: a slow engine serves better than none


Scorer = Callable[["Engine", Want], float]


# -- filters ----------------------------------------------------------------------------------------------
def _healthy(engine: Engine, want: Want) -> bool:
    return engine.healthy


def _not_failed_this_turn(engine: Engine, want: Want) -> bool:
    return engine.url not in want.exclude


def _breaker_closed(engine: Engine, want: Want) -> bool:
    return engine.breaker.allows(want.now)


HEALTHY = Filter(_healthy)
NOT_FAILED_THIS_TURN = Filter(_not_failed_this_turn)
# When overload makes every healthy engine fail at once, ejection is ignored ("panic mode").
BREAKER_CLOSED = Filter(_breaker_closed, soft=True)


# -- scorers ----------------------------------------------------------------------------------------------
def queued_tokens(engine: Engine, want: Want) -> float:
    """P's queue: prompt tokens sent and not yet answered, plus a decaying load for a re-admitted engine."""
    return engine.outstanding_tokens + RAMP_TOKENS * engine.ramp(want.now)


def outstanding_requests(engine: Engine, want: Want) -> float:
    return engine.outstanding_requests + RAMP_REQUESTS * engine.ramp(want.now)


def previous_prefill(engine: Engine, want: Want) -> float:
    """The P that prefilled the conversation's last turn still caches that prompt: keep it while its queue
    is within `slack_tokens` of the least loaded P's (the half token makes an exact tie go its way)."""
    return -(want.slack_tokens + 0.5) if engine.url == want.previous else 0.0


def holder(engine: Engine, want: Want) -> float:
    """The D holding the conversation's KV wins while it is under the load bound: only it can give the next
    P the whole history from its own blocks and read back just the new part."""
    if engine.url == want.previous and engine.outstanding_requests < want.load_bound:
        return float("-inf")
    return 0.0


def used_kv(engine: Engine, want: Want) -> float:
    """D's KV not free for a new conversation, 0..1 of its blocks scaled to FULL_KV_REQUESTS: what the gateway's
    stored handles pin there plus its outstanding prompts, or what D itself last reported in use
    (`vllm:kv_cache_usage_perc`: running requests too, and other replicas' pins), whichever is more. Idle
    conversations' pins fill a D long before its request count shows it; a D whose capacity is unknown scores 0."""
    capacity, block_size = engine.facts.num_gpu_blocks, engine.facts.block_size
    if not capacity or not block_size:
        return 0.0
    in_use = engine.pinned_blocks + -(-engine.outstanding_tokens // block_size)
    reading = engine.data_plane
    if reading is not None and reading.kv_cache_usage is not None:
        in_use = max(in_use, reading.kv_cache_usage * capacity)
    return FULL_KV_REQUESTS * min(1.0, in_use / capacity)


@dataclass(frozen=True)
class Profile:
    filters: Sequence[Filter]
    scorers: Sequence[Scorer]


PREFILL = Profile((HEALTHY, NOT_FAILED_THIS_TURN, BREAKER_CLOSED), (queued_tokens, previous_prefill))
DECODE = Profile((HEALTHY, NOT_FAILED_THIS_TURN, BREAKER_CLOSED), (outstanding_requests, used_kv, holder))


# -- picker -----------------------------------------------------------------------------------------------
class Picker:
    """Runs a profile over a pool's engines. Candidates are rotated on every call, so that ties in score are
    broken round-robin."""

    def __init__(self, role: str) -> None:
        self.role = role
        self._rotation = itertools.count()

    def pick(self, engines: Sequence[Engine], profile: Profile, want: Want) -> Engine:
        candidates = self.candidates(engines, profile, want)
        start = next(self._rotation) % len(candidates)
        rotated = [*candidates[start:], *candidates[:start]]
        return min(rotated, key=lambda e: sum(score(e, want) for score in profile.scorers))

    def candidates(self, engines: Sequence[Engine], profile: Profile, want: Want) -> list[Engine]:
        left = list(engines)
        for step in profile.filters:
            kept = [e for e in left if step.keep(e, want)]
            if kept or not step.soft:
                left = kept
        if not left:
            raise EngineUnavailableError(f"no available {self.role} engine")
        return left
