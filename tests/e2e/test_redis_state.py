"""Conversation state in a real Redis: replicas share it, races never double-use a handle, deletes free KV."""

from __future__ import annotations

import concurrent.futures
import uuid
from urllib.parse import quote

import httpx
import pytest

from tests.e2e.chat import Chat
from tests.e2e.stack import stack

pytestmark = pytest.mark.integration

ADMIN_KEY = "test-admin-key"


@pytest.fixture(scope="module")
def replicas(redis_url):
    gateway = ["--redis-url", redis_url, "--admin-key", ADMIN_KEY]
    with stack(sim=["--output-tokens", "80:120"], gateway=gateway, gateways=3) as s:
        yield s


def question(i: int) -> str:
    return f"Step {i}: which metric tells you first that a cache is too small for its working set?"


def test_turns_hopping_replicas_still_reuse(replicas):
    chat = Chat(replicas, uuid.uuid4().hex, hop=True)
    for i in range(6):
        turn = chat.say(question(i), stream=i % 3 == 2)
        assert turn.text == turn.expected
        assert turn.plan == ("full" if i == 0 else "reuse")
    assert replicas.total("kv_reads_corrupt") == 0


def test_racing_replicas_never_both_reuse(replicas):
    chat = Chat(replicas, uuid.uuid4().hex, hop=True)
    chat.say(question(1))
    chat.messages.append({"role": "user", "content": question(2)})

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        turns = list(pool.map(lambda replica: chat.ask(replica=replica), range(3)))
    assert sum(t.plan == "reuse" for t in turns) <= 1
    assert all(t.text == t.expected for t in turns)
    assert replicas.total("kv_reads_corrupt") == 0


def test_admin_delete_frees_the_pinned_kv(replicas):
    chat = Chat(replicas, uuid.uuid4().hex)
    turn = chat.say(question(7))
    assert turn.conversation.startswith(chat.session + "#")        # the session id scoped by its head
    url = f"{replicas.gateway.url}/admin/conversations/{quote(turn.conversation, safe='')}"
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers=auth).json()["handle_live"] is True
    pinned = replicas.stats(replicas.decode[0])["handles_pinned"]
    assert httpx.delete(url, headers=auth).status_code == 200
    replicas.wait_until(lambda: replicas.stats(replicas.decode[0])["handles_pinned"] == pinned - 1)
    assert httpx.get(url, headers=auth).status_code == 404
    assert chat.say(question(8)).reason == "first_turn"


@pytest.mark.parametrize("refusal", [{"model": "no-such-model"}, {"max_tokens": 10**9}],
                         ids=["unknown_model", "over_context_length"])
def test_a_turn_refused_after_its_claim_leaves_the_next_turn_its_reuse(replicas, refusal):
    """The claim is sent before intake renders (and refuses) the turn: it must go back to the store, handle,
    index entry and counter, so the next turn (on any replica) reads D's KV rather than meeting an 'in flight'."""
    chat = Chat(replicas, uuid.uuid4().hex)
    chat.say(question(3))
    chat.messages.append({"role": "user", "content": question(4)})
    body = {"model": "demo", "messages": chat.messages, **refusal}
    refused = httpx.post(f"{replicas.gateway.url}/v1/chat/completions", json=body, timeout=30,
                         headers={"X-Session-Id": chat.session})
    assert refused.status_code in (400, 404), refused.text
    turn = chat.ask(replica=1)
    assert (turn.plan, turn.reason) == ("reuse", "continuous")
    assert turn.text == turn.expected
    assert replicas.total("kv_reads_corrupt") == 0
