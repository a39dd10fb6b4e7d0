"""The simulator's side of docs/vllm-findings.md: the cases settled on real vLLM (tests/vllm/test_findings.py)
that the other sim tests do not already pin down (their twins are listed in that document)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tests.servers import Server
from tests.sim.conftest import P_LEG_PARAMS, Fleet, Sims

pytestmark = pytest.mark.integration
BS = 16


def _complete(sims: Sims, server: Server, prompt: list[int], max_tokens: int,
              params: dict[str, Any] | None = None) -> dict[str, Any]:
    body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "return_token_ids": True}
    if params is not None:
        body["kv_transfer_params"] = params
    resp = sims.post(server, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _first_turn(sims: Sims, p: Server, d: Server, prompt: list[int]) -> tuple[list[int], dict[str, Any]]:
    p1 = _complete(sims, p, prompt, 1, P_LEG_PARAMS)
    d1 = _complete(sims, d, prompt, 40, p1["kv_transfer_params"])
    return prompt + d1["choices"][0]["token_ids"], d1["kv_transfer_params"]


@pytest.mark.parametrize(("prompt_len", "agree", "blocks"), [(40, 24, 1), (120, 100, 6)],
                         ids=["one-block", "six-blocks"])
def test_a_truncated_handle_reads_exactly_its_blocks(sims: Sims, fleet: Fleet, prompt_len: int, agree: int,
                                                     blocks: int) -> None:
    p, d, c = fleet("p_recompute", "d", "c")      # threshold 0: one 16-token block is worth reading here
    sims.reset(p, d, c)
    s, handle = _first_turn(sims, p, d, list(range(100, 100 + prompt_len)))
    q = s[:agree] + list(range(3000, 3030))
    cut = dict(handle, remote_num_tokens=blocks * BS, remote_block_ids=[handle["remote_block_ids"][0][:blocks]])
    sims.reset(p)                                        # this P has nothing cached
    out = _complete(sims, p, q, 8, cut)
    ps = sims.stats(p)
    assert ps["prompt_tokens_loaded"] == blocks * BS and ps["kv_reads_corrupt"] == 0
    assert out["choices"][0]["token_ids"] == _complete(sims, c, q, 8)["choices"][0]["token_ids"]


def test_a_zero_token_handle_frees_d_blocks_even_while_d_is_busy(sims: Sims, fleet: Fleet) -> None:
    p, d = fleet("p", "d_slow")
    sims.reset(p, d)
    _, handle = _first_turn(sims, p, d, list(range(200, 300)))
    assert sims.stats(d)["handles_pinned"] == 1
    busy = threading.Thread(target=_complete, args=(sims, d, list(range(500, 540)), 40))
    busy.start()
    try:
        time.sleep(0.3)
        _complete(sims, p, [5], 1, dict(handle, remote_num_tokens=0))
        ds = sims.stats(d)
        assert ds["handles_pinned"] == 0 and ds["running"] == 1
    finally:
        busy.join()
