"""The prefix index, one contract for every store (memory, fakeredis, real Redis): what finish_turn files,
what find_by_prefix returns, and that begin_found_turn claims a found handle at most once and otherwise
touches nothing."""

from __future__ import annotations

import asyncio
import time
from hashlib import blake2b

import pytest

from gateway.store import Conversation, ConversationKey, ConversationStore, Holder, index_hash
from tests.store.conftest import MakeStore

BS = 4  # tokens per block; each letter of a text below stands for one block
TENANT = "acme"


def chain(text: str) -> list[bytes]:
    """Chained 16-byte block hashes of a text, one block per letter (as continuity.block_hashes chains)."""
    out, previous = [], b""
    for letter in text:
        previous = blake2b(previous + letter.encode(), digest_size=16).digest()
        out.append(previous)
    return out


def held(text: str, held_tokens: int | None = None) -> Conversation:
    """D holds `text` (len(text) blocks); R defaults to all of it but the last token (prompt + output − 1)."""
    r = len(text) * BS - 1 if held_tokens is None else held_tokens
    return Conversation(model="m", block_size=BS, num_tokens=len(text) * BS, held_tokens=r,
                        block_hashes=b"".join(chain(text)), prefix_hash=text.encode())


def key(session: str, tenant: str = TENANT) -> ConversationKey:
    return ConversationKey(tenant, session)


def handle(name: str) -> dict:
    name = name.encode("utf-8", "surrogatepass").hex()[:64]   # any session id names a valid handle
    return {"remote_engine_id": "d0", "remote_request_id": name, "remote_block_ids": [[1, 2]]}


async def store_turn(store: ConversationStore, k: ConversationKey, record: Conversation, *,
                     with_handle: bool = True, ttl_s: float = 60.0, now: float | None = None) -> int:
    """One whole session turn that leaves `record` (and a handle named after the session) behind."""
    now = time.time() if now is None else now
    start = await store.begin_turn(k, now)
    assert await store.finish_turn(k, start.turn, record, handle(k.session) if with_handle else None,
                                   now + ttl_s, now)
    return start.turn


async def find(store: ConversationStore, prompt: str, *, tenant: str = TENANT, tokens: int | None = None,
               limit: int = 8, now: float | None = None) -> list[tuple[str, int, int, str]]:
    """(session, turn, blocks, state) of each holder found for a prompt of `prompt`'s blocks."""
    found = await store.find_by_prefix(tenant, chain(prompt), len(prompt) * BS if tokens is None else tokens,
                                       time.time() if now is None else now, limit)
    return [(h.key.session, h.turn, h.blocks, h.state) for h in found]


def test_index_hash_is_the_chain_at_the_held_whole_blocks() -> None:
    assert index_hash(held("abcd")) == chain("abcd")[2]          # R = 15 tokens: 3 whole blocks
    assert index_hash(held("abcd", 16)) == chain("abcd")[3]
    assert index_hash(held("abcd", 3)) is None                   # under one block: nothing to file
    assert index_hash(Conversation(held_tokens=8)) is None       # no block size, no hashes


async def test_longest_prefix_first(store: ConversationStore) -> None:
    await store_turn(store, key("long"), held("abcd"))           # filed at 3 blocks
    await store_turn(store, key("short"), held("ab", 8))         # filed at 2 blocks
    await store_turn(store, key("other"), held("xyz"))
    assert await find(store, "abcde") == [("long", 1, 3, "idle"), ("short", 1, 2, "idle")]
    assert await find(store, "abx") == [("short", 1, 2, "idle")]
    assert await find(store, "qrs") == []
    found = await store.find_by_prefix(TENANT, chain("abcde"), 20, time.time())
    assert found[0] == Holder(key("long"), 1, 3, held("abcd"), "idle")


async def test_every_identical_holder_is_kept_and_claimed_once(store: ConversationStore) -> None:
    for session in ("u1", "u2", "u3"):
        await store_turn(store, key(session), held("abc"))
    assert sorted(await find(store, "abcd")) == [(s, 1, 2, "idle") for s in ("u1", "u2", "u3")]
    assert len(await find(store, "abcd", limit=2)) == 2
    now = time.time()
    first = await store.begin_found_turn(key("u2"), 1, now)
    assert first is not None and (first.turn, first.handle_state) == (2, "claimed")
    assert (first.record, first.handle) == (held("abc"), handle("u2"))
    assert await store.begin_found_turn(key("u2"), 1, now) is None       # never two reads of one handle
    assert sorted(await find(store, "abcd")) == [("u1", 1, 2, "idle"), ("u3", 1, 2, "idle")]
    # Two sessionless turns racing for the same holders: each gets a different handle or none.
    claims = await asyncio.gather(*(store.begin_found_turn(key(s), 1, now) for s in ("u1", "u1", "u3", "u3")))
    assert sorted((c.handle for c in claims if c), key=str) == sorted([handle("u1"), handle("u3")], key=str)


async def test_found_claim_leaves_a_moved_conversation_alone(store: ConversationStore) -> None:
    await store_turn(store, key("a"), held("abc"))
    now = time.time()
    own = await store.begin_turn(key("a"), now)                       # its own session turn claims first
    assert own.handle_state == "claimed"
    assert await find(store, "abcd") == []                            # a claimed handle is not offered
    assert await store.begin_found_turn(key("a"), 1, now) is None
    assert await store.finish_turn(key("a"), own.turn, held("abcdef"), handle("a2"), now + 60, now)
    assert await store.begin_found_turn(key("a"), 1, now) is None     # record moved on: turn 1 is stale
    assert await find(store, "abcd") == []                            # the old entry went in the same step
    assert await find(store, "abcdefg") == [("a", 2, 5, "idle")]
    claimed = await store.begin_found_turn(key("a"), 2, now)
    assert claimed is not None and claimed.handle == handle("a2") and claimed.turn == 3


async def test_found_claim_never_bumps_counters(store: ConversationStore) -> None:
    now = time.time()
    await store_turn(store, key("a"), held("abc"), ttl_s=5, now=now)
    assert await store.begin_found_turn(key("a"), 1, now + 5) is None   # expired: untouched
    assert await store.begin_found_turn(key("a"), 7, now) is None       # not the turn found
    assert await store.begin_found_turn(key("nobody"), 1, now) is None
    assert await store.get(key("nobody")) is None
    start = await store.begin_turn(key("a"), now)
    assert (start.turn, start.handle_state) == (2, "claimed")           # as if no found claim was tried


async def test_only_live_handles_are_offered(store: ConversationStore) -> None:
    now = time.time()
    await store_turn(store, key("none"), held("abc"), with_handle=False, now=now)
    await store_turn(store, key("dead"), held("abc"), ttl_s=-1, now=now)
    await store_turn(store, key("soon"), held("abc"), ttl_s=5, now=now)
    assert await find(store, "abcd", now=now) == [("soon", 1, 2, "idle")]
    assert await find(store, "abcd", now=now + 5) == []                 # expiry is exclusive
    await store_turn(store, key("soon"), held("abc"), with_handle=False, now=now)
    assert await find(store, "abcd", now=now) == []                    # a turn without a handle unfiles


async def test_holders_longer_than_the_prompt_are_skipped(store: ConversationStore) -> None:
    await store_turn(store, key("whole"), held("abc", 12))
    await store_turn(store, key("part"), held("ab", 8))
    assert await find(store, "abc", tokens=11) == [("part", 1, 2, "idle")]
    assert await find(store, "abc", tokens=12) == [("whole", 1, 3, "idle"), ("part", 1, 2, "idle")]


async def test_delete_unfiles(store: ConversationStore) -> None:
    await store_turn(store, key("a"), held("abc"))
    assert await store.delete(key("a")) == handle("a")
    assert await find(store, "abcd") == []
    assert await store.begin_found_turn(key("a"), 1, time.time()) is None


async def test_tenants_never_see_each_other(store: ConversationStore) -> None:
    await store_turn(store, key("a", tenant="t1"), held("abc"))
    assert await find(store, "abcd", tenant="t2") == []
    assert await find(store, "abcd", tenant="t1") == [("a", 1, 2, "idle")]
    assert await store.begin_found_turn(key("a", tenant="t2"), 1, time.time()) is None
    with pytest.raises(ValueError):
        await store.find_by_prefix("t{1}", chain("abcd"), 16, time.time())


@pytest.mark.parametrize("session", ["", "a:b", "conv:{x}:*", "naïve 会话 🙂", "\ud800 lone surrogate", "x" * 256])
async def test_found_sessions_come_back_exactly(store: ConversationStore, session: str) -> None:
    await store_turn(store, key(session), held("abc"))
    [found] = await store.find_by_prefix(TENANT, chain("abcd"), 16, time.time())
    assert found.key == key(session)
    assert await store.begin_found_turn(found.key, found.turn, time.time()) is not None


async def test_index_expires_with_the_conversation(make_store: MakeStore) -> None:
    store = make_store(conversation_ttl_s=0.3)
    await store_turn(store, key("a"), held("abc"), ttl_s=600)
    written = time.monotonic()
    while await find(store, "abcd"):
        assert time.monotonic() - written < 3, "index entry outlived its conversation"
        await asyncio.sleep(0.02)
    assert time.monotonic() - written > 0.2


async def test_empty_prompt_finds_nothing(store: ConversationStore) -> None:
    await store_turn(store, key("a"), held("abc"))
    assert await store.find_by_prefix(TENANT, [], 0, time.time()) == []
