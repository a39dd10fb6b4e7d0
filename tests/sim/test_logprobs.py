"""The simulator's logprobs, structured output and NIXL metrics: what `pd-gateway verify` and the gateway's
data-plane view read from vLLM, in vLLM 0.32's shapes and names."""

from __future__ import annotations

import json
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.sim.conftest import Fleet, Sims, user

MESSAGES = [user("Tell me about the river and the stone, in a few words. " * 12)]     # > kv_recompute_threshold
LOGPROBS = {"logprobs": True, "top_logprobs": 5, "return_tokens_as_token_ids": True}


def _first_top(resp: dict[str, Any]) -> list[tuple[str, float]]:
    entry = resp["choices"][0]["logprobs"]["content"][0]
    return [(t["token"], t["logprob"]) for t in entry["top_logprobs"]]


def test_chat_logprobs_shape_and_greedy_top1(sims: Sims, fleet: Fleet) -> None:
    [c] = fleet("c")
    resp = sims.chat(c, MESSAGES, return_token_ids=True, max_tokens=8, **LOGPROBS)
    content = resp["choices"][0]["logprobs"]["content"]
    ids = resp["choices"][0]["token_ids"]
    assert [e["token"] for e in content] == [f"token_id:{i}" for i in ids]       # one entry per generated token
    for entry in content:
        tops = entry["top_logprobs"]
        assert len(tops) == 5 and tops[0]["token"] == entry["token"]            # greedy: the chosen is the likeliest
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
        assert all(t["logprob"] < 0 for t in tops) and entry["bytes"] == list(entry["token"].encode())
    plain = sims.chat(c, MESSAGES, max_tokens=8)
    assert plain["choices"][0]["logprobs"] is None


def test_completion_and_streamed_logprobs(sims: Sims, fleet: Fleet) -> None:
    [c] = fleet("c")
    body = {"model": "demo", "prompt": [10, 11, 12, 13], "max_tokens": 4, "logprobs": 3}
    lp = sims.post(c, "/v1/completions", body).json()["choices"][0]["logprobs"]
    assert set(lp) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    assert len(lp["tokens"]) == len(lp["top_logprobs"]) and all(len(t) == 3 for t in lp["top_logprobs"])
    whole = sims.chat(c, MESSAGES, max_tokens=8, **LOGPROBS)["choices"][0]["logprobs"]["content"]
    text = sims.raw_chat(c, {"messages": MESSAGES, "stream": True, "max_tokens": 8, **LOGPROBS}).text
    frames = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    streamed = [e for f in frames for ch in f["choices"] for e in ((ch.get("logprobs") or {}).get("content") or [])]
    assert streamed == whole


@pytest.mark.parametrize(("extra", "words"), [
    ({"logprobs": True, "top_logprobs": 21}, "greater than max allowed: 20"),
    ({"top_logprobs": 2}, "`logprobs` must be set to true"),
    ({"response_format": {"type": "xml"}}, "response_format"),
])
def test_what_vllm_refuses(sims: Sims, fleet: Fleet, extra: dict[str, Any], words: str) -> None:
    [c] = fleet("c")
    resp = sims.raw_chat(c, {"messages": MESSAGES, **extra})
    assert resp.status_code == 400 and words in resp.json()["error"]["message"]


def test_pd_gives_the_colocated_engines_logprobs_and_wrong_kv_does_not(sims: Sims, fleet: Fleet) -> None:
    """Right KV: to the last bit (the simulator is a deterministic engine). A prompt shorter than the handle
    with the whole handle (tail alignment): another distribution."""
    p, d, c = fleet("p", "d", "c")
    ref = sims.chat(c, MESSAGES, **LOGPROBS)
    pd = sims.turn(p, d, MESSAGES, **LOGPROBS)
    assert _first_top(pd) == _first_top(ref)
    s = pd["prompt_token_ids"] + pd["choices"][0]["token_ids"]
    shorter = s[: len(s) // 2]
    wrong = sims.post(p, "/v1/completions", {"model": "demo", "prompt": shorter, "max_tokens": 1, "logprobs": 5,
                                             "kv_transfer_params": pd["kv_transfer_params"],
                                             "cache_salt": "fresh"}).json()      # P's own cache must not help
    right = sims.post(c, "/v1/completions", {"model": "demo", "prompt": shorter, "max_tokens": 1, "logprobs": 5})
    assert wrong["choices"][0]["logprobs"]["top_logprobs"][0] != right.json()["choices"][0]["logprobs"]["top_logprobs"][0]


def test_response_format_json_schema(sims: Sims, fleet: Fleet) -> None:
    [c] = fleet("c")
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"},
                                               "ok": {"type": "boolean"}}, "required": ["city", "n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    resp = sims.chat(c, MESSAGES, max_tokens=200, response_format=fmt)
    doc = json.loads(resp["choices"][0]["message"]["content"])
    assert isinstance(doc["city"], str) and isinstance(doc["n"], int) and set(doc) <= {"city", "n", "ok"}
    assert json.loads(sims.chat(c, MESSAGES, max_tokens=200, response_format={"type": "json_object"})
                      ["choices"][0]["message"]["content"])


# vLLM 0.32's families, from its source (v1/metrics/loggers.py, kv_connector/v1/nixl/stats.py)
VLLM_FAMILIES = {
    "vllm:nixl_xfer_time_seconds": "histogram", "vllm:nixl_bytes_transferred": "histogram",
    "vllm:nixl_num_descriptors": "histogram", "vllm:nixl_num_failed_transfers": "counter",
    "vllm:nixl_num_kv_expired_reqs": "counter", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_requests_waiting": "gauge", "vllm:num_requests_running": "gauge", "vllm:num_preemptions": "counter",
}


def test_nixl_metrics_under_vllms_names_and_types(sims: Sims, fleet: Fleet) -> None:
    p, d = fleet("p", "d")
    sims.reset(p, d)
    sims.turn(p, d, MESSAGES)
    families = {f.name: f for f in text_string_to_metric_families(sims.http.get(d.url + "/metrics").text)}
    assert {name: families[name].type for name in VLLM_FAMILIES} == VLLM_FAMILIES
    samples = {s.name: s.value for s in families["vllm:nixl_xfer_time_seconds"].samples if "le" not in s.labels}
    assert samples["vllm:nixl_xfer_time_seconds_count"] == 1          # D read P's KV once: the reader records it
    bytes_ = {s.name: s.value for s in families["vllm:nixl_bytes_transferred"].samples}
    assert bytes_["vllm:nixl_bytes_transferred_sum"] > 0
    p_families = {f.name for f in text_string_to_metric_families(sims.http.get(p.url + "/metrics").text)}
    assert "vllm:nixl_xfer_time_seconds" in p_families          # registered with the connector, zero so far
    [c] = fleet("c")
    c_families = {f.name for f in text_string_to_metric_families(sims.http.get(c.url + "/metrics").text)}
    assert "vllm:nixl_xfer_time_seconds" not in c_families and "vllm:kv_cache_usage_perc" in c_families


