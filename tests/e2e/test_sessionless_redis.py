"""Conversations without session ids over gateway replicas that share a real Redis: a conversation is found by
its tokens whichever replica gets the turn, and replicas racing for identical conversations' handles never
read one twice."""

from __future__ import annotations

import concurrent.futures

import pytest

from tests.e2e.stack import Stack, stack

pytestmark = pytest.mark.integration

SYSTEM = {"role": "system", "content": "You are terse and exact."}


@pytest.fixture(scope="module")
def replicas(redis_url):
    with stack(sim=["--output-tokens", "80:120"], gateway=["--redis-url", redis_url], gateways=3) as s:
        yield s


def send(pd: Stack, messages: list[dict], replica: int) -> tuple[str, str, str]:
    raw = pd.client(replica).chat.completions.with_raw_response.create(
        model="demo", messages=messages, max_tokens=150)
    text = raw.parse().choices[0].message.content
    expected = pd.baseline_client().chat.completions.create(model="demo", messages=messages, max_tokens=150)
    assert text == expected.choices[0].message.content
    return raw.headers["x-pd-plan"], raw.headers["x-pd-conversation"], text


def test_found_by_tokens_on_any_replica(replicas):
    messages = [SYSTEM]
    for i in range(5):
        messages.append({"role": "user", "content": f"Step {i}: what does a cache miss cost on replica hops?"})
        plan, how, text = send(replicas, messages, replica=i)
        assert (plan, how) == (("full", "new") if i == 0 else ("reuse", "prefix"))
        messages.append({"role": "assistant", "content": text})
    assert replicas.total("kv_reads_corrupt") == 0


def test_replicas_racing_for_identical_conversations(replicas):
    first = [SYSTEM, {"role": "user", "content": "Name one cache eviction policy (race)."}]
    answers = [send(replicas, list(first), replica=i)[2] for i in range(3)]   # three identical conversations
    assert len(set(answers)) == 1
    turn2 = [*first, {"role": "assistant", "content": answers[0]}, {"role": "user", "content": "Another?"}]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:                    # four turns, three handles
        plans = list(pool.map(lambda r: send(replicas, list(turn2), replica=r)[:2], range(4)))
    assert sorted(plans) == [("full", "new")] + [("reuse", "prefix")] * 3
    assert replicas.total("kv_reads_corrupt") == 0 and replicas.total("handles_double_read") == 0
