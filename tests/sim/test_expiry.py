"""Lifetimes: P's lease, D's pin TTL, and the reader's 5 s expiry margin under both failure policies."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from tests.servers import Server
from tests.sim.conftest import Fleet, Sims, assistant, long_text, user

pytestmark = pytest.mark.integration
SHORT_HOLD_S = 0.6  # the fleet's --kv-lease-duration / --decoder-kv-blocks-ttl


def _wait_for(sims: Sims, server: Server, key: str, value: int, within_s: float = 3.0) -> dict[str, Any]:
    deadline = time.monotonic() + within_s
    while True:
        stats = sims.stats(server)
        if stats[key] == value or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def test_lease_expiry_frees_p_blocks_and_a_late_read_is_silent(sims: Sims, fleet: Fleet) -> None:
    p, d, c = fleet("p_lease", "d", "c")
    sims.reset(p, d)
    messages = [user(long_text(30, "l"))]
    handle = sims.prefill(p, messages)["kv_transfer_params"]
    assert sims.stats(p)["handles_leased_now"] == 1 and sims.stats(p)["blocks_in_use"] > 0
    ps = _wait_for(sims, p, "handles_leased_now", 0)
    assert ps["blocks_in_use"] == 0 and ps["handles_expired"] == 1
    resp = sims.decode(d, messages, handle)  # no error: stale (here still intact) memory is read
    assert sims.stats(p)["handles_read_after_expiry"] == 1
    assert resp["choices"][0]["message"]["content"] == sims.chat(c, messages)["choices"][0]["message"]["content"]


def test_decoder_ttl_unpins_and_a_stale_read_is_silent(sims: Sims, fleet: Fleet) -> None:
    p, d = fleet("p", "d_ttl")
    sims.reset(p, d)
    messages = [user(long_text(30, "x"))]
    r1 = sims.turn(p, d, messages)
    assert sims.stats(d)["handles_pinned"] == 1
    ds = _wait_for(sims, d, "handles_pinned", 0)
    assert ds["blocks_in_use"] == 0 and ds["handles_expired"] == 1
    # An engine that does not check expiry (the field dropped) reads the freed blocks without any error.
    stale = dict(r1["kv_transfer_params"], remote_blocks_expiry_time=None)
    sims.reset(p)
    sims.prefill(p, messages + [assistant(r1), user("next")], stale)
    assert sims.stats(d)["handles_read_after_expiry"] == 1


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_handle_within_expiry_margin_is_declined(sims: Sims, fleet: Fleet, policy: str) -> None:
    p_name = "p" if policy == "fail" else "p_recompute"
    p, d, c = fleet(p_name, "d_ttl", "c")
    sims.reset(p, d)
    m1 = [user(long_text(30, "m"))]
    r1 = sims.turn(p, d, m1)  # D's pin expires in 0.6 s: inside the 5 s margin from the start
    m2 = m1 + [assistant(r1), user("next")]
    sims.reset(p)
    body = {"messages": m2, "max_tokens": 1,
            "kv_transfer_params": dict(r1["kv_transfer_params"], do_remote_decode=True)}
    if policy == "fail":
        resp = sims.raw_chat(p, body)
        assert sims.stats(p)["kv_reads_declined"] == 1 and sims.stats(p)["kv_reads_total"] == 0
        assert resp.status_code == 500
        assert resp.json() == {"error": {"message": "Internal server error", "type": "InternalServerError",
                                         "param": None, "code": 500}}
        return
    # Real vLLM 0.32 never answers it (tests/vllm/test_findings.py): parked until the client goes away, counted
    # as waiting for KV (reason 'deferred'), not for room.
    parked = threading.Thread(target=lambda: pytest.raises(httpx.ReadTimeout, sims.raw_chat, p, body, timeout=1.5))
    parked.start()
    _wait_for(sims, p, "waiting", 1)
    page = sims.http.get(p.url + "/metrics").text
    parked.join()
    assert 'reason="deferred"} 1.0' in page and 'reason="capacity"} 0.0' in page
    ps = _wait_for(sims, p, "waiting", 0)
    assert ps["kv_reads_declined"] == 1 and ps["kv_reads_total"] == 0 and ps["requests_parked"] == 1
    assert ps["waiting"] == 0 and ps["running"] == 0
    assert sims.chat(c, m2)["choices"]                           # the engine still serves


def test_unreachable_holder_fails_d_under_fail_policy(sims: Sims, fleet: Fleet) -> None:
    p, d = fleet("p", "d")
    messages = [user(long_text(30, "q"))]
    handle = sims.prefill(p, messages)["kv_transfer_params"]
    p.stop()  # P gone: D's read cannot happen
    try:
        resp = sims.raw_chat(d, {"messages": messages, "kv_transfer_params": handle})
        assert resp.status_code == 500 and resp.json()["error"]["message"] == "Internal server error"
        streamed = sims.raw_chat(d, {"messages": messages, "kv_transfer_params": handle, "stream": True})
        frames = [f for f in streamed.text.split("\n\n") if f]
        assert streamed.status_code == 200 and frames[-1] == "data: [DONE]"
        assert '"error"' in frames[-2] and '"code":500' in frames[-2]
    finally:
        del fleet.servers["p"]


def test_heartbeats_keep_p_leased_while_d_waits_for_free_blocks(sims: Sims, fleet: Fleet) -> None:
    """D's pinned handles fill its pool; a new D request waits for blocks longer than P's lease. vLLM's D keeps
    heart-beating P from arrival until it has read, so the read is of live blocks, never of freed ones."""
    p_pin, p, d = fleet("p", "p_lease", "d_tiny")
    sims.reset(p_pin, p, d)
    sims.turn(p_pin, d, [user(long_text(150, "fill"))])          # pins most of D's 48 blocks for 2 s
    assert sims.stats(d)["handles_pinned"] == 1
    messages = [user(long_text(120, "wait"))]
    handle = sims.prefill(p, messages)["kv_transfer_params"]     # leased for 0.6 s only
    began = time.monotonic()
    sims.decode(d, messages, handle)
    assert time.monotonic() - began > 3 * SHORT_HOLD_S          # it did wait for D's pin to expire
    ps = sims.stats(p)
    assert ps["handles_expired"] == 0 and ps["handles_read_after_expiry"] == 0
    assert sims.stats(d)["kv_reads_corrupt"] == 0
