"""Random operation sequences give identical answers from the memory store and the Redis scripts
(on fakeredis), so the embedded default behaves like the shared store, boundaries included."""

from __future__ import annotations

import asyncio
from hashlib import blake2b

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

from gateway.store import Answer, Conversation, ConversationKey, MemoryConversationStore, RedisConversationStore

fakeredis = pytest.importorskip("fakeredis")
pytest.importorskip("lupa", reason="fakeredis runs Lua scripts through lupa (fakeredis[lua])")

INFLIGHT_TIMEOUT_S = 600.0
keys = st.sampled_from([ConversationKey("a", "s"), ConversationKey("a", "t"), ConversationKey("b", "s")])


def chain(text: str) -> list[bytes]:
    out, previous = [], b""
    for letter in text:
        previous = blake2b(previous + letter.encode(), digest_size=16).digest()
        out.append(previous)
    return out


# Records and prompts drawn from a few overlapping texts (one letter per 4-token block), so lookups hit.
prompts = st.sampled_from(["abcd", "abd", "ab", "xy", "abcdxy"]).map(chain)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3),
    max_leaves=6,
)
handles = st.none() | st.dictionaries(st.text(max_size=6), json_values, max_size=4)
records = st.builds(
    Conversation,
    decode_engine=st.sampled_from(["", "d0", "d1"]),
    num_tokens=st.integers(0, 10**6),
    block_size=st.sampled_from([0, 4, 4]),
    held_tokens=st.sampled_from([0, 3, 4, 7, 8, 11, 12, 13]),
    block_hashes=st.binary(max_size=48) | st.sampled_from(["abc", "abd", "xyz"]).map(lambda t: b"".join(chain(t))),
    answers=st.lists(st.builds(Answer, st.integers(0, 99), st.just(b"h" * 16), st.lists(st.integers(0, 2**31), max_size=4)), max_size=2),
    updated_at=st.floats(0, 1e10),
)


class SameAnswers(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 1_000.0
        self.loop = asyncio.new_event_loop()
        clock = lambda: self.now  # noqa: E731 - both stores read the same fake wall clock
        self.memory = MemoryConversationStore(inflight_timeout_s=INFLIGHT_TIMEOUT_S, clock=clock)
        self.redis = self.loop.run_until_complete(self._redis_store(clock))
        self.latest: dict[ConversationKey, int] = {}  # last turn begun, per key
        self.begun: dict[ConversationKey, object] = {}  # the last TurnStart, per key, to put back

    async def _redis_store(self, clock) -> RedisConversationStore:
        client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
        return RedisConversationStore(client, inflight_timeout_s=INFLIGHT_TIMEOUT_S, clock=clock)

    def both(self, op: str, *args: object) -> object:
        mem = self.loop.run_until_complete(getattr(self.memory, op)(*args))
        red = self.loop.run_until_complete(getattr(self.redis, op)(*args))
        assert mem == red, (op, args)
        return mem

    @rule(dt=st.sampled_from([0.5, 299.0, INFLIGHT_TIMEOUT_S]))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule(key=keys)
    def begin(self, key: ConversationKey) -> None:
        start = self.begun[key] = self.both("begin_turn", key, self.now)
        self.latest[key] = start.turn

    @rule(key=keys)
    def put_back(self, key: ConversationKey) -> None:
        if key in self.begun:
            self.both("put_back", key, self.begun[key], self.now)

    @rule(key=keys, data=st.data(), record=records, handle=handles,
          expires_in=st.sampled_from([-1.0, 0.0, 1.0, 300.0]))
    def finish(self, key, data, record, handle, expires_in) -> None:
        # Mostly the turn that owns the conversation (the interesting path), sometimes a stale or bogus one.
        latest = self.latest.get(key, 1)
        turn = data.draw(st.sampled_from([latest, latest, latest, latest - 1, latest + 1]))
        self.both("finish_turn", key, turn, record, handle, self.now + expires_in, self.now)

    @rule(tenant=st.sampled_from(["a", "b"]), hashes=prompts, extra=st.sampled_from([0, 0, 1, 3]))
    def find(self, tenant: str, hashes: list[bytes], extra: int) -> None:
        tokens = 4 * len(hashes) + extra
        # Ties within one prefix come in no promised order: compare as sets (the limit exceeds the keys).
        found = [self.loop.run_until_complete(store.find_by_prefix(tenant, hashes, tokens, self.now))
                 for store in (self.memory, self.redis)]
        mem, red = (sorted(f, key=lambda h: (-h.blocks, h.key.session)) for f in found)
        assert mem == red, (tenant, tokens)

    @rule(key=keys, back=st.sampled_from([0, 0, 1]))
    def begin_found(self, key: ConversationKey, back: int) -> None:
        start = self.both("begin_found_turn", key, self.latest.get(key, 1) - back, self.now)
        if start is not None:
            self.latest[key], self.begun[key] = start.turn, start

    @rule(key=keys, text=st.sampled_from(["abc", "abd", "xyz", "ab"]), held=st.sampled_from([4, 7, 8, 11, 12]),
          hashes=prompts, extra=st.sampled_from([0, 0, 1, 3]))
    def file(self, key: ConversationKey, text: str, held: int, hashes: list[bytes], extra: int) -> None:
        """A whole turn that leaves a live handle and an indexable record (what lookups are about), then one."""
        turn = self.both("begin_turn", key, self.now).turn
        self.latest[key] = turn
        record = Conversation(block_size=4, held_tokens=held, block_hashes=b"".join(chain(text)))
        self.both("finish_turn", key, turn, record, {"h": text}, self.now + 5_000.0, self.now)
        self.find(key.tenant, hashes, extra)

    @rule(key=keys)
    def get(self, key: ConversationKey) -> None:
        self.both("get", key)

    @rule(key=keys)
    def delete(self, key: ConversationKey) -> None:
        self.both("delete", key)

    def teardown(self) -> None:
        self.loop.run_until_complete(self.redis.close())
        self.loop.close()


SameAnswers.TestCase.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_memory_and_redis_give_same_answers = SameAnswers.TestCase
