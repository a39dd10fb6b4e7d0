"""Single-turn P→D: D loads P's prompt KV, P computed it, and the answer equals a co-located engine's."""

from __future__ import annotations

import pytest

from tests.servers import Server
from tests.sim.conftest import Fleet, Sims, long_text, user

pytestmark = pytest.mark.integration


@pytest.fixture
def trio(fleet: Fleet, sims: Sims) -> tuple[Server, Server, Server]:
    servers = fleet("p", "d", "c")
    sims.reset(*servers)
    return servers  # type: ignore[return-value]


def test_single_turn_p_to_d_matches_colocated(sims: Sims, trio: tuple[Server, Server, Server]) -> None:
    p, d, c = trio
    messages = [user(long_text(60))]
    p_resp = sims.prefill(p, messages)
    handle = p_resp["kv_transfer_params"]
    n = p_resp["usage"]["prompt_tokens"]
    assert handle["do_remote_prefill"] is True and handle["do_remote_decode"] is False
    assert handle["remote_num_tokens"] == n and handle["remote_request_id"].startswith("chatcmpl-")
    assert handle["remote_port"] == p.port and handle["transfer_mode"] == "pull"
    assert len(handle["remote_block_ids"][0]) == -(-n // 16)

    d_resp = sims.decode(d, messages, handle)
    alone = sims.chat(c, messages, return_token_ids=True)
    assert d_resp["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
    assert d_resp["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]

    ps, ds = sims.stats(p), sims.stats(d)
    assert ps["prompt_tokens_computed"] == n and ps["blocks_in_use"] == 0  # read: lease freed
    assert ds["prompt_tokens_loaded"] == n - 1 and ds["prompt_tokens_computed"] == 1
    assert ds["kv_reads_total"] == 1 and ds["kv_reads_corrupt"] == 0
    assert ps["handles_consumed"] == 1 and ps["heartbeats_received"] >= 1
    assert ds["handles_pinned"] == 1 and d_resp["kv_transfer_params"]["do_remote_decode"] is True


def test_d_handle_covers_prompt_and_output_minus_one(sims: Sims, trio: tuple[Server, Server, Server]) -> None:
    p, d, _ = trio
    resp = sims.turn(p, d, [user(long_text(30, "h"))])
    handle = resp["kv_transfer_params"]
    held = len(resp["prompt_token_ids"]) + len(resp["choices"][0]["token_ids"]) - 1
    assert handle["remote_num_tokens"] == held
    assert len(handle["remote_block_ids"][0]) == -(-held // 16)
    assert handle["remote_engine_id"] == sims.stats(d)["engine_id"] and handle["remote_port"] == d.port
    assert isinstance(handle["remote_blocks_expiry_time"], float)
