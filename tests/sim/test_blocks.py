"""In-process: block pool, prefix cache, holder handles and the reader's block arithmetic."""

from __future__ import annotations

import pytest

from gateway.sim.blocks import BlockPool, PoolExhaustedError, block_hashes
from gateway.sim.handles import HandleTable
from gateway.sim.kvload import KVSource, load_plan
from gateway.sim.stats import SimStats
from gateway.sim.kv_reader import HolderAddress

BS = 4


def test_hashes_chain_over_whole_blocks_and_salt() -> None:
    tokens = list(range(10))
    assert len(block_hashes(tokens, BS)) == 2
    assert block_hashes(tokens, BS)[0] == block_hashes(tokens[:4] + [99] * 6, BS)[0]
    assert block_hashes(tokens, BS)[1] != block_hashes([0, 0, 0, 0] + tokens[4:], BS)[1]  # chained
    assert block_hashes(tokens, BS, "a") != block_hashes(tokens, BS, "b")


def test_freed_blocks_stay_cached_until_reused_lru() -> None:
    pool = BlockPool(4, BS)
    hashes = block_hashes(list(range(8)), BS)
    ids = pool.allocate(2)
    for i, h in zip(ids, hashes):
        pool.commit(i, h)
    pool.release(ids)
    assert pool.in_use == 0 and pool.match_prefix(hashes) == ids
    pool.allocate(2)  # the two never-used blocks go first
    assert pool.match_prefix(hashes) == ids
    pool.allocate(1)  # then the least recently freed: the tail block (vLLM frees tail first)
    assert pool.match_prefix(hashes) == ids[:1]
    with pytest.raises(PoolExhaustedError):
        pool.allocate(2)


def test_refcounts_share_cached_blocks() -> None:
    pool = BlockPool(2, BS)
    [b] = pool.allocate(1)
    pool.touch([b])
    pool.release([b])
    assert pool.in_use == 1
    pool.release([b])
    assert pool.in_use == 0


def test_prefix_caching_off_never_hits() -> None:
    pool = BlockPool(2, BS, caching=False)
    [b] = pool.allocate(1)
    h = block_hashes([1, 2, 3, 4], BS)
    pool.commit(b, h[0])
    assert pool.match_prefix(h) == []


def test_handle_single_use_then_double_read_counted() -> None:
    stats = SimStats()
    pool = BlockPool(4, BS)
    table = HandleTable(pool, stats)
    table.hold("r1", pool.allocate(2), 30, "pin")
    assert pool.in_use == 2 and table.count("pin") == 1
    assert table.claim("r1", "read") == "active" and pool.in_use == 0
    assert table.claim("r1", "read") == "consumed" and stats.handles_double_read == 1


@pytest.mark.parametrize(("first", "then", "issued", "counted"), [
    ("read", "read", True, "handles_reread"),
    ("notify", "read", True, "handles_reread"),             # read after a release: garbage all the same
    (None, "read", False, "handles_read_unknown"),
    ("read", "notify", True, "handles_renotified"),
    ("notify", "notify", True, "handles_renotified"),       # a release sent twice
    (None, "notify", False, "handles_notified_unknown"),
])
def test_double_reads_split_by_what_arrived_and_why(first, then, issued, counted) -> None:
    stats = SimStats()
    pool = BlockPool(4, BS)
    table = HandleTable(pool, stats)
    if issued:
        table.hold("r1", pool.allocate(1), 30, "pin")
        table.claim("r1", first)
    assert table.claim("r1", then) == ("consumed" if issued else "unknown")
    split = ("handles_reread", "handles_read_unknown", "handles_renotified", "handles_notified_unknown")
    assert {k: getattr(stats, k) for k in split} == {k: int(k == counted) for k in split}
    assert stats.handles_double_read == 1 and stats.handles_consumed == int(issued)


def test_expiry_frees_and_later_read_is_counted() -> None:
    stats = SimStats()
    pool = BlockPool(4, BS)
    table = HandleTable(pool, stats)
    table.hold("r1", pool.allocate(1), 0.0, "lease")
    assert table.expire() == 1 and pool.in_use == 0 and stats.handles_expired == 1
    assert table.claim("r1", "read") == "expired" and stats.handles_read_after_expiry == 1


def test_heartbeat_extends_leases_not_pins() -> None:
    table = HandleTable(BlockPool(4, BS), SimStats())
    table.hold("lease", [0], 0.5, "lease")
    table.hold("pin", [1], 0.5, "pin")
    assert table.heartbeat("lease", 60) and not table.heartbeat("pin", 60)
    assert table.held["lease"].expires_at > table.held["pin"].expires_at + 30


def _source(ids: list[int], num_tokens: int | None, expiry: float | None = None) -> KVSource:
    return KVSource(HolderAddress("127.0.0.1", 1, "e", "r"), ids, num_tokens, expiry, False)


@pytest.mark.parametrize(
    ("holder_ids", "held", "prompt", "cached", "threshold", "want_ids", "end"),
    [
        ([10, 11, 12], 10, 10, 0, 0, [10, 11, 12], 9),  # D reading P: all but the last prompt token
        ([10, 11, 12], 10, 10, 4, 0, [11, 12], 9),  # local hit: tail of the list
        ([10, 11, 12], 10, 20, 0, 0, [10, 11, 12], 10),  # P reading D: everything D holds
        ([10, 11, 12], 10, 6, 0, 0, [11, 12], 5),  # shorter prompt: tail alignment picks the wrong blocks
        ([10, 11], 8, 20, 4, 0, [11], 8),  # truncated handle, exact
        ([10, 11, 12], 10, 20, 0, 11, [], 0),  # below threshold: notification only
        ([10, 11, 12], 0, 20, 0, 0, [], 0),  # release handle
        ([10, 11, 12], 10, 20, 8, 0, [12], 10),
        ([10, 11, 12], 10, 20, 12, 0, [], 0),  # local cache covers it all
    ],
)
def test_load_plan(holder_ids: list[int], held: int, prompt: int, cached: int, threshold: int,
                   want_ids: list[int], end: int) -> None:
    plan = load_plan(_source(holder_ids, held), prompt, cached, BS, threshold)
    assert plan.block_ids == want_ids
    if want_ids:
        assert plan.end == end and plan.first_block == cached // BS


def test_load_plan_declines_within_expiry_margin() -> None:
    assert load_plan(_source([1], 4, expiry=100.0), 8, 0, BS, 0, now=96.0).declined
    assert not load_plan(_source([1], 4, expiry=100.0), 8, 0, BS, 0, now=94.0).declined
