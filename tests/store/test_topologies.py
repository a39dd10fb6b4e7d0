"""The Redis store behind Sentinel (with a real failover) and behind a Cluster, on real redis-server processes."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import redis

from gateway.store import Conversation, ConversationKey, RedisConversationStore, StoredResponse, StoreUnavailableError
from tests.redis_cluster import RedisCluster
from tests.redis_server import redis_server_path
from tests.servers import free_port, stop_process

pytestmark = pytest.mark.integration
HANDLE = {"remote_block_ids": [[1, 2, 3]], "remote_num_tokens": 40}
HELD = Conversation(model="m", block_size=4, held_tokens=8, block_hashes=b"\x01" * 16 + b"\x02" * 16)


@contextmanager
def redis_process(*args: str, config: str | None = None, port: int | None = None) -> Iterator[int]:
    """A redis-server (or sentinel, given a config) on a free port; stopped by PID."""
    port, folder = port or free_port(), Path(tempfile.mkdtemp(prefix="pdgw-topo-"))
    cmd = [redis_server_path()]
    if config is not None:
        (folder / "sentinel.conf").write_text(f"port {port}\nbind 127.0.0.1\n{config}")
        cmd += [str(folder / "sentinel.conf"), "--sentinel"]
    else:
        cmd += ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen([*cmd, "--dir", str(folder), *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: _pings(port))
        yield port
    finally:
        stop_process(proc)


def _pings(port: int) -> bool:
    try:
        return redis.Redis(port=port, socket_timeout=0.5).ping()
    except redis.RedisError:
        return False


def wait_for(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


async def one_turn(store: RedisConversationStore, session: str, *, tenant: str = "t",
                   record: Conversation = Conversation(model="m")) -> bool:
    key = ConversationKey(tenant, session)
    start = await store.begin_turn(key, time.time())
    return await store.finish_turn(key, start.turn, record, HANDLE, time.time() + 60, time.time())


def test_sentinel_follows_a_failover():
    with ExitStack() as stack:
        master = stack.enter_context(redis_process())
        stack.enter_context(redis_process("--replicaof", "127.0.0.1", str(master)))
        monitor = (f"sentinel monitor pdgw 127.0.0.1 {master} 1\nsentinel down-after-milliseconds pdgw 500\n"
                   "sentinel failover-timeout pdgw 2000\n")
        sentinel = stack.enter_context(redis_process(config=monitor))
        store = RedisConversationStore.from_url(f"redis+sentinel://127.0.0.1:{sentinel}/pdgw")

        async def scenario() -> None:
            assert await one_turn(store, "before")
            with contextlib.suppress(redis.ConnectionError):         # the master dies mid-reply
                redis.Redis(port=master).shutdown(nosave=True)
            served = False
            deadline = time.monotonic() + 20
            while not served and time.monotonic() < deadline:          # costs reuse, then works again
                try:
                    served = await one_turn(store, "after")
                except StoreUnavailableError:
                    await asyncio.sleep(0.2)
            assert served
            await store.close()

        asyncio.run(scenario())


def test_cluster_serves_the_store():
    with RedisCluster(masters=3) as cluster:
        store = RedisConversationStore.from_url(cluster.url)

        async def scenario() -> None:
            for i in range(12):                                         # keys spread over the three masters
                assert await one_turn(store, f"s{i}", tenant=f"t{i}")
                start = await store.begin_turn(ConversationKey(f"t{i}", f"s{i}"), time.time())
                assert start.handle == HANDLE and start.handle_state == "claimed"
            for i in range(12):                                         # index and records share a slot
                assert await one_turn(store, f"s{i}", tenant=f"t{i}", record=HELD)
                [found] = await store.find_by_prefix(f"t{i}", [b"\x01" * 16, b"\x02" * 16], 8, time.time())
                start = await store.begin_found_turn(found.key, found.turn, time.time())
                assert start is not None and start.handle == HANDLE and found.key.session == f"s{i}"
            for i in range(12):                                         # stored responses: MULTI on one key
                response = StoredResponse(session=f"s{i}", ids=b"\x01" * 8, messages=b"[]", body=b"{}")
                await store.put_response(f"t{i}", f"resp_{i}", response)
                assert await store.get_response(f"t{i}", f"resp_{i}") == response
                assert (await store.get_response(f"t{i}", f"resp_{i}", bulk=False)).ids == b""
            await store.close()

        asyncio.run(scenario())


def test_cluster_follows_a_failover():
    """A master crashes while turns run and its replica is elected: meanwhile the store's calls fail with
    StoreUnavailableError (never retried), and once elected they serve again on every master's keys, the client
    having found the new slot map, before the old master is back (and again after it rejoined)."""
    with RedisCluster(masters=3, replicas=1) as cluster:
        store = RedisConversationStore.from_url(cluster.url)       # its seed is the master that dies
        faults: list[str] = []

        async def traffic(stop: asyncio.Event) -> None:
            while not stop.is_set():
                try:
                    await one_turn(store, "busy", tenant="t0")
                except StoreUnavailableError as exc:
                    faults.append(str(exc))
                await asyncio.sleep(0.01)

        async def served(session: str, tenant: str) -> bool:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                with contextlib.suppress(StoreUnavailableError):
                    return await one_turn(store, session, tenant=tenant)
                await asyncio.sleep(0.1)
            return False

        async def scenario() -> None:
            for i in range(12):                                      # keys on every master
                assert await one_turn(store, f"s{i}", tenant=f"t{i}")
            stop = asyncio.Event()
            running = asyncio.create_task(traffic(stop))
            await asyncio.to_thread(cluster.fail_over, cluster.nodes[0])
            for i in range(12):
                assert await served(f"s{i}", f"t{i}"), f"t{i} not served after the failover"
            await asyncio.to_thread(cluster.rejoin, cluster.nodes[0])
            for i in range(12):
                assert await served(f"s{i}", f"t{i}"), f"t{i} not served after the old master rejoined"
            stop.set()
            await running
            assert faults, "the crash went unnoticed: the test did not exercise the failover"
            await store.close()

        asyncio.run(scenario())
