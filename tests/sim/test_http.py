"""vLLM's HTTP surface as the simulator serves it: shapes, streaming, aborts, errors, prompt pinning."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from tests.servers import Server
from tests.sim.conftest import Fleet, Sims, long_text, user

pytestmark = pytest.mark.integration
THINK_OPEN, THINK_CLOSE = 4096, 4097


def _frames(text: str) -> list[Any]:
    out = []
    for frame in text.split("\n\n"):
        if frame:
            assert frame.startswith("data: ")
            data = frame[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _stream(sims: Sims, server: Server, body: dict[str, Any]) -> list[Any]:
    resp = sims.raw_chat(server, {"stream": True, **body})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    return _frames(resp.text)


def test_streamed_chat_shape_matches_non_streamed(sims: Sims, fleet: Fleet) -> None:
    [c] = fleet("c")
    messages = [user("stream please")]
    whole = sims.chat(c, messages, return_token_ids=True)
    frames = _stream(sims, c, {"messages": messages, "return_token_ids": True,
                               "stream_options": {"include_usage": True}})
    first, *tokens, usage, done = frames
    assert done == "[DONE]"
    assert first["object"] == "chat.completion.chunk" and first["id"].startswith("chatcmpl-")
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["prompt_token_ids"] == whole["prompt_token_ids"]
    assert [t for f in tokens for t in f["choices"][0]["token_ids"]] == whole["choices"][0]["token_ids"]
    assert "".join(f["choices"][0]["delta"].get("content", "") for f in tokens) == \
        whole["choices"][0]["message"]["content"]
    assert [f["choices"][0]["finish_reason"] for f in tokens][-2:] == [None, "stop"]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert all("kv_transfer_params" not in f for f in frames[:-1])


def test_non_streamed_chat_shape(sims: Sims, fleet: Fleet) -> None:
    [c] = fleet("c")
    resp = sims.http.post(c.url + "/v1/chat/completions", headers={"X-Request-Id": "abc"},
                          json={"model": "demo", "messages": [user("hi")], "max_tokens": 3, "ignore_eos": True,
                                "some_unknown_field": 1})
    body = resp.json()
    assert resp.status_code == 200 and body["id"] == "chatcmpl-abc" and body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and "token_ids" not in choice
    assert choice["message"]["role"] == "assistant" and choice["message"]["reasoning_content"] is None
    assert body["usage"]["completion_tokens"] == 3 and body["usage"]["prompt_tokens_details"] is None
    assert body["prompt_token_ids"] is None and body["kv_transfer_params"] is None


def test_handle_ids_carry_the_internal_request_id(sims: Sims, fleet: Fleet) -> None:
    [p] = fleet("p")
    resp = sims.http.post(p.url + "/v1/chat/completions", headers={"X-Request-Id": "xyz"},
                          json={"model": "demo", "messages": [user("hi")], "max_tokens": 1,
                                "kv_transfer_params": {"do_remote_decode": True}})
    rid = resp.json()["kv_transfer_params"]["remote_request_id"]
    assert rid.startswith("chatcmpl-xyz-") and len(rid) == len("chatcmpl-xyz-") + 8


@pytest.mark.parametrize(("d_name", "streams_handle"), [("d", False), ("d_stream", True)])
def test_streamed_d_leg_handle_only_when_patched(sims: Sims, fleet: Fleet, d_name: str,
                                                 streams_handle: bool) -> None:
    p, d = fleet("p", d_name)
    sims.reset(d)
    messages = [user(long_text(20, "k"))]
    handle = sims.prefill(p, messages)["kv_transfer_params"]
    frames = _stream(sims, d, {"messages": messages, "kv_transfer_params": handle})
    finish = frames[-2]
    assert finish["choices"][0]["finish_reason"] == "stop"
    assert ("kv_transfer_params" in finish) is streams_handle
    if streams_handle:
        assert finish["kv_transfer_params"]["do_remote_decode"] is True
    assert sims.stats(d)["handles_pinned"] == 1  # pinned either way: unpatched, it just never reaches you


def test_client_disconnect_mid_stream_frees_and_pins_nothing(sims: Sims, fleet: Fleet) -> None:
    p, d = fleet("p", "d_slow")
    sims.reset(d)
    messages = [user(long_text(20, "a"))]
    handle = sims.prefill(p, messages)["kv_transfer_params"]
    body = {"model": "demo", "messages": messages, "kv_transfer_params": handle, "stream": True}
    with sims.http.stream("POST", d.url + "/v1/chat/completions", json=body) as resp:
        lines = resp.iter_lines()
        for _ in range(6):
            next(lines)
    deadline = time.monotonic() + 3
    while sims.stats(d)["requests_aborted"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    ds = sims.stats(d)
    assert ds["requests_aborted"] == 1 and ds["handles_pinned"] == 0 and ds["blocks_in_use"] == 0


def test_p_without_bidirectional_parks_a_d_handle(sims: Sims, fleet: Fleet) -> None:
    [p] = fleet("p_oneway")
    handle = {"do_remote_decode": True, "do_remote_prefill": False, "remote_block_ids": [[0]],
              "remote_engine_id": "some-d", "remote_host": "127.0.0.1", "remote_port": 1, "remote_num_tokens": 16}
    with pytest.raises(httpx.ReadTimeout):
        sims.http.post(p.url + "/v1/chat/completions", timeout=0.5,
                       json={"model": "demo", "messages": [user("hi")], "max_tokens": 1,
                             "kv_transfer_params": handle})
    # vLLM 0.32 does not even count it as waiting (docs/vllm-findings.md, finding 5)
    assert sims.stats(p)["waiting"] == 0 and sims.stats(p)["running"] == 0


@pytest.mark.parametrize(("c_name", "honoured"), [("c", True), ("c_old", False)])
def test_prompt_token_ids_in_kv_params(sims: Sims, fleet: Fleet, c_name: str, honoured: bool) -> None:
    [c] = fleet(c_name)
    pinned = sims.chat(c, [user("the pinned prompt")], return_token_ids=True)["prompt_token_ids"]
    resp = sims.chat(c, [user("something else")], return_token_ids=True,
                     kv_transfer_params={"prompt_token_ids": pinned})
    assert (resp["prompt_token_ids"] == pinned) is honoured


def test_reasoning_split_non_streamed_and_streamed(sims: Sims, fleet: Fleet) -> None:
    [c] = fleet("c_reasoning")
    messages = [user("think first")]
    whole = sims.chat(c, messages, return_token_ids=True)
    msg, ids = whole["choices"][0]["message"], whole["choices"][0]["token_ids"]
    assert ids[0] == THINK_OPEN and THINK_CLOSE in ids
    assert msg["reasoning_content"] and msg["reasoning"] == msg["reasoning_content"]
    assert "<think>" not in msg["content"] and "</think>" not in msg["content"]
    deltas = [f["choices"][0]["delta"] for f in _stream(sims, c, {"messages": messages})[1:-1]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == msg["content"]


@pytest.mark.parametrize(("c_name", "canonical"), [("c", True), ("c_noncanonical", False)])
def test_canonical_outputs_re_encode_to_the_same_ids(sims: Sims, fleet: Fleet, c_name: str,
                                                     canonical: bool) -> None:
    [c] = fleet(c_name)
    same = []
    for i in range(3):
        choice = sims.chat(c, [user(f"question {i}")], return_token_ids=True)["choices"][0]
        ids = choice["token_ids"][:-1]  # without EOS
        again = sims.post(c, "/tokenize", {"model": "demo", "prompt": choice["message"]["content"]}).json()
        same.append(again["tokens"] == ids)
    assert all(same) if canonical else not all(same)


def test_completions_with_token_prompt(sims: Sims, fleet: Fleet) -> None:
    [c] = fleet("c")
    resp = sims.post(c, "/v1/completions", {"model": "demo", "prompt": [10, 11, 12], "return_token_ids": True,
                                            "max_tokens": 5})
    body = resp.json()
    assert resp.status_code == 200 and body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == [10, 11, 12] and len(choice["token_ids"]) <= 5
    assert isinstance(choice["text"], str) and body["usage"]["prompt_tokens"] == 3
    streamed = _frames(sims.post(c, "/v1/completions", {"model": "demo", "prompt": [10, 11, 12],
                                                        "max_tokens": 5, "stream": True}).text)
    assert "".join(f["choices"][0]["text"] for f in streamed[:-1]) == choice["text"]


@pytest.mark.parametrize(("body", "status", "kind"), [
    ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "NotFoundError"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "BadRequestError"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10 ** 6}, 400, "BadRequestError"),
    ({"messages": "not a list"}, 400, "BadRequestError"),
    ({"messages": [{"role": "user", "content": "x"}], "seed": 2 ** 63}, 400, "BadRequestError"),   # vLLM: int64
    # vLLM's SamplingParams._verify_args: min_tokens in [0, max_tokens] (the sim once spun generating 2**31)
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "min_tokens": 2 ** 31}, 400, "BadRequestError"),
    ({"messages": [{"role": "user", "content": "x"}], "min_tokens": -1}, 400, "BadRequestError"),
])
def test_error_shapes(sims: Sims, fleet: Fleet, body: dict[str, Any], status: int, kind: str) -> None:
    [c] = fleet("c")
    resp = sims.http.post(c.url + "/v1/chat/completions", json=body)
    assert resp.status_code == status
    err = resp.json()["error"]
    assert err["type"] == kind and err["code"] == status and err["param"] is None and err["message"]


def test_info_endpoints(sims: Sims, fleet: Fleet) -> None:
    [c] = fleet("c")
    assert sims.http.get(c.url + "/health").content == b""
    assert sims.http.get(c.url + "/version").json() == {"version": "0.32.0"}
    assert sims.http.get(c.url + "/v1/models").json()["data"][0]["id"] == "demo"
    tok = sims.post(c, "/tokenize", {"model": "demo", "messages": [user("hi")]}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 32768 and tok["token_strs"] is None
    metrics = sims.http.get(c.url + "/metrics").text
    assert 'vllm:cache_config_info{block_size="16"' in metrics
    for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
        assert f'source="{source}"' in metrics
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert name + "{" in metrics
