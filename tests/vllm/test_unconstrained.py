"""The unconstrained model (tests/vllm/make_model.py --unconstrained): it picks any token, so its replies seldom
re-tokenize to the ids it generated, and some end inside a UTF-8 character. In the default history mode
(`generated`) every later turn still reads the previous exchange from D's KV, JSON and streamed; with
`rendered` every later turn diverges inside the previous answer and P reads nothing from D. Each turn is
compared with the model's own engine computing the gateway's prompt ids alone (docs/vllm-findings.md)."""

from __future__ import annotations

import uuid

import pytest

from gateway.turns.render import Renderer
from tests.vllm.chat import Chat
from tests.vllm.engines import BLOCK_SIZE

pytestmark = pytest.mark.vllm

QUESTIONS = [
    "Hello there, how does a paged key value cache work in a serving engine?",
    "Why are the blocks a fixed number of tokens?",
    "What happens when the cache is full?",
    "And how does prefix caching share blocks between requests?",
]
# Greedy, so this conversation is fixed: its second answer stops inside a UTF-8 character (found with
# tests/vllm/measure_history.py). vLLM withholds that character's bytes from the text the client gets.
CUT_INSIDE_A_CHARACTER = "Conversation 5 (generated, stream=False)."


def free_chat(engines, gateway, system: str | None = None) -> Chat:
    chat = Chat(gateway, engines.free_prefill, engines.free_decode, engines.free_prefill, baseline_by_ids=True,
                cache_salt=uuid.uuid4().hex)       # its own prefix-cache space on P: what it reads comes from D
    if system is not None:
        chat.messages = [{"role": "system", "content": system}]
    return chat


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_default_history_reads_d_kv_on_every_turn(engines, free_gateway, free_model_dir, stream):
    renderer = Renderer(str(free_model_dir))
    c = free_chat(engines, free_gateway, CUT_INSIDE_A_CHARACTER)
    for i, question in enumerate(QUESTIONS):
        turn = c.say(question, stream=stream)
        assert turn.exact, f"turn {i + 1} differs from the engine alone given the same prompt ids"
        if i == 0:
            continue
        previous = c.turns[i - 1]
        held = len(previous.prompt_ids) + len(previous.token_ids) - 1
        assert (turn.plan, turn.reason, turn.reused) == ("reuse", "continuous", held), f"turn {i + 1}"
        cached_on_p = len(previous.prompt_ids) // BLOCK_SIZE * BLOCK_SIZE
        assert turn.prefill_loaded == held - cached_on_p > 0, f"turn {i + 1}: P did not read D's KV"
    # What makes this model the test: no answer re-tokenizes to D's ids, and the second one's text as the client
    # got it lacks its last, cut character (the gateway used to drop such an answer: the next turn diverged).
    assert all(renderer.tokenizer.encode(t.text, add_special_tokens=False) != t.token_ids for t in c.turns)
    decoded = renderer.decode(c.turns[1].token_ids)
    assert decoded != c.turns[1].text and decoded.startswith(c.turns[1].text)


def test_rendered_history_loses_d_kv(engines, free_gateway_rendered):
    c = free_chat(engines, free_gateway_rendered)
    for i, question in enumerate(QUESTIONS[:3]):
        turn = c.say(question)
        assert turn.exact
        if i:
            assert turn.reason == "prefix_diverged" and turn.plan in ("partial", "full")
            assert turn.prefill_loaded == 0
