"""A store call whose reply is lost (its deadline passed, the connection dropped) may have run all the same: a
handle it may have put in the store is never released, or a later turn claims it and P reads freed blocks
(docs/protocol.md §4). The chaos soak found it: a finish under load past the store's 1 s deadline, its handle
released as `superseded` and claimed by the conversation's next turn. Over the Redis store's scripts (fakeredis)."""

from __future__ import annotations

from typing import Any

from gateway.errors import OverloadedError
from gateway.store import ConversationKey, StoreUnavailableError
from gateway.turns.reuse.plan import Plan, PlanKind, Reason
from gateway.turns.state.state import Served
from tests.unit.test_claim_ahead import GatedStore, make_state, refused, turn
from tests.unit.test_pins import D, capture, request

KEY = ConversationKey("t", "a")


class LostReplies(GatedStore):
    """`lose`: the named calls run in the store, then their reply is lost."""

    def __init__(self, *lose: str) -> None:
        super().__init__()
        self.lose = set(lose)

    async def finish_turn(self, *args: Any, **kwargs: Any) -> bool:
        stored = await super().finish_turn(*args, **kwargs)
        if "finish_turn" in self.lose:
            raise StoreUnavailableError("redis: TimeoutError: no answer in time")
        return stored

    async def put_back(self, *args: Any, **kwargs: Any) -> bool:
        back = await super().put_back(*args, **kwargs)
        if "put_back" in self.lose:
            raise StoreUnavailableError("redis: TimeoutError: no answer in time")
        return back


async def test_a_finish_whose_reply_is_lost_leaves_its_handle_to_the_next_turn():
    state, releaser = make_state(LostReplies("finish_turn"))
    await turn(state, KEY)
    found, claim = await state.begin(request(20), KEY)
    assert found.start.handle_state == "claimed" and claim.handle is not None    # stored after all
    assert releaser.released == []


async def test_a_put_back_whose_reply_is_lost_leaves_its_handle_to_the_next_turn():
    store = LostReplies()
    state, releaser = make_state(store)
    await turn(state, KEY)
    store.lose.add("put_back")
    await refused(state, KEY, OverloadedError("busy"))
    await state.drain()
    found, claim = await state.begin(request(20), KEY)
    assert found.start.handle_state == "claimed" and claim.handle is not None    # back after all
    assert releaser.released == []


async def test_a_finish_the_store_refused_still_releases_its_handle():
    """A newer turn began meanwhile: the store said no, so the handle is nobody's and D's blocks are freed now."""
    state, releaser = make_state()
    await turn(state, KEY)
    found, _ = await state.begin(request(20), KEY)
    await state.begin(request(20), KEY)                             # a newer turn: the first may not finish
    await state.record(request(20), KEY, found.start, Plan(PlanKind.FULL, Reason.FIRST_TURN), Served("http://p0", D),
                       capture(20, 1, 1))
    assert releaser.released == [(20, "superseded")]


async def test_a_handle_whose_finish_reply_is_lost_still_counts_in_d_s_pin_budget():
    """Else the ledger would admit more pins than D's budget while the unanswered one may be in the store."""
    state, _ = make_state(LostReplies("finish_turn"))
    await turn(state, KEY)
    assert state.pins.pins is not None and state.pins.pins.pinned_tokens(D) == 16
