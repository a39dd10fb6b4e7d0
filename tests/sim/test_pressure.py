"""A D whose pool is full of pinned handles: new requests wait (not fail), are shown waiting in /sim/stats and
vLLM's metrics, and are admitted as soon as a pin is released."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tests.sim.conftest import Fleet, Sims, long_text, running, user

pytestmark = pytest.mark.integration


def _until(sims: Sims, server, check, within_s: float = 5.0) -> dict[str, Any]:
    deadline = time.monotonic() + within_s
    while True:
        stats = sims.stats(server)
        if check(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def _metric(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(name + "{"))
    return float(line.rpartition(" ")[2])


def test_full_d_makes_a_request_wait_until_a_pin_is_released(sims: Sims, fleet: Fleet) -> None:
    (p,) = fleet("p")
    with running("--role", "decode", "--num-blocks", "48", "--decoder-kv-blocks-ttl", "60",
                 "--output-tokens", "8:8") as d:
        sims.reset(p)
        pinned = sims.turn(p, d, [user(long_text(150, "fill"))])["kv_transfer_params"]  # most of D's 48 blocks
        metrics = sims.http.get(d.url + "/metrics").text
        assert 'num_gpu_blocks="48"' in metrics and _metric(metrics, "vllm:kv_cache_usage_perc") > 0.5
        messages = [user(long_text(120, "wait"))]
        handle = sims.prefill(p, messages)["kv_transfer_params"]
        done: dict[str, Any] = {}
        waiter = threading.Thread(target=lambda: done.update(sims.decode(d, messages, handle)))
        waiter.start()
        try:
            stats = _until(sims, d, lambda s: s["waiting"] == 1)
            assert stats["waiting"] == 1 and stats["running"] == 0 and stats["requests_failed"] == 0
            assert _metric(sims.http.get(d.url + "/metrics").text, "vllm:num_requests_waiting") == 1.0
            time.sleep(0.3)
            assert waiter.is_alive()                     # still waiting: the pin holds the blocks for 60 s
            # The gateway's release of an idle handle (here the notification it causes) frees the blocks.
            released = time.monotonic()
            sims.post(d, "/sim/kv/notify", {"request_id": pinned["remote_request_id"],
                                            "engine_id": pinned["remote_engine_id"], "reader": "test"})
            waiter.join(timeout=10)
            assert not waiter.is_alive() and time.monotonic() - released < 2
        finally:
            waiter.join(timeout=10)
        assert done["choices"][0]["message"]["content"] and done["kv_transfer_params"] is not None  # pinned too
        stats = sims.stats(d)
        assert stats["requests_waited_for_blocks"] == 1 and stats["block_wait_seconds_max"] >= 0.3
        assert stats["waiting"] == 0 and stats["kv_reads_corrupt"] == 0


def test_reset_can_resize_the_pool_and_refuses_a_bad_size(sims: Sims) -> None:
    with running("--role", "colocated", "--num-blocks", "200") as c:
        resp = sims.post(c, "/sim/reset", {"num_blocks": 8})
        assert resp.status_code == 200 and resp.json()["num_blocks"] == 8
        assert 'num_gpu_blocks="8"' in sims.http.get(c.url + "/metrics").text
        sims.chat(c, [user("short")], max_tokens=4)                      # fits in 8 blocks
        assert sims.raw_chat(c, {"messages": [user(long_text(200, "big"))]}).status_code == 400  # never fits
        assert sims.post(c, "/sim/reset", {"num_blocks": 0}).status_code == 400
        assert sims.post(c, "/sim/reset", {}).json()["num_blocks"] == 8   # no size: kept
