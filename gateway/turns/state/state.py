"""A conversation's state across turns, through the store: claim it when a turn begins, record what D holds
when the turn ends, mark a failed turn finished. The store never interprets what it keeps; this module does.
A session turn's claim may be sent ahead of its rendering (ahead.py); the pin budget is pinning.py's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
import time

import msgspec

from gateway.config import DEFAULT_TENANT, Settings
from gateway.engines import kv
from gateway.engines.cache_index import Knowledge
from gateway.engines.pool import EnginePool
from gateway.store import Answer, Conversation, ConversationKey, ConversationStore, StoreUnavailableError, TurnStart
from gateway.telemetry import Metrics
from gateway.turns.intake.generated import remember
from gateway.turns.intake.render import Renderer
from gateway.turns.intake.request import TurnRequest
from gateway.turns.legs.capture import DecodeCapture
from gateway.turns.legs.release import HandleReleaser
from gateway.turns.reuse.continuity import HASH_BYTES, Fingerprint, held_fingerprint
from gateway.turns.reuse.lookup import How
from gateway.turns.reuse.plan import Claim, Plan, Reason
from gateway.turns.state.ahead import ClaimAhead, PutBacks
from gateway.turns.state.budget import NEVER_KEPT
from gateway.turns.state.pinning import Pinning
from gateway.turns.state.pins import PinLedger
from gateway.turns.state.sessionless import ConversationFinder, Found
from gateway.turns.state.timing import timed

log = logging.getLogger("gateway.turn")
_NO_HANDLE_REASONS = {"expired": Reason.HANDLE_EXPIRED, "in_flight": Reason.CONCURRENT_TURN,
                      "evicted": Reason.BUDGET_EVICTED}


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
        self.pins = Pinning(pins, store, decode, releaser, metrics)   # the handles kept within D's pin budget
        self.finder = ConversationFinder(store, settings.conversation_lookup, block_size, self._usable)
        self.ahead = PutBacks(store, releaser, metrics)

    # -- begin ---------------------------------------------------------------------------------------------
    def claim_ahead(self, session: ConversationKey | None) -> ClaimAhead:
        """`async with` it around a turn's rendering and run: it claims a session turn's handle ahead, and puts
        the claim back if the turn does not take it. Its `as` target is None where nothing can overlap: no
        session id, lookup by tokens only, or the embedded store (whose claim is no round trip)."""
        ahead = session is not None and self.finder.mode != "prefix" and self.store.kind != "memory"
        return ClaimAhead(self.ahead, session if ahead else None)

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
            found = await timed(self.metrics, "begin_turn", self.finder.begin(
                session, tenant, req.prompt_ids, req.model, time.time()))
        if found is None:
            return None, None
        start = found.start
        self.pins.begun(found.key, kv.from_store(start.handle) is not None, time.time())   # a pin, not {}
        if req.rerender is not None and start.record is not None and start.record.answers:
            req.prompt_ids = req.rerender(start.record.answers)      # past answers as D generated them
        return found, self._claim(req, start)

    async def drain(self) -> None:
        await self.ahead.drain()

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
        held = fingerprint(record)
        cache = holder.known_cache if holder is not None else None
        known = cache is not None and held is not None
        return Claim(False, handle, missing, held, record.model == req.model, holder is not None and holder.healthy,
                     d_cached_blocks=cache.leading(held.block_hashes, held.block_size) if known else None,
                     d_cache_complete=known and cache.knowledge is Knowledge.COMPLETE)

    # -- finish --------------------------------------------------------------------------------------------
    async def record(self, req: TurnRequest, session: ConversationKey | None, start: TurnStart | None,
                     plan: Plan, served: Served, capture: DecodeCapture) -> None:
        """Store what D now holds (the turn still owns the conversation's counter), else release D's handle."""
        leased = capture.handle is not None and capture.handle.leased      # before the flags are D's own
        handle = self._verified_handle(capture)
        if handle and not plan.hold:        # the plan expects no read of D's KV: no pin (P's cache holds it)
            self.releaser.release(handle, "unused")
            handle = None
        if session is not None:
            self.pins.spent(session, plan.reused_tokens)   # the claimed handle, if any, was read or released
        if session is None or start is None or not capture.finished:
            if handle:
                self.releaser.release(handle, "unused")
            return
        now = time.time()
        handle, victims, turned_away = self.pins.admit(session, served.decode, handle, now)
        previous = start.record
        num_tokens, held = held_fingerprint(      # hashes only the blocks the plan did not verify
            req.prompt_ids, capture.prompt_ids, capture.output_ids, _held_tokens(handle, plan, capture, turned_away),
            self.block_size, previous=fingerprint(previous), verified_tokens=plan.reused_tokens)
        record = Conversation(
            decode_engine=served.decode, prefill_engine=served.prefill, model=req.model,
            block_size=self.block_size, num_tokens=num_tokens, held_tokens=held.held_tokens,
            block_hashes=held.block_hashes, prefix_hash=held.prefix_hash,
            handle_note="" if handle else (NEVER_KEPT if turned_away else _missing_note(req, capture, plan)),
            answers=self._answers(req, start, capture), created_at=previous.created_at if previous else now,
            updated_at=now)
        # No pin but tokens only D's prefix cache holds: findable by the next turn's tokens all the same, for as
        # long as the conversation lives (kv.stored's empty handle); the plan then asks D's KV events.
        findable = handle is None and record.held_tokens > 0
        expires_at = now + (self.settings.conversation_ttl_s if findable else
                            self.settings.lease_ttl_s if leased else self.settings.handle_ttl_s)
        stored: bool | None
        try:
            stored = await timed(self.metrics, "finish_turn", self.store.finish_turn(
                session, start.turn, record, kv.stored(handle, findable), expires_at, now,
                _unchanged(previous, record)))
        except StoreUnavailableError:
            # No answer is not a no: the finish may have stored the handle for the next turn to claim and read,
            # so it is not released (the store drops it before D's TTL frees it).
            stored = None
        if handle and stored is False:
            self.releaser.release(handle, "superseded")
        if handle and stored is not False:      # unanswered: it may be in the store, so D's budget counts it
            self.pins.stored(served.decode, session, start.turn, handle, now, expires_at)
        if stored and (handle or findable):
            self.finder.recent.stored(session, start.turn, record)     # the next sessionless turn's first try
        await self.pins.evict(victims)
        self.pins.report(served.decode)

    async def abandon(self, req: TurnRequest, session: ConversationKey | None, start: TurnStart | None,
                      plan: Plan) -> None:
        """A failed turn stores nothing new, but marks itself finished so later turns are not 'concurrent'."""
        if session is None or start is None:
            return
        self.pins.spent(session)
        self.metrics.turns.labels(plan.kind.value, plan.reason.value).inc()
        note = Reason.PREVIOUS_TURN_FAILED.value
        record = msgspec.structs.replace(start.record, handle_note=note) if start.record else \
            Conversation(model=req.model, block_size=self.block_size, handle_note=note)
        try:
            await self.store.finish_turn(session, start.turn, record, None, 0.0, time.time(),
                                         _unchanged(start.record, record))
        except StoreUnavailableError:
            pass

    def _answers(self, req: TurnRequest, start: TurnStart, capture: DecodeCapture) -> list[Answer]:
        previous = start.record.answers if start.record else []
        if req.rerender is None or self.renderer is None:
            return []
        new = self.renderer.answer(capture.output_ids, "".join(capture.text), capture.tool_calls)
        return remember(previous, new) if new else previous

    def _verified_handle(self, capture: DecodeCapture) -> kv.Handle | None:
        """Keep D's handle only if D told us exactly which tokens it holds (prompt + output - 1); as the next turn's
        reader must get it (a local turn's comes with a producer's flags)."""
        handle = capture.handle.as_holders() if capture.handle else None
        if not handle or capture.prompt_ids is None or not capture.output_ids_seen:
            return None
        if not kv.holds_prompt_and_output(handle, len(capture.prompt_ids), len(capture.output_ids)):
            log.warning("D handle covers %s tokens, expected prompt+output-1: not stored", handle.num_tokens)
            self.releaser.release(handle, "unverifiable")
            return None
        return handle


def fingerprint(record: Conversation | None) -> Fingerprint | None:
    """D's held tokens of the conversation's last turn, as the store keeps them."""
    if record is None:
        return None
    return Fingerprint(record.block_size, record.held_tokens, record.block_hashes, record.prefix_hash)


def _unchanged(previous: Conversation | None, record: Conversation) -> int:
    """How many leading block hashes `record` shares with the record its turn began on (the blocks the
    continuity check verified keep their hashes): the store then sends only the rest (a 32k-token history's are
    32 KB, the turn's new blocks a few hundred bytes)."""
    if previous is None or previous.block_size != record.block_size:
        return 0
    old, new = previous.block_hashes, record.block_hashes
    low, high = 0, min(len(old), len(new)) // HASH_BYTES
    while low < high:   # the longest equal prefix, by bisection (a memory compare of a few KB each step)
        mid = (low + high + 1) // 2
        if old[:mid * HASH_BYTES] == new[:mid * HASH_BYTES]:
            low = mid
        else:
            high = mid - 1
    return low


def _missing_reason(record: Conversation) -> Reason:
    return Reason(record.handle_note) if record.handle_note else Reason.NO_HANDLE


def _missing_note(req: TurnRequest, capture: DecodeCapture, plan: Plan) -> str:
    if not plan.hold:
        # none asked for: D's cache and its events carry the next turn (push mode: D never returns one, §8.2)
        return plan.unheld.value
    return Reason.HANDLE_NOT_STREAMED.value if req.stream and capture.finished else ""


def _held_tokens(handle: kv.Handle | None, plan: Plan, capture: DecodeCapture, turned_away: bool = False) -> int:
    """The tokens of D's KV the next turn may count on: what the handle holds; with no handle (push mode, a plan
    that asked D to hold nothing, a handle the pin budget turned away), what D computed or was written (prompt +
    output - 1), which only its prefix cache may still hold (nothing pins it: the local path's bet, found by D's
    KV events or, in push mode, docs/protocol.md §8.2)."""
    if handle is not None:
        return handle.num_tokens or 0
    unpinned = not plan.hold or turned_away
    if not unpinned or capture.prompt_ids is None or not capture.output_ids_seen:
        return 0
    return max(0, len(capture.prompt_ids) + len(capture.output_ids) - 1)
