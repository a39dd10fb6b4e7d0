"""The round trips a turn saves: a sessionless lookup that begins the new conversation when it finds nobody
(`find_or_begin`), and a finish that sends only the block hashes the stored record lacks (`unchanged_blocks`).
Every store alike: the stored record is the one given, whatever the hint says."""

from __future__ import annotations

import time

import pytest

from gateway.store import Conversation, ConversationKey, ConversationStore
from gateway.store.redis_store import RedisConversationStore, conversation_key

KEY = ConversationKey("acme", "s1")
HANDLE = {"remote_block_ids": [[1, 2]], "remote_engine_id": "d0", "remote_num_tokens": 31}


def hashes(*blocks: int) -> bytes:
    return b"".join(bytes([b]) * 16 for b in blocks)


def record(block_hashes: bytes, held: int = 31, note: str = "") -> Conversation:
    return Conversation(decode_engine="d0", model="m", block_size=16, num_tokens=held + 1, held_tokens=held,
                        block_hashes=block_hashes, prefix_hash=b"p" * 16, handle_note=note)


async def turn(store: ConversationStore, rec: Conversation, unchanged: int, handle=HANDLE) -> bool:
    now = time.time()
    start = await store.begin_turn(KEY, now)
    return await store.finish_turn(KEY, start.turn, rec, handle, now + 60, now, unchanged)


@pytest.mark.parametrize("unchanged", [0, 2, 3, 5, 99])
async def test_a_finish_stores_the_whole_record_whatever_its_hint(store: ConversationStore, unchanged: int) -> None:
    assert await turn(store, record(hashes(1, 2, 3)), 0)
    grown = record(hashes(1, 2, 3, 4, 5), held=79)
    assert await turn(store, grown, unchanged)
    assert (await store.get(KEY))[0] == grown
    start = await store.begin_turn(KEY, time.time())
    assert start.record == grown


async def test_a_hint_the_stored_hashes_do_not_bear_out_sends_them_all(store: ConversationStore) -> None:
    assert await turn(store, record(hashes(1, 2, 3)), 0)
    diverged = record(hashes(1, 7, 8, 9), held=63)          # says 3 unchanged: only the first is
    assert await turn(store, diverged, 3)
    assert (await store.get(KEY))[0] == diverged
    shorter = record(hashes(1), held=20)
    assert await turn(store, shorter, 1)
    assert (await store.get(KEY))[0] == shorter


async def test_an_abandoned_turn_keeps_every_hash(store: ConversationStore) -> None:
    rec = record(hashes(*range(1, 40)), held=620)
    assert await turn(store, rec, 0)
    failed = record(rec.block_hashes, held=620, note="previous_turn_failed")
    assert await turn(store, failed, 39, handle=None)
    assert (await store.get(KEY))[0] == failed


async def test_holders_and_claims_carry_the_hashes(store: ConversationStore) -> None:
    rec = record(hashes(1, 2, 3), held=47)
    assert await turn(store, rec, 0)
    grown = record(hashes(1, 2, 3, 4), held=63)
    assert await turn(store, grown, 3)
    now = time.time()
    [holder] = await store.find_by_prefix("acme", [bytes([b]) * 16 for b in (1, 2, 3, 4, 5)], 80, now)
    assert holder.record == grown
    start = await store.begin_found_turn(holder.key, holder.turn, now)
    assert start is not None and start.record == grown


async def test_find_or_begin_begins_the_new_conversation_only_when_nobody_is_found(
        store: ConversationStore) -> None:
    now = time.time()
    new = ConversationKey("acme", "pdgw-new")
    prompt = [bytes([b]) * 16 for b in (1, 2, 3)]
    holders, start = await store.find_or_begin("acme", prompt, 48, now, new)
    assert holders == [] and start is not None and (start.turn, start.record, start.handle_state) == (1, None, "none")
    assert await store.finish_turn(new, 1, record(hashes(1, 2), held=40), HANDLE, now + 60, now)
    other = ConversationKey("acme", "pdgw-other")
    holders, start = await store.find_or_begin("acme", prompt, 48, now, other)
    assert [h.key for h in holders] == [new] and start is None
    assert (await store.begin_turn(other, now)).turn == 1      # the lookup that found someone began nothing
    with pytest.raises(ValueError):
        await store.find_or_begin("acme", prompt, 48, now, ConversationKey("else", "x"))


async def test_find_or_begin_without_whole_blocks_begins(store: ConversationStore) -> None:
    new = ConversationKey("acme", "pdgw-short")
    holders, start = await store.find_or_begin("acme", [], 3, time.time(), new)
    assert holders == [] and start is not None and start.turn == 1


async def test_a_record_an_earlier_layout_wrote_keeps_its_own_hashes(make_store) -> None:
    """A record written whole (v2 before the `blocks` field, or by an older replica after a newer one wrote
    `blocks`): read with its own hashes, and the next finish sends them all."""
    store = make_store()
    if not isinstance(store, RedisConversationStore):
        pytest.skip("the layout is the Redis store's")
    assert await turn(store, record(hashes(1, 2, 3)), 0)
    old = record(hashes(4, 5, 6), held=47)
    from gateway.store.codec import encode_record
    # An older script: the record with its hashes, `finished` bumped, `blocks` left as it was.
    await store.client.hset(conversation_key(KEY), mapping={"record": encode_record(old), "finished": 2,
                                                            "started": 2})
    assert (await store.get(KEY))[0] == old
    start = await store.begin_turn(KEY, time.time())
    assert start.record == old
    grown = record(hashes(4, 5, 6, 7), held=63)
    assert await store.finish_turn(KEY, start.turn, grown, HANDLE, time.time() + 60, time.time(), 3)
    assert (await store.get(KEY))[0] == grown


def redis_kinds(make_store) -> RedisConversationStore:
    store = make_store()
    if not isinstance(store, RedisConversationStore):
        pytest.skip("the Redis store's memo of the hashes it wrote (store/known.py)")
    return store


async def test_a_replica_reads_back_what_another_wrote_and_not_what_it_wrote(make_store) -> None:
    a = redis_kinds(make_store)
    b = RedisConversationStore(a.client)           # another replica on the same server
    one, two = record(hashes(1, 2, 3), held=47), record(hashes(1, 2, 3, 4), held=63)
    assert await turn(a, one, 0)
    replies = []
    original = a._begin_turn

    async def spy(**kwargs):
        replies.append(await original(**kwargs))
        return replies[-1]
    a._begin_turn = spy
    start = await a.begin_turn(KEY, time.time())
    assert start.record == one and replies[-1][5] == 1          # its own write: not sent back
    assert await a.finish_turn(KEY, start.turn, two, HANDLE, time.time() + 60, time.time(), 3)
    start = await b.begin_turn(KEY, time.time())
    assert start.record == two                                   # b holds nothing: sent the bytes
    three = record(hashes(1, 2, 3, 4, 5), held=79)
    assert await b.finish_turn(KEY, start.turn, three, HANDLE, time.time() + 60, time.time(), 4)
    start = await a.begin_turn(KEY, time.time())
    assert start.record == three and replies[-1][5] == three.block_hashes   # a's memo went stale: the bytes


async def test_a_memo_of_a_deleted_conversation_never_matches_its_new_life(make_store) -> None:
    a = redis_kinds(make_store)
    b = RedisConversationStore(a.client)
    assert await turn(a, record(hashes(1, 2, 3)), 0)             # a remembers turn 1's hashes
    await b.delete(KEY)
    fresh = record(hashes(9, 8), held=40)
    assert await turn(b, fresh, 0)                               # turn 1 again, other hashes
    [holder] = await a.find_by_prefix("acme", [bytes([b]) * 16 for b in (9, 8, 7)], 48, time.time())
    assert holder.record == fresh
    claimed = await a.begin_found_turn(holder.key, holder.turn, time.time())
    assert claimed is not None and claimed.record == fresh
