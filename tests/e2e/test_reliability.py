"""Faults and hostile input end to end: dead and slow engines, disconnecting clients, overload, tenants,
a restarted Redis, and client-supplied KV handles. Nothing may hang, leak KV or reach another conversation."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import time
import uuid

import httpx
import pytest

from tests.e2e.chat import Chat
from tests.e2e.stack import stack

pytestmark = pytest.mark.integration

LONG_ANSWERS = ["--output-tokens", "80:120"]
MESSAGES = [{"role": "user", "content": "Explain retries, briefly, to a new colleague on the team."}]


def chat_body(**extra) -> dict:
    return {"model": "demo", "messages": MESSAGES, **extra}


def set_timing(server, **timing) -> None:
    httpx.post(server.url + "/sim/timing", json=timing).raise_for_status()


def test_dead_engines_are_skipped_by_retries():
    with stack(prefills=2, decodes=2, gateway=["--health-interval-s", "60"]) as s:
        s.prefill[0].stop()
        s.decode[0].stop()            # the gateway's health checks have not noticed: only retries can help
        expected = s.baseline_client().chat.completions.create(**chat_body()).choices[0].message.content
        for _ in range(4):
            out = s.client().chat.completions.create(**chat_body())
            assert out.choices[0].message.content == expected
        assert s.metric("pdgw_upstream_errors_total", pool="prefill", kind="engine_unavailable") >= 1


def test_client_disconnect_aborts_decode_and_stores_nothing():
    with stack(sim=LONG_ANSWERS) as s:
        set_timing(s.decode[0], decode_ms_per_token=20)
        session = uuid.uuid4().hex
        with httpx.stream("POST", s.gateway.url + "/v1/chat/completions", json=chat_body(stream=True),
                          headers={"X-Session-Id": session}) as resp:
            next(resp.iter_lines())
        s.wait_until(lambda: s.stats(s.decode[0])["requests_aborted"] == 1)
        assert s.stats(s.decode[0])["handles_pinned"] == 0
        set_timing(s.decode[0], decode_ms_per_token=0)
        turn = Chat(s, session, list(MESSAGES)).send()
        assert (turn.plan, turn.reason) == ("full", "previous_turn_failed")   # and stored no handle


def test_decode_stalling_mid_stream_gets_an_error_event_not_a_hang():
    with stack(gateway=["--decode-idle-timeout-s", "0.5", "--decode-first-byte-timeout-s", "5"]) as s:
        set_timing(s.decode[0], decode_ms_per_token=1500)
        began = time.monotonic()
        resp = httpx.post(s.gateway.url + "/v1/chat/completions", json=chat_body(stream=True), timeout=10)
        events = [json.loads(line[6:]) for line in resp.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        assert time.monotonic() - began < 4
        assert resp.text.rstrip().endswith("data: [DONE]")
        assert set(events[-1]["error"]) == {"message", "type", "param", "code"}
        assert events[-1]["error"]["code"] == "upstream_timeout"


def test_slow_prefill_is_a_504_in_openai_shape():
    with stack(gateway=["--prefill-timeout-s", "0.3", "--max-retries", "0"]) as s:
        set_timing(s.prefill[0], prefill_ms_per_token=50)
        began = time.monotonic()
        resp = httpx.post(s.gateway.url + "/v1/chat/completions", json=chat_body(), timeout=10)
        assert resp.status_code == 504 and resp.json()["error"]["code"] == "upstream_timeout"
        assert time.monotonic() - began < 2


def test_overload_is_429_with_retry_after():
    with stack(gateway=["--max-concurrent-turns", "1"]) as s:
        set_timing(s.decode[0], decode_ms_per_token=30)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            responses = list(pool.map(
                lambda _: httpx.post(s.gateway.url + "/v1/chat/completions", json=chat_body(), timeout=30),
                range(3)))
        statuses = sorted(r.status_code for r in responses)
        assert statuses[0] == 200 and 429 in statuses
        refused = next(r for r in responses if r.status_code == 429)
        assert refused.headers["retry-after"] and refused.json()["error"]["code"] == "rate_limit_exceeded"


def test_tenants_never_share_a_conversation():
    keys = {"alice": "sk-alice-1", "bob": "sk-bob-1"}
    entries = [f"{t}:{hashlib.sha256(k.encode()).hexdigest()}" for t, k in keys.items()]
    with stack(sim=LONG_ANSWERS, gateway=["--api-keys", *entries]) as s:
        def turn(tenant: str, messages: list[dict]) -> httpx.Response:
            return httpx.post(s.gateway.url + "/v1/chat/completions", json={"model": "demo", "messages": messages},
                              headers={"X-Session-Id": "shared-id", "Authorization": f"Bearer {keys[tenant]}"})

        assert httpx.post(s.gateway.url + "/v1/chat/completions", json=chat_body()).status_code == 401
        assert turn("alice", MESSAGES).headers["x-pd-reason"] == "first_turn"
        first = turn("alice", MESSAGES).json()["choices"][0]["message"]["content"]
        assert turn("bob", MESSAGES).headers["x-pd-reason"] == "first_turn"      # same id, other tenant
        follow = [*MESSAGES, {"role": "assistant", "content": first}, {"role": "user", "content": "More?"}]
        assert turn("alice", follow).headers["x-pd-plan"] == "reuse"
        assert s.total("kv_reads_corrupt") == 0


def test_client_handles_never_reach_an_engine():
    """A client naming D's engine, side channel and live blocks of another conversation gets nothing of it."""
    with stack(sim=LONG_ANSWERS) as s:
        victim = Chat(s, uuid.uuid4().hex)
        victim.say("Victim's first question about caches, with enough words to fill some blocks.")
        d = s.stats(s.decode[0])
        evil = {"do_remote_decode": True, "do_remote_prefill": True, "remote_engine_id": d["engine_id"],
                "remote_block_ids": [list(range(8))], "remote_host": "127.0.0.1", "remote_port": s.decode[0].port,
                "remote_request_id": "guess", "remote_num_tokens": 100}
        out = s.client().chat.completions.create(**chat_body(), extra_body={"kv_transfer_params": evil})
        assert out.choices[0].message.content == \
            s.baseline_client().chat.completions.create(**chat_body()).choices[0].message.content
        assert victim.say("And the follow-up?").plan == "reuse"
        assert s.total("kv_reads_corrupt") == 0 and s.total("handles_double_read") == 0


def test_redis_restart_costs_reuse_not_requests(redis_server):
    with stack(sim=LONG_ANSWERS, gateway=["--redis-url", redis_server.url]) as s:
        chat = Chat(s, uuid.uuid4().hex)
        chat.say("Before the restart.")
        redis_server.stop()
        during = chat.say("While Redis is down.")
        assert (during.plan, during.reason) == ("full", "store_unavailable") and during.text == during.expected
        redis_server.start()
        after = chat.say("After the restart.")
        assert after.reason == "first_turn" and after.text == after.expected
        assert chat.say("And then.").plan == "reuse"
        assert s.total("kv_reads_corrupt") == 0


def test_a_p_leg_stuck_on_a_handle_is_redone_without_it():
    """vLLM 0.32 parks a P request whose read of D's blocks it declined (docs/vllm-findings.md #8): the leg
    carrying the handle gets its own short deadline, then the same P prefills without the handle."""
    with stack(sim=LONG_ANSWERS, gateway=["--prefill-handle-timeout-s", "0.5", "--max-retries", "1"]) as s:
        chat = Chat(s, uuid.uuid4().hex)
        chat.say("The first question, long enough to fill a few blocks of the cache.")
        set_timing(s.prefill[0], transfer_ms_per_block=300)     # reading D's blocks now takes seconds
        began = time.monotonic()
        turn = chat.say("The second question.")
        assert (turn.plan, turn.reason) == ("full", "prefill_failed") and turn.text == turn.expected
        assert time.monotonic() - began < 5
        assert s.total("kv_reads_corrupt") == 0
