"""How many new prompt tokens the holder D may compute itself on a warm turn (the local path), from D's headroom
rather than a constant (issue 36).

A local prefill shares D's engine steps with the streams D is decoding: vLLM schedules the running decodes first
and fills the rest of a step with prefill tokens (chunked prefill, vllm/v1/core/sched/scheduler.py), so every step
that carries prefill tokens lasts longer by about `tokens / prefill rate`, and the streams' inter-token latency
grows by that much. The gateway therefore lets D hold at most `itl_budget_s x prefill rate` local prefill tokens in
flight at once while D has streams decoding, and the whole cap while it has none: requests still waiting for their
first token have no inter-token latency to lose (a burst of first turns goes to D as to a co-located engine). A
D whose own queue is not empty gets the floor only: what it would prefill waits behind others, and P is free (its
queue for room: vLLM also counts as waiting the requests waiting for P's KV, which P-path turns themselves put
there). The
prefill rate is the one the gateway learns from P's legs (D runs the same model on the same kind of engine);
until one is known, the floor.

Pure: the runner hands it what it knows of D and logs the result with the turn.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.engines.engine import Engine

FLOOR_TOKENS = 256      # always local: one short chunk costs D's streams a few ms (bench/GPU-RESULTS.md, ITL)


@dataclass(frozen=True)
class Headroom:
    bound: int                  # new tokens this turn may compute on D
    streams: int                # streams running on D (this gateway's, or D's /metrics if it counts more)
    decoding: int               # ...of which past their first token (this gateway's; D's others counted in)
    waiting: int                # requests waiting in D's queue (D's /metrics)
    in_flight: int              # local prefill tokens sent to D whose first token has not come back
    budget_tokens: int          # the ITL budget as prefill tokens at the learned rate (0: no rate known)

    def fields(self) -> dict[str, int]:
        """For the turn's log line."""
        return {"local_bound": self.bound, "d_streams": self.streams, "d_decoding": self.decoding,
                "d_waiting": self.waiting,
                "d_local_in_flight": self.in_flight, "local_budget_tokens": self.budget_tokens}


def local_bound(cap: int, itl_budget_s: float, prefill_tokens_per_s: float | None, *, streams: int, waiting: int,
                in_flight: int, decoding: int | None = None, else_whole_prefill: bool = False) -> Headroom:
    """The local bound for a turn whose D runs `streams` streams (`decoding` of them past their first token; all
    when not told), queues `waiting` requests and is prefilling `in_flight` local tokens already; `cap` (the
    setting) bounds it always, 0 turns the local path off.
    `else_whole_prefill`: D's cache holds the whole history but no handle does, so the P path would prefill the
    whole history again and D read all of it; D computing the new part itself is then the cheaper load on D too,
    and only D's queue bounds it (H200: such turns took 350-550 ms to a first token through P, local ones
    100-200 ms)."""
    decoding = streams if decoding is None else decoding
    budget = int(itl_budget_s * prefill_tokens_per_s) if prefill_tokens_per_s else 0
    floor = min(cap, FLOOR_TOKENS)
    if cap <= 0:
        bound = 0
    elif waiting > 0:
        bound = floor
    elif decoding == 0 or else_whole_prefill:
        bound = cap
    else:
        bound = min(cap, max(floor, budget - in_flight))
    return Headroom(bound, streams, decoding, waiting, in_flight, budget)


def for_decode(decode: Engine, cap: int, itl_budget_ms: float, prefill_tokens_per_s: float | None, *,
               else_whole_prefill: bool = False) -> Headroom:
    """`local_bound` from what the gateway knows of `decode`: its own streams, those past their first token and
    its local prefills in flight there, and D's running and waiting requests as its /metrics last said (the health
    loop's scrape). Running requests D counts beyond this gateway's (another worker's or replica's) are taken
    as decoding: nothing says they are not. Its own local prefills waiting in D's queue are no queue for room
    (the step's token budget holds them back, and they are counted in flight already): taken for one, a burst of
    local first turns made every later turn's bound the floor (29 `not_held` at chat c32 on the simulators)."""
    dp = decode.data_plane
    running = int(dp.requests_running or 0) if dp else 0
    streams = max(decode.outstanding_requests, running)
    decoding = decode.decoding_streams + max(0, running - decode.outstanding_requests)
    waiting = max(0, int(dp.requests_queued) - decode.local_prefills) if dp else 0
    return local_bound(cap, itl_budget_ms / 1000, prefill_tokens_per_s, streams=streams, waiting=waiting,
                       in_flight=decode.local_prefill_tokens, decoding=decoding, else_whole_prefill=else_whole_prefill)
