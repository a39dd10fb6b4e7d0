"""What only the Redis store has: URLs, faults, restarts, round trips, key layout, state size."""

from __future__ import annotations

import socket
import time

import pytest
import redis
import redis.utils
from redis.asyncio.connection import Connection

from gateway.store import Conversation, ConversationKey, RedisConversationStore, StoreUnavailableError
from gateway.store.redis_store import client_from_url, conversation_key, tenant_prefix
from tests.redis_server import RedisServer

KEY = ConversationKey("acme", "s:1")
HANDLE = {"remote_engine_id": "d0", "remote_block_ids": [[1, 2]], "remote_num_tokens": 31}
HELD = Conversation(model="m", block_size=4, held_tokens=8, block_hashes=b"\x01" * 16 + b"\x02" * 16)

integration = pytest.mark.integration


async def one_turn(store: RedisConversationStore, key: ConversationKey = KEY) -> int:
    now = time.time()
    start = await store.begin_turn(key, now)
    assert await store.finish_turn(key, start.turn, Conversation(model="m"), HANDLE, now + 60, now)
    return start.turn


async def assert_unavailable(store: RedisConversationStore, *, within_s: float) -> None:
    now = time.time()
    ops = [
        store.begin_turn(KEY, now),
        store.finish_turn(KEY, 2, Conversation(), None, 0.0, now),
        store.get(KEY),
        store.delete(KEY),
        store.find_by_prefix(KEY.tenant, [b"\x01" * 16], 8, now),
        store.begin_found_turn(KEY, 1, now),
    ]
    for op in ops:
        began = time.monotonic()
        with pytest.raises(StoreUnavailableError):
            await op
        assert time.monotonic() - began < within_s
    assert await store.ping() is False


def test_key_layout() -> None:
    rkey = conversation_key(ConversationKey("acme", "a:b{c}*"))
    assert rkey.startswith("pdgw:v2:{acme}:conv:") and len(rkey) == len("pdgw:v2:{acme}:conv:") + 32
    assert rkey != conversation_key(ConversationKey("acme", "a:b{c}"))
    assert rkey.startswith(tenant_prefix("acme"))  # one hash tag per tenant: one Cluster slot


def test_url_schemes() -> None:
    assert client_from_url("rediss://127.0.0.1:1/0").connection_pool.connection_class.__name__ == "SSLConnection"
    unix = client_from_url("unix:///tmp/x.sock").connection_pool.connection_class.__name__
    assert unix == "UnixDomainSocketConnection"
    sentinel = client_from_url("redis+sentinel://127.0.0.1:26379,127.0.0.1:26380/mymaster/2")
    assert sentinel.connection_pool.service_name == "mymaster"
    assert type(client_from_url("redis+cluster://127.0.0.1:7000")).__name__ == "RedisCluster"
    with pytest.raises(ValueError, match="scheme"):
        client_from_url("memcached://127.0.0.1:11211")


async def test_closed_port_is_unavailable() -> None:
    with socket.socket() as sock:  # bound, not listening: connections are refused
        sock.bind(("127.0.0.1", 0))
        store = RedisConversationStore.from_url(f"redis://127.0.0.1:{sock.getsockname()[1]}/0")
        await assert_unavailable(store, within_s=1.0)
        await store.close()


async def test_silent_server_times_out() -> None:
    with socket.socket() as sock:  # listening, never answering: connect succeeds, reads time out
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        store = RedisConversationStore.from_url(f"redis://127.0.0.1:{sock.getsockname()[1]}/0", op_timeout_s=0.1)
        await assert_unavailable(store, within_s=1.0)
        await store.close()


@integration
async def test_stopped_then_restarted_server() -> None:
    with RedisServer() as server:
        store = RedisConversationStore.from_url(server.url)
        assert await one_turn(store) == 1
        server.stop()
        await assert_unavailable(store, within_s=1.5)
        server.start()  # same port, empty, no cached scripts: the store reconnects and reloads them
        assert await one_turn(store) == 1
        assert await store.get(KEY) == (Conversation(model="m"), HANDLE, 1)
        await store.close()


def test_new_connections_share_one_driver_info(monkeypatch: pytest.MonkeyPatch) -> None:
    """redis-py reads its version from the installed metadata for each connection unless given one DriverInfo
    (milliseconds of the event loop per connection a burst of turns adds to the pool)."""
    client = client_from_url("redis://127.0.0.1:1/0")
    monkeypatch.setattr(redis.utils, "get_lib_version", lambda: pytest.fail("read redis-py's metadata"))
    first, second = (client.connection_pool.make_connection() for _ in range(2))
    assert first.driver_info is second.driver_info is not None


@integration
async def test_unix_socket(redis_server: RedisServer) -> None:
    store = RedisConversationStore.from_url(redis_server.unix_url)
    assert await store.ping()
    assert await one_turn(store, ConversationKey("unix", "s")) == 1
    await store.close()


@integration
async def test_each_operation_is_one_round_trip(clean_redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[bytes] = []
    original = Connection.send_packed_command

    async def counting(self, command, *args, **kwargs):
        sent.append(b"".join(command) if isinstance(command, list) else command)
        return await original(self, command, *args, **kwargs)

    store = RedisConversationStore.from_url(clean_redis_url)
    await one_turn(store)  # connects and loads the scripts (the others' too, below)
    await store.delete(ConversationKey("other", "s"))
    assert await store.find_by_prefix("other", [b"\x01" * 16], 4, 0.0) == []
    assert await store.begin_found_turn(ConversationKey("other", "s"), 1, 0.0) is None
    monkeypatch.setattr(Connection, "send_packed_command", counting)
    now = time.time()
    for op, command in [
        (store.begin_turn(KEY, now), b"EVALSHA"),
        (store.finish_turn(KEY, 2, HELD, HANDLE, now + 9, now), b"EVALSHA"),
        (store.get(KEY), b"HMGET"),
        (store.find_by_prefix(KEY.tenant, [b"\x01" * 16, b"\x02" * 16, b"\x03" * 16], 12, now), b"EVALSHA"),
        (store.begin_found_turn(KEY, 2, now), b"EVALSHA"),
        (store.delete(KEY), b"EVALSHA"),
    ]:
        sent.clear()
        await op
        assert len(sent) == 1 and command in sent[0], sent
    await store.close()


@integration
async def test_ttl_is_set_on_every_write(clean_redis_url: str) -> None:
    store = RedisConversationStore.from_url(clean_redis_url, conversation_ttl_s=1000)
    await one_turn(store)
    with redis.Redis.from_url(clean_redis_url) as admin:
        assert 990_000 < admin.pttl(conversation_key(KEY)) <= 1_000_000
    now = time.time()
    start = await store.begin_turn(KEY, now)
    assert await store.finish_turn(KEY, start.turn, HELD, HANDLE, now + 60, now)
    with redis.Redis.from_url(clean_redis_url) as admin:
        index_key = tenant_prefix(KEY.tenant).encode() + b"pfx:" + b"\x02" * 16
        assert admin.zscore(index_key, conversation_key(KEY).rpartition(":")[2]) == pytest.approx(now + 60)
        assert 990_000 < admin.pttl(index_key) <= 1_000_000
    await store.close()
