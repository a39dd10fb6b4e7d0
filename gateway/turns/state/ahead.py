"""A session turn's claim sent ahead: its store round trip goes out before the turn is rendered and tokenized,
and is awaited once it is. A turn refused in between (a 400 from intake, a context-length refusal, a 429 from
admission, its client gone) never runs: its begin is put back in the store (`put_back`), handle, prefix-index
entry and counter as they were, so the conversation's next turn reuses as if it had never come.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from gateway.engines import kv
from gateway.store import ConversationKey, ConversationStore, StoreUnavailableError, TurnStart
from gateway.telemetry import Metrics
from gateway.turns.legs.release import HandleReleaser
from gateway.turns.state.timing import timed

T = TypeVar("T")


class PutBacks:
    """Claims sent ahead, and the put-backs of those their turns did not take."""

    def __init__(self, store: ConversationStore, releaser: HandleReleaser, metrics: Metrics) -> None:
        self.store, self.releaser, self.metrics = store, releaser, metrics
        self._putting_back: set[asyncio.Task[None]] = set()

    def send_claim(self, session: ConversationKey) -> asyncio.Task[TurnStart]:
        """The session's `begin_turn` as a task of its own (ClaimAhead), started eagerly where asyncio can
        (Python 3.12+): its request is written before this returns, without giving the loop a turn (which, on
        a busy loop, costs more than the overlap saves). On 3.11 it starts at the turn's next await, as before."""
        return _eager_task(timed(self.metrics, "begin_turn", self.store.begin_turn(session, time.time())))

    def put_back(self, session: ConversationKey, claim: asyncio.Future[TurnStart]) -> asyncio.Task[None]:
        """Undo a claim its turn did not take (a task of its own: a cancelled handler cannot stop it half-way)."""
        task = asyncio.ensure_future(self._give_back(session, claim))
        self._putting_back.add(task)
        task.add_done_callback(self._putting_back.discard)
        return task

    async def _give_back(self, session: ConversationKey, claim: asyncio.Future[TurnStart]) -> None:
        try:
            start = await claim
        except Exception:                           # the begin failed (counted by timed): nothing to give back
            return
        try:
            back = await timed(self.metrics, "put_back", self.store.put_back(session, start, time.time()))
        except StoreUnavailableError:
            return          # no answer is not a no: the handle may be back in the store (as in state.py `record`)
        if not back and (handle := kv.from_store(start.handle)) is not None:
            self.releaser.release(handle, "unused")     # a turn began since: the handle is this turn's to free

    async def drain(self) -> None:
        if self._putting_back:
            await asyncio.gather(*self._putting_back, return_exceptions=True)


def _eager_task(coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    if sys.version_info >= (3, 12):
        return asyncio.Task(coro, loop=asyncio.get_running_loop(), eager_start=True)
    return asyncio.ensure_future(coro)


class ClaimAhead:
    """A session turn's claim, sent to the store before the turn is rendered into its prompt, so that the
    store's round trip overlaps the rendering. `async with` it around everything up to the turn's `begin`: `begin`
    takes the claim; a turn that leaves the block without taking it (refused, or cancelled when its client
    went) puts it back. On an error the answer waits for the put-back, so the client's next turn finds the
    handle; on a cancellation it goes on by itself."""

    __slots__ = ("_claim", "_puts", "_session", "_taken")

    def __init__(self, puts: PutBacks, session: ConversationKey | None) -> None:
        self._puts, self._session = puts, session
        self._claim: asyncio.Task[TurnStart] | None = None
        self._taken = False

    async def __aenter__(self) -> ClaimAhead | None:
        if self._session is None:
            return None
        self._claim = self._puts.send_claim(self._session)
        return self

    async def take(self) -> TurnStart:
        """The begun turn, now the turn's own; raises StoreUnavailableError as `begin_turn` does (nothing was
        claimed then). Shielded: a turn cancelled while it waits here leaves the claim to be put back."""
        assert self._claim is not None
        start = await asyncio.shield(self._claim)
        self._taken = True
        return start

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> None:
        if self._claim is None or self._taken or self._session is None:
            return
        self._taken = True
        back = self._puts.put_back(self._session, self._claim)
        if kind is not None and not issubclass(kind, asyncio.CancelledError):
            await asyncio.shield(back)
