"""The streaming plugin (plugins/vllm-pdgw-stream) on real vLLM: D's handle rides on the finish chunk of streamed
chat and completions responses, and only there; an engine without a connector streams as before."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest

from tests.vllm.engines import SERVED_MODEL, Engine
from tests.vllm.test_findings import FRESH, complete, words

pytestmark = pytest.mark.vllm


def stream(engine: Engine, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    req = urllib.request.Request(engine.url + path, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    chunks = []
    with urllib.request.urlopen(req, timeout=60) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_the_finish_chunk_carries_d_handle(engines, path):
    request: dict[str, Any] = {"model": SERVED_MODEL, "temperature": 0, "return_token_ids": True}
    if path == "/v1/completions":
        request["prompt"] = words(200)
    else:
        request["messages"] = [{"role": "user", "content": "Hello, plugin."}]
    p = engines.prefill.post(path, {**request, "max_tokens": 1, "kv_transfer_params": FRESH})
    chunks = stream(engines.decode, path, {**request, "max_tokens": 30, "kv_transfer_params": p["kv_transfer_params"]})
    with_handle = [c for c in chunks if "kv_transfer_params" in c]
    assert len(with_handle) == 1 and with_handle[0]["choices"][0]["finish_reason"] == "length"
    handle = with_handle[0]["kv_transfer_params"]
    prompt_len = len(request["prompt"]) if "prompt" in request else len(chunks[0]["prompt_token_ids"])
    assert handle["do_remote_decode"] and handle["remote_num_tokens"] == prompt_len + 30 - 1
    complete(engines.prefill, [5], 1, {**handle, "remote_num_tokens": 0})       # release D's blocks


def test_an_engine_without_a_connector_streams_no_handle(engines):
    chunks = stream(engines.baseline, "/v1/completions",
                    {"model": SERVED_MODEL, "prompt": words(50), "max_tokens": 8, "temperature": 0})
    assert chunks and not any("kv_transfer_params" in c for c in chunks)
