"""Push mode end to end (issue 26, docs/protocol.md §8): the gateway in front of push-mode simulators
(`--kv-transfer-mode push --no-bidirectional`), real HTTP throughout. Every answer is compared with a co-located
engine given the same conversation; the simulator's oracle checks every KV slot D uses (P's WRITE of another
prompt's KV would count as corrupt); and after each test nothing is left held: no D waiting for a WRITE, no
orphaned D blocks, no registration or staged blocks on P (the sims' /sim/stats push_* gauges)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from gateway.processes import start
from tests.e2e.chat import Chat
from tests.e2e.stack import Stack, stack

pytestmark = pytest.mark.integration

BLOCK = 16
PUSH = ["--kv-transfer-mode", "push", "--no-bidirectional", "--output-tokens", "20:40"]


def topic(i: int) -> str:
    return f"Question {i}: what would a careful operator check before moving change {i} to push mode?"


def long_text(words: int, tag: str) -> str:
    return " ".join(f"{tag}{i} carries some more words to prefill" for i in range(words))


def settled(pd: Stack, *, orphans: int = 0) -> None:
    """Nothing held on any engine: no D request waiting, `orphans` aborted D requests still holding blocks (vLLM
    frees them only on a WRITE), no registration or finished blocks left on P, no block in use but theirs."""
    def clean() -> bool:
        ps, ds = [pd.stats(p) for p in pd.prefill], [pd.stats(d) for d in pd.decode]
        return (all(s["push_registrations_pending"] == 0 and s["blocks_in_use"] == 0 for s in ps)
                and all(s["push_waiting"] == 0 and s["running"] == 0 for s in ds)
                and sum(s["push_orphans"] for s in ds) == orphans
                and (orphans or all(s["blocks_in_use"] == 0 for s in ds)))
    pd.wait_until(clean, timeout_s=10)
    assert pd.total("kv_reads_corrupt") == 0 and pd.total("requests_corrupt") == 0


def writes(pd: Stack) -> int:
    return sum(pd.stats(d)["push_writes_received"] for d in pd.decode)


@pytest.fixture(scope="module")
def pd():
    with stack(sim=PUSH, decode=(), local=True, decodes=2,       # the local cap 256: an idle D's whole bound
               gateway=["--decode-first-byte-timeout-s", "3", "--prefill-timeout-s", "5",
                        "--local-prefill-max-tokens", "256"]) as s:
        yield s


def test_start_up_learns_ps_identity_with_one_pair_and_reports_push(pd):
    log = pd.gateway.log()
    assert "transfer push (as every engine's /server_info shows)" in log
    assert "push identity p0@127.0.0.1:" in log and "a pair with decode" in log and "answered" in log
    assert "reuse    push: P writes its KV into D's blocks" in log
    settled(pd)                       # the identity pair's WRITE consumed P's blocks: nothing left leased


@pytest.mark.parametrize("stream", [False, True])
def test_first_turns_are_pairs_and_exact(pd, stream):
    before = writes(pd)
    chats = [Chat(pd, uuid.uuid4().hex) for _ in range(6)]
    with ThreadPoolExecutor(6) as pool:            # concurrent pairs, one id each
        turns = list(pool.map(lambda c: c.say(long_text(8, c.session[:6]), stream=stream), chats))
    for turn in turns:
        assert (turn.plan, turn.reason, turn.reused) == ("full", "first_turn", 0)
        assert turn.text == turn.expected
    assert writes(pd) - before == 6                 # every D got P's WRITE, none prefilled alone
    assert pd.metric("pdgw_turns_total", plan="full", reason="first_turn") >= 6
    settled(pd)


def test_later_turns_go_local_on_the_holder_then_push_mode_for_a_long_suffix(pd):
    chat = Chat(pd, uuid.uuid4().hex)
    first = chat.say(topic(0))
    assert first.plan == "full" and first.text == first.expected
    p_before = sum(pd.stats(p)["prompt_tokens_computed"] for p in pd.prefill)
    w_before = writes(pd)
    local = chat.say(topic(1), stream=True)
    held = first.prompt_tokens + first.completion_tokens - 1
    assert (local.plan, local.reason, local.reused) == ("local", "short_suffix", held // BLOCK * BLOCK)
    assert local.text == local.expected
    assert sum(pd.stats(p)["prompt_tokens_computed"] for p in pd.prefill) == p_before and writes(pd) == w_before
    long = chat.say(long_text(60, "ls"))                 # far over the 256-token local bound
    assert (long.plan, long.reason, long.reused) == ("full", "push_mode", 0) and long.text == long.expected
    # D registered only what its own prefix cache lacked: P wrote the new blocks, not the history
    again = chat.say(topic(3))
    assert again.plan == "local" and again.text == again.expected
    assert all(pd.stats(d)["handles_pinned"] == 0 for d in pd.decode)      # D returns no handle in push mode
    settled(pd)


def test_a_conversation_without_a_session_id_is_found_by_its_tokens_in_push_mode(pd):
    """D returns no handle in push mode; the store files the record under an empty one (kv.stored), so the next
    turn without a session id still finds the conversation and goes to its D alone."""
    messages = [{"role": "user", "content": topic(50)}]
    client, seen = pd.client(), []
    for i in range(1, 4):
        raw = client.chat.completions.with_raw_response.create(model="demo", messages=messages, max_tokens=60)
        text = raw.parse().choices[0].message.content
        expected = pd.baseline_client().chat.completions.create(model="demo", messages=messages, max_tokens=60)
        assert text == expected.choices[0].message.content
        seen.append((raw.headers["x-pd-plan"], raw.headers["x-pd-conversation"]))
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": topic(50 + i)}]
    assert seen == [("full", "new"), ("local", "prefix"), ("local", "prefix")], seen
    settled(pd)


def test_a_p_failing_once_is_redone_with_the_same_id_and_rescues_d(pd):
    p = pd.prefill[0]
    before = pd.stats(p)
    pd_post(p, "/sim/push-fault", {"push_fault": "fail-prefill", "times": 1})
    chat = Chat(pd, uuid.uuid4().hex)
    turn = chat.say(long_text(10, "pf"))
    assert (turn.plan, turn.reason) == ("full", "first_turn") and turn.text == turn.expected
    after = pd.stats(p)
    assert after["requests_failed"] - before["requests_failed"] == 1          # P's first leg, HTTP 500
    assert after["push_writes_sent"] - before["push_writes_sent"] == 1       # the redo wrote into D's blocks
    assert pd.metric("pdgw_push_decode_aborts_total", reason="prefill_failed") == 0
    settled(pd)


def test_a_client_leaving_before_ds_first_byte_leaves_nothing_held(pd):
    """Litestar runs a non-streamed handler to its end (the client's absence shows only when the answer is written,
    in pull mode too): the pair completes on both engines, and nothing stays held."""
    p = pd.prefill[0]
    pd_post(p, "/sim/timing", {"prefill_ms_per_token": 10})
    try:
        before = writes(pd)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(pd.gateway.url + "/v1/chat/completions", timeout=0.2,
                       json={"model": "demo", "max_tokens": 20,
                             "messages": [{"role": "user", "content": long_text(10, "cg")}]})
        pd.wait_until(lambda: writes(pd) == before + 1)
    finally:
        pd_post(p, "/sim/timing", {"prefill_ms_per_token": 0})
    settled(pd)


def test_a_client_leaving_mid_stream_frees_everything(pd):
    for d in pd.decode:
        pd_post(d, "/sim/timing", {"decode_ms_per_token": 30})
    try:
        with httpx.stream("POST", pd.gateway.url + "/v1/chat/completions", timeout=10,
                          json={"model": "demo", "stream": True, "max_tokens": 40,
                                "messages": [{"role": "user", "content": long_text(6, "ms")}]}) as resp:
            assert resp.status_code == 200
            next(resp.iter_bytes())                  # one chunk, then the client goes away
    finally:
        for d in pd.decode:
            pd_post(d, "/sim/timing", {"decode_ms_per_token": 0})
    settled(pd)


def pd_post(server, path: str, body: dict) -> None:
    httpx.post(server.url + path, json=body, timeout=5).raise_for_status()


# -- failures that need engines of their own ------------------------------------------------------------------
def test_a_turn_cut_off_while_d_waits_aborts_d_and_lets_p_write_which_frees_ds_blocks():
    """The order docs/protocol.md §8.4 asks for, on a turn whose task is cancelled (here: the gateway shutting
    down past uvicorn's 5 s grace, mid-prefill): D is aborted at once (vLLM keeps a waiting D's blocks until a
    WRITE), P's leg is left to finish within its deadline, and its WRITE frees them."""
    with stack(sim=PUSH, decode=(), gateway=["--prefill-timeout-s", "30"]) as pd:
        p, d = pd.prefill[0], pd.decode[0]
        received = pd.stats(d)["push_writes_received"]          # the start-up identity pair's
        pd_post(p, "/sim/timing", {"prefill_ms_per_token": 50})            # 150+ tokens: 7-9 s on P
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, pd.gateway.url + "/v1/chat/completions", timeout=30,
                                  json={"model": "demo", "max_tokens": 20,
                                        "messages": [{"role": "user", "content": long_text(16, "cut")}]})
            pd.wait_until(lambda: pd.stats(d)["push_waiting"] == 1)        # D registered, waits for P
            began = time.monotonic()
            pd.gateway.proc.send_signal(signal.SIGTERM)   # 5 s of grace, then the turn's task is cancelled
            pd.gateway.proc.wait(timeout=40)                  # the shutdown waits for P's leg (its WRITE)
            with pytest.raises(httpx.HTTPError):
                pending.result().raise_for_status()
        assert time.monotonic() - began > 5.5              # P was still prefilling when the turn was cut off
        ds = pd.stats(d)
        assert ds["push_writes_after_abort"] == 1 and ds["push_orphans"] == 0
        assert ds["push_writes_received"] == received
        assert ds["blocks_in_use"] == 0 and pd.stats(p)["blocks_in_use"] == 0
        assert pd.stats(p)["push_registrations_pending"] == 0


def test_p_answering_without_writing_ends_at_the_gateways_deadline_and_the_turn_goes_elsewhere():
    """vLLM never ends a D waiting for a WRITE: the gateway does, decode_first_byte_timeout_s after P answered.
    The D it aborted keeps its blocks (vLLM frees them only on a WRITE, vllm#46283): counted, and left."""
    with stack(sim=PUSH, decode=(), prefills=2, gateway=["--decode-first-byte-timeout-s", "1"]) as pd:
        bad = pd.prefill[0]
        pd_post(bad, "/sim/push-fault", {"push_fault": "never-write"})
        results = []
        for i in range(4):                           # round-robin: some turns start on the bad P
            turn = Chat(pd, uuid.uuid4().hex).say(long_text(6, f"nw{i}"))
            assert turn.text == turn.expected
            results.append(turn.reason)
        aborted = pd.metric("pdgw_push_decode_aborts_total", reason="no_write")
        assert aborted >= 1 and set(results) == {"first_turn"}       # the pair went to the other P
        assert sum(pd.stats(d)["push_orphans"] for d in pd.decode) == aborted     # each one accounted for
        assert pd.total("kv_reads_corrupt") == 0 and pd.total("requests_corrupt") == 0


def test_a_refused_d_is_redone_with_the_same_id_on_another_d():
    with stack(sim=PUSH, decode=(), decodes=2, gateway=["--health-interval-s", "60"]) as pd:
        gone = pd.decode[1]
        gone.stop()                                  # down, and the gateway has not noticed yet
        p_before = pd.stats(pd.prefill[0])
        turns = [Chat(pd, uuid.uuid4().hex).say(long_text(6, f"dr{i}")) for i in range(4)]
        assert all(t.text == t.expected and t.reason == "first_turn" for t in turns)
        p_after = pd.stats(pd.prefill[0])
        # one P leg per turn: the D redone with the same id met P's finished blocks (or P met its registration)
        assert p_after["push_writes_sent"] - p_before["push_writes_sent"] == 4
        assert p_after["push_registrations_received"] - p_before["push_registrations_received"] == 4
        assert pd.metric("pdgw_upstream_errors_total", pool="decode", kind="engine_unavailable") >= 1
        pd.decode = pd.decode[:1]
        settled(pd)
        assert pd.stats(pd.prefill[0])["push_blocks_staged"] == 0


def test_a_restarted_p_with_a_new_engine_id_redoes_the_pair_and_is_learned():
    """P restarted between two health checks: D names the old engine id, P's handshake refuses it, D fails; P's
    answer shows the new identity, so the pair is redone with it (a new id), nobody blamed."""
    with stack(sim=[*PUSH, "--kv-lease-duration", "2"], decode=(), gateway=["--health-interval-s", "60"]) as pd:
        old = pd.prefill[0]
        port = old.port
        old.stop()
        fresh = start(["sim", "--tokenizer", "builtin:demo", *PUSH, "--kv-lease-duration", "2", "--role", "prefill",
                       "--engine-id", "p0-restarted"], port=port)
        try:
            pd.prefill = [fresh]
            turn = Chat(pd, uuid.uuid4().hex).say(long_text(6, "rs"))
            assert (turn.plan, turn.reason) == ("full", "first_turn") and turn.text == turn.expected
            assert pd.stats(pd.decode[0])["kv_load_failures"] == 1          # the stale pair's D
            assert "changed its push identity" in pd.gateway.log()
            again = Chat(pd, uuid.uuid4().hex).say(long_text(6, "r2"))     # the new identity from the start
            assert again.text == again.expected and pd.stats(pd.decode[0])["kv_load_failures"] == 1
            time.sleep(2.5)                  # the stale pair's P blocks were never met: P's lease frees them
            settled(pd)
        finally:
            fresh.stop()


def test_a_mixed_pool_is_refused_with_one_line():
    p = start(["sim", "--role", "prefill", *PUSH])
    d = start(["sim", "--role", "decode"])                     # pull mode: NixlConnector
    try:
        with pytest.raises(RuntimeError) as refused:
            start(["serve", "--prefill", p.url, "--decode", d.url])
        out = str(refused.value)
        assert "exited 1" in out and "Traceback" not in out
        assert f"pd-gateway serve: refused: mixed KV-transfer modes: push (NixlPushConnector) on prefill {p.url}; " \
               f"pull on decode {d.url}" in out
        check = subprocess.run([sys.executable, "-m", "gateway", "check", "--prefill", p.url, "--decode", d.url],
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 1 and "fail: refused: mixed KV-transfer modes" in check.stdout + check.stderr
        forced = subprocess.run([sys.executable, "-m", "gateway", "check", "--prefill", p.url, "--decode", d.url,
                                 "--kv-transfer-mode", "push"], capture_output=True, text=True, timeout=60)
        assert f"decode {d.url} runs pull mode" in forced.stdout + forced.stderr and forced.returncode == 1
    finally:
        p.stop()
        d.stop()
