"""Push mode on real vLLM 0.32 (CPU build): one P and one D on `NixlPushConnector` (docs/protocol.md §8), in dev
mode so that /server_info shows the connector, and the gateway in front in `--kv-transfer-mode auto`.

What it settles: the connector runs on the CPU build with UCX over TCP; the gateway sees the mode and learns P's
side channel from P's handle (not P's HTTP port); both legs sent at once pair by their X-Request-Id; D loads the
first turn's prompt from P's WRITE; a later turn's short suffix is served by D alone from its prefix cache (no
handle pins it); a long one goes to P while D registers only the blocks its cache lacks; every answer equals P's
own (P alone, fresh cache salt); nothing stays in use on either engine. One pair more for the tier (about 30 s to
start, about a minute of tests).
"""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.servers import Server, start
from tests.vllm.engines import SERVED_MODEL, Engine, launch, wait_healthy

pytestmark = pytest.mark.vllm

BLOCK = 128
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}       # /server_info, where the gateway reads the connector
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


@pytest.fixture(scope="module")
def push_pair(vllm_python: str, model_dir: Path, log_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    engines = [launch(vllm_python, model_dir, role, f"{role[0]}-push", log_dir, policy="fail", bidirectional=False,
                      connector="NixlPushConnector", env=DEV_MODE) for role in ("prefill", "decode")]
    try:
        wait_healthy(engines)
        yield engines[0], engines[1]
    finally:
        for engine in engines:
            engine.stop()


@pytest.fixture(scope="module")
def push_gateway(push_pair: tuple[Engine, Engine], model_dir: Path) -> Iterator[Server]:
    p, d = push_pair
    server = start(["serve", "--tokenizer", str(model_dir), "--prefill", p.url, "--decode", d.url,
                    "--health-interval-s", "1", "--local-prefill-max-tokens", "256"])
    try:
        yield server
    finally:
        server.stop()


def sources(engine: Engine) -> dict[str, float]:
    return {s: engine.metric("vllm:prompt_tokens_by_source_total", source=s) for s in SOURCES}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def chat(gateway: Server, messages: list[dict[str, Any]], session: str | None, *, stream: bool = False,
         max_tokens: int = 30) -> tuple[str, dict[str, Any], dict[str, str]]:
    body = {"model": SERVED_MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    headers = {"Content-Type": "application/json", **({"X-Session-Id": session} if session else {})}
    req = urllib.request.Request(gateway.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers=headers)
    with urllib.request.urlopen(req, timeout=120) as resp:
        raw, got = resp.read(), {k.lower(): v for k, v in resp.headers.items()}
    if not stream:
        answer = json.loads(raw)
        return answer["choices"][0]["message"]["content"], answer["usage"], got
    text, usage = "", {}
    for line in raw.decode().splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text += "".join(c["delta"].get("content") or "" for c in chunk.get("choices") or ())
            usage = chunk.get("usage") or usage
    return text, usage, got


def alone(p: Engine, messages: list[dict[str, Any]], max_tokens: int = 30) -> str:
    """P as a co-located engine: no kv_transfer_params, a fresh cache salt (nothing of the pair's reused)."""
    body = {"model": SERVED_MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "cache_salt": uuid.uuid4().hex}
    return p.post("/v1/chat/completions", body)["choices"][0]["message"]["content"]


def idle(p: Engine, d: Engine) -> None:
    """Nothing in use on either engine: P freed its blocks on the WRITE, D its own at the end."""
    deadline = time.monotonic() + 20
    while p.kv_usage() > 0 or d.kv_usage() > 0:
        assert time.monotonic() < deadline, (p.kv_usage(), d.kv_usage())
        time.sleep(0.2)


def test_the_gateway_sees_push_mode_and_learns_ps_side_channel(push_pair, push_gateway):
    p, _ = push_pair
    log = push_gateway.log()
    assert "transfer push (as every engine's /server_info shows)" in log
    # from P's own handle: its side channel (VLLM_NIXL_SIDE_CHANNEL_PORT), which is not its HTTP port
    assert f"push identity p-push@127.0.0.1:{p.side_port} tp 1 pp 1; a pair with decode" in log
    assert "answered" in log and "refused" not in log


def test_a_conversation_in_pairs_and_on_the_local_path(push_pair, push_gateway):
    p, d = push_pair
    session = uuid.uuid4().hex
    asks = [("tell me about the cache and the engine and the request " * 25, False), ("and then", True),
            ("why so " * 3, False), ("more words for the engine " * 40, True)]    # the last over the local bound
    messages: list[dict[str, Any]] = []
    for i, (ask, stream) in enumerate(asks):
        messages.append({"role": "user", "content": ask})
        before_p, before_d = sources(p), sources(d)
        text, usage, headers = chat(push_gateway, messages, session, stream=stream)
        p_did, d_did = delta(before_p, sources(p)), delta(before_d, sources(d))
        prompt, reused = usage["prompt_tokens"], int(headers["x-pd-reused-tokens"])
        plan = (headers["x-pd-plan"], headers["x-pd-reason"])
        assert text == alone(p, messages), f"turn {i + 1} ({plan}) differs from P alone"
        if i == 0:        # D loads the whole prompt from P's WRITE, computes nothing itself
            assert plan == ("full", "first_turn")
            assert d_did == {"local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": prompt}
        elif i == len(asks) - 1:      # over the local bound: P prefills, D registers only what it lacks
            assert plan == ("full", "push_mode") and reused == 0
            assert d_did["local_compute"] == 0 and d_did["local_cache_hit"] > 0
            assert d_did["local_cache_hit"] + d_did["external_kv_transfer"] == prompt
            assert p_did["local_cache_hit"] > 0                   # P's own cache: the last P prompt's blocks
        else:             # D alone: its cache's whole blocks, the rest computed; no P leg at all
            assert plan == ("local", "short_suffix") and reused > 0 and reused % BLOCK == 0
            assert d_did == {"local_compute": prompt - reused, "local_cache_hit": reused, "external_kv_transfer": 0}
            assert p_did == {s: 0 for s in SOURCES}
        messages.append({"role": "assistant", "content": text})
    idle(p, d)


def test_concurrent_first_turns_pair_by_their_ids(push_pair, push_gateway):
    p, d = push_pair
    questions = [[{"role": "user", "content": f"question {i}: what does the engine do with request {i}? " * 6}]
                 for i in range(4)]
    before = d.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: chat(push_gateway, questions[i], None, stream=i % 2 == 1), range(4)))
    for messages, (text, usage, headers) in zip(questions, answers, strict=True):
        assert headers["x-pd-plan"] == "full" and text == alone(p, messages)
    loaded = d.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - before
    assert loaded == sum(usage["prompt_tokens"] for _, usage, _ in answers)     # every D got its own WRITE
    idle(p, d)


def test_a_client_leaving_mid_stream_leaves_nothing_in_use(push_pair, push_gateway):
    p, d = push_pair
    body = {"model": SERVED_MODEL, "stream": True, "max_tokens": 400, "temperature": 0,
            "messages": [{"role": "user", "content": "a long answer about the engine, please " * 10}]}
    req = urllib.request.Request(push_gateway.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.readline().startswith(b"data: ")             # D's first token came: P's WRITE was there
    idle(p, d)
    text, _, headers = chat(push_gateway, body["messages"], None)     # and the pair still serves
    assert headers["x-pd-plan"] == "full" and text == alone(p, body["messages"])
