"""KV cache events as vLLM 0.32 publishes them (`--kv-events-config`), docs/protocol.md §10.

The prefix cache's changes, batched per engine step and sent on a ZMQ PUB socket as the multipart message
[topic, seq as 8 bytes big-endian, msgpack(batch)] (vllm/distributed/kv_events.py:428-433). A batch is the
array [ts, [events...], data_parallel_rank] (EventBatch, array_like: kv_events.py:31-39); each event a map
tagged by its class name (`"type": "BlockStored"`: KVCacheEvent has tag=True but no array_like, :42-47).
- BlockStored: the hashes of blocks newly cached by one request, the hash of the block before them, the
  request's token ids of those blocks (full blocks only; v1/core/block_pool.py:261-346). Hashes are the low 64
  bits of the block hash, big-endian, as an int (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 by default:
  v1/core/kv_cache_utils.py:96-99).
- BlockRemoved: one event per evicted cached block (block_pool.py:611-624).
- AllBlocksCleared: a prefix-cache reset (block_pool.py:863-864).
An endpoint with `*`, `::`, ipc:// or inproc:// is bound, any other is connected to (kv_events.py:360-368).
The replay socket (`replay_endpoint`) is not simulated.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import zmq

_LOW_64 = (1 << 64) - 1


class KVEventsConfig(msgspec.Struct, kw_only=True, frozen=True):
    """vllm/config/kv_events.py's fields, as `--kv-events-config` JSON gives them."""
    enable_kv_cache_events: bool = False
    publisher: str | None = None          # None: "zmq" when enabled, else "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    pass


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def external_hash(block_hash: bytes) -> int:
    """A block hash as events carry it (kv_cache_utils.py:96-99)."""
    return int.from_bytes(block_hash, "big") & _LOW_64


def stored(hashes: list[bytes], parent: bytes | None, token_ids: list[int], block_size: int,
           salt: str | None) -> BlockStored:
    """One request's newly cached run of blocks. The cache salt is the first block's only extra key
    (kv_cache_utils.py generate_block_hash_extra_keys; published untagged by to_event_extra_keys)."""
    extra: list[tuple[Any, ...] | None] = [None] * len(hashes)
    if salt and parent is None:
        extra[0] = (salt,)
    return BlockStored([external_hash(h) for h in hashes], None if parent is None else external_hash(parent),
                       token_ids, block_size, None, "GPU", None, extra, 0, "full_attention")


def removed(block_hash: bytes) -> BlockRemoved:
    return BlockRemoved([external_hash(block_hash)], "GPU", 0)


class KVEventPublisher:
    """The events of one engine step go out as one batch: queued as the pool changes, sent when the event
    loop next runs (a step's changes are all made synchronously). PUB never blocks: past `hwm` queued
    messages ZMQ drops them, as vLLM's socket does."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        endpoint = config.endpoint
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(endpoint)
            endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)  # tcp://127.0.0.1:* : the port taken
        else:
            self._pub.connect(endpoint)
        self.endpoint = endpoint        # /sim/stats says it (tests bind loopback's port 0 this way)
        self._topic = config.topic.encode()
        self._seq = 0
        self._queued: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        self._scheduled = False
        self._encoder = msgspec.msgpack.Encoder()
        self.sent = 0

    def emit(self, event: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
        self._queued.append(event)
        if not self._scheduled:
            try:
                asyncio.get_running_loop().call_soon(self.flush)
                self._scheduled = True
            except RuntimeError:        # no loop (a synchronous caller): sent at the next flush
                pass

    def flush(self) -> None:
        self._scheduled = False
        if not self._queued:
            return
        batch, self._queued = EventBatch(time.time(), self._queued, 0), []
        payload = self._encoder.encode(batch)
        try:
            self._pub.send_multipart((self._topic, self._seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:               # over the high-water mark: dropped, the sequence number still spent
            pass
        self._seq += 1
        self.sent += 1

    def close(self) -> None:
        self.flush()
        self._pub.close(linger=100)
        self._ctx.term()
