"""A conversation's state across turns, through the store: claim it when a turn begins, record what D holds
when the turn ends, mark a failed turn finished. The store never interprets what it keeps; this module does.

A turn with a session id claims ahead (`ClaimAhead`): its store round trip is sent before the turn is rendered
and tokenized, and awaited once it is. A turn refused in between (a 400 from intake, a context-length refusal,
a 429 from admission, its client gone) never runs: its begin is put back in the store (`put_back`), handle,
prefix-index entry and counter as they were, so the conversation's next turn reuses as if it had never come.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from gateway.config import DEFAULT_TENANT, Settings
from gateway.engines import kv
from gateway.engines.pool import EnginePool
from gateway.store import Answer, Conversation, ConversationKey, ConversationStore, StoreUnavailableError, TurnStart
from gateway.telemetry import Metrics
from gateway.turns.capture import DecodeCapture
from gateway.turns.continuity import Fingerprint, held_fingerprint
from gateway.turns.budget import EVICTED
from gateway.turns.generated import remember
from gateway.turns.lookup import How
from gateway.turns.pins import PinLedger, Victim
from gateway.turns.plan import Claim, Plan, Reason
from gateway.turns.release import HandleReleaser
from gateway.turns.render import Renderer
from gateway.turns.request import TurnRequest
from gateway.turns.sessionless import ConversationFinder, Found

log = logging.getLogger("gateway.turn")
T = TypeVar("T")
_NO_HANDLE_REASONS = {"expired": Reason.HANDLE_EXPIRED, "in_flight": Reason.CONCURRENT_TURN,
                      "evicted": Reason.EVICTED}


@dataclass(frozen=True)
class Served:
    """Where a finished turn ran, as the next turn needs to know it."""
    prefill: str
    decode: str


class ConversationState:
    def __init__(self, *, store: ConversationStore, decode: EnginePool, releaser: HandleReleaser,
                 metrics: Metrics, settings: Settings, block_size: int, renderer: Renderer | None,
                 pins: PinLedger | None = None) -> None:
        self.store, self.decode_pool, self.releaser = store, decode, releaser
        self.metrics, self.settings, self.block_size = metrics, settings, block_size
        self.renderer = renderer        # history_tokens "generated": to keep D's answers as it made them
        self.pins = pins                # the handles this process stored, kept within D's pin budget
        self.finder = ConversationFinder(store, settings.conversation_lookup, block_size, self._usable)
        self._putting_back: set[asyncio.Task[None]] = set()

    # -- begin ---------------------------------------------------------------------------------------------
    def claim_ahead(self, session: ConversationKey | None) -> ClaimAhead:
        """`async with` it around a turn's rendering and run: it claims a session turn's handle ahead, and puts
        the claim back if the turn does not take it. Its `as` target is None where nothing can overlap: no
        session id, lookup by tokens only, or the embedded store (whose claim is no round trip)."""
        ahead = session is not None and self.finder.mode != "prefix" and self.store.kind != "memory"
        return ClaimAhead(self, session if ahead else None)

    async def begin(self, req: TurnRequest, session: ConversationKey | None, tenant: str = DEFAULT_TENANT,
                    ahead: ClaimAhead | None = None) -> tuple[Found | None, Claim | None]:
        """Find the turn's conversation (by its session id, else by its tokens: sessionless.py, else a new one)
        and claim its handle (at most once, atomically in the store; `ahead`: claimed already, by session id).
        (None, None): no conversation (no session id and lookup by session id only). Raises
        StoreUnavailableError: the turn is then served stateless."""
        if session is None and req.body.get("cache_salt") is not None:
            # A client that salts its prompts keeps its KV apart from others' on purpose (vLLM's cache_salt):
            # finding a conversation by its tokens would cross that line, so a salted turn without a session id
            # is served stateless.
            return None, None
        if ahead is not None and session is not None:
            found: Found | None = Found(How.SESSION, session, await ahead.take())
        else:
            found = await self._timed("begin_turn", self.finder.begin(
                session, tenant, req.prompt_ids, req.model, time.time()))
        if found is None:
            return None, None
        start = found.start
        if self.pins is not None and start.handle_state == "claimed":
            self.pins.claim(found.key, time.time())   # being read: never a budget victim
        if req.rerender is not None and start.record is not None and start.record.answers:
            req.prompt_ids = req.rerender(start.record.answers)      # past answers as D generated them
        return found, self._claim(req, start)

    def send_claim(self, session: ConversationKey) -> asyncio.Task[TurnStart]:
        """The session's `begin_turn` as a task of its own (ClaimAhead), started eagerly where asyncio can
        (Python 3.12+): its request is written before this returns, without giving the loop a turn (which, on
        a busy loop, costs more than the overlap saves). On 3.11 it starts at the turn's next await, as before."""
        return _eager_task(self._timed("begin_turn", self.store.begin_turn(session, time.time())))

    def put_back(self, session: ConversationKey, claim: asyncio.Future[TurnStart]) -> asyncio.Task[None]:
        """Undo a claim its turn did not take (a task of its own: a cancelled handler cannot stop it half-way)."""
        task = asyncio.ensure_future(self._give_back(session, claim))
        self._putting_back.add(task)
        task.add_done_callback(self._putting_back.discard)
        return task

    async def _give_back(self, session: ConversationKey, claim: asyncio.Future[TurnStart]) -> None:
        try:
            start = await claim
        except Exception:                           # the begin failed (counted by _timed): nothing to give back
            return
        try:
            back = await self._timed("put_back", self.store.put_back(session, start, time.time()))
        except StoreUnavailableError:
            back = False
        if not back and (handle := kv.from_store(start.handle)) is not None:
            self.releaser.release(handle, "unused")     # a turn began since: the handle is this turn's to free

    async def drain(self) -> None:
        if self._putting_back:
            await asyncio.gather(*self._putting_back, return_exceptions=True)

    def _usable(self, decode_url: str) -> bool:
        holder = self.decode_pool.get(decode_url)
        return holder is not None and holder.healthy

    def _claim(self, req: TurnRequest, start: TurnStart) -> Claim:
        record = start.record
        if record is None:
            return Claim(True, None, None, None, True, False)
        handle = kv.from_store(start.handle) if start.handle_state == "claimed" else None
        missing = None if handle else (_NO_HANDLE_REASONS.get(start.handle_state) or _missing_reason(record))
        holder = self.decode_pool.get(record.decode_engine)
        return Claim(False, handle, missing, fingerprint(record), record.model == req.model,
                     holder is not None and holder.healthy)

    # -- finish --------------------------------------------------------------------------------------------
    async def record(self, req: TurnRequest, session: ConversationKey | None, start: TurnStart | None,
                     plan: Plan, served: Served, capture: DecodeCapture) -> None:
        """Store what D now holds (the turn still owns the conversation's counter), else release D's handle."""
        handle = self._verified_handle(capture)
        if session is not None and self.pins is not None:
            self.pins.spent(session)                  # the claimed handle, if any, was read or released
        if session is None or start is None or not capture.finished:
            if handle:
                self.releaser.release(handle, "unused")
            return
        now = time.time()
        handle, victims = self._admit(session, served.decode, handle, now)
        previous = start.record
        num_tokens, held = held_fingerprint(      # hashes only the blocks the plan did not verify
            req.prompt_ids, capture.prompt_ids, capture.output_ids, handle.num_tokens if handle else 0,
            self.block_size, previous=fingerprint(previous), verified_tokens=plan.reused_tokens)
        expires_at = now + self.settings.handle_ttl_s
        record = Conversation(
            decode_engine=served.decode, prefill_engine=served.prefill, model=req.model,
            block_size=self.block_size, num_tokens=num_tokens, held_tokens=held.held_tokens,
            block_hashes=held.block_hashes, prefix_hash=held.prefix_hash,
            handle_note="" if handle else (EVICTED if victims is None else _missing_note(req, capture)),
            answers=self._answers(req, start, capture), created_at=previous.created_at if previous else now,
            updated_at=now)
        try:
            stored = await self._timed("finish_turn", self.store.finish_turn(
                session, start.turn, record, kv.stored(handle), expires_at, now))
        except StoreUnavailableError:
            stored = False
        if handle and not stored:
            self.releaser.release(handle, "superseded")
        if handle and stored and self.pins is not None:
            self.pins.put(served.decode, session, start.turn, handle.num_tokens or 0, now, expires_at)
        await self._evict(victims or [])
        self._report_pins(served.decode)

    def _admit(self, session: ConversationKey, engine: str, handle: kv.Handle | None,
               now: float) -> tuple[kv.Handle | None, list[Victim] | None]:
        """Make room on D for the new handle: the idle handles to evict; (None, None) when the new handle
        alone exceeds the budget (released at once, its conversation's next turn says `evicted`)."""
        if handle is None or self.pins is None:
            return handle, []
        holder = self.decode_pool.get(engine)
        capacity = holder.info.get("num_gpu_blocks") if holder is not None else None
        decision, victims = self.pins.admit(engine, session, handle.num_tokens or 0, capacity, now)
        if not decision.keep_new:
            self._release_evicted(handle, engine)
            return None, None
        return handle, victims

    async def _evict(self, victims: list[Victim]) -> None:
        """Take each victim's handle out of the store first, then free D's blocks: a turn that began in
        between has claimed it, and evict_handle then leaves it alone (it is being read)."""
        async def one(victim: Victim) -> None:
            try:
                wire = await self._timed("evict_handle", self.store.evict_handle(victim.key, victim.turn))
            except StoreUnavailableError:
                return                                 # still in the store: D frees it at its TTL
            if (handle := kv.from_store(wire)) is not None:
                self._release_evicted(handle, victim.engine)
        await asyncio.gather(*(one(v) for v in victims))

    def _release_evicted(self, handle: kv.Handle, engine: str) -> None:
        self.releaser.release(handle, EVICTED)
        self.metrics.handles_evicted.labels(engine).inc()

    def _report_pins(self, engine: str) -> None:
        """The gauge, and the D's pinned blocks where routing's used_kv reads them."""
        if self.pins is None:
            return
        self.metrics.pinned_tokens.labels(engine).set(self.pins.pinned_tokens(engine))
        if (holder := self.decode_pool.get(engine)) is not None:
            holder.info["pinned_blocks"] = self.pins.pinned_blocks(engine)

    async def abandon(self, req: TurnRequest, session: ConversationKey | None, start: TurnStart | None,
                      plan: Plan) -> None:
        """A failed turn stores nothing new, but marks itself finished so later turns are not 'concurrent'."""
        if session is None or start is None:
            return
        if self.pins is not None:
            self.pins.spent(session)
        self.metrics.turns.labels(plan.kind.value, plan.reason.value).inc()
        note = Reason.PREVIOUS_TURN_FAILED.value
        record = msgspec.structs.replace(start.record, handle_note=note) if start.record else \
            Conversation(model=req.model, block_size=self.block_size, handle_note=note)
        try:
            await self.store.finish_turn(session, start.turn, record, None, 0.0, time.time())
        except StoreUnavailableError:
            pass

    def _answers(self, req: TurnRequest, start: TurnStart, capture: DecodeCapture) -> list[Answer]:
        previous = start.record.answers if start.record else []
        if req.rerender is None or self.renderer is None:
            return []
        new = self.renderer.answer(capture.output_ids, "".join(capture.text), capture.tool_calls)
        return remember(previous, new) if new else previous

    def _verified_handle(self, capture: DecodeCapture) -> kv.Handle | None:
        """Keep D's handle only if D told us exactly which tokens it holds (prompt + output - 1)."""
        handle = capture.handle
        if not handle or capture.prompt_ids is None or not capture.output_ids_seen:
            return None
        if not kv.holds_prompt_and_output(handle, len(capture.prompt_ids), len(capture.output_ids)):
            log.warning("D handle covers %s tokens, expected prompt+output-1: not stored", handle.num_tokens)
            self.releaser.release(handle, "unverifiable")
            return None
        return handle

    async def _timed(self, op: str, call: Awaitable[T]) -> T:
        began = time.perf_counter()
        try:
            return await call
        except StoreUnavailableError:
            self.metrics.store_errors.labels(op).inc()
            raise
        finally:
            self.metrics.store_seconds.labels(op).observe(time.perf_counter() - began)


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

    __slots__ = ("_claim", "_session", "_state", "_taken")

    def __init__(self, state: ConversationState, session: ConversationKey | None) -> None:
        self._state, self._session = state, session
        self._claim: asyncio.Task[TurnStart] | None = None
        self._taken = False

    async def __aenter__(self) -> ClaimAhead | None:
        if self._session is None:
            return None
        self._claim = self._state.send_claim(self._session)
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
        back = self._state.put_back(self._session, self._claim)
        if kind is not None and not issubclass(kind, asyncio.CancelledError):
            await asyncio.shield(back)


def fingerprint(record: Conversation | None) -> Fingerprint | None:
    """D's held tokens of the conversation's last turn, as the store keeps them."""
    if record is None:
        return None
    return Fingerprint(record.block_size, record.held_tokens, record.block_hashes, record.prefix_hash)


def _missing_reason(record: Conversation) -> Reason:
    return Reason(record.handle_note) if record.handle_note else Reason.NO_HANDLE


def _missing_note(req: TurnRequest, capture: DecodeCapture) -> str:
    return Reason.HANDLE_NOT_STREAMED.value if req.stream and capture.finished else ""
