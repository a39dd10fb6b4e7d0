"""Context-length admission in the gateway's intake, with the real demo tokenizer: vLLM's checks, its words,
and a huge prompt refused before it is tokenized."""

from __future__ import annotations

import json
import time

import pytest

from gateway.api.schemas import ChatRequest, CompletionRequest, parse
from gateway.errors import InvalidRequestError
from gateway.turns.intake.intake import Intake
from gateway.turns.intake.render import Renderer

LIMIT = 256


@pytest.fixture(scope="module")
def renderer() -> Renderer:
    return Renderer("builtin:demo")


def chat(intake: Intake, content: str, **fields) -> int:
    raw = json.dumps(
        {"messages": [{"role": "user", "content": content}], **fields}).encode()
    body, req = parse(raw, ChatRequest)
    return len(intake.chat(body, req, "r").prompt_ids)


def completion(intake: Intake, prompt, **fields) -> int:
    body, req = parse(json.dumps({"prompt": prompt, **fields}).encode(), CompletionRequest)
    return len(intake.completion(body, req, "r").prompt_ids)


def refused(call) -> str:
    with pytest.raises(InvalidRequestError) as info:
        call()
    assert info.value.status == 400
    return info.value.message


def test_a_prompt_of_max_model_len_tokens_is_refused_in_vllms_words(renderer):
    intake = Intake(renderer, ["demo"], max_model_len=LIMIT)
    words = "word " * 400
    message = refused(lambda: chat(intake, words))
    n = len(renderer.render_chat([{"role": "user", "content": words}]))
    assert message == (f"This model's maximum context length is {LIMIT} tokens. However, your request has {n} "
                       "input tokens. Please reduce the length of the input messages.")


def test_prompt_plus_max_tokens_over_the_limit_is_refused(renderer):
    intake = Intake(renderer, ["demo"], max_model_len=LIMIT)
    n = chat(intake, "Hello there")
    assert chat(intake, "Hello there", max_tokens=LIMIT - n) == n            # exactly fits
    for field in ("max_tokens", "max_completion_tokens"):
        message = refused(lambda f=field: chat(intake, "Hello there", **{f: LIMIT - n + 1}))
        assert message == (f"'max_tokens' or 'max_completion_tokens' is too large: {LIMIT - n + 1}. This model's "
                           f"maximum context length is {LIMIT} tokens and your request has {n} input tokens "
                           f"({LIMIT - n + 1} > {LIMIT} - {n}).")


def test_completions_count_vllms_default_of_16_tokens(renderer):
    intake = Intake(renderer, ["demo"], max_model_len=LIMIT)
    assert completion(intake, list(range(1, LIMIT - 16 + 1))) == LIMIT - 16
    assert "too large: 16" in refused(lambda: completion(intake, list(range(1, LIMIT - 15 + 1))))
    assert "However, your request has" in refused(lambda: completion(intake, "word " * 400, max_tokens=1))


def test_a_huge_prompt_is_refused_without_tokenizing_it(renderer):
    intake = Intake(renderer, ["demo"], max_model_len=32768)
    began = time.perf_counter()
    message = refused(lambda: chat(intake, "hello world, a long prompt. " * 290_000))     # ~8 MB
    assert time.perf_counter() - began < 2.0        # tokenizing it takes ~10-20 s
    assert message.startswith("This model's maximum context length is 32768 tokens. However, your request has "
                              "at least ")


def test_unknown_limit_checks_nothing(renderer):
    assert chat(Intake(renderer, ["demo"]), "word " * 400, max_tokens=10**6) > LIMIT
