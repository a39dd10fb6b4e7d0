"""PROTOCOL.md's open points, settled on real vLLM (answers recorded in docs/vllm-findings.md).

Each test drives the engines directly with token-id prompts (`/v1/completions`): a first turn P→D leaves D
holding `S` (prompt + answer) behind its handle; a second request sends some form of that handle to a P. P's
own answer (a few greedy tokens) is compared with the co-located baseline on the same prompt: KV read for
the wrong positions or tokens changes it. The simulator's twin of each test is in tests/sim/test_findings.py.
"""

from __future__ import annotations

import random
import threading
import time
import urllib.error
import uuid
from typing import Any

import pytest

from tests.vllm.engines import BLOCK_SIZE, PIN_TTL_S, SERVED_MODEL, Engine

pytestmark = pytest.mark.vllm

FRESH = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
         "remote_block_ids": None, "remote_host": None, "remote_port": None}
ANSWER = 12            # tokens P generates itself to show what its KV holds
EXPIRY_MARGIN_S = 5    # P declines a read of D's blocks this close to their expiry
PARK_WAIT_S = 8        # how long a test waits for an answer that never comes


def words(n: int, seed: int | None = None) -> list[int]:
    rng = random.Random(seed if seed is not None else uuid.uuid4().int)
    return [rng.randrange(100, 4000) for _ in range(n)]


def complete(engine: Engine, prompt: list[int], max_tokens: int, params: dict[str, Any] | None = None,
             timeout_s: float = 60, **extra: Any) -> dict[str, Any]:
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, **extra}
    if params is not None:
        body["kv_transfer_params"] = params
    return engine.post("/v1/completions", body, timeout_s=timeout_s)


def first_turn(prefill: Engine, decode: Engine, prompt: list[int], answer: int = 80) -> tuple[list[int], dict]:
    """P→D; returns S (the tokens D holds KV for, plus the last sampled one) and D's handle."""
    p = complete(prefill, prompt, 1, FRESH)
    d = complete(decode, prompt, answer, p["kv_transfer_params"])
    handle = d["kv_transfer_params"]
    assert handle and handle["remote_num_tokens"] == len(prompt) + answer - 1
    return prompt + d["choices"][0]["token_ids"], handle


def expected(baseline: Engine, prompt: list[int], max_tokens: int = ANSWER) -> list[int]:
    return complete(baseline, prompt, max_tokens, cache_salt=uuid.uuid4().hex)["choices"][0]["token_ids"]


def answer(response: dict[str, Any]) -> list[int]:
    return response["choices"][0]["token_ids"]


def truncated(handle: dict, blocks: int) -> dict:
    return {**handle, "remote_num_tokens": blocks * BLOCK_SIZE,
            "remote_block_ids": [group[:blocks] for group in handle["remote_block_ids"]]}


def loaded_by(engine: Engine, call) -> tuple[Any, int]:
    before = engine.loaded_tokens()
    out = call()
    return out, int(engine.loaded_tokens() - before)


# -- partial reuse ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("prompt_len", "agree", "blocks"), [(300, 200, 1), (620, 600, 4)],
                         ids=["one-block", "four-blocks"])
def test_a_truncated_handle_reads_exactly_its_blocks(engines, prompt_len, agree, blocks):
    """Q agrees with S on `agree` tokens; a handle cut to the whole blocks inside that makes P read exactly
    those positions (P computes the rest) and answer like one engine alone. Turn 1 ran through another P,
    so this P has nothing cached."""
    s, handle = first_turn(engines.prefill_fail, engines.decode, words(prompt_len))
    q = s[:agree] + words(40)
    out, loaded = loaded_by(engines.prefill, lambda: complete(engines.prefill, q, ANSWER, truncated(handle, blocks)))
    assert loaded == blocks * BLOCK_SIZE
    assert answer(out) == expected(engines.baseline, q)


# -- a shorter prompt with the whole handle -----------------------------------------------------------------
def test_a_shorter_prompt_with_the_whole_handle_reads_the_wrong_blocks(engines):
    """len(Q) < remote_num_tokens, Q a prefix of S: P reads len(Q) tokens, but from the LAST blocks of D's list
    (tail alignment), so the KV is another position's and the answer is silently wrong. The gateway cuts
    the handle instead (PROTOCOL.md's 'prompt_shorter')."""
    s, handle = first_turn(engines.prefill_fail, engines.decode, words(600))
    q = s[:300]
    assert len(handle["remote_block_ids"][0]) == 6 and len(q) < handle["remote_num_tokens"]
    out, loaded = loaded_by(engines.prefill, lambda: complete(engines.prefill, q, ANSWER, handle))
    assert loaded == len(q)
    assert answer(out) != expected(engines.baseline, q)


# -- releasing a handle ---------------------------------------------------------------------------------------
def test_a_zero_token_handle_frees_d_blocks_even_while_d_is_busy(engines):
    """remote_num_tokens 0 through any P: P reads nothing and notifies D, which frees the pinned blocks at once,
    also while it is decoding other requests (their blocks are freed when they end; the handle's would
    otherwise stay until the pin TTL)."""
    d = engines.decode
    _, handle = first_turn(engines.prefill, d, words(1000))              # 9 blocks pinned on D
    pinned_at = time.monotonic()
    assert d.kv_usage() > 0
    busy = [threading.Thread(target=complete, args=(d, words(100), 600), kwargs={"timeout_s": 120})
            for _ in range(3)]
    for thread in busy:
        thread.start()
    time.sleep(1.0)
    out, loaded = loaded_by(engines.prefill, lambda: complete(
        engines.prefill, [5], 1, {**handle, "remote_num_tokens": 0}))
    assert loaded == 0 and out["choices"][0]["finish_reason"] == "length"
    assert any(thread.is_alive() for thread in busy), "D was not busy during the release"
    for thread in busy:
        thread.join()
    assert d.kv_usage() == 0
    assert time.monotonic() - pinned_at < PIN_TTL_S - 2, "too slow to tell a release from the TTL"


# -- a P without bidirectional transfer -----------------------------------------------------------------------
def test_a_p_without_bidirectional_transfer_parks_a_request_with_d_handle(engines):
    """A P whose connector is one-way never answers a request carrying D's handle (it waits for a transfer it
    never schedules). Closing the connection aborts it and the engine keeps serving."""
    s, handle = first_turn(engines.prefill, engines.decode, words(300))
    with pytest.raises(TimeoutError):
        complete(engines.prefill_oneway, s + words(30), ANSWER, handle, timeout_s=PARK_WAIT_S)
    plain = words(50)
    assert answer(complete(engines.prefill_oneway, plain, ANSWER)) == expected(engines.baseline, plain)


# -- reading a handle twice -----------------------------------------------------------------------------------
def test_a_second_read_of_a_spent_handle_is_silent_and_reads_reused_memory(engines):
    """The first read frees D's blocks; a second read of the same ids succeeds without any error and gets
    whatever those blocks hold by then: here another request's KV, so the answer is wrong."""
    s, handle = first_turn(engines.prefill_fail, engines.decode, words(300))
    q = s + words(30)
    first = complete(engines.prefill, q, ANSWER, handle)
    assert answer(first) == expected(engines.baseline, q)
    _overwrite_free_blocks(engines.decode)
    # Overwriting may outlast the handle's TTL on a loaded machine, and P declines reads near expiry (HTTP 500
    # under `fail`): this read is about freed blocks, so its handle claims a later expiry (D's own clock, +60 s).
    spent = {**handle, "remote_blocks_expiry_time": handle["remote_blocks_expiry_time"] + 60}
    again, loaded = loaded_by(engines.prefill_fail, lambda: complete(engines.prefill_fail, q, ANSWER, spent,
                                                                     cache_salt="second-read"))
    assert loaded == handle["remote_num_tokens"]       # read "successfully", HTTP 200
    assert answer(again) != answer(first), "the reused blocks still held the old KV"


def _overwrite_free_blocks(decode: Engine) -> None:
    """Plain requests on D with fresh prompts until every free block has been written again."""
    for _ in range(18):
        complete(decode, words(1900), 1)


# -- an expired handle ---------------------------------------------------------------------------------------
def test_an_expired_handle_fails_at_once_under_fail_and_parks_under_recompute(engines):
    """Within 5 s of D's expiry P declines the read. Under `fail` the request fails at once with HTTP 500.
    Under `recompute` it is never answered: it stays waiting for remote KV ('deferred') until the client
    goes away. (vLLM 0.32: after the failed read the scheduler asks the connector again, which again
    promises an asynchronous load, and nothing schedules it.) So a P should run under `fail`, and a
    gateway must never send a handle near its expiry and must bound P legs that carry one."""
    _, h1 = first_turn(engines.prefill, engines.decode, words(300))
    s2, h2 = first_turn(engines.prefill, engines.decode, words(300))
    time.sleep(PIN_TTL_S - EXPIRY_MARGIN_S + 1)
    began = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as failed:
        complete(engines.prefill_fail, s2 + words(30), ANSWER, h2)
    assert failed.value.code == 500 and time.monotonic() - began < 5
    p = engines.prefill
    deferred: list[float] = []       # meanwhile: waiting, for KV ('deferred'), not for room (turns/reuse/headroom.py)
    watch = threading.Thread(target=lambda: (time.sleep(PARK_WAIT_S / 2), deferred.append(
        p.metric("vllm:num_requests_waiting_by_reason", reason="deferred"))))
    watch.start()
    with pytest.raises(TimeoutError):
        complete(p, s2 + words(30), ANSWER, h1, timeout_s=PARK_WAIT_S)
    watch.join()
    assert deferred == [1.0]
    deadline = time.monotonic() + 10          # the client went away: vLLM aborts the parked request
    while p.metric("vllm:num_requests_waiting") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert p.metric("vllm:num_requests_waiting") == 0
