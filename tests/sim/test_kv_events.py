"""The simulator's KV events, read as vLLM 0.32's are (docs/protocol.md §10): a real ZMQ SUB socket on loopback,
multipart [topic, seq, msgpack batch], BlockStored chained across turns by parent hash, full blocks only, D
announcing the blocks it read from P, BlockRemoved on eviction, AllBlocksCleared on a reset."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from tests.servers import Server
from tests.sim.conftest import Sims, assistant, long_text, running, user

pytestmark = pytest.mark.integration
BS = 16
CONFIG = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
                     "topic": "kv"})


class Subscriber:
    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.sock.connect(endpoint)
        self.seqs: list[int] = []

    def events(self, timeout_s: float = 2.0) -> list[dict]:
        """Every event that arrives within `timeout_s` of the last one."""
        out: list[dict] = []
        while self.sock.poll(int(timeout_s * 1000)):
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == b"kv"
            self.seqs.append(int.from_bytes(seq, "big"))
            ts, events, rank = msgspec.msgpack.decode(payload)
            assert isinstance(ts, float) and rank == 0
            out += events
            timeout_s = 0.3
        return out

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture()
def pd() -> Iterator[tuple[Server, Server]]:
    with running("--role", "prefill", "--kv-events-config", CONFIG) as p, \
            running("--role", "decode", "--num-blocks", "24", "--kv-events-config", CONFIG) as d:
        yield p, d


def _subscribe(sims: Sims, server: Server) -> Subscriber:
    sub = Subscriber(sims.stats(server)["kv_events_endpoint"])
    time.sleep(0.3)          # ZMQ's slow joiner: the subscription reaches the publisher
    return sub


def test_d_announces_read_blocks_then_each_turn_continues_the_chain(sims: Sims, pd: tuple[Server, Server]) -> None:
    p, d = pd
    sub = _subscribe(sims, d)
    try:
        m1 = [user(long_text(40))]
        r1 = sims.turn(p, d, m1)
        first = [e for e in sub.events() if e["type"] == "BlockStored"]
        prompt = r1["prompt_token_ids"]
        assert first and first[0]["parent_block_hash"] is None
        announced = [t for e in first for t in e["token_ids"]]
        held = r1["kv_transfer_params"]["remote_num_tokens"]
        assert len(announced) == held // BS * BS           # full blocks only: prompt + answer - 1, cut
        assert announced[:len(prompt) // BS * BS] == prompt[:len(prompt) // BS * BS]
        assert all(e["block_size"] == BS and e["medium"] == "GPU" and len(e["token_ids"]) == BS *
                   len(e["block_hashes"]) for e in first)
        last_hash = first[-1]["block_hashes"][-1]
        m2 = m1 + [assistant(r1), user(long_text(20, "b"))]
        sims.turn(p, d, m2, r1["kv_transfer_params"])
        second = [e for e in sub.events() if e["type"] == "BlockStored"]
        assert second[0]["parent_block_hash"] == last_hash  # the chain continues across turns
        assert sub.seqs == list(range(sub.seqs[0], sub.seqs[0] + len(sub.seqs)))
    finally:
        sub.close()


def test_eviction_and_reset_are_announced(sims: Sims, pd: tuple[Server, Server]) -> None:
    _, d = pd
    sub = _subscribe(sims, d)
    try:
        stored: set[int] = set()
        for i in range(6):      # 24 blocks: later prompts evict earlier ones' cached blocks (no pins: plain)
            sims.chat(d, [user(long_text(40, f"c{i}"))], max_tokens=4)
        events = sub.events()
        for e in events:
            if e["type"] == "BlockStored":
                stored.update(e["block_hashes"])
        removed = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
        assert removed and set(removed) <= stored
        sims.reset(d)
        assert [e["type"] for e in sub.events()] == ["AllBlocksCleared"]
    finally:
        sub.close()
