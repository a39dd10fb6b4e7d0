"""A later turn served by D alone, as vLLM 0.32 serves it (docs/protocol.md §9, tests/vllm/test_local.py): D's
prefix cache holds the blocks its pinned handle keeps; asked to hold the result for a reader, D returns a
producer's lease handle; P reads it with D's own flags."""

from __future__ import annotations

import time

import pytest

from tests.servers import Server
from tests.sim.conftest import P_LEG_PARAMS, Fleet, Sims, assistant, long_text, user

pytestmark = pytest.mark.integration
BS = 16


def _local(sims: Sims, d: Server, messages: list[dict], params: dict | None) -> dict:
    ids = sims.post(d, "/tokenize", {"model": "demo", "messages": messages, "add_generation_prompt": True}).json()
    return sims.chat(d, messages, return_token_ids=True, max_tokens=30,
                     kv_transfer_params={**(params or {}), "prompt_token_ids": ids["tokens"]})


def _as_holders(handle: dict) -> dict:
    return {**handle, "do_remote_decode": True, "do_remote_prefill": False}


def test_d_alone_hits_its_pinned_blocks_and_returns_a_producer_lease(sims: Sims, fleet: Fleet) -> None:
    p, d = fleet("p", "d")
    sims.reset(p, d)
    m1 = [user(long_text(60))]
    r1 = sims.turn(p, d, m1)
    held = r1["kv_transfer_params"]["remote_num_tokens"]
    m2 = m1 + [assistant(r1), user("and then?")]
    before = sims.stats(d)
    r2 = _local(sims, d, m2, P_LEG_PARAMS)
    after = sims.stats(d)
    prompt = len(r2["prompt_token_ids"])
    assert after["prompt_tokens_cached"] - before["prompt_tokens_cached"] == held // BS * BS
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == prompt - held // BS * BS
    assert after["prompt_tokens_loaded"] == before["prompt_tokens_loaded"]      # no read of anyone's KV
    handle = r2["kv_transfer_params"]
    assert (handle["do_remote_prefill"], handle["do_remote_decode"]) == (True, False)   # a producer's flags
    assert handle["remote_blocks_expiry_time"] is None
    assert handle["remote_num_tokens"] == prompt + len(r2["choices"][0]["token_ids"]) - 1
    assert after["handles_leased_now"] == before["handles_leased_now"] + 1


def test_only_pinned_ids_leave_no_handle(sims: Sims, fleet: Fleet) -> None:
    p, d = fleet("p", "d")
    sims.reset(p, d)
    m1 = [user(long_text(40, "o"))]
    r1 = sims.turn(p, d, m1)
    r2 = _local(sims, d, m1 + [assistant(r1), user("more")], None)       # kv_transfer_params: the ids alone
    assert r2["kv_transfer_params"] is None
    assert sims.stats(d)["handles_leased_now"] == 0


def test_p_reads_a_local_turn_s_handle_with_d_s_own_flags(sims: Sims, fleet: Fleet) -> None:
    p, d, c = fleet("p", "d", "c")
    sims.reset(p, d, c)
    m1 = [user(long_text(60, "r"))]
    r1 = sims.turn(p, d, m1)
    m2 = m1 + [assistant(r1), user("and then?")]
    r2 = _local(sims, d, m2, P_LEG_PARAMS)
    m3 = m2 + [assistant(r2), user(long_text(30, "s"))]
    sims.reset(p)                                             # P's own cache holds nothing: it reads all
    p3 = sims.prefill(p, m3, _as_holders(r2["kv_transfer_params"]), return_token_ids=True)
    assert sims.stats(p)["prompt_tokens_loaded"] == r2["kv_transfer_params"]["remote_num_tokens"]
    r3 = sims.decode(d, m3, p3["kv_transfer_params"])
    assert sims.stats(p)["kv_reads_corrupt"] == sims.stats(d)["kv_reads_corrupt"] == 0
    assert r3["choices"][0]["token_ids"] == sims.chat(c, m3, return_token_ids=True)["choices"][0]["token_ids"]


def test_a_late_read_of_a_lease_is_not_declined(sims: Sims, fleet: Fleet) -> None:
    """No expiry in the handle: P cannot tell, reads freed blocks (vLLM: HTTP 200, wrong answer)."""
    p, d = fleet("p", "d_tiny")                  # D's lease 0.6 s, few blocks: freed ones are soon reused
    sims.reset(p, d)
    m1 = [user(long_text(80, "l"))]              # over the recompute threshold: P reads rather than computes
    r1 = sims.turn(p, d, m1)
    m2 = m1 + [assistant(r1), user("go")]
    r2 = _local(sims, d, m2, P_LEG_PARAMS)
    time.sleep(1.0)
    sims.stats(d)                                # expiry runs on D's clock
    for i in range(5):          # other requests held for readers take every free block, the freed ones too
        sims.chat(d, [user(long_text(100, f"x{i}"))], max_tokens=8, kv_transfer_params=P_LEG_PARAMS)
    sims.reset(p)                                # P's own cache holds nothing: it reads all it is given
    sims.prefill(p, m2 + [assistant(r2), user("late")], _as_holders(r2["kv_transfer_params"]))
    assert sims.stats(d)["handles_read_after_expiry"] == 1
    assert sims.stats(p)["kv_reads_corrupt"] > 0


def test_d_reads_p_s_blocks_below_the_recompute_threshold(sims: Sims, fleet: Fleet) -> None:
    """vLLM 0.32 skips short reads only where P reads D: D loads even a few tokens past its cache."""
    p, d = fleet("p", "d")
    sims.reset(p, d)
    m1 = [user(long_text(60, "t"))]
    r1 = sims.turn(p, d, m1)
    m2 = m1 + [assistant(r1), user("x")]
    p2 = sims.prefill(p, m2, r1["kv_transfer_params"], return_token_ids=True)
    before = sims.stats(d)["prompt_tokens_loaded"]
    sims.decode(d, m2, p2["kv_transfer_params"])
    loaded = sims.stats(d)["prompt_tokens_loaded"] - before
    assert 0 < loaded < 64                      # under the threshold, read all the same
