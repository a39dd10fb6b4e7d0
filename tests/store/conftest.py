"""Fixtures for the store suite: `make_store` over every kind (the real redis-server is in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest
import redis

from gateway.store import ConversationStore, MemoryConversationStore, RedisConversationStore

MakeStore = Callable[..., ConversationStore]

STORE_KINDS = ["memory", "fakeredis", pytest.param("redis", marks=pytest.mark.integration)]


@pytest.fixture
def clean_redis_url(redis_url: str) -> str:
    """The session's server, emptied: tests share one process but never each other's keys."""
    with redis.Redis.from_url(redis_url) as client:
        client.flushall()
    return redis_url


@pytest.fixture(params=STORE_KINDS)
async def make_store(request: pytest.FixtureRequest) -> AsyncIterator[MakeStore]:
    """`make_store(**kwargs)` builds a store of this run's kind with the constructor's keyword args."""
    kind: str = request.param
    url = request.getfixturevalue("clean_redis_url") if kind == "redis" else None
    made: list[ConversationStore] = []

    def make(**kwargs: object) -> ConversationStore:
        if kind == "memory":
            store: ConversationStore = MemoryConversationStore(**kwargs)
        elif kind == "fakeredis":
            pytest.importorskip("lupa", reason="fakeredis runs Lua scripts through lupa (fakeredis[lua])")
            import fakeredis

            store = RedisConversationStore(fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer()), **kwargs)
        else:
            store = RedisConversationStore.from_url(url, **kwargs)
        made.append(store)
        return store

    yield make
    for store in made:
        await store.close()


@pytest.fixture
def store(make_store: MakeStore) -> ConversationStore:
    return make_store()
