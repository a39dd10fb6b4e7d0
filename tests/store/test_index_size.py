"""What the prefix index costs in Redis, measured with a real server (INFO used_memory over many
conversations, and MEMORY USAGE of one index key): the figures in docs/operations.md come from here."""

from __future__ import annotations

import time
import uuid

import pytest
import redis

from gateway.store import Conversation, ConversationKey, RedisConversationStore

pytestmark = pytest.mark.integration

CONVERSATIONS = 2_000
TOKENS, BLOCK = 1_000, 16


def record(i: int) -> Conversation:
    """A 1,000-token conversation whose blocks are its own (no two share an index entry)."""
    blocks = TOKENS // BLOCK
    hashes = b"".join(i.to_bytes(8, "little") + b.to_bytes(8, "little") for b in range(blocks))
    return Conversation(decode_engine="http://decode-0:8000", prefill_engine="http://prefill-0:8000", model="m",
                        block_size=BLOCK, num_tokens=TOKENS, held_tokens=TOKENS - 1, block_hashes=hashes,
                        prefix_hash=b"\xcd" * 16, created_at=1.8e9, updated_at=1.8e9)


HANDLE = {"do_remote_decode": True, "remote_block_ids": [list(range(63))], "remote_engine_id": "decode-0",
          "remote_request_id": "chatcmpl-" + "x" * 40, "remote_host": "10.0.0.7", "remote_port": 5600,
          "remote_num_tokens": TOKENS - 1, "remote_blocks_expiry_time": 1234.5, "tp_size": 1}


async def used_memory_per_conversation(url: str, *, indexed: bool, same_tokens: bool = False) -> float:
    with redis.Redis.from_url(url) as admin:
        admin.flushall()
        before = admin.info("memory")["used_memory"]
    store = RedisConversationStore.from_url(url)
    now = time.time()
    for i in range(CONVERSATIONS):
        key = ConversationKey("acme", str(uuid.uuid4()))      # a generated session key's length
        start = await store.begin_turn(key, now)
        # A handle that is already dead is stored but not indexed: the same hash, without the index.
        expires = now + 450 if indexed else now - 1
        assert await store.finish_turn(key, start.turn, record(0 if same_tokens else i), HANDLE, expires, now)
    await store.close()
    with redis.Redis.from_url(url) as admin:
        return (admin.info("memory")["used_memory"] - before) / CONVERSATIONS


async def test_index_bytes_per_conversation(clean_redis_url: str) -> None:
    plain = await used_memory_per_conversation(clean_redis_url, indexed=False)
    indexed = await used_memory_per_conversation(clean_redis_url, indexed=True)
    shared = await used_memory_per_conversation(clean_redis_url, indexed=True, same_tokens=True)
    with redis.Redis.from_url(clean_redis_url) as admin:
        [index_key] = admin.keys(b"pdgw:v2:{acme}:pfx:*")
        one_key = admin.memory_usage(index_key, samples=0) / CONVERSATIONS
        conv = admin.keys(b"pdgw:v2:{acme}:conv:*")[0]
        with_fields = admin.memory_usage(conv, samples=0)
        admin.hdel(conv, "session", "held", "indexed")                 # what v1 kept
        lookup_fields = with_fields - admin.memory_usage(conv, samples=0)
    print(f"index: conversation_bytes={plain:.0f} index_bytes_own_entry={indexed - plain:.0f} "
          f"index_bytes_shared_entry={shared - plain:.0f} shared_key_bytes_per_member={one_key:.0f} "
          f"session_held_indexed_fields_bytes={lookup_fields}")
    assert indexed - plain < 500      # one small sorted set per conversation with tokens of its own
    assert shared - plain < 400       # identical conversations share one set
