"""history_tokens "generated": answers spliced in as D's own ids, everything else encoded as usual."""

from gateway.turns.generated import MAX_ANSWER_TOKENS, answer, remember
from gateway.turns.render import Renderer

MESSAGES = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "General Kenobi"},
            {"role": "user", "content": "You are a bold one"}]


def test_canonical_answers_render_exactly_as_the_text_does():
    r = Renderer("builtin:demo")
    ids = r.tokenizer.encode("General Kenobi", add_special_tokens=False)
    assert r.render_chat(MESSAGES, answers=[answer("General Kenobi", ids)]) == r.render_chat(MESSAGES)


def test_non_canonical_ids_are_sent_as_generated():
    r = Renderer("builtin:demo")
    split = [t for ch in "General Kenobi" for t in r.tokenizer.encode(ch, add_special_tokens=False)]
    assert r.decode(split) == "General Kenobi" and split != r.tokenizer.encode("General Kenobi")
    spliced = r.render_chat(MESSAGES, answers=[answer("General Kenobi", split)])
    plain = r.render_chat(MESSAGES)
    header = r.render_chat(MESSAGES[:1])                   # ... "<|im_start|>assistant\n": the previous prompt
    assert spliced[:len(header) + len(split)] == header + split
    assert spliced != plain and r.decode(spliced) == r.decode(plain)


def test_answer_needs_ids_that_decode_to_the_text():
    r = Renderer("builtin:demo")
    ids = r.tokenizer.encode("General Kenobi", add_special_tokens=False)
    eos = r.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert r.answer([*ids, eos], "General Kenobi").ids == ids       # the end-of-turn token is not part of it
    assert r.answer(ids, "Something else") is None                  # e.g. reasoning split out of the content


def test_remember_keeps_the_newest_within_the_bound():
    old = [answer("a", [1] * (MAX_ANSWER_TOKENS // 2)), answer("b", [2] * (MAX_ANSWER_TOKENS // 2))]
    kept = remember(old, answer("c", [3] * 10))
    assert [a.ids[0] for a in kept] == [2, 3]
