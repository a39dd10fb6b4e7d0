"""Each engine's KV events (docs/protocol.md §10), read from its ZMQ PUB socket into its `CacheIndex`
(`Engine.cache`): one SUB socket and one task per engine the `--kv-events` mapping covers (`kv_feeds.py` starts
and stops them as engines join and leave).

A message is [topic, seq (8 bytes big-endian), msgpack [ts, [events...], data_parallel_rank]]. vLLM 0.32 encodes
each event as a map tagged `"type"`; older versions (and vLLM's example subscriber) as a tagged array in field
order. Both are decoded. A message that does not decode counts as lost: the index then waits for the next
batch's number, as after a dropped connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from gateway.engines.cache_index import CacheIndex, Cleared, Event, Removed, Stored

log = logging.getLogger("gateway.kv_events")
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                  "lora_name", "extra_keys", "group_idx")     # BlockStored's order (kv_events.py:56-89)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class EventDecodeError(ValueError):
    """A batch that is not vLLM's KV events."""


def decode_batch(payload: bytes) -> list[Event]:
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise EventDecodeError(str(exc)) from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise EventDecodeError("not an event batch [ts, events, ...]")
    return [e for e in (decode_event(raw) for raw in batch[1]) if e is not None]


def decode_event(raw: Any) -> Event | None:
    """One event, map or tagged array; None for a kind this gateway does not use."""
    if isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = _STORED_FIELDS if kind == "BlockStored" else _REMOVED_FIELDS
        fields = dict(zip(names, raw[1:]))
    else:
        raise EventDecodeError(f"not an event: {type(raw).__name__}")
    try:
        if kind == "BlockStored":
            return _stored(fields)
        if kind == "BlockRemoved":
            return Removed(list(fields["block_hashes"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise EventDecodeError(f"{kind}: {exc}") from None
    return Cleared() if kind == "AllBlocksCleared" else None


def _stored(fields: dict[str, Any]) -> Stored:
    extra = fields.get("extra_keys") or []
    salted = fields.get("parent_block_hash") is None and bool(extra) and extra[0] not in (None, [], ())
    plain = (not salted and fields.get("lora_name") is None and fields.get("lora_id") is None
             and fields.get("group_idx") in (None, 0))
    return Stored(list(fields["block_hashes"]), fields.get("parent_block_hash"), list(fields["token_ids"]),
                  int(fields["block_size"]), plain)


class KVEventSubscriber:
    """One engine's events into its index, for as long as the task runs; ZMQ reconnects by itself, and a
    disconnect marks the index's knowledge unknown until the next batch's number says what was missed."""

    def __init__(self, url: str, endpoint: str, index: CacheIndex, ctx: zmq.asyncio.Context) -> None:
        self.url, self.endpoint, self.index = url, endpoint, index
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")        # every topic: the engine's own setting is not known here
        self.sock.setsockopt(zmq.LINGER, 0)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.connect(endpoint)

    async def run(self) -> None:
        watch = asyncio.create_task(self._watch())
        try:
            while True:
                self.receive(await self.sock.recv_multipart())
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch

    def close(self) -> None:
        """Its sockets closed: once its task has ended, which may be before it ever ran (cancelled at once)."""
        if not self.sock.closed:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
            self.sock.close(linger=0)

    def receive(self, parts: list[bytes]) -> None:
        try:
            if len(parts) != 3 or len(parts[1]) != 8:
                raise EventDecodeError(f"{len(parts)} parts, not [topic, seq, payload]")
            events = decode_batch(parts[2])
        except EventDecodeError as exc:
            log.warning("KV events of %s not understood (%s): its cache is unknown until the next batch",
                        self.url, exc)
            self.index.lost()
            return
        self.index.apply(int.from_bytes(parts[1], "big"), events)

    async def _watch(self) -> None:
        while True:
            await self.monitor.recv_multipart()
            log.info("KV events of %s: disconnected; its cache is unknown until the next batch", self.url)
            self.index.lost()
