"""An engine's reads of another engine's KV (the holder named in `kv_transfer_params`): the read itself, timed
per block; the notification that frees the holder's blocks when nothing is read; the heartbeats that keep a
P's lease alive while the request waits. It works on its engine's current pool, settings and counters (a reset
swaps them)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Protocol

from gateway.sim.blocks import GARBAGE, Slot
from gateway.sim.failures import KVLoadError, KVLoadParked
from gateway.sim.kvload import KVSource, load_plan
from gateway.sim.nixl import NixlStats
from gateway.sim.settings import SimSettings
from gateway.sim.stats import SimStats
from gateway.sim.kv_reader import HolderAddress, KVClient, TransferError


class Reads(Protocol):
    """What a reader uses of its engine, read afresh on every call."""
    settings: SimSettings
    stats: SimStats
    bs: int
    kv: KVClient
    nixl: NixlStats


class KVReader:
    def __init__(self, engine: Reads) -> None:
        self.engine = engine

    async def load(self, prompt_len: int, source: KVSource | None, cached: int) -> dict[int, Slot]:
        """KV for prompt positions read from the holder, by position; empty when nothing is read."""
        if source is None:
            return {}
        e = self.engine
        s, stats, bs = e.settings, e.stats, e.bs
        # vLLM 0.32 skips short reads only when P reads D's blocks; D reads P's whatever their length
        # (nixl/pull_scheduler.py:59-65 against :90-102; tests/vllm/test_local.py)
        threshold = s.recompute_threshold if s.role == "prefill" else 0
        plan = load_plan(source, prompt_len, cached, bs, threshold, margin_s=s.expiry_margin_s)
        if plan.declined:
            stats.kv_reads_declined += 1
            if s.kv_load_failure_policy == "recompute":
                stats.requests_parked += 1
                raise KVLoadParked(source.holder.request_id)
            return self.failed(f"handle {source.holder.request_id} expires within the margin")
        if not plan.block_ids:
            stats.kv_reads_skipped += 1
            await self.notify(source)
            return {}
        began = time.perf_counter()
        with e.waiting_meanwhile(deferred=True):   # WAITING_FOR_REMOTE_KVS: waiting in vLLM's counts
            try:
                blocks = await e.kv.read(source.holder, plan.block_ids)
            except TransferError as exc:
                stats.kv_load_failures += 1
                return self.failed(str(exc))
            if s.transfer_ms_per_block or s.transfer_ms_per_read:
                await asyncio.sleep((s.transfer_ms_per_read + len(blocks) * s.transfer_ms_per_block) / 1000)
        stats.kv_reads_total += 1
        stats.kv_blocks_read += len(blocks)
        e.nixl.transfer(time.perf_counter() - began, len(blocks), bs)     # the reader records it (vLLM)
        blocks = [[]] * plan.missing + blocks  # a handle shorter than needed: the head reads garbage
        out = {}
        for p in range(cached, plan.end):
            block = blocks[p // bs - plan.first_block]
            j = p % bs
            out[p] = block[j] if j < len(block) else GARBAGE
        return out

    def failed(self, why: str) -> dict[int, Slot]:
        if self.engine.settings.kv_load_failure_policy == "fail":
            raise KVLoadError(why)
        return {}  # recompute: the whole uncached prompt is prefilled locally

    async def notify(self, source: KVSource) -> None:
        try:
            await self.engine.kv.notify(source.holder)
            self.engine.stats.notifications_sent += 1
        except TransferError:
            pass  # the holder's lease or pin will run out instead

    async def heartbeat(self, holder: HolderAddress) -> None:
        with contextlib.suppress(TransferError):
            await self.engine.kv.heartbeat(holder)
            self.engine.stats.heartbeats_sent += 1

    async def heartbeats(self, holder: HolderAddress) -> None:
        """From arrival until the read (or P's write), keep P's lease alive (queued for a seat or blocks too):
        every sixth of the reader's own lease (nixl/base_scheduler.py:88)."""
        period = max(0.2, self.engine.settings.kv_lease_duration / 6)
        while True:
            await asyncio.sleep(period)
            await self.heartbeat(holder)
