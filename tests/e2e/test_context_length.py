"""Context-length admission end to end: the gateway learns max_model_len from the engines (/v1/models), refuses
longer requests with vLLM's own 400 before any engine sees them, and keeps serving everyone else meanwhile."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from tests.e2e.stack import stack

pytestmark = pytest.mark.integration

LIMIT = 1024


@pytest.fixture(scope="module")
def small():
    with stack(sim=["--max-model-len", str(LIMIT)]) as s:
        yield s


def post(url: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60, **kw)


def test_an_8mb_prompt_gets_400_quickly_and_others_are_served(small):
    huge = {"model": "demo", "messages": [{"role": "user", "content": "hello world, a long prompt. " * 290_000}]}
    ok = {"model": "demo", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi there!"}]}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        others = [pool.submit(post, small.gateway.url, ok, headers={"X-Session-Id": f"s{i}"}) for i in range(3)]
        began = time.perf_counter()
        refused = post(small.gateway.url, huge)
        took = time.perf_counter() - began
        answers = [f.result() for f in others]
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["type"] == "invalid_request_error"
    assert f"maximum context length is {LIMIT} tokens" in refused.json()["error"]["message"]
    assert took < 5.0                           # tokenizing 8 MB alone takes 10-20 s on this machine
    assert [a.status_code for a in answers] == [200, 200, 200]


@pytest.mark.parametrize("case", ["prompt", "max_tokens"])
def test_the_gateway_refuses_in_the_engines_own_words(small, case):
    body = {"model": "demo", "messages": [{"role": "user", "content": "word " * 1500}]}
    if case == "max_tokens":
        body = {"model": "demo", "max_tokens": LIMIT, "messages": [{"role": "user", "content": "Hello!"}]}
    engine = post(small.baseline.url, body)           # the co-located sim, answering as vLLM does
    gateway = post(small.gateway.url, body)
    assert engine.status_code == gateway.status_code == 400
    assert gateway.json()["error"]["message"] == engine.json()["error"]["message"]
