"""One simulated vLLM engine: queueing, prefix cache, KV loads from a holder, decode, and the end of a request.

A request's life: `admit` (queue for a running slot, then prefill: local cache hit, KV read from the
holder named in `kv_transfer_params`, local compute of the rest, oracle check), `decode` (the answer's
tokens, timed), then exactly one of `finish` (lease or pin the blocks and return a handle) or `abort`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, AsyncIterator

import msgspec

from gateway.sim.blocks import GARBAGE, BlockPool, PoolExhaustedError, Slot, block_hashes
from gateway.sim.generate import Answer, Model, context_digest
from gateway.sim.tools import ToolSpec
from gateway.sim.handles import HandleTable
from gateway.sim.kvload import KVSource, load_plan, parks
from gateway.sim.nixl import NixlStats
from gateway.sim.render import Renderer
from gateway.sim.settings import SimSettings
from gateway.sim.stats import SimStats
from gateway.sim.transfer import KVClient, TransferError
from gateway.sim.waiting import BlockQueue, Grant

EXPIRY_TICK_S = 0.2


class KVLoadError(Exception):
    """A KV load failed (or was declined) under `kv_load_failure_policy: fail`."""


class KVLoadParked(Exception):
    """A P's read of D's blocks was declined (expiry margin) under `recompute`: real vLLM 0.32 never schedules
    the request again; it waits until the client goes away (docs/vllm-findings.md)."""


@dataclass
class EngineRequest:
    request_id: str  # internal id: what handles carry
    prompt: list[int]
    max_tokens: int
    kv_params: dict[str, Any] | None = None
    cache_salt: str | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    seed: int | None = None
    stop: list[str] | None = None
    tools: ToolSpec | None = None        # what the request lets the model call
    schema: dict[str, Any] | None = None  # response_format: the JSON schema the answer follows (structured.py)


@dataclass
class Running:
    req: EngineRequest
    table: list[int]  # block ids, in position order
    num_hits: int  # leading blocks that came from the local prefix cache
    answer: Answer
    digest: bytes = b""     # the effective context's digest: the answer's, and its logprobs', seed
    done: bool = field(default=False)


class Engine:
    def __init__(self, settings: SimSettings, renderer: Renderer) -> None:
        self.settings = settings
        self.bs = settings.block_size
        self.stats = SimStats()
        self.nixl = NixlStats()
        self.pool = BlockPool(settings.num_blocks, settings.block_size, caching=settings.prefix_caching)
        self.handles = HandleTable(self.pool, self.stats)
        self.block_queue = BlockQueue(self.pool, self.stats)
        self.model = Model(renderer, output_tokens=settings.output_tokens, canonical=settings.canonical,
                           reasoning=settings.reasoning, tool_call_rate=settings.tool_call_rate,
                           tool_call_style=settings.tool_call_style)
        self.kv = KVClient(settings.engine_id, settings.block_size)
        self.running = 0
        self.waiting = 0
        self._seats = asyncio.Semaphore(settings.max_num_seqs)
        self._ticker: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        await self.kv.start()
        self._ticker = asyncio.create_task(self._expire_forever())

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        await self.kv.close()

    def reset(self, num_blocks: int | None = None) -> None:
        """Forget handles, cache and counters; with `num_blocks`, also resize the KV pool (benchmarks sweep it).
        Only between runs: a request in flight would keep blocks of the old pool."""
        self.handles.clear()
        self.pool.reset_cache()
        self.stats = SimStats()
        self.nixl = NixlStats()
        if num_blocks is not None and num_blocks != self.settings.num_blocks:
            self.settings = msgspec.structs.replace(self.settings, num_blocks=num_blocks)
            self.pool = BlockPool(num_blocks, self.bs, caching=self.settings.prefix_caching)
            self.handles = HandleTable(self.pool, self.stats)
            self.block_queue = BlockQueue(self.pool, self.stats)
        self.handles.stats = self.block_queue.stats = self.stats

    # -- the request's life ---------------------------------------------------------------------------
    def source(self, params: dict[str, Any] | None) -> KVSource | None:
        return KVSource.from_params(params, self.settings)

    def parks(self, params: dict[str, Any] | None) -> bool:
        return parks(params, self.settings)

    async def admit(self, req: EngineRequest) -> Running:
        self.stats.requests_total += 1
        source = self.source(req.kv_params)
        beats = None
        if source is not None and source.heartbeat:
            self._spawn(self._heartbeat(source))  # on arrival, then while queued
            beats = asyncio.create_task(self._heartbeats(source))
        self.waiting += 1
        try:
            await self._seats.acquire()
        except asyncio.CancelledError:
            if beats is not None:
                beats.cancel()
            if source is not None:  # dropped before reading: tell the holder to free its blocks
                self._spawn(self._notify(source))
            raise
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            # Heartbeats go on until the KV has been read: waiting for free blocks is waiting too.
            return await self._prefill(req, source)
        except BaseException:
            self._leave(failed=True)
            raise
        finally:
            if beats is not None:
                beats.cancel()

    async def decode(self, run: Running) -> AsyncIterator[int]:
        for token in run.answer.token_ids:
            if self.settings.decode_ms_per_token:
                await asyncio.sleep(self.settings.decode_ms_per_token / 1000)
            self.stats.generation_tokens += 1
            yield token

    def finish(self, run: Running) -> dict[str, Any] | None:
        """A normal end (stop or length): cache the blocks, then lease (P) or pin (D) them behind a handle."""
        run.done = True
        self._leave()
        params, prompt = run.req.kv_params, run.req.prompt
        kv_len = len(prompt) + len(run.answer.token_ids) - 1  # the last sampled token has no KV
        if not self._extend(run, kv_len):
            self.stats.holds_skipped_no_blocks += 1
            self.pool.release(run.table)
            return None
        if self.settings.role == "prefill" and params and params.get("do_remote_decode"):
            return self._hold(run, len(prompt), self.settings.kv_lease_duration, "lease")
        if self.settings.role == "decode" and self.settings.bidirectional and params is not None:
            return self._hold(run, kv_len, self.settings.decoder_kv_blocks_ttl, "pin")
        self.pool.release(run.table)
        return None

    def abort(self, run: Running, *, failed: bool = False) -> None:
        """Client gone or request failed: free everything at once, no handle."""
        if run.done:
            return
        run.done = True
        self._leave(failed=failed, aborted=not failed)
        self.pool.release(run.table)

    # -- prefill ----------------------------------------------------------------------------------------
    async def _prefill(self, req: EngineRequest, source: KVSource | None) -> Running:
        prompt, bs = req.prompt, self.bs
        hashes = block_hashes(prompt, bs, req.cache_salt)
        table, num_hits = await self._allocate(prompt, hashes)
        hits = table[:num_hits]
        cached = num_hits * bs
        try:
            loaded = await self._load(req, source, cached)
        except BaseException:
            self.pool.release(table)
            raise
        for p in range(cached, len(prompt)):
            self.pool.blocks[table[p // bs]].slots.append(loaded.get(p, (prompt[p], p)))
        for i in range(len(hits), len(hashes)):
            self.pool.commit(table[i], hashes[i])
        computed = len(prompt) - cached - len(loaded)
        self.stats.prompt_tokens_cached += cached
        self.stats.prompt_tokens_loaded += len(loaded)
        self.stats.prompt_tokens_computed += computed
        if self.settings.prefill_ms_per_token and computed:
            await asyncio.sleep(computed * self.settings.prefill_ms_per_token / 1000)
        slots = self._check(prompt, table)
        digest = context_digest(slots)
        answer = self.model.answer(digest, seed=req.seed, max_tokens=req.max_tokens,
                                   min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, stop=req.stop,
                                   tools=req.tools, schema=req.schema)
        table, num_hits = await self._with_answer_blocks(req, table, num_hits, hashes, len(answer.token_ids))
        return Running(req, table, num_hits, answer, digest)

    async def _with_answer_blocks(self, req: EngineRequest, table: list[int], num_hits: int, hashes: list[bytes],
                                  answer_len: int) -> Grant:
        """Blocks for the answer's KV too, taken before decoding (vLLM takes them step by step, running requests
        before waiting ones). None free: the request is preempted as vLLM does it, by recompute: its blocks go
        back (its prompt's stay in the prefix cache), it waits at the head of the queue for prompt and answer
        blocks together, and recomputes locally whatever the cache lost meanwhile. Owns `table`: on any
        failure it releases what it holds."""
        prompt, bs = req.prompt, self.bs
        total = -(-(len(prompt) + answer_len - 1) // bs)
        extra = total - len(table)
        if extra <= 0 or total > len(self.pool.blocks):
            return table, num_hits                  # nothing to add, or never fits: no handle at the finish
        if extra <= self.pool.num_free:
            return table + self.pool.allocate(extra), num_hits
        self.stats.requests_preempted += 1
        table, num_hits = await self._queued(self._attempt(prompt, hashes, total), first=True, giving_back=table)
        try:
            recomputed = 0
            for i in range(num_hits, -(-len(prompt) // bs)):
                block = self.pool.blocks[table[i]]
                block.slots = [(prompt[p], p) for p in range(i * bs, min((i + 1) * bs, len(prompt)))]
                recomputed += len(block.slots)
                if i < len(hashes):
                    self.pool.commit(table[i], hashes[i])
            self.stats.prompt_tokens_computed += recomputed
            if self.settings.prefill_ms_per_token and recomputed:
                await asyncio.sleep(recomputed * self.settings.prefill_ms_per_token / 1000)
        except BaseException:
            self.pool.release(table)
            raise
        return table, num_hits

    def _attempt(self, prompt: list[int], hashes: list[bytes], total: int) -> Callable[[], Grant | None]:
        """Take `total` blocks for the request, its prefix-cache hits first, if they fit now; else take nothing."""
        def attempt() -> Grant | None:
            hits = self.pool.match_prefix(hashes)[: (len(prompt) - 1) // self.bs]  # the last token is computed
            fresh = total - len(hits)
            if not self.pool.can_take(hits, fresh):
                return None
            self.pool.touch(hits)
            return hits + self.pool.allocate(fresh), len(hits)
        return attempt

    async def _allocate(self, prompt: list[int], hashes: list[bytes]) -> Grant:
        """The prompt's blocks (prefix-cache hits, then fresh ones). When they do not fit the request waits."""
        total = -(-len(prompt) // self.bs)
        if total > len(self.pool.blocks):
            raise PoolExhaustedError(f"the prompt needs {total} KV blocks, the engine has {len(self.pool.blocks)}")
        attempt = self._attempt(prompt, hashes, total)
        return self.block_queue.try_now(attempt) or await self._queued(attempt)

    async def _queued(self, attempt: Callable[[], Grant | None], *, first: bool = False,
                      giving_back: list[int] | None = None) -> Grant:
        """Wait in the queue, counted as waiting, not running, as vLLM's scheduler keeps it in its waiting queue."""
        self.running, self.waiting = self.running - 1, self.waiting + 1
        try:
            return await self.block_queue.wait(attempt, first=first, giving_back=giving_back)
        finally:
            self.running, self.waiting = self.running + 1, self.waiting - 1

    async def _load(self, req: EngineRequest, source: KVSource | None, cached: int) -> dict[int, Slot]:
        """KV for prompt positions read from the holder, by position; empty when nothing is read."""
        if source is None:
            return {}
        plan = load_plan(source, len(req.prompt), cached, self.bs, self.settings.recompute_threshold,
                         margin_s=self.settings.expiry_margin_s)
        if plan.declined:
            self.stats.kv_reads_declined += 1
            if self.settings.kv_load_failure_policy == "recompute":
                self.stats.requests_parked += 1
                raise KVLoadParked(source.holder.request_id)
            return self._load_failed(f"handle {source.holder.request_id} expires within the margin")
        if not plan.block_ids:
            self.stats.kv_reads_skipped += 1
            await self._notify(source)
            return {}
        began = time.perf_counter()
        try:
            blocks = await self.kv.read(source.holder, plan.block_ids)
        except TransferError as exc:
            self.stats.kv_load_failures += 1
            return self._load_failed(str(exc))
        self.stats.kv_reads_total += 1
        self.stats.kv_blocks_read += len(blocks)
        if self.settings.transfer_ms_per_block:
            await asyncio.sleep(len(blocks) * self.settings.transfer_ms_per_block / 1000)
        self.nixl.transfer(time.perf_counter() - began, len(blocks), self.bs)   # the reader records it (vLLM)
        blocks = [[]] * plan.missing + blocks  # a handle shorter than needed: the head reads garbage
        out = {}
        for p in range(cached, plan.end):
            block = blocks[p // self.bs - plan.first_block]
            j = p % self.bs
            out[p] = block[j] if j < len(block) else GARBAGE
        return out

    def _load_failed(self, why: str) -> dict[int, Slot]:
        if self.settings.kv_load_failure_policy == "fail":
            raise KVLoadError(why)
        return {}  # recompute: the whole uncached prompt is prefilled locally

    def _check(self, prompt: list[int], table: list[int]) -> list[Slot]:
        """The oracle: every slot used must hold this prompt's token at its position. Returns the slots."""
        slots, bad = [], 0
        for b, block_id in enumerate(table):
            want = [(prompt[p], p) for p in range(b * self.bs, min((b + 1) * self.bs, len(prompt)))]
            got = self.pool.blocks[block_id].slots[: len(want)]
            bad += got != want
            slots += got
        self.stats.kv_reads_corrupt += bad
        self.stats.requests_corrupt += bad > 0
        return slots

    # -- the end ----------------------------------------------------------------------------------------
    def _extend(self, run: Running, kv_len: int) -> bool:
        """Write the output tokens' KV after the prompt's and cache the full blocks, as vLLM caches decode."""
        seq = run.req.prompt + run.answer.token_ids
        need = -(-kv_len // self.bs) - len(run.table)
        if need > 0:
            if need > self.pool.num_free:
                return False
            run.table += self.pool.allocate(need)
        for p in range(len(run.req.prompt), kv_len):
            self.pool.blocks[run.table[p // self.bs]].slots.append((seq[p], p))
        hashes = block_hashes(seq[:kv_len], self.bs, run.req.cache_salt)
        for i in range(run.num_hits, len(hashes)):
            self.pool.commit(run.table[i], hashes[i])
        return True

    def _hold(self, run: Running, num_tokens: int, ttl: float, kind: str) -> dict[str, Any]:
        n = -(-num_tokens // self.bs)
        held, rest = run.table[:n], run.table[n:]
        self.pool.release(rest)
        rid = run.req.request_id
        expires_at = self.handles.hold(rid, held, ttl, kind)  # type: ignore[arg-type]
        s = self.settings
        common = {"remote_block_ids": [held], "remote_engine_id": s.engine_id, "remote_request_id": rid,
                  "remote_host": s.host, "remote_port": s.port, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
                  "remote_num_tokens": num_tokens}
        if kind == "lease":
            self.stats.handles_leased += 1
            return {"do_remote_prefill": True, "do_remote_decode": False, **common,
                    "remote_prefill_cached_tokens": run.num_hits * self.bs, "transfer_mode": "pull"}
        self.stats.handles_pinned_total += 1
        return {"do_remote_decode": True, "do_remote_prefill": False, **common,
                "remote_blocks_expiry_time": expires_at, "transfer_mode": "pull"}

    def _leave(self, *, failed: bool = False, aborted: bool = False) -> None:
        self.running -= 1
        self._seats.release()
        self.stats.requests_failed += failed
        self.stats.requests_aborted += aborted

    # -- talking to holders -----------------------------------------------------------------------------
    async def _notify(self, source: KVSource) -> None:
        try:
            await self.kv.notify(source.holder)
            self.stats.notifications_sent += 1
        except TransferError:
            pass  # the holder's lease or pin will run out instead

    async def _heartbeat(self, source: KVSource) -> None:
        with contextlib.suppress(TransferError):
            await self.kv.heartbeat(source.holder)
            self.stats.heartbeats_sent += 1

    async def _heartbeats(self, source: KVSource) -> None:
        """From arrival until the read, keep P's lease alive (queued for a seat or for free blocks)."""
        period = max(0.2, self.settings.kv_lease_duration / 3)
        while True:
            await asyncio.sleep(period)
            await self._heartbeat(source)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)  # keep a reference until done
        task.add_done_callback(self._tasks.discard)

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_TICK_S)
            self.handles.expire()
