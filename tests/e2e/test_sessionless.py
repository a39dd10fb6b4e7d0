"""Conversations without any session id (issue 13): found by their tokens in the tenant's prefix index.

An oracle beside the gateway keeps every D-held sequence the gateway should still hold a handle for (from
the engines' own token ids, `return_token_ids`), independently of the gateway's code: a turn whose prompt
extends one of them must reuse (as it would with a session id); any other turn must not take a handle; and
the simulators count every read of KV computed for other tokens and every second read of a handle."""

from __future__ import annotations

import concurrent.futures
import hashlib
from dataclasses import dataclass

import openai

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.stack import Stack, stack

pytestmark = pytest.mark.integration

SYSTEM = {"role": "system", "content": "You are a careful assistant for the kernel cache team. Answer briefly."}
FIRST = ["How do paged key value caches share prompt prefixes?", "What is a block in a paged cache?"]
WORDS = ["alpha", "kernel", "cache", "block", "stream", "token", "prefix", "engine", "river", "orbit"]


@pytest.fixture(scope="module")
def pd():
    # Answers above kv_recompute_threshold, so a reuse is a real read of D's blocks.
    with stack(sim=["--output-tokens", "70:110"]) as s:
        yield s


@dataclass
class Reply:
    plan: str
    reason: str
    how: str
    reused: int
    prompt: list[int]
    output: list[int]
    text: str

    @property
    def held(self) -> list[int]:
        return self.prompt + self.output


def send(pd: Stack, messages: list[dict], *, check: bool = True, api_key: str | None = None) -> Reply:
    client = pd.client() if api_key is None else openai.OpenAI(
        base_url=pd.gateway.url + "/v1", api_key=api_key, max_retries=0, timeout=30)
    raw = client.chat.completions.with_raw_response.create(
        model="demo", messages=messages, max_tokens=150, extra_body={"return_token_ids": True})
    out = raw.parse().model_dump()
    reply = Reply(raw.headers["x-pd-plan"], raw.headers["x-pd-reason"], raw.headers["x-pd-conversation"],
                  int(raw.headers["x-pd-reused-tokens"]), out["prompt_token_ids"], out["choices"][0]["token_ids"],
                  out["choices"][0]["message"]["content"])
    if check:
        expected = pd.baseline_client().chat.completions.create(model="demo", messages=messages, max_tokens=150)
        assert reply.text == expected.choices[0].message.content
    return reply


def say(pd: Stack, messages: list[dict], content: str, api_key: str | None = None) -> Reply:
    messages.append({"role": "user", "content": content})
    reply = send(pd, messages, api_key=api_key)
    messages.append({"role": "assistant", "content": reply.text})
    return reply


def assert_clean(pd: Stack) -> None:
    assert pd.total("kv_reads_corrupt") == 0
    assert pd.total("handles_double_read") == 0


def test_six_turns_without_a_session_id_reuse_like_a_session(pd):
    messages, previous = [SYSTEM], None
    for i in range(6):
        reply = say(pd, messages, f"Turn {i}: and what should a careful engineer check next about blocks?")
        if previous is None:
            assert (reply.plan, reply.reason, reply.how) == ("full", "no_session", "new")
        else:
            assert (reply.plan, reply.reason, reply.how) == ("reuse", "continuous", "prefix")
            assert reply.reused == len(previous.held) - 1
        previous = reply
    assert pd.metric("pdgw_conversation_lookups_total", how="prefix") >= 5
    assert_clean(pd)


def test_identical_conversations_each_keep_reusing(pd):
    """Two users, same system prompt and first message, same (greedy) answer: two holders of exactly the same
    tokens. Their second turns, sent at once, each claim one of them; never one handle twice."""
    chats = [[SYSTEM, {"role": "user", "content": FIRST[0] + " (twins)"}] for _ in range(2)]
    firsts = [send(pd, m) for m in chats]
    assert firsts[0].held == firsts[1].held and {f.how for f in firsts} == {"new"}
    for messages, first in zip(chats, firsts, strict=True):
        messages.append({"role": "assistant", "content": first.text})
        messages.append({"role": "user", "content": "Go on, in more detail."})
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        seconds = list(pool.map(lambda m: send(pd, m), chats))
    assert [(s.plan, s.how) for s in seconds] == [("reuse", "prefix")] * 2
    assert_clean(pd)


def test_shared_prefixes_and_regenerates_never_take_a_handle(pd):
    owner = [SYSTEM]
    say(pd, owner, FIRST[1] + " (owner)")
    say(pd, owner, "Why fixed size?")
    stranger = send(pd, [SYSTEM, {"role": "user", "content": FIRST[1] + " (stranger)"}])  # same system prompt
    assert (stranger.plan, stranger.how) == ("full", "new")
    branch = send(pd, [SYSTEM, owner[1], owner[2], {"role": "user", "content": "Why not variable size?"}])
    assert (branch.plan, branch.how) == ("full", "new")     # extends turn 1, whose handle turn 2 spent
    regenerate = send(pd, owner[:-1])                       # the last answer again: shorter than D's tokens
    assert (regenerate.plan, regenerate.how) == ("full", "new")
    then = say(pd, owner, "And then?")
    assert (then.plan, then.how) == ("reuse", "prefix")      # its handle was never taken
    assert_clean(pd)


def test_another_tenant_never_finds_it():
    keys = {"a": "key-of-tenant-a", "b": "key-of-tenant-b"}
    api_keys = [f"{t}:{hashlib.sha256(k.encode()).hexdigest()}" for t, k in keys.items()]
    with stack(sim=["--output-tokens", "70:110"], gateway=["--api-keys", *api_keys]) as pd:
        owner = [SYSTEM]
        say(pd, owner, FIRST[0] + " (tenant a)", api_key=keys["a"])
        owner.append({"role": "user", "content": "Go on."})
        other = send(pd, owner, api_key=keys["b"])             # tenant b sends a's exact next turn
        assert (other.plan, other.how) == ("full", "new")
        mine = send(pd, owner, api_key=keys["a"])
        assert (mine.plan, mine.how) == ("reuse", "prefix")     # a's handle was still there
        assert_clean(pd)


# -- the oracle ------------------------------------------------------------------------------------------

class Oracle:
    """The D-held sequences with a live, unclaimed handle, as the gateway should have them."""

    def __init__(self) -> None:
        self.held: list[list[int]] = []

    def expect(self, prompt: list[int]) -> list[int] | None:
        """The holder this prompt must claim (the longest it extends), or None."""
        fits = [h for h in self.held if len(prompt) >= len(h) - 1 and prompt[:len(h) - 1] == h[:-1]]
        return max(fits, key=len) if fits else None

    def turn(self, prompt: list[int], reply: Reply) -> None:
        claimed = self.expect(prompt)
        if claimed is not None:
            assert (reply.plan, reply.how, reply.reused) == ("reuse", "prefix", len(claimed) - 1)
            self.held.remove(claimed)
        else:
            assert (reply.plan, reply.how) == ("full", "new"), (reply.plan, reply.reason)
        self.held.append(reply.held)


def act(action: str, messages: list[dict], data) -> None:
    sentence = " ".join(data.draw(st.lists(st.sampled_from(WORDS), min_size=2, max_size=30)))
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if action == "edit" and users:
        messages[data.draw(st.sampled_from(users))]["content"] = sentence
    elif action == "truncate" and len(messages) >= 4:
        del messages[data.draw(st.integers(2, len(messages) - 1)):]
    elif action == "regenerate" and messages[-1]["role"] == "assistant":
        messages.pop()
        return
    elif action == "drop_answer" and messages[-1]["role"] == "assistant":
        messages[-1]["content"] = messages[-1]["content"].rsplit(" ", 1)[0]
    if messages[-1]["role"] != "user":
        # Often the same words as another client: identical conversations are the interesting case.
        same = data.draw(st.booleans())
        messages.append({"role": "user", "content": "Tell me more." if same else sentence})


ACTIONS = st.sampled_from(["extend", "extend", "extend", "edit", "truncate", "regenerate", "drop_answer"])


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(clients=st.integers(2, 4), steps=st.lists(st.tuples(st.integers(0, 3), ACTIONS), min_size=6, max_size=14),
       data=st.data())
def test_random_interleaved_conversations_without_session_ids(pd, clients, steps, data):
    salt = data.draw(st.integers(0, 10**9))      # examples do not see each other's conversations
    system = {"role": "system", "content": f"{SYSTEM['content']} Ticket {salt}."}
    chats = [[system, {"role": "user", "content": data.draw(st.sampled_from(FIRST))}] for _ in range(clients)]
    oracle = Oracle()
    for messages in chats:
        oracle.turn(*prompt_and(send(pd, messages), messages))
    for client, action in steps:
        messages = chats[client % clients]
        act(action, messages, data)
        oracle.turn(*prompt_and(send(pd, messages), messages))
    assert_clean(pd)


def prompt_and(reply: Reply, messages: list[dict]) -> tuple[list[int], Reply]:
    messages.append({"role": "assistant", "content": reply.text})
    return reply.prompt, reply
