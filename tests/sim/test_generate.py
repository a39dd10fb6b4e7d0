"""In-process: the simulated model's answers (determinism, lengths, EOS, stop strings, reasoning)."""

from __future__ import annotations

import pytest

from gateway.sim.generate import Model, context_digest
from gateway.sim.chat_render import Renderer

EOS = 2


@pytest.fixture(scope="module")
def renderer() -> Renderer:
    return Renderer("builtin:demo")


@pytest.fixture(scope="module")
def model(renderer: Renderer) -> Model:
    return Model(renderer, output_tokens=(8, 12))


DIGEST = context_digest([(5, 0), (6, 1)])


def test_same_context_same_answer_other_context_or_seed_differs(model: Model) -> None:
    a = model.answer(DIGEST, seed=None, max_tokens=100)
    assert a == model.answer(DIGEST, seed=None, max_tokens=100)
    assert a != model.answer(context_digest([(5, 0), (7, 1)]), seed=None, max_tokens=100)
    assert a != model.answer(DIGEST, seed=1, max_tokens=100)
    assert a.finish_reason == "stop" and a.token_ids[-1] == EOS and 8 <= len(a.token_ids) - 1 <= 20


def test_lengths_max_min_and_ignore_eos(model: Model) -> None:
    assert model.answer(DIGEST, seed=None, max_tokens=3).finish_reason == "length"
    assert len(model.answer(DIGEST, seed=None, max_tokens=3).token_ids) == 3
    long = model.answer(DIGEST, seed=None, max_tokens=100, min_tokens=50)
    assert len(long.token_ids) > 50 and long.token_ids[-1] == EOS
    assert EOS not in model.answer(DIGEST, seed=None, max_tokens=60, ignore_eos=True).token_ids


def test_stop_string_cuts_the_answer(model: Model, renderer: Renderer) -> None:
    text = renderer.decode(model.answer(DIGEST, seed=None, max_tokens=100).token_ids)
    word = text.split()[2]
    cut = model.answer(DIGEST, seed=None, max_tokens=100, stop=[word])
    assert cut.finish_reason == "stop" and cut.stop_reason == word and word not in renderer.decode(cut.token_ids)


def test_canonical_and_reasoning(renderer: Renderer) -> None:
    thinking = Model(renderer, output_tokens=(8, 12), reasoning=True)
    ids = thinking.answer(DIGEST, seed=None, max_tokens=100).token_ids[:-1]
    assert ids[0] == 4096 and 4097 in ids and renderer.encode(renderer.decode(ids)) == ids
    odd = Model(renderer, output_tokens=(30, 40), canonical=False)
    ids = odd.answer(DIGEST, seed=None, max_tokens=100).token_ids[:-1]
    assert renderer.encode(renderer.decode(ids)) != ids
