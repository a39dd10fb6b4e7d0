"""Push mode (vLLM's NixlPushConnector, docs/protocol.md §8): D registers its blocks with P, P writes into them.

Both legs carry the same X-Request-Id and may arrive in either order; D's push leg names P, not P's blocks.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.servers import Server, start
from tests.sim.conftest import P_LEG_PARAMS, Fleet, Sims, long_text, user

pytestmark = pytest.mark.integration
BS = 16  # the sims' block size


@pytest.fixture
def trio(fleet: Fleet, sims: Sims) -> Iterator[tuple[Server, Server, Server]]:
    servers = fleet("p_push", "d_push", "c")
    sims.reset(*servers)
    yield servers  # type: ignore[misc]
    p = servers[0]
    sims.post(p, "/sim/push-fault", {"push_fault": "none"}).raise_for_status()
    sims.post(p, "/sim/timing", {"prefill_ms_per_token": 0, "transfer_ms_per_block": 0}).raise_for_status()


def p_leg(p: Server, messages: list[dict[str, Any]], rid: str, timeout: float = 30) -> httpx.Response:
    """The P leg, as in pull mode (docs/protocol.md §3, §8.2)."""
    return httpx.post(p.url + "/v1/chat/completions", headers={"X-Request-Id": rid}, timeout=timeout,
                      json={"model": "demo", "messages": messages, "max_tokens": 1, "stream": False,
                            "kv_transfer_params": P_LEG_PARAMS})


def push_params(p: Server, engine_id: str, rid: str = "x") -> dict[str, Any]:
    """P's identity instead of P's blocks (docs/protocol.md §8.2); `remote_request_id` as a concurrent dispatcher
    can know it, P's id without its random suffix (vLLM 0.32 needs the field)."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id,
            "remote_host": "127.0.0.1", "remote_port": p.port, "tp_size": 1, "pp_size": 1,
            "remote_request_id": f"chatcmpl-{rid}"}


def d_leg(d: Server, p: Server, engine_id: str, messages: list[dict[str, Any]], rid: str, timeout: float = 30,
          **body: Any) -> httpx.Response:
    return httpx.post(d.url + "/v1/chat/completions", headers={"X-Request-Id": rid}, timeout=timeout,
                      json={"model": "demo", "messages": messages, "return_token_ids": True,
                            "kv_transfer_params": push_params(p, engine_id, rid), **body})


def wait_until(check: Callable[[], bool], within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def blocks(n_tokens: int) -> int:
    return -(-n_tokens // BS)


def _alone(sims: Sims, c: Server, messages: list[dict[str, Any]]) -> list[int]:
    return sims.chat(c, messages, return_token_ids=True)["choices"][0]["token_ids"]


def _settled(sims: Sims, *servers: Server) -> bool:
    return wait_until(lambda: all(sims.stats(s)["blocks_in_use"] == 0 for s in servers))


def test_push_refuses_bidirectional_transfer() -> None:
    with pytest.raises(RuntimeError, match="Bidirectional KV transfer is not supported for NIXL push connector"):
        start(["sim", "--role", "decode", "--kv-transfer-mode", "push"])


def test_server_info_and_p_handle_name_the_push_mode(sims: Sims, trio: tuple[Server, Server, Server]) -> None:
    p, d, _ = trio
    for server, role in ((p, "kv_producer"), (d, "kv_consumer")):
        kv = sims.http.get(server.url + "/server_info?config_format=json").json()["vllm_config"]["kv_transfer_config"]
        assert kv["kv_connector"] == "NixlPushConnector" and kv["kv_role"] == role
        assert kv["kv_connector_extra_config"]["bidirectional_kv_xfer"] is False
    extra = sims.http.get(d.url + "/server_info").json()["vllm_config"]["kv_transfer_config"]
    assert extra["kv_connector_extra_config"]["push_registration_timeout"] == 1.0
    handle = p_leg(p, [user("hello there")], "t-mode").json()["kv_transfer_params"]
    assert handle["transfer_mode"] == "push" and handle["do_remote_prefill"] is True


def test_d_first_then_p_writes_into_d_blocks(sims: Sims, trio: tuple[Server, Server, Server]) -> None:
    p, d, c = trio
    pid, messages = sims.stats(p)["engine_id"], [user(long_text(60, "df"))]
    with ThreadPoolExecutor(1) as pool:
        d_resp = pool.submit(d_leg, d, p, pid, messages, "t-dfirst")
        assert wait_until(lambda: sims.stats(p)["push_registrations_pending"] == 1)  # D registered, P not there
        assert not d_resp.done() and sims.stats(d)["push_waiting"] == 1
        assert p_leg(p, messages, "t-dfirst").status_code == 200
        body = d_resp.result().json()
    n = body["usage"]["prompt_tokens"]
    assert body["kv_transfer_params"] is None  # D returns no handle in push mode (push_scheduler.py:247-250)
    assert body["choices"][0]["token_ids"] == _alone(sims, c, messages)
    ds = sims.stats(d)
    assert ds["push_registrations_sent"] == 1 and ds["push_writes_received"] == 1
    assert ds["push_blocks_received"] == blocks(n) and ds["kv_reads_total"] == 0
    assert ds["prompt_tokens_loaded"] == n - 1 and ds["prompt_tokens_computed"] == 1
    assert ds["kv_reads_corrupt"] == 0 and ds["handles_pinned"] == 0
    assert _settled(sims, p, d)  # P frees its lease once the write completed
    ps = sims.stats(p)
    assert ps["push_writes_sent"] == 1 and ps["push_blocks_written"] == blocks(n) and ps["handles_consumed"] == 1
    assert ps["push_registrations_pending"] == 0 and ps["push_blocks_staged"] == 0


def test_p_first_then_d_matches_the_staged_blocks(sims: Sims, trio: tuple[Server, Server, Server]) -> None:
    p, d, c = trio
    pid, messages = sims.stats(p)["engine_id"], [user(long_text(45, "pf"))]
    assert p_leg(p, messages, "t-pfirst").status_code == 200
    ps = sims.stats(p)
    assert ps["push_blocks_staged"] == 1 and ps["handles_leased_now"] == 1 and ps["push_writes_sent"] == 0
    body = d_leg(d, p, pid, messages, "t-pfirst").json()
    assert body["choices"][0]["token_ids"] == _alone(sims, c, messages)
    assert body["kv_transfer_params"] is None and sims.stats(d)["kv_reads_corrupt"] == 0
    assert _settled(sims, p, d)
    assert sims.stats(p)["push_blocks_staged"] == 0 and sims.stats(p)["push_writes_sent"] == 1


def test_concurrent_pairs_in_any_order_are_exact(sims: Sims, trio: tuple[Server, Server, Server]) -> None:
    p, d, c = trio
    pid = sims.stats(p)["engine_id"]
    prompts = {f"t-pair{i}": [user(long_text(20 + 7 * i, f"c{i}"))] for i in range(6)}
    legs: list[tuple[str, str]] = [(rid, leg) for rid in prompts for leg in ("p", "d")]
    random.Random(7).shuffle(legs)

    def send(rid: str, leg: str) -> httpx.Response:
        return p_leg(p, prompts[rid], rid) if leg == "p" else d_leg(d, p, pid, prompts[rid], rid)

    with ThreadPoolExecutor(len(legs)) as pool:
        answers = {(rid, leg): f for (rid, leg), f in zip(legs, pool.map(lambda x: send(*x), legs))}
    for rid, messages in prompts.items():
        assert answers[(rid, "p")].status_code == 200
        assert answers[(rid, "d")].json()["choices"][0]["token_ids"] == _alone(sims, c, messages)
    ds = sims.stats(d)
    assert ds["push_writes_received"] == 6 and ds["kv_reads_corrupt"] == 0 and ds["requests_corrupt"] == 0
    assert _settled(sims, p, d)
    ps = sims.stats(p)
    assert ps["push_writes_sent"] == 6 and ps["push_registrations_pending"] == 0 and ps["push_blocks_staged"] == 0


def test_streamed_d_leg(sims: Sims, trio: tuple[Server, Server, Server]) -> None:
    p, d, c = trio
    pid, messages = sims.stats(p)["engine_id"], [user(long_text(30, "st"))]
    assert p_leg(p, messages, "t-stream").status_code == 200
    text = d_leg(d, p, pid, messages, "t-stream", stream=True).text
    assert text.rstrip().endswith("data: [DONE]") and "kv_transfer_params" not in text
    assert sims.stats(d)["push_writes_received"] == 1 and sims.stats(d)["kv_reads_corrupt"] == 0


def test_a_shared_request_id_pairs_wrong_prompts_and_the_oracle_sees_it(
        sims: Sims, trio: tuple[Server, Server, Server]) -> None:
    """vLLM pairs the legs by id and checks counts, never tokens (docs/protocol.md §8.2): one id for two
    dispatches writes one prompt's KV into the other's blocks, with no error."""
    p, d, _ = trio
    pid = sims.stats(p)["engine_id"]
    a, b = [user(long_text(40, "aa"))], [user(long_text(40, "bb"))]
    with ThreadPoolExecutor(1) as pool:
        d_resp = pool.submit(d_leg, d, p, pid, a, "t-shared")
        assert wait_until(lambda: sims.stats(p)["push_registrations_pending"] == 1)
        assert p_leg(p, b, "t-shared").status_code == 200
        assert d_resp.result().status_code == 200
    ds = sims.stats(d)
    assert ds["push_writes_received"] == 1 and ds["requests_corrupt"] == 1 and ds["kv_reads_corrupt"] > 0


def test_write_time_is_paid_per_block_and_d_cache_hits_are_not_written(
        sims: Sims, trio: tuple[Server, Server, Server]) -> None:
    p, d, c = trio
    ms = 25.0
    sims.post(p, "/sim/timing", {"transfer_ms_per_block": ms}).raise_for_status()
    pid, messages = sims.stats(p)["engine_id"], [user(long_text(70, "tm"))]
    assert p_leg(p, messages, "t-time1").status_code == 200  # P done: D's wait is the write alone
    started = time.monotonic()
    body = d_leg(d, p, pid, messages, "t-time1").json()
    elapsed = time.monotonic() - started
    n = body["usage"]["prompt_tokens"]
    assert elapsed >= blocks(n) * ms / 1000
    # The same prompt again on the same D: its prefix cache holds all but the block of the last token, so D
    # registers (and P writes) only that one (nixl/push_scheduler.py:171, base_worker.py:3446-3455).
    assert p_leg(p, messages, "t-time2").status_code == 200
    again = d_leg(d, p, pid, messages, "t-time2").json()
    assert again["choices"][0]["token_ids"] == body["choices"][0]["token_ids"] == _alone(sims, c, messages)
    ds = sims.stats(d)
    hits = (n - 1) // BS
    assert ds["push_blocks_received"] == blocks(n) + blocks(n) - hits and ds["kv_reads_corrupt"] == 0
    assert _settled(sims, p, d) and sims.stats(p)["push_blocks_written"] == ds["push_blocks_received"]


def test_p_failing_leaves_d_waiting_until_p_is_redone_with_the_same_id(
        sims: Sims, trio: tuple[Server, Server, Server]) -> None:
    p, d, c = trio
    pid, messages = sims.stats(p)["engine_id"], [user(long_text(35, "px"))]
    sims.post(p, "/sim/push-fault", {"push_fault": "fail-prefill"}).raise_for_status()
    with ThreadPoolExecutor(1) as pool:
        d_resp = pool.submit(d_leg, d, p, pid, messages, "t-pfail")
        assert wait_until(lambda: sims.stats(p)["push_registrations_pending"] == 1)
        failed = p_leg(p, messages, "t-pfail")
        assert failed.status_code == 500 and failed.json()["error"]["message"] == "Internal server error"
        time.sleep(0.3)
        assert not d_resp.done() and sims.stats(d)["push_waiting"] == 1  # nobody tells D (§8.4)
        # The same id on the same P matches D's pending registration: D's request is rescued.
        sims.post(p, "/sim/push-fault", {"push_fault": "none"}).raise_for_status()
        assert p_leg(p, messages, "t-pfail").status_code == 200
        body = d_resp.result().json()
    assert body["choices"][0]["token_ids"] == _alone(sims, c, messages)
    assert sims.stats(d)["kv_reads_corrupt"] == 0 and _settled(sims, p, d)


def test_p_never_writing_d_waits_past_its_watchdog_and_keeps_its_blocks(
        sims: Sims, trio: tuple[Server, Server, Server]) -> None:
    p, d, _ = trio
    pid, messages = sims.stats(p)["engine_id"], [user(long_text(35, "nw"))]
    sims.post(p, "/sim/push-fault", {"push_fault": "never-write"}).raise_for_status()
    handle = p_leg(p, messages, "t-never").json()["kv_transfer_params"]
    assert handle["transfer_mode"] == "push"  # P answers normally, then writes nothing
    with pytest.raises(httpx.ReadTimeout):  # the watchdog (1 s) does not end D's request: only the client does
        d_leg(d, p, pid, messages, "t-never", timeout=2.5)
    n = handle["remote_num_tokens"]
    assert wait_until(lambda: sims.stats(d)["push_orphans"] == 1)
    ds = sims.stats(d)
    assert ds["push_registrations_timed_out"] == 1 and ds["push_waiting"] == 0
    assert ds["blocks_in_use"] == blocks(n) and ds["waiting"] == 0 and ds["running"] == 0  # held: vLLM #46283
    ps = sims.stats(p)
    assert ps["push_writes_withheld"] == 1 and ps["push_registrations_pending"] == 1
    assert wait_until(lambda: sims.stats(p)["blocks_in_use"] == 0)  # P's lease (3 s) frees P's side
    assert sims.stats(p)["handles_expired"] == 1
    # A P leg redone with the same id matches the pending registration; its write frees D's held blocks.
    sims.post(p, "/sim/push-fault", {"push_fault": "none"}).raise_for_status()
    assert p_leg(p, messages, "t-never").status_code == 200
    assert _settled(sims, p, d)
    assert sims.stats(d)["push_writes_after_abort"] == 1 and sims.stats(d)["push_orphans"] == 0


def test_client_abort_on_d_holds_its_blocks_until_p_writes(sims: Sims, trio: tuple[Server, Server, Server]) -> None:
    p, d, _ = trio
    pid, messages = sims.stats(p)["engine_id"], [user(long_text(30, "ab"))]
    with pytest.raises(httpx.ReadTimeout):
        d_leg(d, p, pid, messages, "t-dabort", timeout=0.5)
    assert wait_until(lambda: sims.stats(d)["push_orphans"] == 1)
    assert sims.stats(d)["blocks_in_use"] > 0
    assert p_leg(p, messages, "t-dabort").status_code == 200
    assert _settled(sims, p, d)
    ds = sims.stats(d)
    assert ds["push_writes_after_abort"] == 1 and ds["push_orphans"] == 0 and ds["push_writes_received"] == 0


def test_client_abort_on_p_leaves_d_waiting(sims: Sims, trio: tuple[Server, Server, Server]) -> None:
    p, d, c = trio
    pid, messages = sims.stats(p)["engine_id"], [user(long_text(40, "pa"))]
    sims.post(p, "/sim/timing", {"prefill_ms_per_token": 30}).raise_for_status()  # about 1.5 s of prefill
    with ThreadPoolExecutor(1) as pool:
        d_resp = pool.submit(d_leg, d, p, pid, messages, "t-pabort")
        assert wait_until(lambda: sims.stats(p)["push_registrations_pending"] == 1)
        with pytest.raises(httpx.ReadTimeout):
            p_leg(p, messages, "t-pabort", timeout=0.3)  # P's prefill is aborted: no write
        assert wait_until(lambda: sims.stats(p)["running"] == 0 and sims.stats(p)["blocks_in_use"] == 0)
        assert not d_resp.done() and sims.stats(d)["push_waiting"] == 1
        assert sims.stats(p)["push_writes_sent"] == 0
        sims.post(p, "/sim/timing", {"prefill_ms_per_token": 0}).raise_for_status()
        assert p_leg(p, messages, "t-pabort").status_code == 200  # redone: D's request completes
        assert d_resp.result().json()["choices"][0]["token_ids"] == _alone(sims, c, messages)
    assert _settled(sims, p, d)


def test_d_that_cannot_reach_p_fails_under_fail(sims: Sims, trio: tuple[Server, Server, Server]) -> None:
    p, d, _ = trio
    resp = d_leg(d, p, "not-this-p", [user(long_text(20, "un"))], "t-unreach")  # handshake refused
    assert resp.status_code == 500 and resp.json()["error"]["message"] == "Internal server error"
    ds = sims.stats(d)
    assert ds["kv_load_failures"] == 1 and ds["push_waiting"] == 0 and ds["blocks_in_use"] == 0


@pytest.mark.parametrize("field", ["tp_size", "remote_request_id"])
def test_push_leg_without_a_field_vllm_reads_kills_ds_engine(sims: Sims, trio: tuple[Server, Server, Server],
                                                             field: str) -> None:
    """vLLM 0.32 reads them with params[...] in its scheduler: the KeyError is fatal to D's engine core (seen for
    remote_request_id on the CPU tier, nixl/metadata.py:334). Every later request fails, /health too."""
    p, d, _ = trio
    params = {k: v for k, v in push_params(p, sims.stats(p)["engine_id"]).items() if k != field}
    resp = sims.raw_chat(d, {"messages": [user("hi")], "kv_transfer_params": params})
    assert resp.status_code == 500 and sims.stats(d)["blocks_in_use"] == 0
    assert sims.raw_chat(d, {"messages": [user("hello")]}).status_code == 500
    assert sims.http.get(d.url + "/health").status_code == 500
    sims.reset(d)                                     # the test hook: as if restarted
    assert sims.http.get(d.url + "/health").status_code == 200


def test_mixed_pools_fail_the_handshake(sims: Sims, fleet: Fleet) -> None:
    """The transfer mode is in NIXL's compatibility hash (nixl/base_worker.py:1391-1395)."""
    p_push, d_push, p_pull, d_pull = fleet("p_push", "d_push", "p", "d")
    sims.reset(p_push, d_push, p_pull, d_pull)
    messages = [user(long_text(20, "mx"))]
    handle = p_leg(p_push, messages, "t-mixed1").json()["kv_transfer_params"]
    assert sims.raw_chat(d_pull, {"messages": messages, "kv_transfer_params": handle}).status_code == 500
    pull_id = sims.stats(p_pull)["engine_id"]
    assert d_leg(d_push, p_pull, pull_id, messages, "t-mixed2").status_code == 500
    assert sims.stats(d_push)["kv_load_failures"] == 1 and sims.stats(d_pull)["kv_load_failures"] == 1


def test_a_counted_fault_applies_to_that_many_p_legs(sims: Sims, trio: tuple[Server, Server, Server]) -> None:
    """A test hook for transient failures: `times` P legs get the fault, then it turns itself off."""
    p, _, _ = trio
    answer = sims.post(p, "/sim/push-fault", {"push_fault": "fail-prefill", "times": 2}).json()
    assert answer == {"push_fault": "fail-prefill", "times": 2}
    messages = [user(long_text(12, "ct"))]
    assert [p_leg(p, messages, f"t-count{i}").status_code for i in range(3)] == [500, 500, 200]
    sims.post(p, "/sim/push-fault", {"push_fault": "never-write", "times": 1}).raise_for_status()
    assert p_leg(p, messages, "t-count3").status_code == 200 and p_leg(p, messages, "t-count4").status_code == 200
    assert sims.stats(p)["push_writes_withheld"] == 1          # the second one staged its blocks for D
