"""State bytes stay proportional to blocks: 16 B of hash per block plus a small fixed part."""

from __future__ import annotations

from gateway.store import Conversation
from gateway.store.codec import encode_record


def record_for(tokens: int, block_size: int = 16) -> Conversation:
    return Conversation(
        decode_engine="decode-0", prefill_engine="prefill-0", model="Qwen/Qwen3-8B", block_size=block_size,
        num_tokens=tokens, held_tokens=tokens - 1, block_hashes=b"\xab" * 16 * (tokens // block_size),
        prefix_hash=b"\xcd" * 16, created_at=1.8e9, updated_at=1.8e9,
    )


def test_record_bytes_per_1k_tokens() -> None:
    one_k, nine_k = len(encode_record(record_for(1_000))), len(encode_record(record_for(9_000)))
    assert (nine_k - one_k) / 8 <= 1_005  # 16 B per 16-token block: ~1,000 B per 1k tokens
    assert one_k - 62 * 16 < 300  # fixed part: field names, ids, timestamps
