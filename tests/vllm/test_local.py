"""A later turn served by D alone (the `local` path, issue 24): real vLLM, the tier's shared engines.

A first turn runs P→D; D then pins `S` (prompt + answer) behind its handle. The next turn's prompt `Q` extends
`S` and goes to D alone as a CHAT request with the gateway's verified ids pinned in
`kv_transfer_params.prompt_token_ids` (D renders nothing) and no P leg. What is checked, each against vLLM's own
counters (`vllm:prompt_tokens_by_source_total`) and the co-located baseline engine given the same ids:

(a) D's prefix cache serves every whole block of the KV its handle pins (the partial last block is computed
    again), JSON and streamed;
(b) with `do_remote_decode: true` (the same object the gateway sends P on a first turn) D returns a handle for
    the local turn (producer-style: `do_remote_prefill: true`, no expiry, held for D's `kv_lease_duration`),
    which P reads once its flags are D's own (`do_remote_decode: true`, `do_remote_prefill: false`); two local
    turns in a row work too;
(c) releasing the old handle once D has answered (or has sent its first streamed chunk) keeps the blocks the
    new turn shares with it: the running or finished request holds its own reference. Released before, the
    blocks can be reused and the hit is gone (the answer stays right: D computes what it lacks).

What was seen, with vLLM's source lines: docs/protocol.md §9. The last tests run conversations through the gateway
with the local path on (`free_gateway_local`), on the unconstrained model.
"""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from typing import Any

import pytest

from tests.vllm.engines import BLOCK_SIZE, LOCAL_LEASE_S, SERVED_MODEL, Engine
from tests.vllm.test_findings import FRESH, complete, expected, words

pytestmark = pytest.mark.vllm

# With pinned ids the messages are not rendered: these stand for what the gateway would send.
MESSAGES = [{"role": "user", "content": "Rendered by the gateway; the pinned ids are the prompt."}]
LOCAL = FRESH                      # what the gateway sends D on a local turn (plus the pinned ids)
FIRST, ANSWER, NEW = 300, 40, 30   # first prompt, answer and new tokens per turn
SOURCES = ("local_cache_hit", "local_compute", "external_kv_transfer")
LEASE_MARGIN_S = 4                 # a lease-style handle is used at most LOCAL_LEASE_S - this after D answered


def chat(engine: Engine, ids: list[int], max_tokens: int, params: dict[str, Any] | None,
         stream: bool = False) -> tuple[list[int], dict[str, Any] | None, list[int]]:
    """A chat request with `ids` pinned; returns (answer ids, handle, the prompt ids the engine used)."""
    body: dict[str, Any] = {"model": SERVED_MODEL, "messages": MESSAGES, "max_tokens": max_tokens,
                            "temperature": 0, "return_token_ids": True,
                            "kv_transfer_params": {**(params or {}), "prompt_token_ids": list(ids)}}
    if not stream:
        out = engine.post("/v1/chat/completions", body)
        return out["choices"][0]["token_ids"], out.get("kv_transfer_params"), out["prompt_token_ids"]
    chunks = _sse(engine, body)
    answer = [t for c in chunks for choice in c.get("choices", []) for t in choice.get("token_ids") or []]
    handles = [c["kv_transfer_params"] for c in chunks if "kv_transfer_params" in c]
    assert len(handles) <= 1
    return answer, (handles[0] if handles else None), chunks[0]["prompt_token_ids"]


def _sse(engine: Engine, body: dict[str, Any], on_first=None) -> list[dict[str, Any]]:
    req = urllib.request.Request(engine.url + "/v1/chat/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    chunks: list[dict[str, Any]] = []
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: "):]))
                if len(chunks) == 1 and on_first is not None:
                    on_first()
    return chunks


def overwrite_free_blocks(d: Engine) -> None:
    """Plain requests with fresh prompts until every free block of D's pool (255) has been taken again: each takes
    14 whole blocks from the front of the free queue (freed cached blocks go to its end, evicted last)."""
    for _ in range(20):
        complete(d, words(1900), 1)


def sources(engine: Engine) -> dict[str, int]:
    return {s: int(engine.metric("vllm:prompt_tokens_by_source_total", source=s)) for s in SOURCES}


def counted(engine: Engine, call) -> tuple[Any, dict[str, int]]:
    before = sources(engine)
    out = call()
    after = sources(engine)
    return out, {s: after[s] - before[s] for s in SOURCES}


def by_source(hit: int = 0, computed: int = 0, loaded: int = 0) -> dict[str, int]:
    return {"local_cache_hit": hit, "local_compute": computed, "external_kv_transfer": loaded}


def whole_blocks(n: int) -> int:
    return n // BLOCK_SIZE * BLOCK_SIZE


def first_turn(engines, ids: list[int], answer: int = ANSWER) -> tuple[list[int], dict]:
    """P→D through chat with pinned ids; returns S (prompt + answer) and D's handle (a decoder pin)."""
    _, p_handle, _ = chat(engines.prefill, ids, 1, FRESH)
    out, handle, _ = chat(engines.decode, ids, answer, p_handle)
    assert handle and handle["do_remote_decode"] and handle["remote_blocks_expiry_time"] is not None
    assert handle["remote_num_tokens"] == len(ids) + answer - 1
    return ids + out, handle


def release(engines, handle: dict) -> None:
    """The zero-token read through P (docs/protocol.md §4): D unpins without moving data."""
    complete(engines.prefill, [5], 1, {**handle, "do_remote_decode": True, "do_remote_prefill": False,
                                       "remote_num_tokens": 0})


def as_d_handle(handle: dict) -> dict:
    """A local turn's handle, flags rewritten as D's own handle: P then reads exactly remote_num_tokens."""
    return {**handle, "do_remote_decode": True, "do_remote_prefill": False}


def d_blocks(d: Engine) -> int:
    """Blocks D holds (pinned or in running requests); its pool has 255 usable blocks."""
    return round(d.kv_usage() * 255)


def wait_for_d_blocks(d: Engine, n: int, timeout_s: float) -> float:
    """Poll until D holds at most `n` blocks; returns how long that took. A release is asynchronous: P sends D
    its notification while answering, D frees the blocks in a later step."""
    began = time.monotonic()
    while d_blocks(d) > n and time.monotonic() - began < timeout_s:
        time.sleep(0.05)
    return time.monotonic() - began


def wait_until_d_holds_nothing(d: Engine) -> None:
    """Other tests' pins run out within D's TTL (20 s)."""
    wait_for_d_blocks(d, 0, LOCAL_LEASE_S + 10)
    assert d_blocks(d) == 0, "D still holds blocks nobody released"


def assert_local_handle(handle: dict | None, prompt_len: int, answer: int, shared: list[int]) -> None:
    """The shape D returns for a `do_remote_decode` request: a producer's, with D's ids."""
    assert handle is not None, "D returned no handle for the local turn"
    assert (handle["do_remote_prefill"], handle["do_remote_decode"]) == (True, False)
    assert handle["remote_engine_id"] == "d0" and handle["remote_blocks_expiry_time"] is None
    assert handle["remote_num_tokens"] == prompt_len + answer - 1
    blocks = handle["remote_block_ids"][0]
    assert len(blocks) == -(-handle["remote_num_tokens"] // BLOCK_SIZE)
    assert blocks[:len(shared)] == shared, "the local turn does not reuse the pinned blocks"


# -- (a) + (b): a conversation with two local turns between P→D turns -------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_local_turns_hit_d_pinned_blocks_and_hand_back_a_handle_p_reads(engines, stream):
    """N: P→D. N+1, N+2: D alone (chat, pinned ids, `do_remote_decode`), each releasing the previous handle once
    D has answered. N+3: P reads N+2's handle (as D's own), D reads P's. Counters on every turn; every answer
    equal to the baseline's on the same ids (compared after the conversation, so turns follow each other
    within D's lease)."""
    p, d = engines.prefill, engines.decode
    answers: list[tuple[list[int], list[int]]] = []
    ids = words(FIRST)
    s, handle = first_turn(engines, ids)
    answers.append((ids, s[len(ids):]))
    held, shared = handle["remote_num_tokens"], handle["remote_block_ids"][0]

    for _ in range(2):                                          # N+1 and N+2: local
        q = s + words(NEW)
        p_before = sources(p)
        (out, local, used), on_d = counted(d, lambda: chat(d, q, ANSWER // 2, LOCAL, stream))
        answered_at = time.monotonic()
        assert used == q, "D did not use the pinned ids"
        assert sources(p) == p_before, "P took part in a local turn"
        hit = whole_blocks(min(held, len(q) - 1))               # the handle's whole blocks; the partial one recomputed
        assert on_d == by_source(hit, len(q) - hit), "D's prefix cache missed the blocks its handle pins"
        assert len(out) == ANSWER // 2                          # D honours max_tokens under do_remote_decode
        assert_local_handle(local, len(q), len(out), shared[:hit // BLOCK_SIZE])
        release(engines, handle)                                # the old handle, after D answered
        answers.append((q, out))
        s, handle = q + out, local
        held, shared = local["remote_num_tokens"], local["remote_block_ids"][0]

    q = s + words(100)                                          # N+3: P reads the last local turn's handle
    assert time.monotonic() - answered_at < LOCAL_LEASE_S - LEASE_MARGIN_S, "too slow for D's lease"
    (_, p_handle, _), on_p = counted(p, lambda: chat(p, q, 1, as_d_handle(handle)))
    cached_on_p = whole_blocks(FIRST)                           # P's own prefix cache: turn N's prompt
    assert on_p == by_source(cached_on_p, len(q) - held, held - cached_on_p), "P did not read D's local-turn KV"
    (out, last, _), on_d = counted(d, lambda: chat(d, q, ANSWER, p_handle, stream))
    assert on_d == by_source(whole_blocks(held), 0, len(q) - whole_blocks(held))
    answers.append((q, out))
    release(engines, last)
    for i, (prompt, answer) in enumerate(answers):
        assert answer == expected(engines.baseline, prompt, len(answer)), f"turn N+{i} differs from the baseline"


def test_local_turn_with_only_pinned_ids_hits_the_cache_and_returns_no_handle(engines):
    """`kv_transfer_params: {"prompt_token_ids": ...}` alone: vLLM pops the ids before the engine sees the params,
    so the request carries none, and D pins nothing (no handle). The cache hit is the same."""
    d = engines.decode
    s, handle = first_turn(engines, words(FIRST))
    q = s + words(NEW)
    (out, local, used), on_d = counted(d, lambda: chat(d, q, ANSWER // 2, None))
    assert used == q and local is None
    hit = whole_blocks(handle["remote_num_tokens"])
    assert on_d == by_source(hit, len(q) - hit)
    release(engines, handle)
    assert out == expected(engines.baseline, q, len(out))


# -- (b): the local handle's lifetime -----------------------------------------------------------------------
def test_a_local_handle_is_a_lease_of_d_kv_lease_duration_without_expiry(engines):
    """D pins a `do_remote_decode` request's blocks for ITS kv_lease_duration (not decoder_kv_blocks_ttl); no
    reader heartbeats extend it; the handle carries no expiry, so P cannot decline a late read: the gateway's
    own TTL is the only guard."""
    d = engines.decode
    wait_until_d_holds_nothing(d)
    expired = d.metric("vllm:nixl_num_kv_expired_reqs_total")
    ids = words(FIRST)
    out, local, _ = chat(d, ids, ANSWER, LOCAL)
    pinned_at = time.monotonic()
    assert_local_handle(local, len(ids), len(out), [])
    assert d_blocks(d) == len(local["remote_block_ids"][0])
    while d_blocks(d) and time.monotonic() - pinned_at < LOCAL_LEASE_S + 20:
        time.sleep(0.25)
    freed_after = time.monotonic() - pinned_at
    assert d_blocks(d) == 0, "the lease never ran out"
    assert LOCAL_LEASE_S - 2 < freed_after, f"freed after {freed_after:.1f} s, before D's lease"
    assert d.metric("vllm:nixl_num_kv_expired_reqs_total") == expired + 1


# -- (c): when the old handle may be released ---------------------------------------------------------------
@pytest.mark.parametrize("when", ["after_answer", "after_first_chunk"])
def test_releasing_the_old_handle_once_d_holds_the_blocks_keeps_them(engines, when):
    """The local turn's request references the blocks it hit (vLLM's block pool counts references): releasing
    the old handle then frees only its partial last block. Every free block is then written over; P still
    reads the local turn's handle right."""
    p, d = engines.prefill, engines.decode
    wait_until_d_holds_nothing(d)
    s, old = first_turn(engines, words(FIRST))
    old_blocks = old["remote_block_ids"][0]
    assert d_blocks(d) == len(old_blocks) == 3
    q = s + words(NEW)
    if when == "after_answer":
        out, local, _ = chat(d, q, ANSWER // 2, LOCAL)
        release(engines, old)
    else:                                   # while D decodes: its first chunk means the request was scheduled
        body = {"model": SERVED_MODEL, "messages": MESSAGES, "max_tokens": 300, "temperature": 0,
                "return_token_ids": True, "kv_transfer_params": {**LOCAL, "prompt_token_ids": q}}
        chunks = _sse(d, body, on_first=lambda: release(engines, old))
        out = [t for c in chunks for choice in c.get("choices", []) for t in choice.get("token_ids") or []]
        local = next(c["kv_transfer_params"] for c in chunks if "kv_transfer_params" in c)
        assert len(out) == 300 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    answered_at = time.monotonic()
    shared = whole_blocks(old["remote_num_tokens"]) // BLOCK_SIZE
    assert local["remote_block_ids"][0][:shared] == old_blocks[:shared]
    wait_for_d_blocks(d, len(local["remote_block_ids"][0]), 5)          # the old handle's partial block
    assert d_blocks(d) == len(local["remote_block_ids"][0]), "releasing the old handle freed shared blocks"
    overwrite_free_blocks(d)
    q2 = q + out + words(100)
    assert time.monotonic() - answered_at < LOCAL_LEASE_S - LEASE_MARGIN_S, "too slow for D's lease"
    (p_out, _, _), on_p = counted(p, lambda: chat(p, q2, 12, as_d_handle(local)))
    assert on_p["external_kv_transfer"] == local["remote_num_tokens"] - on_p["local_cache_hit"]
    assert p_out == expected(engines.baseline, q2, 12), "P read blocks the release freed"
    assert out == expected(engines.baseline, q, len(out))


def test_releasing_the_old_handle_before_the_local_turn_loses_the_hit(engines):
    """Released first, the old blocks are free (still cached, evicted last) and other requests can take them:
    the local turn then computes everything itself. Still the right answer, only slower."""
    d = engines.decode
    wait_until_d_holds_nothing(d)
    s, old = first_turn(engines, words(FIRST))
    release(engines, old)
    wait_for_d_blocks(d, 0, 5)
    assert d_blocks(d) == 0, "the release did not reach D"
    overwrite_free_blocks(d)
    q = s + words(NEW)
    (out, local, _), on_d = counted(d, lambda: chat(d, q, ANSWER // 2, LOCAL))
    assert on_d == by_source(0, len(q))
    release(engines, local)
    assert out == expected(engines.baseline, q, len(out))


# -- D's own threshold -----------------------------------------------------------------------------------------
def test_d_reads_a_p_suffix_shorter_than_the_recompute_threshold(engines):
    """kv_recompute_threshold (64) applies to reads of D's blocks (P's side); on vLLM 0.32 D reads whatever P's
    handle holds beyond its own prefix cache, even 25 tokens."""
    p, d = engines.prefill, engines.decode
    ids = words(250)
    s, handle = first_turn(engines, ids, answer=21)             # D caches 2 whole blocks (256 of 270)
    q = s + words(10)
    _, p_handle, _ = chat(p, q, 1, handle)
    (out, last, _), on_d = counted(d, lambda: chat(d, q, 12, p_handle))
    assert on_d == by_source(256, 0, len(q) - 256) and len(q) - 256 < 64
    release(engines, last)
    assert out == expected(engines.baseline, q, 12)


# -- through the gateway: a conversation on the local path, the unconstrained model ----------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_conversation_through_the_gateway_goes_local_and_p_reads_what_it_left(engines, free_gateway_local,
                                                                                  stream):
    """Short questions go to D alone (exact, no P computation, nothing moved over NIXL); a long one then takes
    the P path and P reads the handle the last local turn left on D, with D's own flags (exact)."""
    from tests.vllm.chat import Chat
    from tests.vllm.test_unconstrained import QUESTIONS
    c = Chat(free_gateway_local, engines.free_prefill, engines.free_decode, engines.free_prefill,
             baseline_by_ids=True, cache_salt=uuid.uuid4().hex, compare_later=True)
    for question in QUESTIONS[:3]:
        c.say(question, stream=stream)
    c.say(" ".join(f"and then part {i} of the longer question" for i in range(40)), stream=stream)
    c.compare()
    first, *local, long = c.turns
    assert all(turn.exact for turn in c.turns), [turn.plan for turn in c.turns]
    for i, turn in enumerate(local, 2):
        assert (turn.plan, turn.reason) == ("local", "short_suffix"), f"turn {i}"
        assert turn.decode_loaded == 0, f"turn {i}: NIXL was used"
        held = len(c.turns[i - 2].prompt_ids) + len(c.turns[i - 2].token_ids) - 1
        assert turn.reused == held // BLOCK_SIZE * BLOCK_SIZE, f"turn {i}"
    # P computed nothing for them but each local turn's release of the handle before it (a one-token prompt), which
    # may land in P's counters a turn late (its /metrics lag its steps)
    assert sum(turn.prefill_computed for turn in local) <= len(local), "P computed a local turn's prompt"
    held = len(local[-1].prompt_ids) + len(local[-1].token_ids) - 1
    assert (long.plan, long.reason) == ("reuse", "continuous")
    on_p = len(first.prompt_ids) // BLOCK_SIZE * BLOCK_SIZE       # P's cache holds the first turn's prompt only
    assert long.prefill_loaded == held - on_p > 0                 # the rest read from the local turn's lease
