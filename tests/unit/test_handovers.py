"""`--decode-handover-limit` (turns/run/admission.py `Handovers`, taken in turns/run/decode_leg.py): the P path's
D legs waiting for their first token on one D, at most the limit at once, the rest sent in arrival order, each
slot freed at the first token or when the leg ends. On the H200 a burst's reads of P's KV on D progressed together
and finished together (the chat c128 burst's 128 first tokens within 60 ms, 0.8 s after P's last answer): in
order, the same total work gives the early turns their first token early."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from gateway.engines.engine import Engine
from gateway.turns.reuse import plan as plans
from gateway.turns.reuse.plan import Reason
from gateway.config import Settings
from gateway.turns.run.decode_leg import DecodeLeg, _prefilled

D = Engine("http://d", "decode")


def p_path_turn(decode: Engine = D) -> SimpleNamespace:
    return SimpleNamespace(decode=decode, plan=plans.full(Reason.FIRST_TURN), pair=None, handover=None,
                           local_prefill=None)


def legs(limit: int, first_byte_s: float = 60.0) -> DecodeLeg:
    settings = Settings(decode_handover_limit=limit, decode_first_byte_timeout_s=first_byte_s)
    return DecodeLeg(client=None, calls=None, outcome=None, rates=None, metrics=None, settings=settings)


def p_path_turn_in_pair() -> SimpleNamespace:
    turn = p_path_turn()
    turn.pair = object()
    return turn


def test_legs_beyond_the_limit_wait_and_go_in_arrival_order():
    async def scenario() -> list[int]:
        handovers, sent = legs(2), []
        turns = [p_path_turn() for _ in range(5)]

        async def leg(i: int) -> None:
            await handovers._handover(turns[i])
            sent.append(i)

        tasks = [asyncio.create_task(leg(i)) for i in range(5)]
        await asyncio.sleep(0)
        assert sent == [0, 1]                       # two on D; three held back
        for i in range(3):
            _prefilled(turns[i])                    # a first token: the next in line goes
            await asyncio.sleep(0)
            assert sent == list(range(3 + i)) and turns[i].handover is None
        await asyncio.gather(*tasks)
        return sent
    assert asyncio.run(scenario()) == [0, 1, 2, 3, 4]


def test_off_by_default_and_never_for_local_legs_push_pairs_or_other_ds():
    async def scenario() -> None:
        off = legs(0)
        for _ in range(10):
            await off._handover(t := p_path_turn())
            assert t.handover is None
        one = legs(1)
        await one._handover(p_path_turn())
        local = p_path_turn()
        local.plan = plans.whole_prompt_local(local.plan, False)
        await asyncio.wait_for(one._handover(local), 0.1)
        await asyncio.wait_for(one._handover(p_path_turn_in_pair()), 0.1)
        await asyncio.wait_for(one._handover(p_path_turn(Engine("http://d2", "decode"))), 0.1)
    asyncio.run(scenario())


def test_a_slot_no_leg_frees_is_freed_once_no_first_token_can_come():
    """A stream the client never read leaves no leg to free its slot: D's first-byte deadline does, and a slot
    freed twice (the leg, then its timer) frees one place only."""
    async def scenario() -> None:
        handovers = legs(1, first_byte_s=0.05)
        held = p_path_turn()
        await handovers._handover(held)
        waiting = asyncio.create_task(handovers._handover(nxt := p_path_turn()))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        await asyncio.wait_for(waiting, 1.0)           # the first slot's timer let it in
        held.handover.release()                          # ...and the leg's late release frees nothing more
        third = asyncio.create_task(handovers._handover(p_path_turn()))
        await asyncio.sleep(0.01)
        assert not third.done()
        _prefilled(nxt)
        await asyncio.wait_for(third, 1.0)
    asyncio.run(scenario())
