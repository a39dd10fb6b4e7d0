"""The unconstrained model (tests/vllm/make_model.py --unconstrained): it picks any token, so its replies seldom
re-tokenize to the ids it generated, and some end inside a UTF-8 character. In the default history mode
(`generated`) every later turn still reads the previous exchange from D's KV, JSON and streamed; with
`rendered` every later turn diverges inside the previous answer and P reads nothing from D. Each turn is
compared with the model's own engine computing the gateway's prompt ids alone (docs/vllm-findings.md)."""

from __future__ import annotations

import uuid

import pytest

from gateway.turns.intake.render import Renderer
from tests.vllm.chat import Chat
from tests.vllm.engines import BLOCK_SIZE, SERVED_MODEL

pytestmark = pytest.mark.vllm

QUESTIONS = [
    "Hello there, how does a paged key value cache work in a serving engine?",
    "Why are the blocks a fixed number of tokens?",
    "What happens when the cache is full?",
    "And how does prefix caching share blocks between requests?",
]
REPLACEMENT = "\ufffd"
MIN_CUT = 30      # turn 2 then reads > kv_recompute_threshold (64) tokens from D: vLLM would recompute fewer


def free_chat(engines, gateway, system: str | None = None) -> Chat:
    chat = Chat(gateway, engines.free_prefill, engines.free_decode, engines.free_prefill, baseline_by_ids=True,
                cache_salt=uuid.uuid4().hex,       # its own prefix-cache space on P: what it reads comes from D
                compare_later=True)
    if system is not None:
        chat.messages = [{"role": "system", "content": system}]
    return chat


def cut_inside_a_character(engines, renderer: Renderer) -> tuple[str, int]:
    """A system line and a max_tokens for which the first answer stops right after a lone byte of a multi-byte
    character: vLLM then withholds that byte (U+FFFD) from the text the client gets. Found on the model's own
    engine (greedy: the gateway's turn gives the same tokens), so it holds whatever the random weights are."""
    for n in range(20):
        system = f"Conversation {n}, cut inside a character."
        out = engines.free_prefill.post("/v1/chat/completions", {
            "model": SERVED_MODEL, "messages": [{"role": "system", "content": system},
                                                {"role": "user", "content": QUESTIONS[0]}],
            "max_tokens": 80, "temperature": 0, "return_token_ids": True, "cache_salt": uuid.uuid4().hex})
        ids = out["choices"][0]["token_ids"]
        for k in range(MIN_CUT, len(ids) + 1):
            lone_byte = renderer.decode(ids[k - 1:k]) == REPLACEMENT
            if lone_byte and not renderer.decode(ids[:k - 1]).endswith(REPLACEMENT):
                return system, k
    raise AssertionError("no answer of 20 stops inside a character: is the model unconstrained?")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_default_history_reads_d_kv_on_every_turn(engines, free_gateway, free_model_dir, stream):
    renderer = Renderer(str(free_model_dir))
    system, cut = cut_inside_a_character(engines, renderer)
    c = free_chat(engines, free_gateway, system)
    for i, question in enumerate(QUESTIONS):
        c.max_tokens = cut if i == 0 else 80
        c.say(question, stream=stream)
    c.compare()
    for i, turn in enumerate(c.turns):
        assert turn.exact, f"turn {i + 1} differs from the engine alone given the same prompt ids"
        if i == 0:
            continue
        previous = c.turns[i - 1]
        held = len(previous.prompt_ids) + len(previous.token_ids) - 1
        assert (turn.plan, turn.reason, turn.reused) == ("reuse", "continuous", held), f"turn {i + 1}"
        cached_on_p = len(previous.prompt_ids) // BLOCK_SIZE * BLOCK_SIZE
        assert turn.prefill_loaded == held - cached_on_p > 0, f"turn {i + 1}: P did not read D's KV"
    # What makes this model the test: its answers do not re-tokenize to D's ids, and the first one's text as the
    # client got it lacks the cut character's byte (the gateway used to drop such an answer: turn 2 diverged).
    assert all(renderer.tokenizer.encode(t.text, add_special_tokens=False) != t.token_ids for t in c.turns[1:])
    assert renderer.decode(c.turns[0].token_ids) == c.turns[0].text + REPLACEMENT


def test_rendered_history_loses_d_kv(engines, free_gateway_rendered, free_model_dir):
    """A later turn diverges inside the previous answer wherever that answer's text does not re-tokenize to the ids
    D generated (most do not; one that does continues, as it should: its history is D's tokens). Under a loaded
    tier the engines' numerics may give an answer that does: seen once in CI-sized runs, so that case is allowed
    and checked for what it is."""
    renderer = Renderer(str(free_model_dir))
    c = free_chat(engines, free_gateway_rendered)
    for question in QUESTIONS[:3]:
        c.say(question)
    c.compare()
    diverged = 0
    for i, turn in enumerate(c.turns):
        assert turn.exact
        if not i:
            continue
        previous = c.turns[i - 1]
        if renderer.tokenizer.encode(previous.text, add_special_tokens=False) == previous.token_ids:
            assert (turn.plan, turn.reason) == ("reuse", "continuous")
            continue
        assert turn.reason == "prefix_diverged" and turn.plan in ("partial", "full")
        assert turn.prefill_loaded == 0
        diverged += 1
    assert diverged, "no answer of the unconstrained model failed to re-tokenize: is the model unconstrained?"
