"""Bidirectional reuse (PROTOCOL §4): P reading D's pinned blocks, and every way it goes wrong silently."""

from __future__ import annotations

from typing import Any

import pytest

from tests.servers import Server
from tests.sim.conftest import Fleet, Sims, assistant, long_text, user

pytestmark = pytest.mark.integration
BS = 16


def _turn1(sims: Sims, p: Server, d: Server, text: str, **body: Any) -> tuple[list[dict[str, str]], dict[str, Any]]:
    messages = [user(text)]
    return messages, sims.turn(p, d, messages, **body)


def _held(resp: dict[str, Any]) -> list[int]:
    return resp["prompt_token_ids"] + resp["choices"][0]["token_ids"]


def _tokenize(sims: Sims, server: Server, messages: list[dict[str, Any]]) -> list[int]:
    return sims.post(server, "/tokenize", {"model": "demo", "messages": messages}).json()["tokens"]


def test_turn2_p_reads_d_blocks_and_computes_only_the_suffix(sims: Sims, fleet: Fleet) -> None:
    p, d, c = fleet("p", "d", "c")
    sims.reset(p, d, c)
    m1, r1 = _turn1(sims, p, d, long_text(50))
    handle = r1["kv_transfer_params"]
    held = handle["remote_num_tokens"]
    m2 = m1 + [assistant(r1), user("and then?")]
    sims.reset(p)  # no local cache on P: all of D's tokens cross
    p2 = sims.prefill(p, m2, handle, return_token_ids=True)
    q2 = p2["prompt_token_ids"]
    assert q2[:held] == _held(r1)[:held]  # canonical output: the history re-renders to D's exact tokens
    ps = sims.stats(p)
    assert (ps["prompt_tokens_loaded"], ps["prompt_tokens_computed"]) == (held, len(q2) - held)
    assert ps["kv_reads_corrupt"] == 0
    assert sims.stats(d)["handles_consumed"] == 1 and sims.stats(d)["handles_pinned"] == 0

    r2 = sims.decode(d, m2, p2["kv_transfer_params"])
    ds = sims.stats(d)
    assert ds["kv_reads_corrupt"] == 0
    assert ds["prompt_tokens_cached"] == held // BS * BS  # D's own cache still holds turn 1
    assert r2["choices"][0]["token_ids"] == sims.chat(c, m2, return_token_ids=True)["choices"][0]["token_ids"]


def test_turn2_with_p_cache_reads_only_beyond_it(sims: Sims, fleet: Fleet) -> None:
    p, d = fleet("p_recompute", "d")  # threshold 0: the short read happens
    sims.reset(p, d)
    m1, r1 = _turn1(sims, p, d, long_text(50, "c"))
    handle = r1["kv_transfer_params"]
    held, n1 = handle["remote_num_tokens"], len(r1["prompt_token_ids"])
    p2 = sims.prefill(p, m1 + [assistant(r1), user("more")], handle, return_token_ids=True)
    ps, q2 = sims.stats(p), p2["prompt_token_ids"]
    own = n1 // BS * BS
    assert ps["prompt_tokens_cached"] == own  # turn 1 computed all n1; turn 2 hits P's own blocks
    assert ps["prompt_tokens_loaded"] == held - own
    assert ps["prompt_tokens_computed"] - n1 == len(q2) - held  # only the new suffix
    assert ps["kv_reads_corrupt"] == 0


def test_short_suffix_below_threshold_is_recomputed_but_holder_notified(sims: Sims, fleet: Fleet) -> None:
    p, d, c = fleet("p", "d", "c")
    sims.reset(p, d)
    m1, r1 = _turn1(sims, p, d, long_text(50, "t"))
    m2 = m1 + [assistant(r1), user("ok")]
    p2 = sims.prefill(p, m2, r1["kv_transfer_params"])  # P's own cache leaves < 64 tokens to read
    ps, ds = sims.stats(p), sims.stats(d)
    assert ps["kv_reads_skipped"] == 1 and ps["kv_reads_total"] == 0 and ps["notifications_sent"] == 1
    assert ds["handles_consumed"] == 1 and ds["handles_pinned"] == 0 and ds["blocks_in_use"] == 0
    r2 = sims.decode(d, m2, p2["kv_transfer_params"])
    assert r2["choices"][0]["message"]["content"] == sims.chat(c, m2)["choices"][0]["message"]["content"]


def test_single_use_second_read_is_silent_then_corrupt_once_reused(sims: Sims, fleet: Fleet) -> None:
    p, d = fleet("p_recompute", "d_small")
    sims.reset(p, d)
    m1, r1 = _turn1(sims, p, d, long_text(40, "s"))
    handle = r1["kv_transfer_params"]
    m2 = m1 + [assistant(r1), user("again")]
    for _ in range(2):
        sims.reset(p)
        sims.prefill(p, m2, handle)
        assert sims.stats(p)["kv_reads_corrupt"] == 0  # freed blocks still hold the data
    assert sims.stats(d)["handles_double_read"] == sims.stats(d)["handles_reread"] == 1
    # Another request takes (nearly) every block of D's 40: the freed ones get new content.
    resp = sims.post(d, "/v1/completions", {"model": "demo", "prompt": [5] * 600, "max_tokens": 1})
    assert resp.status_code == 200, resp.text
    sims.reset(p)
    sims.prefill(p, m2, handle)
    assert sims.stats(p)["kv_reads_corrupt"] > 0 and sims.stats(d)["handles_reread"] == 2


def test_shorter_prompt_with_full_handle_reads_wrong_blocks(sims: Sims, fleet: Fleet) -> None:
    p, d, c = fleet("p", "d", "c")
    sims.reset(p, d)
    m1, r1 = _turn1(sims, p, d, long_text(50, "r"), min_tokens=40)  # D holds 2+ blocks beyond the prompt
    sims.reset(p)
    p2 = sims.prefill(p, m1, r1["kv_transfer_params"])  # a regenerate: Q shorter than R
    assert sims.stats(p)["kv_reads_corrupt"] > 0
    sims.reset(d)  # a D without turn 1 in its cache loads P's (wrong) KV and answers differently
    r2 = sims.decode(d, m1, p2["kv_transfer_params"])
    assert sims.stats(d)["kv_reads_corrupt"] > 0
    assert r2["choices"][0]["message"]["content"] != sims.chat(c, m1)["choices"][0]["message"]["content"]


def test_truncated_handle_gives_exact_partial_reuse(sims: Sims, fleet: Fleet) -> None:
    p, d, c = fleet("p", "d", "c")
    sims.reset(p, d)
    m1, r1 = _turn1(sims, p, d, long_text(50, "u"))
    m2 = m1 + [{"role": "assistant", "content": "something else entirely"}, user("go on")]
    q2, s = _tokenize(sims, c, m2), _held(r1)
    common = next(i for i, (a, b) in enumerate(zip(q2, s)) if a != b)
    cut = common // BS * BS
    handle = dict(r1["kv_transfer_params"], remote_num_tokens=cut,
                  remote_block_ids=[r1["kv_transfer_params"]["remote_block_ids"][0][: cut // BS]])
    sims.reset(p)
    p2 = sims.prefill(p, m2, handle)
    ps = sims.stats(p)
    assert ps["prompt_tokens_loaded"] == cut and ps["kv_reads_corrupt"] == 0
    r2 = sims.decode(d, m2, p2["kv_transfer_params"])
    assert r2["choices"][0]["message"]["content"] == sims.chat(c, m2)["choices"][0]["message"]["content"]


def test_release_handle_frees_d_blocks_without_data(sims: Sims, fleet: Fleet) -> None:
    p, d = fleet("p", "d")
    sims.reset(p, d)
    m1, r1 = _turn1(sims, p, d, long_text(20, "z"))
    assert sims.stats(d)["handles_pinned"] == 1
    sims.prefill(p, [user("warm-up")], dict(r1["kv_transfer_params"], remote_num_tokens=0))
    ps, ds = sims.stats(p), sims.stats(d)
    assert ps["kv_reads_total"] == 0 and ps["prompt_tokens_loaded"] == 0 and ps["notifications_sent"] == 1
    assert ds["handles_pinned"] == 0 and ds["blocks_in_use"] == 0


def test_a_release_sent_again_is_a_notification_and_a_read_after_it_a_reread(sims: Sims, fleet: Fleet) -> None:
    """D counts each claim of a spent handle by what arrived: a second release is ignored (vLLM logs it); a read
    after the release copies freed blocks."""
    p, d = fleet("p", "d")
    sims.reset(p, d)
    m1, r1 = _turn1(sims, p, d, long_text(50, "w"))
    handle = r1["kv_transfer_params"]
    for _ in range(2):
        sims.prefill(p, [user("warm-up")], dict(handle, remote_num_tokens=0))
    ds = sims.stats(d)
    assert (ds["handles_double_read"], ds["handles_renotified"], ds["handles_reread"]) == (1, 1, 0)
    sims.reset(p)
    sims.prefill(p, m1 + [assistant(r1), user("more")], handle)
    ds = sims.stats(d)
    assert (ds["handles_double_read"], ds["handles_renotified"], ds["handles_reread"]) == (2, 1, 1)
