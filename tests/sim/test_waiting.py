"""Requests waiting for free KV blocks: FCFS admission as freed blocks come back, cancellation, time waited."""

from __future__ import annotations

import asyncio

import pytest

from gateway.sim.blocks import BlockPool
from gateway.sim.handles import HandleTable
from gateway.sim.stats import SimStats
from gateway.sim.waiting import BlockQueue, Grant

BS = 4


def taking(pool: BlockPool, n: int):
    """An attempt for n fresh blocks (no cache hits)."""
    def attempt() -> Grant | None:
        return (pool.allocate(n), 0) if pool.can_take([], n) else None
    return attempt


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


@pytest.fixture
def setup() -> tuple[BlockPool, SimStats, BlockQueue]:
    pool, stats = BlockPool(4, BS), SimStats()
    return pool, stats, BlockQueue(pool, stats)


async def test_fits_at_once_without_queueing(setup) -> None:
    pool, stats, queue = setup
    assert queue.try_now(taking(pool, 3)) is not None
    assert stats.requests_waited_for_blocks == 0


async def test_head_of_line_waits_and_a_smaller_later_request_does_not_overtake(setup) -> None:
    pool, stats, queue = setup
    held = pool.allocate(3)                                   # one free block left
    big = asyncio.create_task(queue.wait(taking(pool, 2)))
    await settle()
    assert queue.try_now(taking(pool, 1)) is None             # FCFS: queued behind the big one, though it fits
    small = asyncio.create_task(queue.wait(taking(pool, 1)))
    await settle()
    assert not big.done() and not small.done() and len(queue) == 2
    pool.release(held[:1])                                    # two free now: the head fits, the next does not
    await settle()
    assert big.done() and not small.done()
    pool.release(held[1:])
    await settle()
    assert small.done() and len(queue) == 0
    assert stats.requests_waited_for_blocks == 2 and stats.block_wait_seconds_max > 0
    assert stats.block_wait_seconds_total >= stats.block_wait_seconds_max


async def test_an_expiring_pin_admits_the_waiter(setup) -> None:
    pool, stats, queue = setup
    handles = HandleTable(pool, stats)
    handles.hold("r1", pool.allocate(4), ttl_s=0.05, kind="pin")
    waiter = asyncio.create_task(queue.wait(taking(pool, 2)))
    await asyncio.sleep(0.1)
    assert not waiter.done()                                  # expiry is noticed on the engine's tick
    handles.expire()
    await settle()
    table, _ = waiter.result()
    assert len(table) == 2 and stats.handles_expired == 1


async def test_a_cancelled_head_leaves_and_lets_the_next_in(setup) -> None:
    pool, _, queue = setup
    held = pool.allocate(3)
    big = asyncio.create_task(queue.wait(taking(pool, 4)))
    await settle()
    small = asyncio.create_task(queue.wait(taking(pool, 1)))
    await settle()
    assert not small.done()
    big.cancel()                                              # the client went away while queued
    await settle()
    assert small.done() and len(queue) == 0 and pool.num_free == 0
    pool.release(held)


async def test_a_grant_cancelled_before_it_runs_is_given_back(setup) -> None:
    pool, _, queue = setup
    held = pool.allocate(4)
    waiter = asyncio.create_task(queue.wait(taking(pool, 2)))
    await settle()
    pool.release(held)                                        # granted now, in the same step ...
    waiter.cancel()                                           # ... and cancelled before it resumed
    await settle()
    assert waiter.cancelled() and pool.num_free == 4


async def test_a_running_requests_blocks_go_before_the_waiting_ones(setup) -> None:
    pool, _, queue = setup
    held = pool.allocate(4)
    waiting = asyncio.create_task(queue.wait(taking(pool, 1)))
    await settle()
    running = asyncio.create_task(queue.wait(taking(pool, 1), first=True))   # its answer's block
    await settle()
    pool.release(held[:1])
    await settle()
    assert running.done() and not waiting.done()
    pool.release(held[1:])
    await settle()
    assert waiting.done()


async def test_no_block_for_the_answer_preempts_by_recompute_then_resumes() -> None:
    """vLLM preempts a running request whose next block does not fit: its blocks go back, it waits at the head
    of the queue and recomputes what the prefix cache lost. The oracle still sees the right KV."""
    from gateway.sim.engine_core import Engine, EngineRequest
    from gateway.sim.chat_render import Renderer
    from gateway.sim.settings import SimSettings

    engine = Engine(SimSettings(role="colocated", num_blocks=10, block_size=16, output_tokens=(40, 40)),
                    Renderer("builtin:demo", None))
    held = engine.pool.allocate(8)                  # two free: the prompt's, none for the answer
    prompt = list(range(100, 132))                  # two blocks
    admitted = asyncio.create_task(engine.admit(EngineRequest("r1", prompt, max_tokens=40)))
    await settle()
    assert not admitted.done() and engine.stats.requests_preempted == 1 and engine.waiting == 1
    engine.pool.release(held)
    run = await asyncio.wait_for(admitted, 5)
    need = -(-(len(prompt) + len(run.answer.token_ids) - 1) // 16)
    assert len(run.table) == need and engine.waiting == 0 and engine.running == 1
    assert engine.stats.prompt_tokens_computed == 32 + 16        # again its last block (a last token always is)
    assert engine.stats.kv_reads_corrupt == 0
    assert [token async for token in engine.decode(run)] == run.answer.token_ids
    engine.finish(run)
    assert engine.pool.in_use == 0 and engine.stats.holds_skipped_no_blocks == 0
