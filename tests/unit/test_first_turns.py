"""First turns on D alone (`--local-first-turns`, turns/run/path_choice.py) within D's local bound (issue 36,
item 4). On the H200 a burst's first turns through P and D reached their first token nearly together, at 2.3-2.6x
the co-located engine's TTFT p50; with the bound counting every stream on D, only the burst's first turn went to D
(6 of 96 at chat c64). Requests still waiting for their first token have no inter-token latency to lose: the bound
counts the streams past it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gateway.config import Settings
from gateway.engines.engine import Engine
from gateway.turns.reuse import plan as plans
from gateway.turns.reuse.plan import Reason
from gateway.turns.reuse.rates import DecodeTiming, PrefillTiming, Rates
from gateway.turns.run.decode_leg import DecodeLeg
from gateway.turns.run.path_choice import PathChoice

P, D = "http://p", "http://d"
PROMPT = 1000                   # tokens: 20 ms at 50k tokens/s, the ITL budget's worth


def learned() -> Rates:
    rates = Rates(weight=1.0)
    rates.observe(PrefillTiming(P, "", 1000, 0, None, 0, 0.02))          # P: 50,000 tokens/s
    return rates


def first_turn(decode: Engine) -> SimpleNamespace:
    return SimpleNamespace(req=SimpleNamespace(prompt_ids=[1] * PROMPT), decode=decode, start=None, session="s",
                           plan=plans.full(Reason.FIRST_TURN), headroom=None, prefill=None, reused_tokens=0,
                           local_ahead=0)


def burst(decode: Engine, n: int) -> list[str]:
    """`n` first turns at once, each leg counted on D as the D leg does until its first token."""
    paths = PathChoice(Settings(local_first_turns=True), learned(), outcome=None, pick=None)
    went = []
    for _ in range(n):
        turn = first_turn(decode)
        assert paths.choose(turn) is None
        if turn.plan.local:
            decode.local_prefill_tokens += PROMPT
        decode.outstanding_requests += 1
        went.append("D" if turn.plan.local else "P")
    return went


def test_a_burst_on_a_d_with_nothing_decoding_goes_to_d():
    assert burst(Engine(D, "decode"), 8) == ["D"] * 8


def test_streams_decoding_on_d_bound_it_by_the_itl_budget():
    """One stream past its first token: local prefills in flight take the ITL budget (20 ms at 50k tokens/s:
    1000 tokens); the rest go through P."""
    assert burst(Engine(D, "decode", decoding_streams=1, outstanding_requests=1), 3) == ["D", "P", "P"]


def test_a_local_leg_learns_its_fixed_part_net_of_the_prefills_ahead_of_it():
    """A first turn queued behind 4000 local tokens on D took 100 ms to its first token: 80 of them are D's
    queue, not a fixed part of the local path (taken for one, it sent the later turns the P path, 221 of 222 at
    chat c32 on the simulators)."""
    rates = learned()
    leg = DecodeLeg(client=None, calls=None, outcome=None, rates=rates, metrics=None, settings=Settings())
    turn = first_turn(Engine(D, "decode"))
    turn.plan, turn.local_ahead = plans.whole_prompt_local(turn.plan, False), 4000
    leg._learn(turn, 0.1)
    rates.observe_decode(DecodeTiming(D, False, 0, 0.05, at=0.0), None)
    costs = rates.path_costs(P, D, p_queued_tokens=0, p_waiting=0)
    assert costs.local_fixed_s == pytest.approx(0.0, abs=1e-9)
