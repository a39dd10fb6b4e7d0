"""The KV events subscriber's index (engines/cache_index.py, engines/kv_events.py): chains rebuilt from token
ids into the gateway's own fingerprints, removal, clearing, gaps and reconnects, both event encodings."""

from __future__ import annotations

import msgspec
import pytest

from gateway.engines.cache_index import CacheIndex, Cleared, Knowledge, Removed, Stored
from gateway.engines.kv_events import EventDecodeError, KVEventSubscriber, decode_batch
from gateway.turns.reuse.continuity import Fingerprint, block_hashes

BS = 4
TOKENS = list(range(100, 124))          # 6 blocks


def chain(tokens: list[int] = TOKENS) -> bytes:
    return b"".join(block_hashes(tokens, BS))


def stored(first: int, count: int, parent: int | None, tokens: list[int] = TOKENS, **kw) -> Stored:
    """Blocks first..first+count-1 of `tokens`, vLLM hashes 1000 + block number."""
    return Stored([1000 + i for i in range(first, first + count)], parent,
                  tokens[first * BS:(first + count) * BS], BS, **kw)


def fed(*batches: list) -> CacheIndex:
    index = CacheIndex()
    for seq, events in enumerate(batches):
        index.apply(seq, events)
    return index


def test_chains_across_events_match_the_gateways_own_fingerprints() -> None:
    index = fed([stored(0, 2, None)], [stored(2, 3, 1001)])
    assert index.knowledge is Knowledge.COMPLETE
    assert index.leading(chain(), BS) == 5
    held = Fingerprint.of(TOKENS, len(TOKENS), BS)            # what the store keeps for a conversation
    assert index.leading(held.block_hashes, BS) == 5
    assert index.leading(chain(), BS * 2) == 0                # another block size: nothing comparable


def test_another_conversation_with_the_same_tail_block_does_not_match() -> None:
    other = [7] * BS + TOKENS[BS:]
    index = fed([stored(0, 6, None, other)])
    assert index.leading(chain(), BS) == 0


def test_removed_blocks_cut_the_held_prefix_and_clear_empties_it() -> None:
    index = fed([stored(0, 6, None)], [Removed([1003])])
    assert index.leading(chain(), BS) == 3
    index.apply(2, [Cleared()])
    assert index.leading(chain(), BS) == 0 and index.knowledge is Knowledge.COMPLETE


def test_a_block_whose_parent_is_unknown_is_not_indexed() -> None:
    index = fed([stored(2, 2, 1001)])
    assert len(index) == 0 and index.unchained == 2


def test_salted_or_lora_blocks_are_not_comparable() -> None:
    index = fed([stored(0, 2, None, plain=False)])
    assert len(index) == 0


def test_a_gap_clears_and_leaves_positives_only() -> None:
    index = fed([stored(0, 4, None)])
    index.apply(2, [stored(4, 1, 1003)])       # batch 1 lost: it may have removed anything
    assert index.knowledge is Knowledge.PARTIAL and index.gaps == 1
    assert index.leading(chain(), BS) == 0     # its parent went with the clear


def test_a_late_join_is_partial_and_a_restart_from_zero_complete() -> None:
    index = CacheIndex()
    index.apply(5, [stored(0, 2, None)])
    assert index.knowledge is Knowledge.PARTIAL and index.leading(chain(), BS) == 2
    index.apply(0, [stored(0, 1, None)])       # the engine restarted: its counter from 0, its cache empty
    assert index.knowledge is Knowledge.COMPLETE and index.leading(chain(), BS) == 1


def test_a_batch_out_of_order_is_treated_as_lost_events() -> None:
    index = fed([stored(0, 4, None)], [Removed([1003])])
    index.apply(3, [])
    index.apply(2, [stored(3, 1, 1002)])       # late: whatever batch 3 said may be undone
    assert index.knowledge is Knowledge.PARTIAL and index.leading(chain(), BS) == 0


def test_a_disconnect_is_unknown_until_the_next_batch_says_nothing_was_missed() -> None:
    index = fed([stored(0, 4, None)])
    index.lost()
    assert index.knowledge is Knowledge.UNKNOWN
    index.apply(1, [])
    assert index.knowledge is Knowledge.COMPLETE and index.leading(chain(), BS) == 4
    index.lost()
    index.apply(5, [])
    assert index.knowledge is Knowledge.PARTIAL and index.leading(chain(), BS) == 0


def test_a_hash_stored_twice_stays_until_removed_twice() -> None:
    index = fed([stored(0, 1, None)], [stored(0, 1, None)], [Removed([1000])])
    assert index.leading(chain(), BS) == 1
    index.apply(3, [Removed([1000])])
    assert index.leading(chain(), BS) == 0


# -- the wire ---------------------------------------------------------------------------------------------
def _map(kind: str, **fields) -> dict:
    return {"type": kind, **fields}


MAP_BATCH = [1.5, [
    _map("BlockStored", block_hashes=[11, 12], parent_block_hash=None, token_ids=TOKENS[:8], block_size=BS,
         lora_id=None, medium="GPU", lora_name=None, extra_keys=[None, None], group_idx=0,
         kv_cache_spec_kind="full_attention"),
    _map("BlockRemoved", block_hashes=[12], medium="GPU", group_idx=0),
    _map("AllBlocksCleared")], 0]
ARRAY_BATCH = [1.5, [                 # vLLM's example subscriber's encoding: tagged arrays in field order
    ["BlockStored", [11, 12], None, TOKENS[:8], BS, None, "GPU"],
    ["BlockRemoved", [12], "GPU"],
    ["AllBlocksCleared"]]]


@pytest.mark.parametrize("batch", [MAP_BATCH, ARRAY_BATCH], ids=["map", "array_like"])
def test_both_encodings_decode_alike(batch: list) -> None:
    events = decode_batch(msgspec.msgpack.encode(batch))
    assert events == [Stored([11, 12], None, TOKENS[:8], BS), Removed([12]), Cleared()]


def test_bytes_hashes_and_a_salted_first_block() -> None:
    salted = _map("BlockStored", block_hashes=[b"\x01" * 32], parent_block_hash=None, token_ids=TOKENS[:4],
                  block_size=BS, lora_id=None, medium="GPU", lora_name=None, extra_keys=[["salt"]])
    (event,) = decode_batch(msgspec.msgpack.encode([0.0, [salted]]))
    assert event.block_hashes == [b"\x01" * 32] and not event.plain


@pytest.mark.parametrize("payload", [b"\xc1", msgspec.msgpack.encode({"ts": 1}),
                                     msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}]]),
                                     msgspec.msgpack.encode([1.0, [42]])])
def test_garbage_is_an_error(payload: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_batch(payload)


def test_an_undecodable_message_makes_the_cache_unknown() -> None:
    index = fed([stored(0, 2, None)])
    sub = KVEventSubscriber.__new__(KVEventSubscriber)
    sub.url, sub.index = "http://d", index
    sub.receive([b"kv", (1).to_bytes(8, "big"), b"\xc1"])
    assert index.knowledge is Knowledge.UNKNOWN
    sub.receive([b"kv", (2).to_bytes(8, "big"), msgspec.msgpack.encode([0.0, []])])
    assert index.knowledge is Knowledge.PARTIAL          # batch 1 was lost after all


@pytest.mark.parametrize("events, knowledge, cached, known", [
    ([[stored(0, 6, None)]], Knowledge.COMPLETE, 21, True),        # all of the 21 held tokens
    ([[stored(0, 2, None)]], Knowledge.COMPLETE, 8, True),         # complete: what it lacks, it lacks
    (None, Knowledge.UNKNOWN, 0, False),                           # nothing heard: the rates' estimate
])
def test_the_cost_plan_reads_p_s_cache_from_its_events(events, knowledge, cached, known):
    from gateway.engines.engine import Engine
    from gateway.store import Conversation
    from gateway.turns.reuse.cost import TurnShape
    from gateway.turns.run.path_choice import PathChoice

    class Rates:
        def warm_tokens(self, *_):
            return 0

    p = Engine("http://p0", "prefill", cache=CacheIndex())
    for seq, batch in enumerate(events or []):
        p.cache.apply(seq, batch)
    assert p.cache.knowledge is knowledge
    held = Fingerprint.of(TOKENS, 21, BS)
    record = Conversation(block_size=BS, held_tokens=21, block_hashes=held.block_hashes, prefill_engine="http://p0")
    paths = PathChoice(None, Rates(), None, None)      # type: ignore[arg-type]
    shape = paths.p_cached(TurnShape(30, 21, 20, 0, False), p, record)
    assert (shape.p_cached_tokens, shape.p_cache_known) == (cached, known)
