"""One contract, every store: memory, fakeredis (unit speed) and a real redis-server (integration)."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.store import Answer, Conversation, ConversationKey, ConversationStore
from tests.store.conftest import MakeStore

KEY = ConversationKey("acme", "session-1")
HANDLE = {
    "do_remote_decode": True,
    "remote_block_ids": [[1, 2, 3]],
    "remote_engine_id": "d0",
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
    "remote_num_tokens": 47,
    "remote_blocks_expiry_time": 1234.5,
    "remote_prefill_cached_tokens": None,
}


def record(n: int = 1) -> Conversation:
    return Conversation(
        decode_engine="d0", model="m", block_size=16, num_tokens=16 * n, held_tokens=16 * n - 1,
        block_hashes=bytes(range(16)) * n, answers=[Answer(n, b"h" * 16, [7] * n)], created_at=1.0, updated_at=float(n),
    )


async def finished_turn(
    store: ConversationStore, key: ConversationKey, *, handle=HANDLE, ttl_s: float = 60.0, now: float | None = None
):
    """Run one whole turn that leaves `handle` (live for `ttl_s` after `now`) behind; returns its TurnStart."""
    now = time.time() if now is None else now
    start = await store.begin_turn(key, now)
    assert await store.finish_turn(key, start.turn, record(start.turn), handle, now + ttl_s, now)
    return start


async def test_new_conversation(store: ConversationStore) -> None:
    now = time.time()
    start = await store.begin_turn(KEY, now)
    assert (start.turn, start.record, start.handle, start.handle_state) == (1, None, None, "none")
    assert await store.get(KEY) is None  # begun, but nothing recorded yet

    assert await store.finish_turn(KEY, 1, record(1), HANDLE, now + 60, now)
    assert await store.get(KEY) == (record(1), HANDLE, 1)

    second = await store.begin_turn(KEY, now)
    assert (second.turn, second.record, second.handle, second.handle_state) == (2, record(1), HANDLE, "claimed")
    assert await store.get(KEY) == (record(1), None, 1)  # claimed: gone from the store


async def test_concurrent_begin_claims_once(store: ConversationStore) -> None:
    await finished_turn(store, KEY)
    starts = await asyncio.gather(*(store.begin_turn(KEY, time.time()) for _ in range(2)))
    assert sorted(s.handle_state for s in starts) == ["claimed", "in_flight"]
    assert [s.handle for s in starts if s.handle is not None] == [HANDLE]
    assert sorted(s.turn for s in starts) == [2, 3]


async def test_new_conversation_concurrent_begin(store: ConversationStore) -> None:
    starts = await asyncio.gather(*(store.begin_turn(KEY, time.time()) for _ in range(2)))
    assert sorted((s.turn, s.handle_state) for s in starts) == [(1, "none"), (2, "in_flight")]


async def test_abandoned_turn_stops_counting_as_in_flight(make_store: MakeStore) -> None:
    store = make_store(inflight_timeout_s=10)
    now = time.time()
    await store.begin_turn(KEY, now)
    assert (await store.begin_turn(KEY, now + 9)).handle_state == "in_flight"
    assert (await store.begin_turn(KEY, now + 20)).handle_state == "none"


async def test_expired_handle(store: ConversationStore) -> None:
    now = time.time()
    await finished_turn(store, KEY, ttl_s=5, now=now)
    assert await store.get(KEY) == (record(1), HANDLE, 1)
    start = await store.begin_turn(KEY, now + 5)  # expiry is exclusive
    assert (start.turn, start.record, start.handle, start.handle_state) == (2, record(1), None, "expired")
    assert await store.finish_turn(KEY, 2, record(2), None, 0.0, now)
    assert (await store.begin_turn(KEY, now)).handle_state == "none"  # affinity kept, no handle


async def test_get_hides_expired_handle(store: ConversationStore) -> None:
    await finished_turn(store, KEY, ttl_s=-1)
    assert await store.get(KEY) == (record(1), None, 1)
    assert (await store.begin_turn(KEY, time.time())).handle_state == "expired"


async def test_stale_turn_cannot_overwrite_newer(store: ConversationStore) -> None:
    now = time.time()
    await finished_turn(store, KEY)
    t2 = await store.begin_turn(KEY, now)
    t3 = await store.begin_turn(KEY, now)
    assert (t2.handle_state, t3.handle_state) == ("claimed", "in_flight")
    assert not await store.finish_turn(KEY, t2.turn, record(2), {"stale": True}, now + 60, now)
    assert await store.get(KEY) == (record(1), None, 1)

    assert await store.finish_turn(KEY, t3.turn, record(3), HANDLE, now + 60, now)
    assert not await store.finish_turn(KEY, t2.turn, record(2), {"stale": True}, now + 60, now)
    assert not await store.finish_turn(KEY, t3.turn, record(9), {"twice": True}, now + 60, now)
    assert await store.get(KEY) == (record(3), HANDLE, 3)


async def test_finish_without_begin_is_refused(store: ConversationStore) -> None:
    now = time.time()
    assert not await store.finish_turn(KEY, 1, record(1), HANDLE, now + 60, now)
    assert await store.get(KEY) is None


async def test_finish_without_handle_keeps_affinity(store: ConversationStore) -> None:
    await finished_turn(store, KEY, handle=None)
    assert await store.get(KEY) == (record(1), None, 1)
    start = await store.begin_turn(KEY, time.time())
    assert (start.record, start.handle, start.handle_state) == (record(1), None, "none")


async def test_delete_returns_live_handle(store: ConversationStore) -> None:
    await finished_turn(store, KEY)
    assert await store.delete(KEY) == HANDLE
    assert await store.get(KEY) is None
    assert await store.delete(KEY) is None
    start = await store.begin_turn(KEY, time.time())
    assert (start.turn, start.record, start.handle_state) == (1, None, "none")


async def test_delete_drops_expired_handle_silently(store: ConversationStore) -> None:
    await finished_turn(store, KEY, ttl_s=-1)
    assert await store.delete(KEY) is None
    assert await store.get(KEY) is None


async def test_tenants_are_isolated(store: ConversationStore) -> None:
    a, b = ConversationKey("a", "same"), ConversationKey("b", "same")
    await finished_turn(store, a)
    assert await store.get(b) is None
    start = await store.begin_turn(b, time.time())
    assert (start.turn, start.record, start.handle_state) == (1, None, "none")
    assert await store.delete(b) is None
    assert await store.get(a) == (record(1), HANDLE, 1)


@pytest.mark.parametrize("session", [
    "", "a:b", "a:c", "b", "conv:{x}:*", "naïve 会话 🙂", "\ud800 lone surrogate", "x" * 256, "a b\r\n\x00",
])
async def test_odd_session_ids(store: ConversationStore, session: str) -> None:
    key = ConversationKey("t-1.x_Y", session)
    await finished_turn(store, key)
    assert await store.get(key) == (record(1), HANDLE, 1)
    assert await store.get(ConversationKey("t-1.x_Y", session[:-1] + "?")) is None


@pytest.mark.parametrize("key", [
    ConversationKey("", "s"), ConversationKey("a:b", "s"), ConversationKey("x" * 81, "s"),
    ConversationKey("ok", "x" * 257), ConversationKey("tenant{1}", "s"),
])
async def test_invalid_keys_are_refused(store: ConversationStore, key: ConversationKey) -> None:
    with pytest.raises(ValueError):
        await store.begin_turn(key, time.time())
    with pytest.raises(ValueError):
        await store.get(key)


async def test_conversation_expires_after_last_write(make_store: MakeStore) -> None:
    store = make_store(conversation_ttl_s=0.3)
    await finished_turn(store, KEY)
    written = time.monotonic()
    while await store.get(KEY) is not None:
        assert time.monotonic() - written < 3, "conversation outlived its TTL"
        await asyncio.sleep(0.02)
    assert time.monotonic() - written > 0.2
    assert (await store.begin_turn(KEY, time.time())).turn == 1


async def test_ping(store: ConversationStore) -> None:
    assert await store.ping() is True
    assert store.kind in ("memory", "redis")


# -- evict_handle: the pin budget takes an idle handle away before freeing D's blocks -------------------------
async def test_evict_handle_takes_the_idle_handle_and_marks_the_next_turn(store: ConversationStore) -> None:
    start = await finished_turn(store, KEY)
    assert await store.evict_handle(KEY, start.turn) == HANDLE
    assert await store.get(KEY) == (record(1), None, 1)
    assert await store.evict_handle(KEY, start.turn) is None           # once
    second = await store.begin_turn(KEY, time.time())
    assert (second.turn, second.handle, second.handle_state) == (2, None, "evicted")
    assert await store.finish_turn(KEY, 2, record(2), HANDLE, time.time() + 60, time.time())
    third = await store.begin_turn(KEY, time.time())
    assert (third.handle, third.handle_state) == (HANDLE, "claimed")   # a stored handle clears the mark


async def test_evict_handle_never_takes_a_claimed_handle(store: ConversationStore) -> None:
    start = await finished_turn(store, KEY)
    claimed = await store.begin_turn(KEY, time.time())
    assert claimed.handle == HANDLE
    assert await store.evict_handle(KEY, start.turn) is None
    assert await store.finish_turn(KEY, claimed.turn, record(2), HANDLE, time.time() + 60, time.time())
    assert (await store.begin_turn(KEY, time.time())).handle_state == "claimed"   # not marked evicted


async def test_evict_handle_never_takes_a_newer_turns_handle(store: ConversationStore) -> None:
    first = await finished_turn(store, KEY)
    await finished_turn(store, KEY)                                    # turn 2 claimed 1's, stored its own
    assert await store.evict_handle(KEY, first.turn) is None
    assert await store.get(KEY) == (record(2), HANDLE, 2)


async def test_evicted_is_reported_once(store: ConversationStore) -> None:
    start = await finished_turn(store, KEY)
    await store.evict_handle(KEY, start.turn)
    assert (await store.begin_turn(KEY, time.time())).handle_state == "evicted"
    assert (await store.begin_turn(KEY, time.time())).handle_state == "in_flight"


async def test_evict_an_expired_or_unknown_handle(store: ConversationStore) -> None:
    now = time.time()
    assert await store.evict_handle(ConversationKey("acme", "nobody"), 1) is None
    start = await finished_turn(store, KEY, ttl_s=-1, now=now)          # D has already dropped it
    assert await store.evict_handle(KEY, start.turn) is None
    assert await store.get(KEY) == (record(1), None, 1)


async def test_an_evicted_handle_leaves_the_prefix_index(store: ConversationStore) -> None:
    await finished_turn(store, KEY)
    second = await finished_turn(store, KEY)                           # record(2): indexed at its first block
    now = time.time()
    assert [h.key for h in await store.find_by_prefix("acme", [bytes(range(16))], 64, now)] == [KEY]
    assert await store.evict_handle(KEY, second.turn) == HANDLE
    assert await store.find_by_prefix("acme", [bytes(range(16))], 64, now) == []


async def test_an_empty_handle_is_filed_and_claimed_once_like_any(store: ConversationStore) -> None:
    """kv.stored's empty handle (nothing pinned on D, the record still findable by its tokens) is opaque to the
    store: filed in the prefix index, claimed by one turn, read back as {}."""
    await finished_turn(store, KEY, handle={})
    second = await finished_turn(store, KEY, handle={})
    now = time.time()
    [holder] = await store.find_by_prefix("acme", [bytes(range(16))], 64, now)
    assert (holder.key, holder.turn) == (KEY, second.turn)
    found = await store.begin_found_turn(KEY, holder.turn, now)
    assert found is not None and found.handle == {} and found.handle_state == "claimed"
    assert await store.begin_found_turn(KEY, holder.turn, now) is None
    assert await store.find_by_prefix("acme", [bytes(range(16))], 64, now) == []


# -- put_back: a turn refused after its claim undoes its begin -------------------------------------------------
async def test_put_back_returns_the_claimed_handle_as_if_the_turn_never_began(store: ConversationStore) -> None:
    await finished_turn(store, KEY)
    stored = await finished_turn(store, KEY)                           # record(2), indexed at its first block
    now = time.time()
    refused = await store.begin_turn(KEY, now)
    assert (refused.turn, refused.handle_state) == (3, "claimed") and refused.handle_expires_at > now
    assert await store.find_by_prefix("acme", [bytes(range(16))], 64, now) == []
    assert await store.put_back(KEY, refused, now)
    assert await store.get(KEY) == (record(2), HANDLE, 2)
    assert [h.key for h in await store.find_by_prefix("acme", [bytes(range(16))], 64, now)] == [KEY]
    assert await store.begin_found_turn(KEY, stored.turn, now) == refused     # a lookup may claim it again
    assert await store.put_back(KEY, refused, now)
    again = await store.begin_turn(KEY, now)
    assert again == refused                                            # the same turn, the same handle
    assert await store.finish_turn(KEY, again.turn, record(3), None, 0.0, now)


async def test_put_back_changes_nothing_once_another_turn_began(store: ConversationStore) -> None:
    await finished_turn(store, KEY)
    now = time.time()
    refused = await store.begin_turn(KEY, now)
    later = await store.begin_turn(KEY, now)
    assert later.handle_state == "in_flight"
    assert not await store.put_back(KEY, refused, now)                # the caller releases the handle
    assert await store.get(KEY) == (record(1), None, 1)
    assert await store.finish_turn(KEY, later.turn, record(3), HANDLE, now + 60, now)
    assert await store.get(KEY) == (record(3), HANDLE, 3)


async def test_put_back_is_refused_after_finish_delete_or_once_done(store: ConversationStore) -> None:
    await finished_turn(store, KEY)
    now = time.time()
    finished = await store.begin_turn(KEY, now)
    assert await store.finish_turn(KEY, finished.turn, record(2), None, 0.0, now)
    assert not await store.put_back(KEY, finished, now)
    refused = await store.begin_turn(KEY, now)
    assert await store.put_back(KEY, refused, now)
    assert not await store.put_back(KEY, refused, now)                # once
    deleted = await store.begin_turn(KEY, now)
    await store.delete(KEY)
    assert not await store.put_back(KEY, deleted, now)
    assert await store.get(KEY) is None


async def test_put_back_of_a_first_turn(store: ConversationStore) -> None:
    now = time.time()
    refused = await store.begin_turn(KEY, now)
    assert await store.put_back(KEY, refused, now)
    assert await store.get(KEY) is None
    start = await store.begin_turn(KEY, now)
    assert (start.turn, start.record, start.handle_state) == (1, None, "none")     # not "in_flight"


async def test_put_back_lets_the_turn_in_flight_finish(store: ConversationStore) -> None:
    await finished_turn(store, KEY)
    now = time.time()
    running = await store.begin_turn(KEY, now)
    refused = await store.begin_turn(KEY, now)
    assert refused.handle_state == "in_flight"
    assert await store.put_back(KEY, refused, now)
    assert await store.finish_turn(KEY, running.turn, record(2), HANDLE, now + 60, now)
    assert (await store.begin_turn(KEY, now)).handle == HANDLE


async def test_put_back_reports_an_eviction_again(store: ConversationStore) -> None:
    start = await finished_turn(store, KEY)
    await store.evict_handle(KEY, start.turn)
    refused = await store.begin_turn(KEY, time.time())
    assert refused.handle_state == "evicted"
    assert await store.put_back(KEY, refused, time.time())
    assert (await store.begin_turn(KEY, time.time())).handle_state == "evicted"


async def test_a_handle_that_died_meanwhile_goes_back_dead(store: ConversationStore) -> None:
    now = time.time()
    await finished_turn(store, KEY)
    await finished_turn(store, KEY, ttl_s=5, now=now)                  # record(2), indexable
    refused = await store.begin_turn(KEY, now)
    assert await store.put_back(KEY, refused, now + 5)                 # expiry is exclusive: dead now
    assert await store.find_by_prefix("acme", [bytes(range(16))], 64, now) == []
    start = await store.begin_turn(KEY, now + 5)
    assert (start.turn, start.handle, start.handle_state) == (3, None, "expired")


# -- stored responses (the Responses API's previous_response_id) -------------------------------------------
def stored_response(n: int = 1):
    from gateway.store import StoredResponse

    return StoredResponse(session=f"chain-{n}", model="m", ids=bytes(range(8)) * n, messages=b'[{"role":"user"}]',
                          context=b"c" * 16, body=b'{"id":"resp_x"}', created_at=float(n))


async def test_stored_response_round_trip_and_delete(store: ConversationStore) -> None:
    await store.put_response("acme", "resp_1", stored_response(1))
    assert await store.get_response("acme", "resp_1") == stored_response(1)
    assert await store.get_response("acme", "resp_2") is None
    assert await store.delete_response("acme", "resp_1") is True
    assert await store.get_response("acme", "resp_1") is None
    assert await store.delete_response("acme", "resp_1") is False


async def test_stored_responses_are_tenant_scoped(store: ConversationStore) -> None:
    await store.put_response("acme", "resp_1", stored_response(1))
    assert await store.get_response("other", "resp_1") is None          # never another tenant's response
    assert await store.delete_response("other", "resp_1") is False
    assert await store.get_response("acme", "resp_1") == stored_response(1)


async def test_stored_response_leaves_conversations_alone(store: ConversationStore) -> None:
    await finished_turn(store, KEY)
    await store.put_response(KEY.tenant, KEY.session, stored_response(2))   # same id as a session: other key
    assert (await store.get(KEY))[1] == HANDLE
    assert await store.delete_response(KEY.tenant, KEY.session)
    assert (await store.get(KEY))[1] == HANDLE


async def test_stored_response_expires_with_the_conversation_ttl(make_store: MakeStore) -> None:
    store = make_store(conversation_ttl_s=0.2)
    await store.put_response("acme", "resp_1", stored_response(1))
    assert await store.get_response("acme", "resp_1") is not None
    await asyncio.sleep(0.35)
    assert await store.get_response("acme", "resp_1") is None


@pytest.mark.parametrize("bad", ["", "a" * 129, "resp:1", "resp 1", None])
async def test_stored_response_ids_are_checked(store: ConversationStore, bad) -> None:
    with pytest.raises(ValueError):
        await store.get_response("acme", bad)


async def test_stored_response_without_its_bulk(store: ConversationStore) -> None:
    from gateway.store.base import response_meta

    await store.put_response("acme", "resp_1", stored_response(3))
    meta = await store.get_response("acme", "resp_1", bulk=False)
    assert meta == response_meta(stored_response(3)) and (meta.ids, meta.messages, meta.body) == (b"", b"", b"")
    assert meta.session == "chain-3" and meta.context == b"c" * 16
    assert await store.get_response("other", "resp_1", bulk=False) is None


# -- replicas: each gateway replica's share of D's pin budget --------------------------------------------------
async def test_replicas_count_the_live_heartbeats_of_every_replica(store: ConversationStore) -> None:
    assert await store.replicas("r1", 100.0, 5.0) == 1
    assert await store.replicas("r2", 101.0, 5.0) == 2          # another replica on the same store
    assert await store.replicas("r1", 102.0, 5.0) == 2          # a beat again is still one replica
    assert await store.replicas("r2", 104.0, 5.0) == 2
    assert await store.replicas("r2", 107.5, 5.0) == 1          # r1 last beat at 102: gone after 107
    assert await store.replicas("r3", 200.0, 5.0) == 1          # r2 gone too, r3 alone
