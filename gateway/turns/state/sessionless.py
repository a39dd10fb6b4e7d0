"""The start of a turn without a session id: find its conversation by its tokens, claim it, or start anew.

One prefix lookup (one store round trip), then a claim of the first holder `lookup.claimable` keeps. The
claim (`begin_found_turn`) succeeds only if that conversation is still exactly as the lookup saw it, and
claims the handle at most once across every replica; a claim that loses a race (another sessionless turn of
an identical conversation, or the holder's own next turn) changes nothing, and the next holder is tried (if
a whole page of holders was lost, one more lookup fetches the next page: the claimed ones have left the index).
When none is left the turn starts a new conversation under a generated session key, so its answer is stored
and indexed for the next turn to find.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass

from gateway.store import DEFAULT_MAX_HOLDERS, ConversationKey, ConversationStore, TurnStart
from gateway.turns.reuse.lookup import How, claimable, prompt_hashes

GENERATED_PREFIX = "pdgw-"  # generated session keys: never shown to clients, 128 random bits
LOOKUPS = 2  # a full page of holders all lost to racers: look once more (the claimed ones have left the index)


@dataclass(frozen=True)
class Found:
    how: How                # PREFIX or NEW
    key: ConversationKey    # where the turn's outcome is stored
    start: TurnStart        # the begun turn (with the claimed handle when found by prefix)


def new_session() -> str:
    return GENERATED_PREFIX + secrets.token_hex(16)


async def begin_sessionless(store: ConversationStore, tenant: str, prompt_ids: list[int], model: str,
                            block_size: int, now: float, *, by_prefix: bool = True,
                            decode_ok: Callable[[str], bool] = lambda engine: True) -> Found:
    """Begin the turn of a request without a session id. Raises StoreUnavailableError like `begin_turn`."""
    if by_prefix and block_size > 0:
        hashes = prompt_hashes(prompt_ids, block_size)
        for _ in range(LOOKUPS):
            holders = await store.find_by_prefix(tenant, hashes, len(prompt_ids), now, DEFAULT_MAX_HOLDERS)
            for holder in claimable(prompt_ids, model, holders, decode_ok):
                start = await store.begin_found_turn(holder.key, holder.turn, now)
                if start is not None:
                    return Found(How.PREFIX, holder.key, start)
            if len(holders) < DEFAULT_MAX_HOLDERS:
                break          # that was every holder there is
    key = ConversationKey(tenant, new_session())
    return Found(How.NEW, key, await store.begin_turn(key, now))


class ConversationFinder:
    """How every turn finds its conversation, per the `conversation_lookup` setting: by the client's session
    id (which wins when given, unless the setting is `prefix`), else by its tokens, else a new one."""

    def __init__(self, store: ConversationStore, mode: str, block_size: int,
                 decode_ok: Callable[[str], bool] = lambda engine: True) -> None:
        self.store, self.mode, self.block_size, self.decode_ok = store, mode, block_size, decode_ok

    async def begin(self, session: ConversationKey | None, tenant: str, prompt_ids: list[int], model: str,
                    now: float) -> Found | None:
        """The begun turn and how its conversation was found; None: stateless (no id, lookup by id only)."""
        if session is not None and self.mode != "prefix":
            return Found(How.SESSION, session, await self.store.begin_turn(session, now))
        if self.mode == "session":
            return None
        return await begin_sessionless(self.store, tenant, prompt_ids, model, self.block_size, now,
                                       decode_ok=self.decode_ok)
