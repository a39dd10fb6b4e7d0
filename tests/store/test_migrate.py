"""Migrations against a real redis-server: recorded, idempotent, only new ones applied, in order."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from gateway.store import Conversation, ConversationKey, RedisConversationStore
from gateway.store.codec import encode_handle, encode_record
from gateway.store.migrate import (
    DEFAULT_DIRECTORY,
    MIGRATIONS_KEY,
    SCHEMA_VERSION_KEY,
    apply_migrations,
    load_migrations,
    schema_version,
)
from gateway.store.redis_store import conversation_key

pytestmark = pytest.mark.integration

# Each test migration counts its runs in `test:runs`, so a second run of `up` would show.
MIGRATION = '''
VERSION = {version}
DESCRIPTION = "test migration {version}"

async def up(redis) -> None:
    {body}
    await redis.hincrby("test:runs", str(VERSION), 1)
'''


def write(directory: Path, version: int, body: str = "pass") -> None:
    (directory / f"{version:04d}_step{version}.py").write_text(MIGRATION.format(version=version, body=body))


async def test_only_new_migrations_are_applied(tmp_path: Path, clean_redis_url: str) -> None:
    write(tmp_path, 2)
    write(tmp_path, 1)
    (tmp_path / "README.md").write_text("not a migration")
    assert await apply_migrations(clean_redis_url, tmp_path) == [1, 2]
    assert await apply_migrations(clean_redis_url, tmp_path) == []
    write(tmp_path, 3)
    assert await apply_migrations(clean_redis_url, tmp_path) == [3]
    with redis.Redis.from_url(clean_redis_url) as client:
        assert client.hgetall("test:runs") == {b"1": b"1", b"2": b"1", b"3": b"1"}
        assert sorted(client.hkeys(MIGRATIONS_KEY)) == [b"1", b"2", b"3"]
        assert client.get(SCHEMA_VERSION_KEY) == b"3"
    assert await schema_version(clean_redis_url) == 3


async def test_a_failed_migration_stops_the_run_and_is_retried(tmp_path: Path, clean_redis_url: str) -> None:
    write(tmp_path, 1)
    write(tmp_path, 2, body="raise RuntimeError('boom')")
    write(tmp_path, 3)
    with pytest.raises(RuntimeError, match="boom"):
        await apply_migrations(clean_redis_url, tmp_path)
    assert await schema_version(clean_redis_url) == 1
    write(tmp_path, 2)
    assert await apply_migrations(clean_redis_url, tmp_path) == [2, 3]
    assert await schema_version(clean_redis_url) == 3


async def test_repository_migrations_apply(clean_redis_url: str) -> None:
    assert [m.version for m in load_migrations(DEFAULT_DIRECTORY)][0] == 1
    assert await schema_version(clean_redis_url) == 0
    assert (await apply_migrations(clean_redis_url))[0] == 1
    assert await apply_migrations(clean_redis_url) == []
    assert await schema_version(clean_redis_url) >= 1


async def test_v1_conversations_move_to_v2(clean_redis_url: str) -> None:
    """A conversation stored under layout v1 keeps its record, handle, counters and TTL under v2, and a v2
    store then claims its handle as usual (it joins the prefix index on its next turn)."""
    key = ConversationKey("acme", "s-1")
    digest = conversation_key(key).rpartition(":")[2]
    record, handle, now = Conversation(model="m", held_tokens=7), {"remote_num_tokens": 7}, time.time()
    with redis.Redis.from_url(clean_redis_url) as client:
        client.hset(f"pdgw:v1:conv:acme:{digest}", mapping={
            "record": encode_record(record), "handle": encode_handle(handle),
            "handle_expires_at": repr(now + 60), "started": 3, "finished": 3, "started_at": repr(now)})
        client.pexpire(f"pdgw:v1:conv:acme:{digest}", 500_000)
    await apply_migrations(clean_redis_url)
    with redis.Redis.from_url(clean_redis_url) as client:
        assert client.keys("pdgw:v1:*") == []
        assert 490_000 < client.pttl(conversation_key(key)) <= 500_000
    store = RedisConversationStore.from_url(clean_redis_url)
    start = await store.begin_turn(key, now)
    assert (start.turn, start.record, start.handle, start.handle_state) == (4, record, handle, "claimed")
    await store.close()
    assert await apply_migrations(clean_redis_url) == []


@pytest.mark.parametrize("name, text, error", [
    ("0002_x.py", MIGRATION.format(version=3, body="pass"), "VERSION must be 2"),
    ("0002_x.py", "VERSION = 2\nasync def up(redis): pass\n", "DESCRIPTION"),
    ("0002_x.py", "VERSION = 2\nDESCRIPTION = ''\ndef up(redis): pass\n", "async def up"),
])
def test_malformed_migrations_are_refused(tmp_path: Path, name: str, text: str, error: str) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=error):
        load_migrations(tmp_path)
