"""The start of a turn without a session id: find its conversation by its tokens, claim it, or start anew.

One prefix lookup (one store round trip, which also begins the new conversation when it finds nobody), then a
claim of the first holder `lookup.claimable` keeps. The claim (`begin_found_turn`) succeeds only if that
conversation is still exactly as the lookup saw it, and claims the handle at most once across every replica;
a claim that loses a race (another sessionless turn of an identical conversation, or the holder's own next
turn) changes nothing, and the next holder is tried (if a whole page of holders was lost, one more lookup fetches the next page: the claimed ones have left the index).
When none is left the turn starts a new conversation under a generated session key, so its answer is stored
and indexed for the next turn to find.

Before the lookup, the conversations this process stored lately (`RecentHolders`) are tried: a conversation's
next turn mostly comes back to the replica that served its last, which then claims it without the lookup's
round trip (the sessionless turn's extra cost over a session turn, bench/README.md).
"""

from __future__ import annotations

import secrets
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.store import (DEFAULT_MAX_HOLDERS, Conversation, ConversationKey, ConversationStore, Holder, TurnStart,
                           index_hash)
from gateway.turns.reuse.lookup import How, claimable, prompt_hashes

GENERATED_PREFIX = "pdgw-"  # generated session keys: never shown to clients, 128 random bits
LOOKUPS = 2  # a full page of holders all lost to racers: look once more (the claimed ones have left the index)
RECENT_HOLDERS = 4096  # conversations remembered per process (a record's fingerprint: 16 bytes per block)


@dataclass(frozen=True)
class Found:
    how: How                # PREFIX or NEW
    key: ConversationKey    # where the turn's outcome is stored
    start: TurnStart        # the begun turn (with the claimed handle when found by prefix)


def new_session() -> str:
    return GENERATED_PREFIX + secrets.token_hex(16)


class RecentHolders:
    """The conversations this process stored lately, found by their prefix-index hash, as the store's index finds
    them but without its round trip. A hint only, exactly as the index is: a holder is tried only when the prompt
    extends its whole held sequence (`lookup.claimable`), its claim (`begin_found_turn`) succeeds only while the
    conversation is still as stored (the turn that wrote it, nothing begun since: another replica's turn makes the
    entry stale and the claim fail), and the plan verifies the exact tokens against the record the claim returns.
    Least recently stored go first beyond `max_entries`."""

    def __init__(self, max_entries: int = RECENT_HOLDERS) -> None:
        self.max_entries = max_entries
        self._by_hash: OrderedDict[tuple[str, bytes], tuple[ConversationKey, int, Conversation]] = OrderedDict()
        self._hash_of: dict[ConversationKey, bytes] = {}
        self._at: dict[str, Counter[int]] = {}   # per tenant: how many entries are filed at each block count

    def stored(self, key: ConversationKey, turn: int, record: Conversation) -> None:
        """Turn `turn` stored `record` with a live handle under `key` (and the store indexed it)."""
        self.drop(key)
        digest = index_hash(record)
        if digest is None or self.max_entries <= 0:
            return
        replaced = self._by_hash.pop((key.tenant, digest), None)
        if replaced is not None:          # another conversation filed at the same hash: this one is the hint now
            self._hash_of.pop(replaced[0], None)
            self._unfiled(key.tenant, replaced[2])
        self._by_hash[(key.tenant, digest)] = (key, turn, record)
        self._hash_of[key] = digest
        self._at.setdefault(key.tenant, Counter())[record.held_tokens // record.block_size] += 1
        while len(self._by_hash) > self.max_entries:
            (tenant, _), (old, _, old_record) = self._by_hash.popitem(last=False)
            self._hash_of.pop(old, None)
            self._unfiled(tenant, old_record)

    def drop(self, key: ConversationKey) -> None:
        digest = self._hash_of.pop(key, None)
        if digest is not None:
            entry = self._by_hash.pop((key.tenant, digest), None)
            if entry is not None:
                self._unfiled(key.tenant, entry[2])

    def _unfiled(self, tenant: str, record: Conversation) -> None:
        at = self._at[tenant]
        blocks = record.held_tokens // record.block_size
        at[blocks] -= 1
        if at[blocks] <= 0:
            del at[blocks]

    def holders(self, tenant: str, hashes: Sequence[bytes], prompt_tokens: int) -> list[Holder]:
        """Remembered holders at the prompt's block hashes, longest prefix first (the store's order)."""
        out = []
        at = self._at.get(tenant, {})
        # Only where an entry is filed: a 32k-token prompt has 2,000 block hashes, a tenant's entries few lengths.
        positions = sorted((b for b in at if b <= len(hashes)), reverse=True) if len(at) < len(hashes) \
            else range(len(hashes), 0, -1)
        for blocks in positions:
            entry = self._by_hash.get((tenant, hashes[blocks - 1]))
            if entry is not None and entry[2].held_tokens <= prompt_tokens:
                out.append(Holder(entry[0], entry[1], blocks, entry[2], "idle"))
        return out

    def __len__(self) -> int:
        return len(self._by_hash)


async def begin_sessionless(store: ConversationStore, tenant: str, prompt_ids: list[int], model: str,
                            block_size: int, now: float, *, by_prefix: bool = True,
                            decode_ok: Callable[[str], bool] = lambda engine: True,
                            recent: RecentHolders | None = None) -> Found:
    """Begin the turn of a request without a session id. Raises StoreUnavailableError like `begin_turn`."""
    if by_prefix and block_size > 0:
        hashes = prompt_hashes(prompt_ids, block_size)
        if recent is not None:
            remembered = recent.holders(tenant, hashes, len(prompt_ids))
            for holder in claimable(prompt_ids, model, remembered, decode_ok):
                recent.drop(holder.key)          # claimed now, or stale: either way no longer as remembered
                start = await store.begin_found_turn(holder.key, holder.turn, now)
                if start is not None:
                    return Found(How.PREFIX, holder.key, start)
        key = ConversationKey(tenant, new_session())
        for _ in range(LOOKUPS):
            # A lookup that finds nobody has begun the new conversation too: one round trip for a first turn.
            holders, start = await store.find_or_begin(tenant, hashes, len(prompt_ids), now, key,
                                                       DEFAULT_MAX_HOLDERS)
            if start is not None:
                return Found(How.NEW, key, start)
            for holder in claimable(prompt_ids, model, holders, decode_ok):
                start = await store.begin_found_turn(holder.key, holder.turn, now)
                if start is not None:
                    return Found(How.PREFIX, holder.key, start)
            if len(holders) < DEFAULT_MAX_HOLDERS:
                break          # that was every holder there is
        return Found(How.NEW, key, await store.begin_turn(key, now))
    key = ConversationKey(tenant, new_session())
    return Found(How.NEW, key, await store.begin_turn(key, now))


class ConversationFinder:
    """How every turn finds its conversation, per the `conversation_lookup` setting: by the client's session
    id (which wins when given, unless the setting is `prefix`), else by its tokens, else a new one."""

    def __init__(self, store: ConversationStore, mode: str, block_size: int,
                 decode_ok: Callable[[str], bool] = lambda engine: True) -> None:
        self.store, self.mode, self.block_size, self.decode_ok = store, mode, block_size, decode_ok
        self.recent = RecentHolders(RECENT_HOLDERS if mode != "session" else 0)

    async def begin(self, session: ConversationKey | None, tenant: str, prompt_ids: list[int], model: str,
                    now: float) -> Found | None:
        """The begun turn and how its conversation was found; None: stateless (no id, lookup by id only)."""
        if session is not None and self.mode != "prefix":
            return Found(How.SESSION, session, await self.store.begin_turn(session, now))
        if self.mode == "session":
            return None
        return await begin_sessionless(self.store, tenant, prompt_ids, model, self.block_size, now,
                                       decode_ok=self.decode_ok, recent=self.recent)
