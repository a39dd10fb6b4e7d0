"""One simulated vLLM engine: queueing, prefix cache, KV loads from a holder, decode, and the end of a request.

A request's life: `admit` (queue for a running slot, then prefill: local cache hit, KV read from the holder named
in `kv_transfer_params` (reading.py) or in push mode written by P (push.py), local compute of the rest, oracle
check), `decode` (the answer's tokens, timed), then exactly one of `finish` (lease or pin the blocks and return a
handle: holding.py) or `abort`.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Iterator

import msgspec

from gateway.sim.allocation import Allocator
from gateway.sim.blocks import BlockPool, Slot, block_hashes
from gateway.sim.failures import RequestFailed
from gateway.sim.generate import Model, context_digest
from gateway.sim.handles import HandleTable
from gateway.sim.holding import Holding
from gateway.sim.kvevents import KVEventPublisher
from gateway.sim.kvload import KVSource, parks
from gateway.sim.nixl import NixlStats
from gateway.sim.push import PushReceiver, PushSender
from gateway.sim.reading import KVReader
from gateway.sim.chat_render import Renderer
from gateway.sim.engine_request import EngineRequest, Running
from gateway.sim.settings import SimSettings
from gateway.sim.stats import SimStats
from gateway.sim.steps import Steps
from gateway.sim.kv_reader import KVClient
from gateway.sim.waiting import BlockQueue

EXPIRY_TICK_S = 0.2


class Engine:
    def __init__(self, settings: SimSettings, renderer: Renderer) -> None:
        self.settings = settings
        self.bs = settings.block_size
        self.stats = SimStats()
        self.nixl = NixlStats()
        events = settings.kv_events
        self.events = KVEventPublisher(events) if events is not None and events.publishes else None
        self.pool = BlockPool(settings.num_blocks, settings.block_size, caching=settings.prefix_caching,
                              events=self.events)
        self.handles = HandleTable(self.pool, self.stats)
        self.block_queue = BlockQueue(self.pool, self.stats)
        self.model = Model(renderer, output_tokens=settings.output_tokens, canonical=settings.canonical,
                           reasoning=settings.reasoning, tool_call_rate=settings.tool_call_rate,
                           tool_call_style=settings.tool_call_style)
        self.kv = KVClient(settings.engine_id, settings.block_size)
        self.reader = KVReader(self)
        self.push_sender = PushSender(self)
        self.push_receiver = PushReceiver(self)
        self.allocator = Allocator(self)
        self.holding = Holding(self)
        self.steps = Steps(self)
        self.running = 0
        self.waiting = 0
        self.deferred = 0               # of the waiting: those waiting for a KV transfer
        self.dead: str | None = None    # vLLM's engine core died (a push leg it could not read): nothing serves
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
        if self.events is not None:
            self.events.close()

    def reset(self, num_blocks: int | None = None) -> None:
        """Forget handles, cache and counters; with `num_blocks`, also resize the KV pool (benchmarks sweep it).
        Only between runs: a request in flight would keep blocks of the old pool."""
        self.dead = None                # a test hook: the engine as restarted
        self.handles.clear()
        self.push_sender.clear()
        self.push_receiver.clear()
        self.pool.reset_cache()
        self.stats = SimStats()
        self.nixl = NixlStats()
        if num_blocks is not None and num_blocks != self.settings.num_blocks:
            self.settings = msgspec.structs.replace(self.settings, num_blocks=num_blocks)
            self.pool = BlockPool(num_blocks, self.bs, caching=self.settings.prefix_caching, events=self.events)
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
        if self.dead:                   # vLLM's API server answers 500 once its engine core is gone
            raise RequestFailed(self.dead)
        source = self.source(req.kv_params)
        beats = None
        beat = source.holder if source and source.heartbeat else self.push_receiver.heartbeat_target(req.kv_params)
        if beat is not None:
            self.spawn(self.reader.heartbeat(beat))  # on arrival, then while queued
            beats = asyncio.create_task(self.reader.heartbeats(beat))
        self.waiting += 1
        try:
            await self._seats.acquire()
        except asyncio.CancelledError:
            if beats is not None:
                beats.cancel()
            if source is not None:  # dropped before reading: tell the holder to free its blocks
                self.spawn(self.reader.notify(source))
            raise
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            # Heartbeats go on until the KV has been read: waiting for free blocks is waiting too.
            run = await self._prefill(req, source)
            if self.push_sender.fails(req.kv_params):  # --push-fault fail-prefill: P's leg ends in an error
                self.pool.release(run.table)
                raise RequestFailed("injected push-mode prefill failure")
            return run
        except BaseException:
            self._leave(failed=True)
            raise
        finally:
            if beats is not None:
                beats.cancel()

    async def decode(self, run: Running) -> AsyncIterator[int]:
        for token in run.answer.token_ids:
            await self.steps.token()
            self.stats.generation_tokens += 1
            yield token

    def finish(self, run: Running) -> dict[str, Any] | None:
        """A normal end (stop or length): cache the blocks, then lease (P) or pin (D) them behind a handle."""
        run.done = True
        self._leave()
        return self.holding.finish(run)

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
        table, num_hits = await self.allocator.allocate(prompt, hashes)
        hits = table[:num_hits]
        cached = num_hits * bs
        push = self.push_receiver
        try:
            loaded = await (push.receive(req, table, num_hits) if push.takes(req.kv_params)
                            else self.reader.load(len(prompt), source, cached))
        except BaseException:
            self.pool.release(table)
            raise
        for p in range(cached, len(prompt)):
            self.pool.blocks[table[p // bs]].slots.append(loaded.get(p, (prompt[p], p)))
        self.pool.commit_run(table, hashes, prompt, len(hits), req.cache_salt)  # loaded blocks too: D announces them
        computed = len(prompt) - cached - len(loaded)
        self.stats.prompt_tokens_cached += cached
        self.stats.prompt_tokens_loaded += len(loaded)
        self.stats.prompt_tokens_computed += computed
        try:  # an abort mid-prefill (the client left) frees the prompt's blocks
            await self.steps.compute(computed)
        except BaseException:
            self.pool.release(table)
            raise
        slots = checked(self.pool, self.stats, prompt, table)
        digest = context_digest(slots)
        answer = self.model.answer(digest, seed=req.seed, max_tokens=req.max_tokens,
                                   min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, stop=req.stop,
                                   tools=req.tools, schema=req.schema)
        table, num_hits = await self.allocator.with_answer_blocks(req, table, num_hits, hashes, len(answer.token_ids))
        return Running(req, table, num_hits, answer, digest)

    @contextlib.contextmanager
    def waiting_meanwhile(self, *, deferred: bool = False, seated: bool = True) -> Iterator[None]:
        """A request counted as waiting meanwhile (a `seated` one not as running then), as vLLM's scheduler keeps it
        in its waiting queues; `deferred`: waiting for a KV transfer (WAITING_FOR_REMOTE_KVS, in vLLM's
        skipped-waiting queue and its metrics' reason "deferred": v1/core/sched/scheduler.py make_stats,
        v1/metrics/loggers.py)."""
        self.running, self.waiting, self.deferred = self.running - seated, self.waiting + 1, self.deferred + deferred
        try:
            yield
        finally:
            self.running += seated
            self.waiting, self.deferred = self.waiting - 1, self.deferred - deferred

    def _leave(self, *, failed: bool = False, aborted: bool = False) -> None:
        self.running -= 1
        self._seats.release()
        self.stats.requests_failed += failed
        self.stats.requests_aborted += aborted

    def spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)  # keep a reference until done
        task.add_done_callback(self._tasks.discard)

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_TICK_S)
            self.handles.expire()


def checked(pool: BlockPool, stats: SimStats, prompt: list[int], table: list[int]) -> list[Slot]:
    """The oracle: every slot used must hold this prompt's token at its position (a wrong one counts as a corrupt
    read). Returns the slots."""
    slots, bad, bs = [], 0, pool.block_size
    for b, block_id in enumerate(table):
        want = [(prompt[p], p) for p in range(b * bs, min((b + 1) * bs, len(prompt)))]
        got = pool.blocks[block_id].slots[: len(want)]
        bad += got != want
        slots += got
    stats.kv_reads_corrupt += bad
    stats.requests_corrupt += bad > 0
    return slots
