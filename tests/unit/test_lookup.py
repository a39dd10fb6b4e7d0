"""Finding a conversation by its tokens: which holders a prompt may claim (table-driven), and the claims
themselves over the embedded store: identical conversations each keep reusing, a shared prefix, branch or
regenerate never takes another conversation's handle, tenants never meet."""

from __future__ import annotations

import asyncio

import pytest

from gateway.store import (
    DEFAULT_MAX_HOLDERS,
    Conversation,
    ConversationKey,
    Holder,
    HolderState,
    MemoryConversationStore,
)
from gateway.turns.reuse.continuity import Fingerprint, block_hashes
from gateway.turns.reuse.lookup import How, PromptChains, claimable
from gateway.turns.intake.pieces import TokenIds
from gateway.turns.state.sessionless import ConversationFinder, RecentHolders, begin_sessionless

BS = 4
SYS = list(range(1, 11))                    # a system prompt many conversations share
U1, A1 = [20, 21, 22, 23, 24], [30, 31, 32, 33, 34, 35]
U2 = [40, 41, 42]
P1 = SYS + U1                               # turn 1's prompt
S1 = P1 + A1                                # what D holds after turn 1 (21 tokens); R = 20
R1 = len(S1) - 1


def stored(held: list[int], model: str = "m", engine: str = "d0") -> Conversation:
    """The record a turn leaves when D holds `held` (prompt + output; R = all but the last token)."""
    fp = Fingerprint.of(held, len(held) - 1, BS)
    return Conversation(decode_engine=engine, model=model, block_size=BS, num_tokens=len(held),
                        held_tokens=fp.held_tokens, block_hashes=fp.block_hashes, prefix_hash=fp.prefix_hash)


def holder(record: Conversation, state: HolderState = "idle") -> Holder:
    return Holder(ConversationKey("t", "s"), 1, record.held_tokens // BS, record, state)


@pytest.mark.parametrize(("prompt", "claims"), [
    (S1 + U2, True),                                    # the next turn: extends all of S1
    (S1[:R1] + [99], True),                             # extends S1[:R] (the last sampled token has no KV)
    (S1[:R1], True),                                    # exactly R tokens
    (SYS + [25, 26, 27] + U2, False),                   # shares only the system prompt
    (P1 + [30, 31, 32, 99, 98, 97] + U2, False),        # same first message, another answer
    (P1, False),                                        # a regenerate of turn 1: shorter than R
    (S1[:R1 - 1], False),                               # truncated history
    (SYS + [20, 21, 29, 23, 24] + A1 + U2, False),      # an edited earlier message: a branch
    (S1[:16] + [77] + S1[17:] + U2, False),             # diverges inside the last whole block
    (S1[:R1 - 1] + [77] + U2, False),                   # diverges after the indexed blocks, before R
])
def test_only_a_prompt_that_extends_the_whole_held_sequence_claims(prompt: list[int], claims: bool) -> None:
    assert bool(claimable(prompt, "m", [holder(stored(S1))])) is claims


@pytest.mark.parametrize(("state", "model", "healthy", "claims"), [
    ("idle", "m", True, True),
    ("in_flight", "m", True, False),         # its own next turn has begun
    ("expired", "m", True, False),
    ("none", "m", True, False),
    ("idle", "other-model", True, False),
    ("idle", "m", False, False),             # its D is down: nothing to read
])
def test_only_live_idle_holders_of_the_same_model(state: HolderState, model: str, healthy: bool,
                                                  claims: bool) -> None:
    found = claimable(S1 + U2, model, [holder(stored(S1), state)], decode_ok=lambda engine: healthy)
    assert bool(found) is claims


def test_order_is_kept_and_misfits_dropped() -> None:
    longer, shorter, other = stored(S1 + U2 + [50, 51, 52, 53, 54]), stored(S1), stored(SYS + [9, 9, 9, 9, 9, 9])
    prompt = S1 + U2 + [50, 51, 52, 53, 54] + [60]
    found = claimable(prompt, "m", [holder(longer), holder(other), holder(shorter)])
    assert [h.record for h in found] == [longer, shorter]


# -- over the embedded store ------------------------------------------------------------------------------

def embedded() -> MemoryConversationStore:
    return MemoryConversationStore(clock=lambda: 100.0)   # the turns below run at 100..102, handles live to 500


async def first_turn(store: MemoryConversationStore, prompt: list[int], answer: list[int], handle: dict,
                     tenant: str = "t") -> ConversationKey:
    """A sessionless turn that starts a conversation and leaves `handle` for D's prompt + answer."""
    found = await begin_sessionless(store, tenant, prompt, "m", BS, 100.0)
    assert found.how == How.NEW
    await finish(store, found.key, found.start.turn, prompt + answer, handle)
    return found.key


async def finish(store: MemoryConversationStore, key: ConversationKey, turn: int, held: list[int],
                 handle: dict | None) -> None:
    assert await store.finish_turn(key, turn, stored(held), handle, 500.0, 100.0)


async def test_identical_conversations_each_claim_a_different_holder() -> None:
    store = embedded()
    keys = {await first_turn(store, P1, A1, {"h": 1}), await first_turn(store, P1, A1, {"h": 2})}
    assert len(keys) == 2                                   # two users, same tokens: two conversations
    turns = [await begin_sessionless(store, "t", S1 + U2, "m", BS, 101.0) for _ in range(3)]
    assert [t.how for t in turns] == [How.PREFIX, How.PREFIX, How.NEW]
    assert {t.key for t in turns[:2]} == keys
    assert sorted(t.start.handle["h"] for t in turns[:2]) == [1, 2]   # never two reads of one handle
    assert all(t.start.handle_state == "claimed" for t in turns[:2])


async def test_a_claim_that_loses_the_race_tries_the_next_holder() -> None:
    store = RacingStore()
    for h in (1, 2):
        await first_turn(store, P1, A1, {"h": h})
    found = await begin_sessionless(store, "t", S1 + U2, "m", BS, 101.0)
    assert found.how == How.PREFIX and store.rival is not None
    assert {found.start.handle["h"], store.rival.handle["h"]} == {1, 2}


class RacingStore(MemoryConversationStore):
    """Another replica claims the first holder between this turn's lookup and its claim."""

    rival = None

    def __init__(self) -> None:
        super().__init__(clock=lambda: 100.0)

    async def find_by_prefix(self, *args, **kwargs):
        holders = await super().find_by_prefix(*args, **kwargs)
        if holders and self.rival is None:
            self.rival = await self.begin_found_turn(holders[0].key, holders[0].turn, 101.0)
        return holders


@pytest.mark.parametrize("prompt", [
    SYS + [25, 26, 27] + U2,                    # another user, same system prompt
    P1,                                         # regenerate of turn 1
    SYS + [20, 21, 29, 23, 24] + A1 + U2,       # branch: an earlier message edited
    S1[:R1 - 1],                                # truncated
])
async def test_a_prompt_that_only_shares_a_prefix_never_takes_the_handle(prompt: list[int]) -> None:
    store = embedded()
    key = await first_turn(store, P1, A1, {"h": 1})
    found = await begin_sessionless(store, "t", prompt, "m", BS, 101.0)
    assert found.how == How.NEW and found.key != key and found.start.handle is None
    assert (await store.get(key))[1] == {"h": 1}              # still there for its own next turn
    again = await begin_sessionless(store, "t", S1 + U2, "m", BS, 102.0)
    assert (again.how, again.key, again.start.handle) == (How.PREFIX, key, {"h": 1})


async def test_a_found_conversation_goes_on_under_its_key() -> None:
    store = embedded()
    key = await first_turn(store, P1, A1, {"h": 1})
    second = await begin_sessionless(store, "t", S1 + U2, "m", BS, 101.0)
    assert (second.how, second.key, second.start.turn) == (How.PREFIX, key, 2)
    await finish(store, key, 2, S1 + U2 + [50, 51, 52, 53, 54], {"h": 2})
    third = await begin_sessionless(store, "t", S1 + U2 + [50, 51, 52, 53, 54, 60], "m", BS, 102.0)
    assert (third.how, third.key, third.start.turn, third.start.handle) == (How.PREFIX, key, 3, {"h": 2})


async def test_tenants_never_find_each_other() -> None:
    store = embedded()
    key = await first_turn(store, P1, A1, {"h": 1}, tenant="a")
    found = await begin_sessionless(store, "b", S1 + U2, "m", BS, 101.0)
    assert found.how == How.NEW and found.key.tenant == "b"
    assert (await store.get(key))[1] == {"h": 1}


async def test_prefix_lookup_off_starts_new() -> None:
    store = embedded()
    await first_turn(store, P1, A1, {"h": 1})
    found = await begin_sessionless(store, "t", S1 + U2, "m", BS, 101.0, by_prefix=False)
    assert found.how == How.NEW


async def test_concurrent_identical_turns_never_share_a_handle() -> None:
    store = embedded()
    for h in range(3):
        await first_turn(store, P1, A1, {"h": h})
    turns = await asyncio.gather(*(begin_sessionless(store, "t", S1 + U2, "m", BS, 101.0) for _ in range(5)))
    handles = [t.start.handle["h"] for t in turns if t.start.handle]
    assert sorted(handles) == [0, 1, 2] and len({t.key for t in turns}) == 5


@pytest.mark.parametrize(("mode", "session", "how"), [
    ("both", "mine", How.SESSION),        # a session id wins
    ("both", None, How.PREFIX),
    ("session", "mine", How.SESSION),
    ("session", None, None),              # no id, no lookup: stateless
    ("prefix", "mine", How.PREFIX),       # ids ignored: found by tokens
    ("prefix", None, How.PREFIX),
])
async def test_conversation_lookup_setting(mode: str, session: str | None, how: How | None) -> None:
    store = embedded()
    await first_turn(store, P1, A1, {"h": 1})
    finder = ConversationFinder(store, mode, BS)
    key = ConversationKey("t", session) if session else None
    found = await finder.begin(key, "t", S1 + U2, "m", 101.0)
    assert (found.how if found else None) == how
    if how == How.SESSION:
        assert found.key == key and found.start.turn == 1


async def test_a_page_of_lost_races_looks_again() -> None:
    """Many identical conversations, many racers: when every holder of the first page was claimed by others
    between the lookup and the claim, a second lookup finds the next ones."""
    store = LosingStore()
    for h in range(DEFAULT_MAX_HOLDERS + 2):
        await first_turn(store, P1, A1, {"h": h})
    store.lookups = 0
    found = await begin_sessionless(store, "t", S1 + U2, "m", BS, 101.0)
    assert found.how == How.PREFIX and store.lookups == 2


class LosingStore(MemoryConversationStore):
    """Other replicas win every claim on the first page of holders."""

    lookups = 0

    def __init__(self) -> None:
        super().__init__(clock=lambda: 100.0)

    async def find_by_prefix(self, *args, **kwargs):
        holders = await super().find_by_prefix(*args, **kwargs)
        self.lookups += 1
        if self.lookups == 1:
            for holder in holders:
                assert await self.begin_found_turn(holder.key, holder.turn, 101.0) is not None
        return holders


# -- the memo of recent prompts' chains ------------------------------------------------------------------

BASE = list(range(100, 164))                     # 16 blocks of 4


@pytest.mark.parametrize("prompt", [
    BASE + [1, 2, 3, 4, 5, 6],                   # the next turn: the memo covers all 16 blocks
    BASE,                                        # the same prompt again
    BASE[:30],                                   # shorter (regenerate): the first 7 blocks
    BASE[:21] + [0] + BASE[22:],                 # differs inside block 5: the bytes say so, blocks 5+ hashed
    [7] + BASE[1:],                              # another first block
    BASE[:3],                                    # under one block
])
@pytest.mark.parametrize("as_token_ids", [False, True])
def test_remembered_chains_are_the_prompts_own(prompt: list[int], as_token_ids: bool) -> None:
    chains = PromptChains()
    chains.hashes(TokenIds(BASE), BS)
    chains.hashes(BASE[:12] + [9] * 20, BS)       # a branch sharing the first 3 blocks
    ids = TokenIds(prompt) if as_token_ids else prompt
    assert chains.hashes(ids, BS) == block_hashes(prompt, BS)
    assert chains.hashes(ids, BS) == block_hashes(prompt, BS)    # and once remembered itself


def test_remembered_chains_are_bounded() -> None:
    chains = PromptChains(max_bytes=2_000)
    for i in range(50):
        chains.hashes([i] * 40, BS)
        chains.hashes([i] * 40 + [1] * 8, BS)     # supersedes the one before: same start, longer
    assert chains._bytes <= 2_000
    assert chains._bytes == sum(len(t) + len(c) for e in chains._by_start.values() for t, c in e)


# -- the conversations this process stored lately ------------------------------------------------------------

class Spy(MemoryConversationStore):
    """The embedded store, counting prefix lookups (the round trip RecentHolders saves)."""

    lookups = 0

    async def find_by_prefix(self, *args, **kwargs):
        self.lookups += 1
        return await super().find_by_prefix(*args, **kwargs)


async def remembered_first_turn(store: Spy, recent: RecentHolders, prompt: list[int], answer: list[int],
                                handle: dict) -> ConversationKey:
    found = await begin_sessionless(store, "t", prompt, "m", BS, 100.0, recent=recent)
    await finish(store, found.key, found.start.turn, prompt + answer, handle)
    recent.stored(found.key, found.start.turn, stored(prompt + answer))
    return found.key


async def test_a_remembered_holder_is_claimed_without_the_lookup() -> None:
    store, recent = Spy(clock=lambda: 100.0), RecentHolders()
    key = await remembered_first_turn(store, recent, P1, A1, {"h": 1})
    store.lookups = 0
    found = await begin_sessionless(store, "t", S1 + U2, "m", BS, 101.0, recent=recent)
    assert (found.how, found.key, found.start.handle) == (How.PREFIX, key, {"h": 1})
    assert store.lookups == 0 and len(recent) == 0           # claimed: no longer as remembered


async def test_a_remembered_holder_the_prompt_does_not_extend_is_not_claimed() -> None:
    store, recent = Spy(clock=lambda: 100.0), RecentHolders()
    await remembered_first_turn(store, recent, P1, A1, {"h": 1})
    for prompt in (P1 + [30, 31, 32, 99, 98, 97] + U2, S1[:16] + [77] + S1[17:] + U2, P1):
        found = await begin_sessionless(store, "t", prompt, "m", BS, 101.0, recent=recent)
        assert found.how == How.NEW, prompt
    assert len(recent) == 1          # still there for its own next turn
    other_tenant = await begin_sessionless(store, "u", S1 + U2, "m", BS, 101.0, recent=recent)
    assert other_tenant.how == How.NEW


async def test_a_stale_memory_falls_back_to_the_lookup() -> None:
    """Another replica's turn moved the conversation on: the remembered claim fails, the store's index decides."""
    store, recent = Spy(clock=lambda: 100.0), RecentHolders()
    key = await remembered_first_turn(store, recent, P1, A1, {"h": 1})
    moved = await store.begin_turn(key, 100.5)                    # elsewhere: claims the handle, stores turn 2
    await finish(store, key, moved.turn, S1 + U2 + [70, 71, 72, 73, 74], {"h": 2})
    store.lookups = 0
    found = await begin_sessionless(store, "t", S1 + U2 + [70, 71, 72, 73, 74] + [80], "m", BS, 101.0,
                                    recent=recent)
    assert store.lookups == 1 and (found.how, found.key, found.start.handle) == (How.PREFIX, key, {"h": 2})
    stale = await begin_sessionless(store, "t", S1 + U2, "m", BS, 101.0, recent=recent)
    assert stale.how == How.NEW and len(recent) == 0


def test_recent_holders_are_bounded() -> None:
    recent = RecentHolders(max_entries=2)
    for i in range(3):
        recent.stored(ConversationKey("t", f"s{i}"), 1, stored([i] * 8 + S1))
    assert len(recent) == 2
    assert not recent.holders("t", block_hashes([0] * 8 + S1, BS), 100)
    assert recent.holders("t", block_hashes([2] * 8 + S1, BS), 100)
