"""Claiming ahead (turns/state/state.py `ClaimAhead`): a session turn's store claim goes out before the turn is
rendered; a turn that then does not run (refused by intake or admission, its client gone) puts its begin back,
so the conversation's next turn reuses, and the pin ledger and the store still agree on which handle is idle.
Over the Redis store's scripts (fakeredis): the embedded store claims in place, with nothing to overlap."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import pytest

from gateway.config import Settings
from gateway.engines.pool import EnginePool
from gateway.errors import InvalidRequestError, OverloadedError
from gateway.store import ConversationKey, MemoryConversationStore, RedisConversationStore, StoreUnavailableError
from gateway.telemetry import Metrics
from gateway.turns.legs.calls import EngineCalls
from gateway.turns.state.budget import PinBudget
from gateway.turns.state.pins import PinLedger
from gateway.turns.reuse.plan import Plan, PlanKind, Reason
from gateway.turns.state.state import ConversationState, Served
from gateway.turns.runner import TurnRunner
from tests.unit.test_pins import BS, D, Releaser, capture, request

fakeredis = pytest.importorskip("fakeredis")
pytest.importorskip("lupa", reason="fakeredis runs Lua scripts through lupa (fakeredis[lua])")

KEY = ConversationKey("t", "a")


class GatedStore(RedisConversationStore):
    """begin_turn claims, then holds its answer until `gate` is set (a reply slow to come back); or fails
    when `down`."""

    def __init__(self) -> None:
        super().__init__(fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer()))
        self.gate = asyncio.Event()
        self.gate.set()
        self.down = False
        self.begun = 0

    async def begin_turn(self, key: ConversationKey, now: float) -> Any:
        self.begun += 1
        if self.down:
            raise StoreUnavailableError("down")
        start = await super().begin_turn(key, now)
        await self.gate.wait()
        return start


def make_state(store: Any = None, capacity: int = 20, **settings: Any) -> tuple[ConversationState, Releaser]:
    settings_ = Settings(prefill=["http://p0"], decode=[D], **settings)
    decode = EnginePool("decode", settings_.decode)
    decode.get(D).facts.num_gpu_blocks = capacity        # a budget of 10 blocks of 4 tokens
    releaser = Releaser()
    state = ConversationState(store=GatedStore() if store is None else store,  # type: ignore[arg-type]
                              decode=decode, releaser=releaser,  # type: ignore[arg-type]
                              metrics=Metrics(), settings=settings_, block_size=BS, renderer=None,
                              pins=PinLedger(PinBudget(0.5, BS)))
    return state, releaser


async def turn(state: ConversationState, key: ConversationKey, prompt: int = 16, handle_id: int = 0) -> Any:
    """One whole turn, claimed ahead, that leaves a handle of `prompt` tokens on D; returns its start."""
    req = request(prompt)
    async with state.claim_ahead(key) as ahead:
        found, _ = await state.begin(req, key, ahead=ahead)
    await state.record(req, key, found.start, Plan(PlanKind.FULL, Reason.FIRST_TURN), Served("http://p0", D),
                       capture(prompt, 1, handle_id))
    return found.start


async def refused(state: ConversationState, key: ConversationKey, error: Exception) -> None:
    with pytest.raises(type(error)):
        async with state.claim_ahead(key) as ahead:
            assert ahead is not None
            raise error


@pytest.mark.parametrize("error", [InvalidRequestError("bad messages"), OverloadedError("busy")])
async def test_a_refused_turn_puts_its_claim_back_and_the_next_turn_reuses(error):
    state, releaser = make_state()
    first = await turn(state, KEY)
    await refused(state, KEY, error)
    found, claim = await state.begin(request(20), KEY)
    assert (found.start.turn, found.start.handle_state) == (first.turn + 1, "claimed")
    assert claim.handle is not None and releaser.released == []


async def test_a_put_back_handle_stays_an_idle_pin_the_budget_may_evict():
    """The ledger never saw the refused claim and the store is back to the turn that stored the handle:
    evict_handle(key, that turn) takes it, so D's blocks are freed and the next turn says `evicted`."""
    state, releaser = make_state()
    await turn(state, KEY, handle_id=1)
    await refused(state, KEY, OverloadedError("busy"))
    await turn(state, ConversationKey("t", "b"), handle_id=2)
    await turn(state, ConversationKey("t", "c"), handle_id=3)          # 12 blocks > 10: a, the oldest, goes
    assert releaser.released == [(16, "evicted")]
    found, _ = await state.begin(request(20), KEY)
    assert found.start.handle_state == "evicted"


async def test_a_turn_that_takes_its_claim_keeps_it():
    state, releaser = make_state()
    await turn(state, KEY)
    async with state.claim_ahead(KEY) as ahead:
        found, claim = await state.begin(request(20), KEY, ahead=ahead)
    assert found.start.handle_state == "claimed"
    await state.drain()
    assert (await state.store.get(KEY))[1] is None                  # still claimed: nothing went back
    assert releaser.released == []


async def test_a_client_gone_while_the_claim_is_out_still_puts_it_back():
    store = GatedStore()
    state, releaser = make_state(store)
    await turn(state, KEY)
    store.gate.clear()                                              # the claim lands, its reply is slow
    waiting = asyncio.Event()

    async def handler() -> None:
        async with state.claim_ahead(KEY) as ahead:
            waiting.set()
            await state.begin(request(20), KEY, ahead=ahead)
    task = asyncio.create_task(handler())
    await waiting.wait()
    await asyncio.sleep(0)
    task.cancel()                                                   # the server cancels the handler
    store.gate.set()                                                # the reply comes: the claim goes back
    with pytest.raises(asyncio.CancelledError):
        await task
    await state.drain()
    found, _ = await state.begin(request(20), KEY)
    assert found.start.handle_state == "claimed" and releaser.released == []


async def test_a_turn_begun_meanwhile_owns_the_conversation_and_the_refused_claim_is_released():
    state, releaser = make_state()
    await turn(state, KEY)
    with pytest.raises(OverloadedError):
        async with state.claim_ahead(KEY):
            while (await state.store.get(KEY))[1] is not None:      # until the claim has landed
                await asyncio.sleep(0)
            other, _ = await state.begin(request(20), KEY)          # another replica's turn
            assert other.start.handle_state == "in_flight"
            raise OverloadedError("busy")
    assert releaser.released == [(16, "unused")]
    await state.record(request(20), KEY, other.start, Plan(PlanKind.FULL, Reason.CONCURRENT_TURN),
                       Served("http://p0", D), capture(20, 1, 9))
    assert (await state.store.get(KEY))[2] == other.start.turn      # its outcome was stored


async def test_store_down_while_claiming_ahead_serves_the_turn_stateless():
    store = GatedStore()
    state, releaser = make_state(store)
    store.down = True
    async with state.claim_ahead(KEY) as ahead:
        with pytest.raises(StoreUnavailableError):
            await state.begin(request(20), KEY, ahead=ahead)
    await state.drain()
    assert releaser.released == []


@pytest.mark.parametrize("case", ["no session", "embedded store", "lookup by tokens only"])
async def test_nothing_is_claimed_ahead_where_nothing_overlaps(case):
    store = MemoryConversationStore() if case == "embedded store" else None
    settings = {"conversation_lookup": "prefix"} if case == "lookup by tokens only" else {}
    state, _ = make_state(store, **settings)
    async with state.claim_ahead(None if case == "no session" else KEY) as ahead:
        assert ahead is None


async def test_admission_refusing_the_turn_in_the_runner_puts_the_claim_back():
    """As `api/routes.py` runs it: `run` admits the turn inside the block, and a 429 there leaves it untaken."""
    state, releaser = make_state(max_concurrent_turns=1)
    await turn(state, KEY)
    runner = TurnRunner(client=None, prefill=EnginePool("prefill", ["http://p0"]),  # type: ignore[arg-type]
                        decode=state.decode_pool, state=state, calls=EngineCalls(Metrics()),
                        releaser=releaser, metrics=Metrics(), settings=state.settings)  # type: ignore[arg-type]
    held = runner.admission.admit(10)                               # another turn holds the only slot
    with pytest.raises(OverloadedError):
        async with runner.claim_ahead(KEY) as ahead:
            await runner.run(request(20), KEY, "t", ahead)
    held.close()
    found, _ = await state.begin(request(20), KEY)
    assert found.start.handle_state == "claimed" and releaser.released == []


@pytest.mark.skipif(sys.version_info < (3, 12),
                    reason="eager tasks: Python 3.12+ (on 3.11 the claim starts at the turn's first await)")
async def test_the_claim_is_under_way_before_the_turn_is_rendered():
    store = GatedStore()
    state, _ = make_state(store)
    async with state.claim_ahead(KEY) as ahead:
        assert store.begun == 1                 # begin_turn ran up to its first wait, with no await in between
        await state.begin(request(20), KEY, ahead=ahead)
    assert store.begun == 1
