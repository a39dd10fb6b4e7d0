"""What only the embedded store has: its size bound and expiry sweeping."""

from __future__ import annotations

from gateway.store import Answer, Conversation, ConversationKey, MemoryConversationStore


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


async def write(store: MemoryConversationStore, key: ConversationKey, now: float) -> None:
    start = await store.begin_turn(key, now)
    assert await store.finish_turn(key, start.turn, Conversation(), {"h": 1}, now + 60, now)


async def test_least_recently_written_is_evicted_first() -> None:
    store = MemoryConversationStore(max_conversations=2)
    a, b, c = (ConversationKey("t", s) for s in "abc")
    await write(store, a, 1.0)
    await write(store, b, 1.0)
    await write(store, a, 1.0)  # a is now the newer write
    await write(store, c, 1.0)
    assert len(store) == 2
    assert await store.get(b) is None
    assert await store.get(a) is not None and await store.get(c) is not None


async def test_expired_conversations_are_swept_on_write() -> None:
    clock = FakeClock()
    store = MemoryConversationStore(conversation_ttl_s=10, clock=clock)
    for session in "abc":
        await write(store, ConversationKey("t", session), clock.now)
    clock.now += 11
    await write(store, ConversationKey("t", "d"), clock.now)
    assert len(store) == 1


async def test_records_are_not_aliased() -> None:
    store = MemoryConversationStore()
    key, record, handle = ConversationKey("t", "s"), Conversation(answers=[Answer(1, b"h", [1])]), {"ids": [1]}
    start = await store.begin_turn(key, 1.0)
    await store.finish_turn(key, start.turn, record, handle, 100.0, 1.0)
    record.answers[0].ids.append(2)
    handle["ids"].append(2)
    assert (await store.begin_turn(key, 2.0)).record == Conversation(answers=[Answer(1, b"h", [1])])


async def test_evicted_and_expired_conversations_leave_the_index() -> None:
    clock = FakeClock()
    store = MemoryConversationStore(max_conversations=2, conversation_ttl_s=10, clock=clock)
    record = Conversation(block_size=4, held_tokens=8, block_hashes=b"\x01" * 16 + b"\x02" * 16)
    for session in "abc":                              # a is evicted by c
        key = ConversationKey("t", session)
        start = await store.begin_turn(key, clock.now)
        assert await store.finish_turn(key, start.turn, record, {"h": session}, clock.now + 60, clock.now)
    found = await store.find_by_prefix("t", [b"\x01" * 16, b"\x02" * 16], 8, clock.now)
    assert sorted(h.key.session for h in found) == ["b", "c"]
    clock.now += 11                                    # b and c expire with their conversations
    assert await store.find_by_prefix("t", [b"\x01" * 16, b"\x02" * 16], 8, clock.now) == []
    assert list(store._index) == []                    # nothing left behind
